"""Inputs that could make graphopt eat the machine (constant folding, the executor's memory
guard, --data archives) or write a wrong model (rolled-back rewrites, lying value_info, a
second YieldOp in a branch): each is bounded or refused.

Test names carry the number of the promise they pin (``test_item08_...`` to ``item13``):
08 constant folding checks sizes first, 09 the memory guard counts every output, 10 --data
reads only what the graph needs, 11 a written model is a valid one, 12 the Split fusion does
not trust value_info, 13 a second YieldOp is refused."""
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
    own peak RSS (MiB) is added. VmHWM, not getrusage: Linux carries ru_maxrss across exec, so
    a child forked from a large pytest process would report the parent's size."""
    wrapped = script + textwrap.dedent("""
        with open("/proc/self/status") as _status:
            _hwm = next(line for line in _status if line.startswith("VmHWM:"))
        RESULT["peak_mib"] = int(_hwm.split()[1]) / 1024
        print(json.dumps(RESULT))
    """)
    env = dict(os.environ, GRAPHOPT_MEMORY_LIMIT="off")
    done = subprocess.run([sys.executable, "-P", "-c", wrapped], capture_output=True, text=True,
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
        done = subprocess.run([sys.executable, "-P", "-m", "graphopt", *command],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode != 0, (command, done.stdout, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "1 inside an If/Loop/Scan body" in lines[0], \
            (command, done.stderr)


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
    return subprocess.run([sys.executable, "-P", "-m", "graphopt", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env=dict(os.environ))


def _same_results(original, optimized, feeds):
    import onnxruntime as ort

    options = ort.SessionOptions()  # onnxruntime's own fusions trust value_info too
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL

    def run(model):
        session = ort.InferenceSession(model.SerializeToString(), options,
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
        producer = graph.producer_of("t2")
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


# ---- item 12 --------------------------------------------------------------------------
def lying_value_info_model() -> onnx.ModelProto:
    """x[B, S, 4] -> Relu -> y, declared [2, 6, 4] by value_info; Gather(y, 0, axis 1) and
    Slice(y, 1:6, axis 1) tile axis 1 only if S really is 6."""
    ints = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    return _model([helper.make_node("Relu", ["x"], ["y"]),
                   helper.make_node("Gather", ["y", "i0"], ["first"], axis=1),
                   helper.make_node("Slice", ["y", "s", "e", "ax"], ["rest"])],
                  [helper.make_tensor_value_info("x", F, ["B", "S", 4])],
                  [helper.make_tensor_value_info("first", F, ["B", 4]),
                   helper.make_tensor_value_info("rest", F, ["B", None, 4])],
                  [ints("i0", 0), ints("s", [1]), ints("e", [6]), ints("ax", [1])],
                  value_info=[helper.make_tensor_value_info("y", F, [2, 6, 4])])


def test_item12_split_fusion_does_not_trust_lying_value_info(tmp_path):
    import graphopt

    model = lying_value_info_model()
    optimized, _ = graphopt.optimize(model)
    assert "Split" not in [n.op_type for n in optimized.graph.node]
    for shape in [(2, 6, 4), (3, 9, 4), (1, 3, 4)]:  # all accepted by the original
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        _same_results(model, optimized, {"x": x})
    source, out = tmp_path / "in.onnx", tmp_path / "out.onnx"
    onnx.save(model, source)
    assert _cli("optimize", source, "-o", out).returncode == 0
    _same_results(model, onnx.load(out), {"x": np.ones((3, 9, 4), np.float32)})


def test_item12_split_fusion_still_fires_when_inference_proves_the_shape():
    """The same graph with x declared [2, 6, 4]: inference from the input proves axis 1 is
    6, so the pieces tile it and the fusion is made."""
    import graphopt

    model = lying_value_info_model()
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[0].dim_value, dims[1].dim_value = 2, 6
    del model.graph.value_info[:]
    optimized, _ = graphopt.optimize(model)
    assert "Split" in [n.op_type for n in optimized.graph.node]
    _same_results(model, optimized, {"x": np.ones((2, 6, 4), np.float32)})


# ---- item 9 ---------------------------------------------------------------------------
def fused_outer_product_model() -> onnx.ModelProto:
    """FusedMatMul(a[N, 1], b[1, N]) -> [N, N] -> ReduceSum: ONNX shape inference does not
    know FusedMatMul, so its output (and everything after it) used to count 0 bytes."""
    ms = helper.make_opsetid(MS, 1)
    return _model([helper.make_node("FusedMatMul", ["a", "b"], ["p"], domain=MS, alpha=2.0),
                   helper.make_node("Relu", ["p"], ["q"]),
                   helper.make_node("ReduceSum", ["q"], ["s"], keepdims=0)],
                  [helper.make_tensor_value_info("a", F, ["N", 1]),
                   helper.make_tensor_value_info("b", F, [1, "N"])],
                  [helper.make_tensor_value_info("s", F, [])], extra_opsets=[ms])


def test_item09_memory_guard_counts_fusedmatmul_outputs(monkeypatch):
    from graphopt.executor import Session, memory
    from graphopt.executor.memory import MemoryLimitError

    monkeypatch.setenv(memory.ENV, "1G")
    session = Session(fused_outer_product_model(), device="cpu", numerics=None)
    small = np.ones((64, 1), np.float32)
    assert session.run({"a": small, "b": small.T})["s"] == 2 * 64 * 64
    n = 1 << 15  # p and q: [N, N] float32 = 4 GiB each, both alive at the Relu
    ran = []
    with pytest.raises(MemoryLimitError, match=r"planned peak memory 8\.0 GiB exceeds the "
                                               r"1\.0 GiB available"):
        session.run({"a": np.ones((n, 1), np.float32), "b": np.ones((1, n), np.float32)},
                    observer=lambda *args: ran.append(args))
    assert ran == []


def test_item09_every_registered_kernel_has_an_output_size_estimate():
    from graphopt.executor.output_sizes import has_estimate
    from graphopt.executor.registry import all_specs

    missing = [f"{s.domain or 'ai.onnx'}.{s.op_type}" for s in all_specs()
               if not has_estimate(s.domain, s.op_type)]
    assert missing == []


def test_item09_a_contrib_op_without_an_estimate_is_refused_not_counted_zero():
    from graphopt.executor.memory import complete_types
    from graphopt.executor.output_sizes import NoSizeEstimateError
    from graphopt.executor.plan import PlannedNode

    node = PlannedNode(index=0, name="mystery", op_type="NotEstimated", domain=MS, opset=1,
                       inputs=("x",), outputs=("y",), attrs={})
    model = _model([helper.make_node("NotEstimated", ["x"], ["y"], domain=MS)],
                   [helper.make_tensor_value_info("x", F, [4])],
                   [helper.make_tensor_value_info("y", F, None)])
    with pytest.raises(NoSizeEstimateError, match=r"no output-size estimate for "
                                                  r"com\.microsoft\.NotEstimated"):
        complete_types([node], model, {"x": (F, [4])}, lambda name: None)


def test_item09_contrib_estimates_agree_with_the_kernels():
    """Each estimate, on a small graph the executor runs, gives the shapes the kernels make."""
    from graphopt.executor import Session, memory
    from graphopt.executor.memory import complete_types, infer_types

    ms = helper.make_opsetid(MS, 1)
    model = _model(
        [helper.make_node("FusedMatMul", ["a", "b"], ["p"], domain=MS, transA=1,
                          transBatchB=1),
         helper.make_node("Gelu", ["p"], ["g"], domain=MS),
         helper.make_node("BiasGelu", ["g", "bias"], ["bg"], domain=MS),
         helper.make_node("GeluGrad", ["bg", "p"], ["gg"], domain=MS),
         helper.make_node("ConcatTraining", ["gg", "p"], ["cat", "lengths"], domain=MS, axis=1),
         helper.make_node("SplitTraining", ["cat", "sizes"], ["s0", "s1"], domain=MS, axis=1),
         helper.make_node("ReduceSumTraining", ["s1", "axes"], ["r"], domain=MS, keepdims=0),
         helper.make_node("Add", ["r", "r"], ["out"])],
        [helper.make_tensor_value_info("a", F, [3, 4, 5]),
         helper.make_tensor_value_info("b", F, [4, 3, 6])],
        [helper.make_tensor_value_info("out", F, None)],
        [numpy_helper.from_array(np.ones(6, np.float32), "bias"),
         numpy_helper.from_array(np.array([3, 7], np.int64), "sizes"),
         numpy_helper.from_array(np.array([1], np.int64), "axes")], extra_opsets=[ms])
    session = Session(model, device="cpu", numerics=None)
    names = ["p", "g", "bg", "gg", "cat", "lengths", "s0", "s1", "r", "out"]
    rng = np.random.default_rng(0)
    got = session.run({"a": rng.standard_normal((3, 4, 5), np.float32),
                       "b": rng.standard_normal((4, 3, 6), np.float32)}, names)
    types = complete_types(session._ordered, model, infer_types(model),
                           session._memory._constant)
    for name in names:
        assert types[name][1] == list(got[name].shape), name
    assert memory  # the guard module is the one Session uses


# ---- item 10 --------------------------------------------------------------------------
MLP = os.path.join(ROOT, "tests", "fixtures", "mlp.onnx")  # x [4, 64] -> 10 logits


def _write_bomb_npz(path, extra_elements: int, big: str = "unused") -> None:
    """The MLP's x and labels, plus ``big``: ``extra_elements`` float32 zeros (compressed
    to almost nothing); by default named 'unused', which the graph never reads."""
    import zipfile

    rng = np.random.default_rng(1)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as archive:
        for name, array in (("x", rng.standard_normal((40, 64)).astype(np.float32)),
                            ("labels", rng.integers(0, 10, 40).astype(np.int64))):
            if name != big:
                with archive.open(f"{name}.npy", "w") as f:
                    np.lib.format.write_array(f, array)
        with archive.open(f"{big}.npy", "w", force_zip64=True) as f:
            np.lib.format.write_array_header_1_0(
                f, {"descr": "<f4", "fortran_order": False, "shape": (extra_elements,)})
            chunk = bytes(1 << 24)
            for _ in range(extra_elements * 4 // len(chunk)):
                f.write(chunk)


def test_item10_data_npz_reads_only_the_arrays_the_graph_needs(tmp_path):
    data = tmp_path / "bomb.npz"
    _write_bomb_npz(data, 1 << 26)  # 256 MiB of zeros, about 1 MB compressed
    assert os.path.getsize(data) < 4 << 20
    plain = tmp_path / "plain.npz"  # the same run without the unused array: the control
    _write_bomb_npz(plain, 0)

    def peak_of_a_run_on(path, output):
        result = _peak_rss_mib(f"""
import json
from graphopt.cli import main
RESULT = {{}}
RESULT["code"] = main(["run", {MLP!r}, "--data", {str(path)!r}, "--loss", "cross_entropy",
                       "--batch-size", "4", "--steps", "2", "-o", {str(output)!r}],
                      standalone_mode=False)
""")
        assert result["code"] in (0, None), result
        assert os.path.exists(output)
        return result["peak_mib"]

    # against the control, not an absolute size: the process's own size depends on what it
    # loads (numba's compiled kernels, about 110 MiB); reading the array would add 256 MiB
    grown = (peak_of_a_run_on(data, tmp_path / "t.onnx")
             - peak_of_a_run_on(plain, tmp_path / "control.onnx"))
    assert grown < 32, grown


def test_item10_array_sizes_are_checked_against_the_limit_before_decompressing(tmp_path):
    from graphopt.trainer.data import load_npz

    np.savez(tmp_path / "plain.npz", x=np.ones((40, 64), np.float32),
             labels=np.zeros(40, np.int64))
    arrays = load_npz(str(tmp_path / "plain.npz"))
    assert isinstance(arrays["x"], np.memmap)  # uncompressed: mapped, not read
    np.testing.assert_array_equal(arrays["labels"], np.zeros(40, np.int64))
    bad = tmp_path / "big_x.npz"
    _write_bomb_npz(bad, 1 << 24, big="x")  # the graph's own input declares 64 MiB
    env = dict(os.environ, GRAPHOPT_MEMORY_LIMIT="16M")
    done = subprocess.run([sys.executable, "-P", "-m", "graphopt", "run", MLP, "--data", str(bad),
                           "--loss", "cross_entropy", "--batch-size", "4", "--steps", "1",
                           "-o", str(tmp_path / "t.onnx")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "array 'x' (16777216,) float32 needs 64.0 MiB, more than the " \
        "16.0 MiB available" in lines[0], done.stderr
