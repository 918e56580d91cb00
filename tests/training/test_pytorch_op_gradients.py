"""Every op the training builder differentiates, against torch autograd without torch: the
committed results of tests/fixtures/make_torch_truth.py (float64 inputs, the output gradient
g, and d sum(y * g) / d input), rebuilt here as one-node ONNX models."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from onnx import helper, numpy_helper
from support.layouts import relaid

from graphopt.ir import normalize_domain
from graphopt.training import build_training_graph
from graphopt.training.registry import GRADIENTS

from .helpers import FIXTURES, run_training

DATA = np.load(os.path.join(FIXTURES, "torch_op_gradients.npz"))
CASES = json.loads(str(DATA["__meta__"]))["cases"]


def one_node_model(name: str):
    case = CASES[name]
    arrays = {k: DATA[f"{name}/input/{k}"] for k in case["params"]}
    arrays.update({k: DATA[f"{name}/const/{k}"] for k in case["consts"]})
    outputs = [f"y{i}" for i in range(case["outputs"])]
    node = helper.make_node(case["op_type"], case["inputs"], outputs, name=name,
                            domain=case["domain"], **case["attrs"])
    graph = helper.make_graph(
        [node], name, [],
        [helper.make_tensor_value_info(o, helper.np_dtype_to_tensor_dtype(
            DATA[f"{name}/output/{i}"].dtype), list(DATA[f"{name}/output/{i}"].shape))
         for i, o in enumerate(outputs)],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in arrays.items()])
    opsets = [helper.make_opsetid("", case["opset"])]
    if case["domain"]:
        opsets.append(helper.make_opsetid(case["domain"], 1))
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return model, outputs


# "relaid": the weights and the output gradients fed in other memory layouts (Fortran
# order, strided views; see support/layouts.py), so that every forward and gradient kernel
# also runs on inputs that are not C-contiguous
@pytest.mark.parametrize("layout", ["stored", "relaid"])
@pytest.mark.parametrize("name", list(CASES))
def test_gradient_equals_pytorch_autograd(name, layout):
    case = CASES[name]
    model, outputs = one_node_model(name)
    training = build_training_graph(model, loss="output")
    feeds = {f"{o}_grad": DATA[f"{name}/g/{i}"] for i, o in enumerate(outputs)}
    if layout == "relaid":
        feeds = {name_: relaid(value, position) for position, (name_, value) in enumerate(
            {**{p: DATA[f"{name}/input/{p}"] for p in case["params"]}, **feeds}.items())}
    result = run_training(training, feeds)
    for i, o in enumerate(outputs):
        np.testing.assert_allclose(result[o], DATA[f"{name}/output/{i}"], rtol=1e-12,
                                   atol=1e-12, err_msg=f"{name}: output {i}")
    for param in case["params"]:
        np.testing.assert_allclose(result[f"{param}_grad"], DATA[f"{name}/grad/{param}"],
                                   rtol=1e-10, atol=1e-12, err_msg=f"{name}: gradient of {param}")


def test_every_differentiated_op_has_a_pytorch_case():
    covered = {(normalize_domain(c["domain"]), c["op_type"]) for c in CASES.values()}
    missing = sorted(set(GRADIENTS) - covered)
    assert not missing, f"no PyTorch truth for {missing}: add a case to make_torch_truth.py"
