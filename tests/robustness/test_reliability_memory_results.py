"""Issue 12, items 8-13: inputs that made graphopt eat the machine (constant folding, the
executor's memory guard, --data archives) or write a wrong model (rolled-back rewrites,
lying value_info, a second YieldOp in a branch). One regression test per item."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _model(nodes, inputs, outputs, inits=(), opset=17, value_info=(), extra_opsets=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits),
                              value_info=list(value_info))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    *extra_opsets])
    model.ir_version = 8
    return model


def _peak_rss_mib(script: str, timeout: int = 300) -> dict:
    """Run ``script`` in a fresh interpreter; it prints a JSON object, to which the child's
    own peak RSS (MiB, from getrusage) is added."""
    wrapped = script + textwrap.dedent("""
        import resource as _resource
        RESULT["peak_mib"] = _resource.getrusage(_resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(RESULT))
    """)
    env = dict(os.environ, PYTHONPATH=ROOT, GRAPHOPT_MEMORY_LIMIT="off")
    done = subprocess.run([sys.executable, "-c", wrapped], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---- item 8 ---------------------------------------------------------------------------
def huge_constant_models() -> dict[str, onnx.ModelProto]:
    """A few hundred bytes each, whose constant-foldable node would produce >= 1 GiB."""
    n = 1 << 28
    one = numpy_helper.from_array(np.array([1.0], np.float32))
    s = helper.make_tensor_value_info("s", F, [])

    def reduce(nodes, inits):
        return _model([*nodes, helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0)],
                      [], [s], inits)

    scalar = lambda name, v, dt=np.float32: numpy_helper.from_array(np.array(v, dt), name)  # noqa: E731
    return {
        "ConstantOfShape": reduce(
            [helper.make_node("ConstantOfShape", ["shape"], ["big"], value=one)],
            [numpy_helper.from_array(np.array([1 << 29], np.int64), "shape")]),
        "Range": reduce([helper.make_node("Range", ["a", "b", "c"], ["big"])],
                        [scalar("a", 0.0), scalar("b", float(n)), scalar("c", 1.0)]),
        "Tile": reduce([helper.make_node("Tile", ["x", "r"], ["big"])],
                       [numpy_helper.from_array(np.ones(64, np.float32), "x"),
                        numpy_helper.from_array(np.array([1 << 22], np.int64), "r")]),
        "Expand": reduce([helper.make_node("Expand", ["x", "shape"], ["big"])],
                         [numpy_helper.from_array(np.ones(1, np.float32), "x"),
                          numpy_helper.from_array(np.array([n], np.int64), "shape")]),
    }


def test_item08_fold_constants_checks_size_before_computing(tmp_path):
    paths = {}
    for name, model in huge_constant_models().items():
        paths[name] = str(tmp_path / f"{name}.onnx")
        onnx.save(model, paths[name])
        assert os.path.getsize(paths[name]) < 400
    result = _peak_rss_mib(f"""
import json
import graphopt
RESULT = {{}}
for name, path in {paths!r}.items():
    optimized, _ = graphopt.optimize(path)
    RESULT[name] = [n.op_type for n in optimized.graph.node]
""")
    for name in paths:  # left as they were: their results are far over the folding limit
        assert result[name][-1] == "ReduceSum" and len(result[name]) == 2, result
    assert result["peak_mib"] < 200, result


def test_item08_small_constants_still_fold():
    """The size check happens before evaluating, and still lets small results through."""
    import graphopt

    model = _model([helper.make_node("Range", ["a", "b", "c"], ["r"]),
                    helper.make_node("Add", ["x", "r"], ["y"])],
                   [helper.make_tensor_value_info("x", F, [8])],
                   [helper.make_tensor_value_info("y", F, [8])],
                   [numpy_helper.from_array(np.array(v, np.float32), n)
                    for n, v in (("a", 0.0), ("b", 8.0), ("c", 1.0))])
    optimized, _ = graphopt.optimize(model, ["fold_constants"])
    assert [n.op_type for n in optimized.graph.node] == ["Add"]
    folded = {i.name: numpy_helper.to_array(i) for i in optimized.graph.initializer}
    np.testing.assert_array_equal(folded["r"], np.arange(8, dtype=np.float32))


# ---- item 13 --------------------------------------------------------------------------
MS = "com.microsoft"


def yield_in_branch_model() -> onnx.ModelProto:
    """A training graph's YieldOp at the top, and a second one inside an If branch."""
    def branch(tag):
        nodes = [helper.make_node("Identity", ["loss"], [f"{tag}_out"])]
        if tag == "then":
            nodes.append(helper.make_node("YieldOp", ["loss"], ["then_grad"], domain=MS,
                                          name="hidden_yield", full_shape_outputs=[0]))
        return helper.make_graph(nodes, tag, [], [helper.make_tensor_value_info(
            f"{tag}_out", F, [])])

    nodes = [helper.make_node("ReduceSum", ["x"], ["loss"], keepdims=0),
             helper.make_node("YieldOp", ["loss"], ["loss_grad"], domain=MS, name="yield",
                              full_shape_outputs=[0]),
             helper.make_node("If", ["c"], ["picked"], then_branch=branch("then"),
                              else_branch=branch("else")),
             helper.make_node("Identity", ["loss_grad"], ["x_grad_scale"])]
    return _model(nodes, [helper.make_tensor_value_info("x", F, [4]),
                          helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                  [helper.make_tensor_value_info("picked", F, []),
                   helper.make_tensor_value_info("x_grad_scale", F, [])],
                  extra_opsets=[helper.make_opsetid(MS, 1)])


def test_item13_second_yieldop_inside_if_branch_is_refused(tmp_path):
    import graphopt
    from graphopt.errors import GraphoptError
    from graphopt.training import build_training_graph

    model = yield_in_branch_model()
    with pytest.raises(GraphoptError, match=r"2 YieldOp nodes .*'hidden_yield'.*inside an If"):
        graphopt.optimize(model, ["mark_backward_pass"], check_input=False)
    with pytest.raises(GraphoptError, match=r"YieldOp node\(s\) .*'hidden_yield'.*If/Loop"):
        build_training_graph(model)
    path = tmp_path / "two_yields.onnx"
    onnx.save(model, path)
    np.savez(tmp_path / "d.npz", x=np.ones((2, 4), np.float32), c=np.array([True, True]))
    for command in (["optimize", str(path), "-o", str(tmp_path / "o.onnx")],
                    ["run", str(path), "--data", str(tmp_path / "d.npz"), "--steps", "1",
                     "-o", str(tmp_path / "t.onnx")]):
        done = subprocess.run([sys.executable, "-m", "graphopt", *command], capture_output=True,
                              text=True, timeout=120, cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=ROOT))
        assert done.returncode != 0, (command, done.stdout, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "YieldOp" in lines[0], (command, done.stderr)
