"""One reading of a model's facts wherever they are read: the optimizer, the gradient
builder's type table and the memory guard infer types from the inputs alone (a value_info
that lies is not believed by any of them), read a Constant the same way (annotations such as
__backwardpass aside), and take an initializer a run may be fed for no constant."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphopt.ir import Model
from graphopt.tensor_types import infer_types
from graphopt.training.types import TypeTable


def _lying_model(domain: str = "") -> onnx.ModelProto:
    """x [B, S, 4] -> Relu -> y; a value_info claims the Relu's output is [2, 6, 4]."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", "S", 4])],
        value_info=[helper.make_tensor_value_info("r", TensorProto.FLOAT, [2, 6, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(domain, 17)])


def _dims(type_proto) -> list:
    return [d.dim_value or d.dim_param for d in type_proto.tensor_type.shape.dim]


def test_a_lying_value_info_is_believed_by_none_of_the_readers():
    model = _lying_model()
    assert _dims(infer_types(model)["r"]) == ["B", "S", 4]
    assert TypeTable.infer(model).shape("r") == ["B", "S", 4]
    assert Model(model).inferred_types()["r"].tensor_type.shape.dim[0].dim_param == "B"
    # the model itself keeps what it declared
    assert [d.dim_value for d in model.graph.value_info[0].type.tensor_type.shape.dim] == \
        [2, 6, 4]


def test_a_constant_is_read_the_same_way_by_the_type_table_and_the_ir():
    value = numpy_helper.from_array(np.array([0, 2], np.int64))
    annotated = helper.make_node("Constant", [], ["axes"], value=value)
    annotated.attribute.insert(0, helper.make_attribute("__backwardpass", 1))
    graph = helper.make_graph(
        [annotated, helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
        [numpy_helper.from_array(np.ones(3, np.float32), "w")])
    graph.input.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, [3]))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    table = TypeTable.infer(model)
    np.testing.assert_array_equal(table.constant("axes"), [0, 2])
    np.testing.assert_array_equal(Model(model).graph.constant_value("axes"), [0, 2])
    # an initializer a run may be fed (a graph input) is no constant, for either
    assert table.constant("w") is None and Model(model).graph.constant_value("w") is None
