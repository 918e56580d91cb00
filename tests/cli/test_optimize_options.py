"""`graphopt optimize` options users of onnxsim and polygraphy reach for: --only with "did you
mean", --report -, the op-type summary, --check [N], --input-shape, -v/-q; and `graphopt
rules` descriptions that end where their sentence does."""
from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from support.models import fixture_path, model_from_text

from graphopt import registry
from graphopt.cli import main
from graphopt.dsl import Rule, op, var
from graphopt.executor import compare

MQA = fixture_path("mqa_opset17.onnx")


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def one_error_line(result) -> str:
    assert result.exit_code == 1, (result.exit_code, result.output)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphopt: error: "), result.stderr
    return lines[0]


# ---- 9: --only, did you mean -----------------------------------------------------------
def test_only_runs_just_the_named_rules(tmp_path):
    # the exporter's Constant indices must be folded before the Split fusion can match
    result = invoke("optimize", MQA, "--dry-run", "--only", "fold_constants", "--only",
                    "gather_slice_to_split", "--report", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    report = json.loads((tmp_path / "r.json").read_text())
    assert sorted(report["rules"]) == ["fold_constants", "gather_slice_to_split"]
    assert report["rules"]["gather_slice_to_split"]["rewrites"] == 1
    assert "com.microsoft.FusedMatMul" not in report["op_types_after"]


def test_only_ignores_level_and_is_repeatable(tmp_path):
    result = invoke("optimize", MQA, "--dry-run", "--level", "1", "--only",
                    "matmul_scale_to_fused_matmul", "--only", "fold_constants",
                    "--report", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    rules = json.loads((tmp_path / "r.json").read_text())["rules"]
    assert set(rules) == {"matmul_scale_to_fused_matmul", "fold_constants"}


@pytest.mark.parametrize("option", ["--only", "--enable", "--disable", "--explain"])
def test_misspelt_rule_says_did_you_mean(option, tmp_path):
    line = one_error_line(invoke("optimize", MQA, "-o", tmp_path / "o.onnx", option,
                                 "gather_slice_to_splt"))
    assert "did you mean 'gather_slice_to_split'?" in line
    assert os.listdir(tmp_path) == []


def test_unrelated_rule_name_gets_no_suggestion(tmp_path):
    line = one_error_line(invoke("optimize", MQA, "-o", tmp_path / "o.onnx", "--only", "zzz"))
    assert "did you mean" not in line and "graphopt rules" in line


# ---- 10: --report -, dry run says the report was written ----------------------------------
def test_report_dash_writes_json_to_stdout_and_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = invoke("optimize", MQA, "--dry-run", "--report", "-")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)          # stdout is the JSON alone
    assert report["rules"]["gather_slice_to_split"]["rewrites"] == 1
    assert "fired:" in result.stderr             # the human-readable part went to stderr
    assert os.listdir(tmp_path) == []            # no file named "-"


def test_dry_run_with_report_says_the_report_was_written(tmp_path):
    result = invoke("optimize", MQA, "--dry-run", "--report", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    assert f"wrote the report to {tmp_path / 'r.json'}" in result.stdout
    assert result.stdout.splitlines()[-1] == "dry run: only the report was written"
    assert sorted(os.listdir(tmp_path)) == ["r.json"]


# ---- 11: op types before / after -------------------------------------------------------------
def test_op_type_summary_in_text_and_json(tmp_path):
    result = invoke("optimize", MQA, "--dry-run", "--report", tmp_path / "r.json")
    summary = next(line for line in result.stdout.splitlines() if line.startswith("op types:"))
    assert "removed" in summary and "Slice 1" in summary and "added Split 1" in summary
    report = json.loads((tmp_path / "r.json").read_text())
    model = onnx.load(MQA)
    assert sum(report["op_types_before"].values()) == len(model.graph.node)
    assert report["op_type_changes"]["Split"] == {"before": 0, "after": 1}
    assert report["op_type_changes"]["Slice"]["after"] == 0
    assert sum(report["op_types_after"].values()) == report["nodes_after"]


def test_op_type_summary_says_unchanged_when_nothing_fired(tmp_path):
    result = invoke("optimize", MQA, "--dry-run", "--only", "gathernd_to_gather")
    assert "op types: unchanged" in result.stdout


# ---- 12: --check [N] -----------------------------------------------------------------------
def test_check_passes_on_a_correct_rewrite(tmp_path):
    out = tmp_path / "o.onnx"
    result = invoke("optimize", MQA, "-o", out, "--check")
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if line.startswith("check:"))
    assert "3 random input set(s)" in line and "outputs match" in line
    assert out.exists()
    result = invoke("optimize", MQA, "--dry-run", "--check", "2")
    assert "check: 2 random input set(s)" in result.stdout


X = var("x")
WRONG = Rule(name="test_only_relu_to_sigmoid", description="A wrong rewrite for --check",
             match=op.Relu(X), rewrite=lambda m: op.Sigmoid(m.x))
RELU = model_from_text("""
<ir_version: 8, opset_import: ["" : 17]>
g (float[2, 3] x) => (float[2, 3] y) { y = Relu(x) }
""")


@pytest.fixture
def wrong_rule():
    registry.register(WRONG)
    yield WRONG.name
    registry._registered.pop(WRONG.name, None)


def test_check_fails_with_exit_1_and_writes_nothing_when_outputs_differ(tmp_path, wrong_rule):
    model = tmp_path / "relu.onnx"
    onnx.save(RELU, model)
    out = tmp_path / "o.onnx"
    line = one_error_line(invoke("optimize", model, "-o", out, "--only", wrong_rule,
                                 "--check", "2"))
    assert "outputs that differ: y" in line and "nothing written" in line
    assert not out.exists()


def test_check_falls_back_to_the_executor_without_onnxruntime(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_onnxruntime(name, *args, **kwargs):
        if name == "onnxruntime":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_onnxruntime)
    wrong = onnx.ModelProto()
    wrong.CopyFrom(RELU)
    wrong.graph.node[0].op_type = "Sigmoid"
    result = compare.check(RELU, wrong, 2)
    assert result.runtime.startswith("the graphopt executor") and not result.ok
    assert compare.check(RELU, RELU, 2).ok


# ---- 13: --input-shape --------------------------------------------------------------------------
DYNAMIC = fixture_path("mqa_opset17_dynamic.onnx")


def _dims(path, name):
    value = next(i for i in onnx.load(path).graph.input if i.name == name)
    return [d.dim_value or d.dim_param for d in value.type.tensor_type.shape.dim]


def test_input_shape_fixes_symbolic_dimensions(tmp_path):
    name = onnx.load(DYNAMIC).graph.input[0].name
    dims = _dims(DYNAMIC, name)
    assert any(isinstance(d, str) for d in dims)
    fixed = [1 if isinstance(d, str) else d for d in dims]
    out = tmp_path / "o.onnx"
    result = invoke("optimize", DYNAMIC, "-o", out, "--input-shape",
                    f"{name}:{','.join(map(str, fixed))}", "--check", "1")
    assert result.exit_code == 0, result.output
    assert _dims(out, name) == fixed


@pytest.mark.parametrize("spec, needle", [
    ("nope:1,2", "no input 'nope'"),
    ("x:1", "dimensions given"),
    ("x:a,b", "NAME:DIM,DIM"),
    ("x", "NAME:DIM,DIM"),
])
def test_input_shape_mistakes_are_one_line(spec, needle, tmp_path):
    model = tmp_path / "relu.onnx"
    onnx.save(RELU, model)
    line = one_error_line(invoke("optimize", model, "--dry-run", "--input-shape", spec))
    assert needle in line


def test_input_shape_cannot_change_a_fixed_dimension(tmp_path):
    model = tmp_path / "relu.onnx"
    onnx.save(RELU, model)
    line = one_error_line(invoke("optimize", model, "--dry-run", "--input-shape", "x:4,3"))
    assert "fixed at 2" in line


# ---- 14: -v / -q ---------------------------------------------------------------------------
def test_quiet_prints_nothing_and_verbose_prints_more(tmp_path):
    quiet = invoke("optimize", MQA, "-o", tmp_path / "q.onnx", "-q")
    assert quiet.exit_code == 0 and quiet.stdout == "" and quiet.stderr == ""
    assert (tmp_path / "q.onnx").exists()
    normal = invoke("optimize", MQA, "-o", tmp_path / "n.onnx")
    verbose = invoke("optimize", MQA, "-o", tmp_path / "v.onnx", "--verbose")
    assert verbose.stdout.startswith("rules run: ")
    assert "op type  " in verbose.stdout and "op type  " not in normal.stdout
    assert len(verbose.stdout.splitlines()) > len(normal.stdout.splitlines())
    one_error_line(invoke("optimize", MQA, "--dry-run", "-q", "-v"))


def test_quiet_still_reports_errors(tmp_path):
    line = one_error_line(invoke("optimize", tmp_path / "missing.onnx", "--dry-run", "-q"))
    assert "missing.onnx" in line


# ---- 15: rule descriptions are whole sentences ------------------------------------------------
def test_rule_descriptions_are_not_cut_mid_sentence():
    result = CliRunner().invoke(main, ["rules"])
    cut = []
    for rule in registry.all_rules().values():
        text = rule.description.strip()
        last = text.rstrip(").").split()[-1].lower()
        if (text.count("(") != text.count(")")
                or last in {"with", "and", "or", "to", "of", "the", "a", "an", "for", "by", "in"}):
            cut.append(f"{rule.name}: {text!r}")
        assert text in result.stdout
    assert not cut, cut


def test_check_numbers_reach_the_tolerance():
    rng = np.random.default_rng(0)
    feeds = compare.random_inputs(RELU, rng, {"x": [2, 3]})
    assert feeds["x"].shape == (2, 3) and feeds["x"].dtype == np.float32


def test_input_shape_lets_the_shape_arithmetic_fold(tmp_path):
    model = tmp_path / "dynamic.onnx"
    onnx.save(model_from_text("""
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 4, 6] x) => (float[N, 24] y) {
  s = Shape <start = 0, end = 1> (x)
  n = Size(x)
  per_row = Div(n, s)
  target = Concat <axis = 0> (s, per_row)
  y = Reshape(x, target)
}"""), model)
    kept, fixed = tmp_path / "kept.onnx", tmp_path / "fixed.onnx"
    assert invoke("optimize", model, "-o", kept).exit_code == 0
    result = invoke("optimize", model, "-o", fixed, "--input-shape", "x:2,4,6", "--check")
    assert result.exit_code == 0, result.output
    assert len(onnx.load(kept).graph.node) == 5
    assert [n.op_type for n in onnx.load(fixed).graph.node] == ["Reshape"]


def test_profile_lists_each_phase_with_its_time_and_peak(tmp_path):
    out = tmp_path / "o.onnx"
    result = CliRunner().invoke(main, ["optimize", fixture_path("hf_falcon_mqa_ts17.onnx"),
                                       "-o", str(out), "--profile"])
    assert result.exit_code == 0, result.output
    table = result.output[result.output.index("phase "):].splitlines()
    rows = {line[:50].strip(): line[50:].split() for line in table[2:] if line.strip()
            and not line.startswith("wrote")}
    for phase in ("load", "rewrites", "validation", "save"):
        ms, peak, read = rows[phase]
        assert float(ms.replace(",", "")) >= 0 and float(peak.replace(",", "")) > 10
        assert read == "-" or float(read.replace(",", "")) >= 0
    assert rows["gather_slice_to_split"][1:] == ["-", "-"]   # a rule: its time, in rewrites
    assert "whole-model type inference (within the rewrites)" in rows
    assert out.exists()
