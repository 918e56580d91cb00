"""A rewrite that passes the local checks but breaks the whole model must be found by the
careful replay, rolled back and reported; the result is the unchanged, valid model."""
from __future__ import annotations

import onnx
import pytest
from support.models import model_from_text

import graphopt
from graphopt.dsl import Rule, op, var

x = var("x")

# Unsqueeze(x, axes) -> Identity(x): locally fine ('u' has no declared type), but the Relu
# reading 'u' produces a declared rank-4 graph output, so the whole-model check fails.
BREAKS_THE_MODEL = Rule(name="test_drop_unsqueeze", description="wrong on purpose",
                        match=op.Unsqueeze(x, var("axes")), rewrite=lambda m: op.Identity(m.x))

MODEL = model_from_text("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,3] x) => (float[1,2,3] y) {
      axes = Constant <value = int64[1] {0}> ()
      u = Unsqueeze(x, axes)
      y = Relu(u)
    }""")


def test_the_rule_passes_the_local_checks():
    """Precondition of the test below: without the final check the rewrite would stick."""
    from graphopt import modelio
    from graphopt.engine import Engine
    from graphopt.report import Report

    model = modelio.load(MODEL)
    report = Report()
    Engine([BREAKS_THE_MODEL]).run(model, report)
    assert report.rules["test_drop_unsqueeze"].rewrites == 1
    with pytest.raises(onnx.shape_inference.InferenceError):
        onnx.shape_inference.infer_shapes(model.flush(), strict_mode=True)


def test_a_rewrite_breaking_the_model_is_rolled_back_and_reported():
    out, report = graphopt.optimize(MODEL, [BREAKS_THE_MODEL])
    assert [n.op_type for n in out.graph.node] == ["Constant", "Unsqueeze", "Relu"]
    stats = report.rules["test_drop_unsqueeze"]
    assert stats.rewrites == 0 and stats.rollbacks == 1
    assert any("replayed with a check after every rewrite" in w for w in report.warnings)
    onnx.checker.check_model(out, full_check=True)


def test_a_pass_whose_only_change_breaks_the_model_is_rolled_back():
    """Checking after every change covers a pass that changed one thing, not only several."""
    from graphopt import modelio
    from graphopt.dsl import Pass
    from graphopt.engine import Engine
    from graphopt.report import Report

    def bypass_unsqueeze(graph, report):
        # one journaled edit: Relu reads the Unsqueeze's input, so the declared [1, 2, 3]
        # output no longer fits the [2, 3] it now computes
        relu = graph.nodes_of_type("Relu")[0]
        unsqueeze = graph.nodes_of_type("Unsqueeze")[0]
        graph.replace_input(relu, 0, graph.node(unsqueeze).input[0])
        return 1

    model = modelio.load(MODEL)
    report = Report()
    Engine([Pass(name="test_bypass", description="bypass", run=bypass_unsqueeze)],
           validate_each=True).run(model, report)
    assert report.rules["test_bypass"].rollbacks == 1
    onnx.checker.check_model(model.flush(), full_check=True)


def test_a_flush_keeps_the_tensors_the_proto_holds_and_their_order():
    """Removing and adding initializers rewrites only those: every other tensor is the very
    message the proto held (protobuf copies what it is given: a whole-list rewrite copied
    every weight at every flush), and the order is the table's, with a re-added name last."""
    import numpy as np
    from onnx import helper, numpy_helper

    from graphopt.ir import Model

    tensors = [numpy_helper.from_array(np.full(4, i, np.float32), f"t{i}") for i in range(4)]
    graph = helper.make_graph([helper.make_node("Add", ["t0", "t1"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", 1, [4])], tensors)
    model = Model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    g = model.graph
    held = {t.name: t for t in model.proto.graph.initializer}
    g.remove_initializer("t2")
    g.add_initializer(numpy_helper.from_array(np.zeros(2, np.float32), "new"))
    model.flush()
    names = [t.name for t in model.proto.graph.initializer]
    assert names == ["t0", "t1", "t3", "new"]
    for tensor in model.proto.graph.initializer[:3]:
        assert tensor is held[tensor.name]
    g.remove_initializer("t0")
    g.add_initializer(numpy_helper.from_array(np.ones(4, np.float32), "t0"))
    model.flush()
    assert [t.name for t in model.proto.graph.initializer] == ["t1", "t3", "new", "t0"]
    assert numpy_helper.to_array(model.proto.graph.initializer[3]).tolist() == [1, 1, 1, 1]
    assert model.proto.graph.initializer[0] is held["t1"]
