"""Training a model whose weights stay where they lie: inline weights referenced in the model
file and external data train alike, the graphs the preparation copies and rewrites never hold
the weights' bytes, and -o writes the trained weights inline again."""
from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from support.cli_runs import cli
from support.training_runs import write_npz

from graphopt import modelio
from graphopt.trainer import RunOptions, run

WIDTH = 160  # 160 x 160 float32: 100 KiB, a weight the loader references in the file


def _mlp(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    w1 = numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) * 0.05)
                                 .astype(np.float32), "w1")
    frozen = numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) * 0.05)
                                     .astype(np.float32), "frozen_w2")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "frozen_w2"], ["logits"])], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", WIDTH])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", WIDTH])],
        [w1, frozen])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _data(tmp_path) -> str:
    rng = np.random.default_rng(3)
    return write_npz(tmp_path / "d.npz", {
        "x": rng.standard_normal((16, WIDTH)).astype(np.float32),
        "labels": rng.integers(0, WIDTH, 16).astype(np.int64)})


def _train(model_path, data, out, *extra):
    code, _, stderr = cli("run", model_path, "--data", data, "--loss", "cross_entropy",
                          "--steps", 3, "--batch-size", 8, "--device", "cpu", "--freeze",
                          "frozen_*", "-o", out, "-q", *extra)
    assert code == 0, stderr
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}


def test_inline_referenced_and_external_weights_train_alike(tmp_path):
    inline = tmp_path / "inline" / "m.onnx"
    inline.parent.mkdir()
    onnx.save(_mlp(), str(inline))
    external = tmp_path / "external" / "m.onnx"
    external.parent.mkdir()
    onnx.save(_mlp(), str(external), save_as_external_data=True, location="w.bin",
              size_threshold=0)
    loaded = modelio.load(inline)
    assert all(t.data_location == TensorProto.EXTERNAL for t in loaded.proto.graph.initializer)
    data = _data(tmp_path)
    a = _train(inline, data, tmp_path / "a.onnx")
    b = _train(external, data, tmp_path / "b.onnx")
    assert sorted(a) == sorted(b) == ["frozen_w2", "w1"]
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    start = {t.name: numpy_helper.to_array(t) for t in _mlp().graph.initializer}
    assert not np.array_equal(a["w1"], start["w1"])          # trained
    np.testing.assert_array_equal(a["frozen_w2"], start["frozen_w2"])   # frozen, streamed
    # the inline model's output holds its weights inline; the external one's has a data file
    assert not [n for n in os.listdir(tmp_path) if n.startswith("a.onnx.")]
    assert [n for n in os.listdir(tmp_path) if n.startswith("b.onnx.")]


def test_the_training_graph_references_the_weights_it_does_not_train(tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save(_mlp(), str(path))
    outcome = run(RunOptions(model=str(path), data=_data(tmp_path), loss="cross_entropy",
                             steps=1, batch_size=8, device="cpu", freeze=("frozen_*",),
                             quiet=True))
    frozen = next(t for t in outcome.graph.proto.graph.initializer if t.name == "frozen_w2")
    assert frozen.data_location == TensorProto.EXTERNAL and not frozen.HasField("raw_data")
    assert outcome.graph.proto.ByteSize() < 20_000   # the graph, not its 100 KiB weight
