"""The trained model (-o) is the forward graph with the new weights: onnxruntime loads it and
gives the executor's outputs; the input model is never overwritten by accident."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.training_runs import MLP, mlp_data, write_npz

from graphopt.errors import GraphoptError
from graphopt.executor import Session
from graphopt.trainer import RunOptions, run

ort = pytest.importorskip("onnxruntime")


def onnxruntime_outputs(path, feeds):
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.mark.parametrize("precision", ["fp32", "mixed"])
def test_trained_mqa_runs_in_onnxruntime_like_the_executor(tmp_path, precision):
    out = str(tmp_path / "trained.onnx")
    outcome = run(RunOptions(example="mqa", steps=3, precision=precision, device="cpu",
                             output=out, quiet=True))
    trained = onnx.load(out)
    onnx.checker.check_model(trained, full_check=True)
    assert not any(n.op_type == "YieldOp" for n in trained.graph.node)
    assert [o.name for o in trained.graph.output] == ["logits"]
    before = {t.name: onnx.numpy_helper.to_array(t) for t in outcome.forward.graph.initializer}
    after = {t.name: onnx.numpy_helper.to_array(t) for t in trained.graph.initializer}
    assert after["lm_head.weight"].dtype == np.float32
    assert not np.array_equal(before["lm_head.weight"], after["lm_head.weight"])  # it trained
    np.testing.assert_array_equal(after["lm_head.weight"], outcome.result.params["lm_head.weight"])

    feeds = {"input_ids": np.random.default_rng(0).integers(0, 56, (3, 32)).astype(np.int64)}
    ours = Session(out, device="cpu", numerics=None).run(feeds)["logits"]
    (theirs,) = onnxruntime_outputs(out, feeds)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def test_trained_fixture_model_and_no_overwrite(tmp_path):
    data = write_npz(tmp_path / "d.npz", mlp_data())
    with pytest.raises(GraphoptError, match="overwrite the input"):
        run(RunOptions(model=MLP, data=data, loss="cross_entropy", steps=2, batch_size=4,
                       output=MLP, quiet=True))
    out = str(tmp_path / "mlp_trained.onnx")
    run(RunOptions(model=MLP, data=data, loss="cross_entropy", steps=5, batch_size=4,
                   output=out, quiet=True, device="cpu"))
    x = mlp_data()["x"][:4]
    (theirs,) = onnxruntime_outputs(out, {"x": x})
    ours = Session(out, device="cpu", numerics=None).run({"x": x})["output"]
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
