"""Training graphs of the PyTorch-exported fixtures: gradients equal torch autograd's."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from graphopt.training import build_training_graph

from .helpers import MS, fixture, run_training


@pytest.mark.parametrize("name", ["mlp", "cnn", "mqa_block"])
def test_gradients_equal_pytorch_autograd(name):
    path, data, meta = fixture(name)
    training = build_training_graph(path, loss="output")  # loss sum(output * g): g fed
    feeds = {k: data[k] for k in meta["inputs"]}
    result = run_training(training, {**feeds, "output_grad": data["grad_output"]})
    np.testing.assert_allclose(result["output"], data["output"], rtol=1e-4, atol=1e-5)
    assert meta["grads"]
    for param in meta["grads"]:
        np.testing.assert_allclose(result[f"{param}_grad"], data[param], rtol=1e-4, atol=1e-5,
                                   err_msg=f"{name}: gradient of {param}")


@pytest.mark.parametrize("name", ["mlp", "cnn", "mqa_block"])
def test_graph_layout_is_ortmodule_style(name):
    path, _, meta = fixture(name)
    training = build_training_graph(path, loss="output")
    proto = training.proto
    onnx.checker.check_model(proto)
    assert any(o.domain == MS for o in proto.opset_import)
    nodes = list(proto.graph.node)
    yields = [i for i, n in enumerate(nodes) if n.op_type == "YieldOp" and n.domain == MS]
    assert len(yields) == 1
    yield_node = nodes[yields[0]]
    assert list(yield_node.input) == ["output"] and list(yield_node.output) == ["output_grad"]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in yield_node.attribute}
    assert attrs["full_shape_outputs"] == [0]
    outputs = [o.name for o in proto.graph.output]
    assert outputs == ["output"] + [f"{p}_grad" for p in meta["grads"]]
    assert training.grads == {p: f"{p}_grad" for p in meta["grads"]}
    assert training.losses == ["output"] and training.loss_grads == ["output_grad"]
    # every forward node feeds the YieldOp: the backward-pass marking relies on it
    forward_outputs = {o for n in nodes[:yields[0]] for o in n.output}
    backward_inputs = {i for n in nodes[yields[0]:] for i in n.input}
    assert "output" in forward_outputs and "output_grad" in backward_inputs
    # trainable weights are graph inputs too (defaults = their values)
    inputs = {i.name for i in proto.graph.input}
    assert set(meta["grads"]) <= inputs


def test_caller_model_is_not_modified():
    path, _, _ = fixture("mqa_block")
    forward = onnx.load(path)
    before = forward.SerializeToString()
    build_training_graph(forward, loss="output")
    assert forward.SerializeToString() == before


def test_static_dynamic_and_dynamo_exports_agree():
    """The same attention exported four ways gives the same weight gradients (dynamo stores
    the weights transposed)."""
    g = np.random.default_rng(3).standard_normal((2, 8, 64)).astype(np.float32)
    grads = {}
    for name in ["mqa_opset14", "mqa_opset17", "mqa_opset17_dynamic", "mqa_dynamo"]:
        path, data, meta = fixture(name)
        training = build_training_graph(path, loss="output",
                                        trainable=list(meta["param_map"].values()))
        result = run_training(training, {"hidden_states": data["hidden_states"],
                                         "output_grad": g})
        np.testing.assert_allclose(result["output"], data["output"], rtol=1e-4, atol=1e-5)
        grads[name] = {}
        for torch_name, init_name in meta["param_map"].items():
            grad = result[f"{init_name}_grad"]
            transposed = torch_name in meta.get("param_map_transposed", [])
            grads[name][torch_name] = grad.T if transposed else grad
    reference = grads.pop("mqa_opset17")
    for name, found in grads.items():
        for param, grad in found.items():
            np.testing.assert_allclose(grad, reference[param], rtol=1e-4, atol=1e-5,
                                       err_msg=f"{name}: {param}")


@pytest.mark.parametrize("name", ["mqa_opset17_dynamic", "mqa_dynamo_dynamic"])
def test_dynamic_axes_graph_is_right_for_other_sizes(name):
    """Exported with dynamic batch/seq: the gradient graph must not bake in the export
    sizes. Checked in float64 at batch 3, seq 5 against central differences."""
    from .helpers import ForwardRunner, central_differences, to_float64

    path, _, meta = fixture(name)
    forward = to_float64(onnx.load(path))
    training = build_training_graph(forward, loss="output",
                                    trainable=list(meta["param_map"].values()))
    rng = np.random.default_rng(7)
    x = rng.standard_normal((3, 5, 64))
    g = rng.standard_normal((3, 5, 64))
    result = run_training(training, {"hidden_states": x, "output_grad": g})

    params = list(meta["param_map"].values())
    runner = ForwardRunner(forward, fed_initializers=params)
    values = {"hidden_states": x,
              **{t.name: onnx.numpy_helper.to_array(t) for t in forward.graph.initializer
                 if t.name in params}}
    loss = lambda v: float((runner(v)["output"] * g).sum())  # noqa: E731
    for param in params:
        expected = central_differences(loss, values, param)
        np.testing.assert_allclose(result[f"{param}_grad"], expected, rtol=1e-5, atol=1e-7,
                                   err_msg=param)


def test_rewrite_rules_keep_the_gradients_and_mark_the_backward_pass():
    """The `graphopt run` flow: build, then the level-1/2 rules (FusedMatMul fusions,
    backward-pass marking), then the executor."""
    import graphopt
    from graphopt.training.paths import ancestors

    path, data, meta = fixture("mqa_block")
    training = build_training_graph(path, loss="output")
    optimized, _ = graphopt.optimize(training.proto)
    nodes = list(optimized.graph.node)
    position = next(i for i, n in enumerate(nodes) if n.op_type == "YieldOp")

    def marked(n):
        return any(a.name == "__backwardpass" and a.i == 1 for a in n.attribute)

    forward = ancestors(nodes, nodes[position].input)  # YieldOp's ancestors: the unmarked nodes
    assert forward and not any(marked(n) for n in forward)
    assert all(marked(n) for n in nodes[position:])
    feeds = {"hidden_states": data["hidden_states"], "output_grad": data["grad_output"]}
    result = run_training(optimized, feeds)
    for param in meta["grads"]:
        np.testing.assert_allclose(result[f"{param}_grad"], data[param], rtol=1e-4, atol=1e-5)
