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


# ---- item 11 --------------------------------------------------------------------------
def if_reads_folded_transpose_model() -> onnx.ModelProto:
    """Transpose(Transpose(x)) cancels out, and both If branches read its result t2 from the
    outer scope: fold_transposes must keep t2 defined."""
    def branch(tag):
        return helper.make_graph([helper.make_node("Identity", ["t2"], [f"{tag}_o"])], tag,
                                 [], [helper.make_tensor_value_info(f"{tag}_o", F, [2, 3])])
    return _model([helper.make_node("Transpose", ["x"], ["t1"], perm=[1, 0]),
                   helper.make_node("Transpose", ["t1"], ["t2"], perm=[1, 0]),
                   helper.make_node("If", ["c"], ["b"], then_branch=branch("then"),
                                    else_branch=branch("else"))],
                  [helper.make_tensor_value_info("x", F, [2, 3]),
                   helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                  [helper.make_tensor_value_info("b", F, [2, 3])])


def sparse_split_sizes_model() -> onnx.ModelProto:
    """Two Slices tiling axis 1 (gather_slice_to_split makes a constant named split_sizes)
    next to a (spare) sparse initializer already named split_sizes."""
    ints = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(
        np.array([5.0], np.float32), "split_sizes"), ints("", [1]), [3])
    model = _model([helper.make_node("Slice", ["x", "s0", "e0", "ax"], ["a"]),
                    helper.make_node("Slice", ["x", "s1", "e1", "ax"], ["b"])],
                   [helper.make_tensor_value_info("x", F, [2, 6, 4])],
                   [helper.make_tensor_value_info("a", F, [2, 3, 4]),
                    helper.make_tensor_value_info("b", F, [2, 3, 4])],
                   [ints("s0", [0]), ints("e0", [3]), ints("s1", [3]), ints("e1", [6]),
                    ints("ax", [1])])
    model.graph.sparse_initializer.append(sparse)
    return model


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "graphopt", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT))


def _same_results(original, optimized, feeds):
    import onnxruntime as ort

    def run(model):
        session = ort.InferenceSession(model.SerializeToString(),
                                       providers=["CPUExecutionProvider"])
        return session.run(None, feeds)
    for want, got in zip(run(original), run(optimized), strict=True):
        np.testing.assert_array_equal(want, got)


@pytest.mark.parametrize("case", ["if_reads_folded_transpose", "sparse_split_sizes"])
def test_item11_cli_writes_a_valid_model_for_outer_scope_uses_and_generated_names(case,
                                                                                   tmp_path):
    model = {"if_reads_folded_transpose": if_reads_folded_transpose_model,
             "sparse_split_sizes": sparse_split_sizes_model}[case]()
    onnx.checker.check_model(model, full_check=True)
    source, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(model, source)
    done = _cli("optimize", source, "-o", out)
    assert done.returncode == 0, done.stderr
    written = onnx.load(out)
    onnx.checker.check_model(written, full_check=True)
    x = np.arange(np.prod([d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]),
                  dtype=np.float32).reshape(
        [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim])
    feeds = {"x": x} if case == "sparse_split_sizes" else {"x": x, "c": np.array(True)}
    _same_results(model, written, feeds)
    assert "final validation failed" not in done.stderr  # the rules got it right first time
    fired = {"if_reads_folded_transpose": "Transpose", "sparse_split_sizes": "Slice"}[case]
    assert fired not in [n.op_type for n in written.graph.node]  # the rewrite was made


def test_item11_optimize_file_saves_the_model_final_validation_accepted(tmp_path):
    """A pass that breaks the model in a way only the whole-model check sees (it drops the
    producer of a tensor an If branch reads): the careful replay rolls it back, and the file
    written is that validated model, not the first attempt."""
    from graphopt import api
    from graphopt.dsl import Pass

    def drop_t2_producer(graph, report):
        producer = graph.producer.get("t2")
        if producer is None:
            return 0
        graph.remove_node(producer)
        return 1

    bad = Pass(name="drop_t2_producer", description="a buggy pass", level=1, run=drop_t2_producer)
    model = if_reads_folded_transpose_model()
    source, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(model, source)
    report = api.optimize_file(str(source), str(out), rules=[bad])
    assert any("final validation failed" in w for w in report.warnings)
    written = onnx.load(out)
    onnx.checker.check_model(written, full_check=True)
    assert [n.op_type for n in written.graph.node] == ["Transpose", "Transpose", "If"]
