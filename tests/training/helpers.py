"""Reference gradients for the training-graph tests: the executor runs the training graph,
onnxruntime runs the forward model for central differences (float64 where exactness
matters), and the PyTorch fixtures hold autograd gradients."""
from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.training import TrainingGraph, build_training_graph

FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures")
MS = "com.microsoft"
DOUBLE = TensorProto.DOUBLE


def fixture(name: str):
    """(path of the .onnx, the .npz contents, its meta dict)."""
    data = np.load(os.path.join(FIXTURES, f"{name}.npz"))
    return os.path.join(FIXTURES, f"{name}.onnx"), data, json.loads(str(data["__meta__"]))


def run_training(training: TrainingGraph | onnx.ModelProto, feeds: dict
                 ) -> dict[str, np.ndarray]:
    from graphopt.executor import Session

    proto = training.proto if isinstance(training, TrainingGraph) else training
    onnx.checker.check_model(proto)
    return Session(proto, device="cpu").run(feeds)


class ForwardRunner:
    """The forward model on onnxruntime, with chosen initializers fed instead of stored."""

    def __init__(self, model: onnx.ModelProto, fed_initializers=()):
        ort = pytest.importorskip("onnxruntime")
        model = _with_initializers_as_inputs(model, fed_initializers)
        self.output_names = [o.name for o in model.graph.output]
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        try:
            session = ort.InferenceSession(model.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
            self._run = lambda feeds: dict(zip(self.output_names, session.run(None, feeds),
                                                  strict=True))
        except ort.capi.onnxruntime_pybind11_state.NotImplemented:
            # onnxruntime has no float64 kernel for a few ops (Erf, Conv): the executor's
            # forward kernels, themselves checked against onnxruntime in float32, stand in
            from graphopt.executor import Session

            executor = Session(model, device="cpu")
            self._run = executor.run

    def __call__(self, feeds: dict) -> dict[str, np.ndarray]:
        return self._run(feeds)


def _with_initializers_as_inputs(model: onnx.ModelProto, names) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    names = set(names)
    declared = {i.name for i in copy.graph.input}
    for init in copy.graph.initializer:
        if init.name in names and init.name not in declared:
            copy.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type,
                                                                  list(init.dims)))
    return copy


def central_differences(loss, values: dict[str, np.ndarray], name: str, eps=1e-6) -> np.ndarray:
    """d loss / d values[name], element by element; ``loss(values) -> float``."""
    base = values[name]
    grad = np.zeros(base.shape, dtype=np.float64)
    for index in np.ndindex(base.shape):
        shifted = {}
        for sign in (1, -1):
            x = base.copy()
            x[index] += sign * eps
            shifted[sign] = loss({**values, name: x})
        grad[index] = (shifted[1] - shifted[-1]) / (2 * eps)
    return grad


def directional_derivative(loss, values: dict[str, np.ndarray], name: str, direction, eps):
    """(loss(x + eps d) - loss(x - eps d)) / 2 eps, for float32 models too big per element."""
    base = values[name].astype(np.float64)
    plus = loss({**values, name: (base + eps * direction).astype(values[name].dtype)})
    minus = loss({**values, name: (base - eps * direction).astype(values[name].dtype)})
    return (plus - minus) / (2 * eps)


def to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same model computing in float64 (initializers, Constants, Cast targets, I/O)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    graph = copy.graph
    for i, init in enumerate(graph.initializer):
        if init.data_type == TensorProto.FLOAT:
            graph.initializer[i].CopyFrom(
                numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float64), init.name))
    for node in graph.node:
        for attr in node.attribute:
            if attr.name == "value" and attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(numpy_helper.from_array(
                    numpy_helper.to_array(attr.t).astype(np.float64), attr.t.name))
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = DOUBLE
    for vi in list(graph.input) + list(graph.output):
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = DOUBLE
    del graph.value_info[:]
    return copy


def model(nodes, inputs, outputs, initializers=(), opset=17) -> onnx.ModelProto:
    """A forward model; ``inputs``/``outputs`` are value infos, ``initializers`` arrays by
    name."""
    graph = helper.make_graph(nodes, "forward", inputs, outputs,
                              [numpy_helper.from_array(np.asarray(v), k)
                               for k, v in dict(initializers).items()])
    built = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    inferred = onnx.shape_inference.infer_shapes(built, data_prop=True).graph
    known = {vi.name: vi for vi in list(inferred.value_info) + list(inferred.output)}
    for out in built.graph.output:  # outputs declared without a shape: take the inferred one
        if not out.type.tensor_type.HasField("shape") and out.name in known:
            out.type.CopyFrom(known[out.name].type)
    onnx.checker.check_model(built)
    return built


def check_against_finite_differences(forward: onnx.ModelProto, feeds: dict, *,
                                     input_grads=(), rtol=1e-6, atol=1e-8, seed=0, **options):
    """Build the training graph (loss sum(output * g)) of a float64 ``forward`` model and
    compare every gradient output with central differences of the forward model."""
    training = build_training_graph(forward, loss="output", input_grads=input_grads, **options)
    grads = {**training.grads, **training.input_grads}
    trained = list(grads)
    runner = ForwardRunner(forward, fed_initializers=trained)
    output_names = [o.name for o in forward.graph.output]
    initial = {t.name: numpy_helper.to_array(t) for t in forward.graph.initializer
               if t.name in trained}
    values = {**feeds, **initial}
    forward_out = runner(values)
    rng = np.random.default_rng(seed)
    g = {name: rng.standard_normal(forward_out[name].shape) for name in output_names}

    def loss(v):
        out = runner(v)
        return float(sum((out[n] * g[n]).sum() for n in output_names))

    result = run_training(training, {**feeds, **{f"{n}_grad": g[n] for n in output_names}})
    assert trained, "no gradient outputs"
    for name in trained:
        expected = central_differences(loss, values, name)
        np.testing.assert_allclose(result[grads[name]], expected, rtol=rtol, atol=atol,
                                   err_msg=f"gradient of {name}")
    return training
