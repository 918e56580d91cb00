"""The `graphopt` command: user errors are one line and exit 1, usage errors exit 2, and
the success paths print and write what they say."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import onnx
import pytest
from click.testing import CliRunner
from support.models import fixture_path, model_from_text, overlapping_slices_model

import graphopt
from graphopt.cli import main
from graphopt.registry import all_rules

MQA = fixture_path("mqa_opset17.onnx")
MQA_BYTES = open(MQA, "rb").read()

OVERLAP = overlapping_slices_model()


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_user_error(result, *, contains: str | None = None):
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("graphopt: error: ")
    assert "Traceback" not in result.output and "Traceback" not in result.stderr
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit)
    if contains:
        assert contains in lines[0], lines[0]
    return lines[0]


# ---- bad inputs: exit 1, one line, nothing written -------------------------------------
def _write(path, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def _not_a_model_proto() -> bytes:
    return onnx.helper.make_tensor("t", onnx.TensorProto.FLOAT, [2], [1.0, 2.0]).SerializeToString()


def _model_without_opsets() -> bytes:
    model = onnx.ModelProto()
    model.CopyFrom(OVERLAP)
    del model.opset_import[:]
    return model.SerializeToString()


def _model_failing_the_checker() -> bytes:
    model = onnx.ModelProto()
    model.CopyFrom(OVERLAP)
    model.graph.node[3].input[0] = "nowhere"
    return model.SerializeToString()


BAD_INPUTS = {
    "missing": (lambda d: str(d / "nope.onnx"), "no such file"),
    "directory": (lambda d: str(d), "is a directory"),
    "empty": (lambda d: _write(d / "e.onnx", b""), "empty file"),
    "random_bytes": (lambda d: _write(d / "r.onnx", bytes(range(256)) * 7), "not an ONNX model"),
    "tensor_proto": (lambda d: _write(d / "t.onnx", _not_a_model_proto()), "not an ONNX model"),
    "no_opset_import": (lambda d: _write(d / "o.onnx", _model_without_opsets()),
                        "no opset_import"),
    "checker_fails": (lambda d: _write(d / "c.onnx", _model_failing_the_checker()),
                      "invalid ONNX model"),
}
for _cut in (1, 10, 1000, len(MQA_BYTES) // 2, len(MQA_BYTES) - 5, len(MQA_BYTES) - 1):
    BAD_INPUTS[f"truncated_at_{_cut}"] = (
        lambda d, n=_cut: _write(d / f"cut{n}.onnx", MQA_BYTES[:n]), "not an ONNX model")


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_and_exit_1(tmp_path, case):
    make, message = BAD_INPUTS[case]
    src_dir = tmp_path / "in"
    src_dir.mkdir()
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    source = make(src_dir)
    assert_user_error(invoke("optimize", source, "-o", out_dir / "o.onnx"), contains=message)
    assert os.listdir(out_dir) == []


@pytest.mark.parametrize("option", ["--enable", "--disable", "--explain"])
def test_unknown_rule_name(tmp_path, option):
    line = assert_user_error(invoke("optimize", MQA, "-o", tmp_path / "o.onnx", option,
                                    "no_such_rule"))
    assert line == ("graphopt: error: unknown rule 'no_such_rule' "
                    "(list them with: graphopt rules)")
    assert os.listdir(tmp_path) == []


def test_output_folder_missing(tmp_path):
    assert_user_error(invoke("optimize", MQA, "-o", tmp_path / "no" / "o.onnx"),
                      contains="does not exist")
    assert os.listdir(tmp_path) == []


def test_output_folder_that_is_a_file(tmp_path):
    blocker = tmp_path / "model.onnx"
    blocker.write_bytes(b"not a folder")
    assert_user_error(invoke("optimize", MQA, "-o", blocker / "o.onnx"),
                      contains="is a file, not a folder")
    assert os.listdir(tmp_path) == ["model.onnx"]


def test_output_folder_not_writable(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("running as root: a read-only folder is still writable")
        assert_user_error(invoke("optimize", MQA, "-o", folder / "o.onnx"),
                          contains="is not writable")
        assert os.listdir(folder) == []
    finally:
        folder.chmod(stat.S_IRWXU)


def test_output_folder_not_writable_even_as_root(tmp_path, monkeypatch):
    """Root can write anywhere, so pretend: the check must come from os.access."""
    from graphopt import modelio

    folder = str(tmp_path / "ro")
    os.mkdir(folder)
    real_access = os.access
    monkeypatch.setattr(modelio.os, "access", lambda path, mode: False if (
        os.path.abspath(path) == folder and mode & os.W_OK) else real_access(path, mode))
    assert_user_error(invoke("optimize", MQA, "-o", os.path.join(folder, "o.onnx")),
                      contains=f"output folder {folder} is not writable")
    assert os.listdir(folder) == []


def test_external_data_model_from_another_folder_has_no_traceback(tmp_path, monkeypatch):
    import numpy as np

    src_dir = tmp_path / "src"
    src_dir.mkdir()
    w = onnx.numpy_helper.from_array(np.ones((8, 4), np.float32), "W")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
         onnx.helper.make_node("MatMul", ["x", "Wt"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", 1, [2, 4])],
        [onnx.helper.make_tensor_value_info("y", 1, [2, 8])], initializer=[w])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    onnx.save_model(model, src_dir / "m.onnx", save_as_external_data=True,
                    all_tensors_to_one_file=True, location="w.bin", size_threshold=0)
    monkeypatch.chdir(tmp_path)
    result = invoke("optimize", src_dir / "m.onnx", "-o", tmp_path / "o.onnx", "--level", "2",
                    "--disable", "fold_constants")
    assert result.exit_code == 0, result.exception
    assert "fired: matmul_transpose_to_fused_matmul" in result.output


def test_output_is_a_directory(tmp_path):
    (tmp_path / "d").mkdir()
    assert_user_error(invoke("optimize", MQA, "-o", tmp_path / "d"), contains="is a directory")
    assert os.listdir(tmp_path / "d") == []


def test_output_equal_to_input_needs_in_place(tmp_path):
    src = _write(tmp_path / "m.onnx", MQA_BYTES)
    assert_user_error(invoke("optimize", src, "-o", src), contains="pass --in-place")
    assert open(src, "rb").read() == MQA_BYTES
    assert os.listdir(tmp_path) == ["m.onnx"]
    result = invoke("optimize", src, "--in-place")
    assert result.exit_code == 0, result.output
    assert f"wrote {src}" in result.output
    assert "Split" in [n.op_type for n in onnx.load(src).graph.node]


def test_no_output_is_a_user_error(tmp_path):
    assert_user_error(invoke("optimize", MQA), contains="no output")


def test_report_file_equal_to_input_is_refused(tmp_path):
    src = _write(tmp_path / "m.onnx", MQA_BYTES)
    assert_user_error(invoke("optimize", src, "-o", tmp_path / "o.onnx", "--report", src),
                      contains="would overwrite the input")
    assert os.listdir(tmp_path) == ["m.onnx"]


# ---- usage errors: one line, exit 1, as every other mistake ----------------------------
@pytest.mark.parametrize("args", [
    ["optimize", MQA, "--no-such-option"],
    ["optimize", MQA, "-o", "x.onnx", "--level", "3"],
    ["optimize", MQA, "-o", "x.onnx", "--level", "zero"],
    ["optimize", MQA, "-o", "x.onnx", "--provider", "tpu"],
    ["optimize", MQA, "-o", "x.onnx", "--only", "no_such_rule"],
    ["optimize"],
    ["rules", "--no-such-option"],
    ["run", "--example", "mqa", "--level", "3"],
    ["no-such-command"],
])
def test_usage_errors_are_one_line_and_exit_1_in_every_command(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke(*args)
    line = assert_user_error(result)
    assert "Usage:" not in result.output
    if args[0] in ("optimize", "rules", "run") and "no_such_rule" not in args:
        assert f"(see 'graphopt {args[0]} -h')" in line, line
    assert os.listdir(tmp_path) == []


# ---- success paths ------------------------------------------------------------------------
def test_success_prints_the_table_and_fired_line(tmp_path):
    out = tmp_path / "o.onnx"
    result = invoke("optimize", MQA, "-o", out)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["rule", "level", "candidates", "rewrites", "rollbacks", "ms"]
    rows = {line.split()[0]: line.split() for line in lines[2:] if line and
            line.split()[0] in all_rules()}
    assert set(rows) == set(all_rules())
    assert rows["gather_slice_to_split"][1:4] == ["1", "1", "1"]
    assert ("fired: constant_to_initializer, eliminate_common_subexpressions, fold_constants, "
            "gather_slice_to_split, matmul_scale_to_fused_matmul, "
            "matmul_transpose_to_fused_matmul") in lines
    assert lines[-1] == f"wrote {out}"
    assert result.stderr == ""
    model = onnx.load(out)
    onnx.checker.check_model(model)
    assert [n.op_type for n in model.graph.node].count("Split") == 1


def test_dry_run_writes_nothing(tmp_path):
    result = invoke("optimize", MQA, "-o", tmp_path / "o.onnx", "--dry-run")
    assert result.exit_code == 0
    assert "fired: " in result.output and result.output.splitlines()[-1] == \
        "dry run: nothing written"
    assert os.listdir(tmp_path) == []
    result = invoke("optimize", MQA, "--dry-run")  # no -o needed
    assert result.exit_code == 0


def test_report_file_is_json_with_per_rule_numbers(tmp_path):
    report_path = tmp_path / "r.json"
    result = invoke("optimize", MQA, "-o", tmp_path / "o.onnx", "--report", report_path)
    assert result.exit_code == 0
    data = json.loads(report_path.read_text())
    assert set(data["rules"]) == set(all_rules())
    for _name, stats in data["rules"].items():
        assert {"candidates", "rewrites", "rollbacks", "seconds"} <= set(stats)
        assert stats["seconds"] >= 0 and stats["rollbacks"] == 0
    assert data["rules"]["gather_slice_to_split"]["rewrites"] == 1
    assert data["rules"]["gather_slice_to_split"]["candidates"] == 1
    assert data["rules"]["matmul_transpose_to_fused_matmul"]["rewrites"] == 1
    assert data["rules"]["matmul_scale_to_fused_matmul"]["rewrites"] == 1
    assert data["nodes_before"] > data["nodes_after"] > 0
    assert sorted(os.listdir(tmp_path)) == ["o.onnx", "r.json"]


def test_explain_prints_the_overlap_reason(tmp_path):
    src = tmp_path / "overlap.onnx"
    onnx.save(OVERLAP, src)
    result = invoke("optimize", src, "-o", tmp_path / "o.onnx", "--explain",
                    "gather_slice_to_split")
    assert result.exit_code == 0
    assert ("gather_slice_to_split: 1 candidate(s), 0 rewrite(s); why it did not match:"
            in result.output)
    assert "  at tensor 'x': pieces on axis 1 do not tile it: overlap at 3 (Slice '')" in \
        result.output.splitlines()


def test_explain_of_a_rule_that_did_not_run(tmp_path):
    result = invoke("optimize", MQA, "--dry-run", "--level", "1", "--explain",
                    "matmul_scale_to_fused_matmul")
    assert result.exit_code == 0
    assert "matmul_scale_to_fused_matmul: did not run" in result.output


def test_rules_lists_every_rule_with_level_and_providers():
    result = invoke("rules")
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert lines[0].split()[:4] == ["name", "level", "kind", "providers"]
    listed = {line.split()[0]: line.split() for line in lines[1:]}
    expected = {"fold_constants": ("1", "pass"), "mark_backward_pass": ("1", "pass"),
                "gather_slice_to_split": ("1", "rule"), "gathernd_to_gather": ("1", "rule"),
                "transpose_gather_to_gather_transpose": ("1", "rule"),
                "fold_transposes": ("1", "rule"),
                "matmul_transpose_to_fused_matmul": ("2", "rule"),
                "matmul_scale_to_fused_matmul": ("2", "rule")}
    assert set(expected) <= set(listed)
    for name, (level, kind) in expected.items():
        assert listed[name][1:4] == [level, kind, "cpu,cuda,rocm"], listed[name]


@pytest.fixture
def rocm_only_rule():
    from graphopt import registry

    rule = graphopt.Rule(name="test_rocm_only_relu", description="Relu(Relu(x)) -> Relu(x)",
                         level=1, providers=frozenset({"rocm"}),
                         match=graphopt.op.Relu(graphopt.op.Relu(graphopt.var("x"))),
                         rewrite=lambda m: graphopt.op.Relu(m.x))
    graphopt.register(rule)
    yield rule
    registry._registered.pop(rule.name, None)


def test_provider_filters_rules(tmp_path, rocm_only_rule):
    src = tmp_path / "relu.onnx"
    onnx.save(model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3] x) => (float[3] y) { r = Relu(x)
          y = Relu(r) }"""), src)
    listed = invoke("rules").output
    assert "test_rocm_only_relu" in listed and " rocm " in listed
    rocm = invoke("optimize", src, "-o", tmp_path / "a.onnx", "--provider", "rocm",
                  "--report", tmp_path / "a.json")
    cpu = invoke("optimize", src, "-o", tmp_path / "b.onnx", "--provider", "cpu",
                 "--report", tmp_path / "b.json")
    assert rocm.exit_code == 0 and cpu.exit_code == 0
    assert "fired: test_rocm_only_relu" in rocm.output
    assert "test_rocm_only_relu" not in cpu.output
    assert [n.op_type for n in onnx.load(tmp_path / "a.onnx").graph.node] == ["Relu"]
    assert [n.op_type for n in onnx.load(tmp_path / "b.onnx").graph.node] == ["Relu", "Relu"]
    assert "test_rocm_only_relu" not in json.loads((tmp_path / "b.json").read_text())["rules"]


def test_level_1_makes_no_fused_matmul(tmp_path):
    for name in ("mqa_opset17.onnx", "mqa_block.onnx", "mqa_dynamo.onnx"):
        out = tmp_path / name
        result = invoke("optimize", fixture_path(name), "-o", out, "--level", "1")
        assert result.exit_code == 0
        model = onnx.load(out)
        assert "com.microsoft" not in {n.domain for n in model.graph.node}
        assert "FusedMatMul" not in [n.op_type for n in model.graph.node]
        assert "Split" in [n.op_type for n in model.graph.node]
        assert "matmul_" not in result.output


def test_enable_and_disable(tmp_path):
    result = invoke("optimize", MQA, "--dry-run", "--disable", "gather_slice_to_split")
    assert result.exit_code == 0
    assert "gather_slice_to_split" not in result.output
    result = invoke("optimize", MQA, "--dry-run", "--level", "1", "--enable",
                    "matmul_scale_to_fused_matmul")
    assert "matmul_scale_to_fused_matmul" in result.output.split("fired: ")[1]


# ---- a real process: no traceback, the right exit codes -------------------------------------
def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-P", "-m", "graphopt.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_subprocess_user_error_and_success(tmp_path):
    bad = _write(tmp_path / "cut.onnx", MQA_BYTES[:1000])
    proc = _cli("optimize", bad, "-o", tmp_path / "o.onnx", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"graphopt: error: {bad}: not an ONNX model (protobuf parse failed; truncated?)"]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["cut.onnx"]
    proc = _cli("optimize", MQA, "-o", tmp_path / "o.onnx", "--level", "3", cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    proc = _cli("optimize", MQA, "-o", tmp_path / "o.onnx", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "fired: " in proc.stdout and proc.stderr == ""
    assert onnx.load(tmp_path / "o.onnx").graph.node


def test_console_script_is_installed(tmp_path):
    script = os.path.join(os.path.dirname(sys.executable), "graphopt")
    if not os.path.exists(script):
        pytest.skip("console script not installed in this environment")
    proc = subprocess.run([script, "optimize", str(tmp_path / "missing.onnx"), "-o",
                           str(tmp_path / "o.onnx")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"graphopt: error: {tmp_path / 'missing.onnx'}: no such file"]


# ---- Ctrl-C anywhere: one line, exit code 130 ----------------------------------------------
def test_interrupt_while_click_parses_arguments_exits_130(monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(type(main), "make_context", interrupted)
    result = CliRunner().invoke(main, ["rules"])
    assert result.exit_code == 130
    assert result.output.splitlines()[-1] == "graphopt: interrupted; nothing was written"
    assert "Aborted" not in result.output


INTERRUPT_DURING_IMPORTS = r"""
import importlib.abc, os, signal, sys
class InterruptOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "graphopt.cli":
            os.kill(os.getpid(), signal.SIGINT)
        return None
sys.meta_path.insert(0, InterruptOnImport())
from graphopt.console import main
sys.argv = ["graphopt", "--version"]
main()
"""


def test_interrupt_while_the_console_script_imports_exits_130(tmp_path):
    proc = subprocess.run([sys.executable, "-P", "-c", INTERRUPT_DURING_IMPORTS], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130
    assert proc.stderr.splitlines() == ["graphopt: interrupted; nothing was written"]
    assert proc.stdout == ""


def test_python_dash_m_graphopt_is_the_command(tmp_path):
    proc = subprocess.run([sys.executable, "-P", "-m", "graphopt", "--version"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "graphopt, version" in proc.stdout


def test_importing_the_package_is_cheap_so_the_console_script_can_guard_the_rest(tmp_path):
    code = ("import sys, graphopt, graphopt.console; "
            "print(sorted({'onnx', 'numpy'} & set(sys.modules)))")
    proc = subprocess.run([sys.executable, "-P", "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.stdout.strip() == "[]", proc.stderr


def test_optimizer_choices_are_the_trainers_optimizers():
    # cli.py spells the choices (importing the trainer would slow every command's start)
    from graphopt.trainer.optimizers import OPTIMIZERS

    option = next(p for p in main.commands["run"].params if p.name == "optimizer")
    assert list(option.type.choices) == list(OPTIMIZERS)
