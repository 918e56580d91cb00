"""Inline weights referenced in the model file, and written back inline from it: the bytes a
save writes are the bytes protobuf writes for the model with its weights, the weights are
never in the parsed proto, and anything unusual in the file falls back to a whole parse."""
from __future__ import annotations

import glob
import io
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt import modelio, weight_refs
from graphopt.api import optimize_file
from graphopt.errors import GraphoptError

FIXTURES = sorted(glob.glob(os.path.join(os.path.dirname(__file__), os.pardir, "fixtures",
                                         "*.onnx")))
WIDTH = 160  # a 160 x 160 float32 weight: 100 KiB, above the referencing threshold


def _referenced(path: str, min_bytes: int = 1) -> onnx.ModelProto | None:
    fd = os.open(path, os.O_RDONLY)
    try:
        return weight_refs.read_without_weights(fd, os.fstat(fd).st_size,
                                                os.path.basename(path), min_bytes=min_bytes)
    finally:
        os.close(fd)


def _written_back(path: str, proto: onnx.ModelProto) -> bytes:
    """The model written with every referenced weight copied from ``path``'s bytes."""
    with open(path, "rb") as f:
        source = f.read()

    def length(tensor):
        info = {e.key: e.value for e in tensor.external_data}
        return int(info["length"]) if info.get("location") == os.path.basename(path) else None

    def copy(tensor, dst):
        info = {e.key: e.value for e in tensor.external_data}
        start, size = int(info["offset"]), int(info["length"])
        dst.write(source[start:start + size])
        return size

    pieces, total = weight_refs.encoded_pieces(proto, length)
    out = io.BytesIO()
    weight_refs.write_with_weights(pieces, out, copy)
    assert len(out.getvalue()) == total
    return out.getvalue()


@pytest.mark.parametrize("path", FIXTURES, ids=os.path.basename)
def test_every_fixture_is_written_back_as_protobuf_writes_it(path):
    """With every raw_data initializer referenced (threshold 1 byte), writing back gives the
    bytes SerializeToString gives for the model parsed whole."""
    whole = onnx.load(path, load_external_data=False)
    referenced = _referenced(path)
    if referenced is None:
        pytest.skip("no raw_data initializer in the main graph")
    assert all(t.data_location == TensorProto.EXTERNAL and not t.HasField("raw_data")
               for t in referenced.graph.initializer if t.external_data)
    assert _written_back(path, referenced) == whole.SerializeToString()


def _model_with_weight(path, *, raw: bytes | None = None, doc: str = "") -> np.ndarray:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((WIDTH, WIDTH)).astype(np.float32)
    tensor = numpy_helper.from_array(weight, "W")
    if raw is not None:
        tensor.raw_data = raw
    tensor.doc_string = doc
    bias = numpy_helper.from_array(rng.standard_normal(WIDTH).astype(np.float32), "b")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]),
         helper.make_node("Identity", ["h"], ["h2"]),
         helper.make_node("Add", ["h2", "b"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", WIDTH])], [tensor, bias])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return weight


def test_load_references_a_large_weight_and_reads_it_on_demand(tmp_path):
    path = tmp_path / "m.onnx"
    weight = _model_with_weight(path, doc="kept")
    model = modelio.load(path)
    tensor = model.graph.initializer("W")
    assert tensor.data_location == TensorProto.EXTERNAL and not tensor.HasField("raw_data")
    assert tensor.doc_string == "kept"
    assert model.proto.ByteSize() < 2_000  # the 100 KiB are not in the proto
    assert model.graph.initializer("b").HasField("raw_data")  # small: parsed as it is
    np.testing.assert_array_equal(model.graph.constant_value("W"), weight)
    modelio.load_external_data(model)  # what graphopt run does before training
    assert model.proto.SerializeToString() == onnx.load(str(path)).SerializeToString()


def test_optimize_writes_the_weight_back_inline(tmp_path):
    path, out = tmp_path / "m.onnx", tmp_path / "out.onnx"
    weight = _model_with_weight(path)
    report = optimize_file(str(path), str(out))
    assert report.written == [str(out)]  # no data file: the weights are inline again
    assert sorted(os.listdir(tmp_path)) == ["m.onnx", "out.onnx"]
    result = onnx.load(str(out))
    assert [n.op_type for n in result.graph.node] == ["MatMul", "Add"]
    np.testing.assert_array_equal(numpy_helper.to_array(result.graph.initializer[0]), weight)
    # the same bytes as optimizing the model handed over whole (as a ModelProto)
    whole_out = tmp_path / "whole.onnx"
    model = modelio.load(onnx.load(str(path)))
    from graphopt.api import optimize
    optimized, _ = optimize(model)
    whole_out.write_bytes(optimized.SerializeToString())
    assert out.read_bytes() == whole_out.read_bytes()


def test_in_place_reads_the_weights_from_the_replaced_file(tmp_path):
    path = tmp_path / "m.onnx"
    weight = _model_with_weight(path)
    optimize_file(str(path), None, in_place=True)
    result = onnx.load(str(path))
    np.testing.assert_array_equal(numpy_helper.to_array(result.graph.initializer[0]), weight)
    assert len(result.graph.node) == 2


def test_a_raw_data_of_the_wrong_size_is_one_error(tmp_path):
    path = tmp_path / "m.onnx"
    _model_with_weight(path, raw=b"\0" * (WIDTH * WIDTH * 4 - 8))
    with pytest.raises(GraphoptError, match=r"tensor 'W' holds 102392 bytes of raw data; its "
                                            r"dims and type need 102400"):
        modelio.load(path)


@pytest.mark.parametrize("cut", [1, 7, 1000])
def test_a_truncated_file_is_still_reported_as_not_onnx(tmp_path, cut):
    path = tmp_path / "m.onnx"
    _model_with_weight(path)
    data = path.read_bytes()
    path.write_bytes(data[:-cut])
    with pytest.raises(GraphoptError, match="not an ONNX model|invalid ONNX model"):
        modelio.load(path)


def test_repeated_raw_data_and_external_fields_stay_unreferenced(tmp_path):
    """protobuf keeps the last of repeated scalar fields: such a tensor is parsed as it is."""
    path = tmp_path / "m.onnx"
    _model_with_weight(path)
    model = onnx.load(str(path))
    tensor = model.graph.initializer[0]
    doubled = tensor.SerializeToString() + b"\x4a" + weight_refs.encode_varint(
        len(tensor.raw_data)) + tensor.raw_data
    assert _referenced_tensor(doubled) is None
    assert _referenced_tensor(tensor.SerializeToString()) is not None


def _referenced_tensor(encoded: bytes):
    known = {f.number for f in TensorProto.DESCRIPTOR.fields}
    return weight_refs._tensor_reference(encoded, 0, len(encoded), "m.onnx", 1, known)


@pytest.mark.parametrize("values", [0, 7])
def test_a_large_tensor_without_its_values_is_one_error(tmp_path, values):
    """No raw_data and too few float_data values: refused on load, not written out broken
    (the structure check sees no large weight, so it cannot)."""
    tensor = onnx.TensorProto(name="W", data_type=onnx.TensorProto.FLOAT, dims=[100000, 4])
    tensor.float_data.extend([0.5] * values)
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 100000])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])], [tensor])
    path = tmp_path / "m.onnx"
    onnx.save(onnx.helper.make_model(graph), str(path))
    with pytest.raises(GraphoptError, match=rf"tensor 'W' holds {values} values; its dims "
                                            r"\[100000, 4\] need 400000"):
        modelio.load(path)
