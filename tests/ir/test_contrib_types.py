"""Types behind com.microsoft ops ONNX shape inference does not know: a fused Gelu's output,
and what is computed from it (a Shape's value included), are typed for the rules and for the
gradient builder; the model is given back as it was."""
from __future__ import annotations

from support.models import model_from_text

from graphopt import modelio
from graphopt.tensor_types import contrib_stand_ins
from graphopt.training.types import TypeTable


def gelu_then_shape_model():
    # Expand(b, Shape(Gelu(x))): its rank is known only from the Shape's value
    return model_from_text("""
        <ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
        g (float[B,7] x, float[7] b) => (float[B,7] y)
        {
        g = com.microsoft.Gelu(x)
        s = Shape(g)
        e = Expand(b, s)
        y = Add(g, e)
        }""")


def test_engine_types_what_follows_a_gelu():
    graph = modelio.load(gelu_then_shape_model()).graph
    assert graph.static_shape("g") == [None, 7]  # B is symbolic
    assert graph.static_shape("e") == [None, 7]


def test_gradient_builder_types_what_follows_a_gelu():
    table = TypeTable.infer(gelu_then_shape_model())
    assert table.rank("g") == 2 and table.rank("e") == 2 and table.shape("y")[1] == 7


def test_the_nodes_are_given_back():
    model = gelu_then_shape_model()
    before = model.SerializeToString()
    try:
        with contrib_stand_ins(model):
            assert [n.op_type for n in model.graph.node][0] == "Identity"
            raise RuntimeError("inference failed")
    except RuntimeError:
        pass
    assert model.SerializeToString() == before
