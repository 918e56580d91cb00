"""Input validation: values no run can use are refused in one line where they are consumed
(the CLI and the Python API alike), data-parallel refusals come from rank 0 alone before any
rank waits on another, an ambiguous class axis is asked for instead of guessed, and a .npz
of thousands of members opens reading only the members the graph uses.

Each test is named after the failure class it pins and fails on the code before the fix."""
from __future__ import annotations

import subprocess
import sys
import time
import zipfile

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.cli_runs import assert_one_error_line, cli, invoke, one_error_line
from support.mpi import MPIEXEC, needs_mpi
from support.training_runs import MLP, mlp_data, write_npz

import graphopt
from graphopt import api
from graphopt.errors import GraphoptError
from graphopt.executor import Session
from graphopt.training import build_training_graph
from graphopt.training.prepare import prepare_training

BEYOND_INT64 = 2**70


@pytest.fixture
def mlp_files(tmp_path):
    return MLP, write_npz(tmp_path / "d.npz", mlp_data(samples=16))


# ---- values beyond int64 ------------------------------------------------------------------
@pytest.mark.parametrize("value", [BEYOND_INT64, -BEYOND_INT64])
def test_ignore_index_beyond_int64_is_one_line(mlp_files, value):
    model, data = mlp_files
    one_error_line(invoke("run", model, "--data", data, "--loss", "cross_entropy",
                          "--batch-size", "4", "--steps", "1", "--ignore-index", value),
                   f"--ignore-index) {value} is outside int64")


@pytest.mark.parametrize("value", [BEYOND_INT64, 2**63, 1.5, "3", True])
def test_ignore_index_not_an_int64_is_refused_by_the_builder(value):
    forward = onnx.load(MLP)
    with pytest.raises(GraphoptError, match="ignore_index"):
        build_training_graph(forward, "cross_entropy", ignore_index=value)
    with pytest.raises(GraphoptError, match="ignore_index"):
        prepare_training(forward, loss="cross_entropy", ignore_index=value)


def test_ignore_index_at_the_int64_limits_is_accepted():
    forward = onnx.load(MLP)
    for value in (2**63 - 1, -2**63, np.int64(-1)):
        training = build_training_graph(forward, "cross_entropy", ignore_index=value)
        loss = next(n for n in training.proto.graph.node
                    if n.op_type == "SoftmaxCrossEntropyLoss")
        attrs = {a.name: helper.get_attribute_value(a) for a in loss.attribute}
        assert attrs["ignore_index"] == int(value)


def test_input_shape_beyond_int64_is_one_line(tmp_path):
    big = "99999999999999999999999"
    one_error_line(invoke("optimize", MLP, "--dry-run", "--input-shape", f"x:{big},64"),
                   f"dimension 0 is {big}", "int64")
    with pytest.raises(GraphoptError, match="int64"):
        api.parse_input_shape(f"x:{big},64")


@pytest.mark.parametrize("dims, message", [
    ([BEYOND_INT64, 64], "int64"),
    ([2**63, 64], "int64"),
    ([0, 64], "positive"),
    (["4", 64], "integers"),
    ([True, 64], "integers"),
    ("4,64", "integers"),
])
def test_input_shapes_the_api_cannot_use_are_one_graphopt_error(tmp_path, dims, message):
    with pytest.raises(GraphoptError, match=message):
        graphopt.optimize_file(MLP, None, dry_run=True, input_shapes={"x": dims})


def test_input_shape_at_the_int64_limit_is_accepted():
    assert api.parse_input_shape(f"x:1,{2**63 - 1}") == ("x", [1, 2**63 - 1])


# ---- rule names that are not strings --------------------------------------------------------
@pytest.mark.parametrize("options", [
    {"only": [3]}, {"disable": [None]}, {"enable": [b"x"]}, {"explain": [1.5]}, {"rules": [3]},
    {"rules": 3},
])
def test_non_string_rule_names_are_one_graphopt_error(options):
    with pytest.raises(GraphoptError) as caught:
        graphopt.optimize(MLP, **options)
    assert "\n" not in str(caught.value) and "string" in str(caught.value)
    with pytest.raises(GraphoptError):
        graphopt.select_rules(**{k: v for k, v in options.items() if k != "explain"}
                              or {"only": [1.5]})


def test_rule_names_as_one_string_or_none_select_as_expected():
    by_name = [r.name for r in graphopt.select_rules(only="fold_constants")]
    assert by_name == ["fold_constants"]
    everything = [r.name for r in graphopt.select_rules()]
    assert [r.name for r in graphopt.select_rules(disable=None)] == everything
    _, report = graphopt.optimize(MLP, only=["fold_constants"])
    assert set(report.rules) <= {"fold_constants"}


# ---- the class axis of cross_entropy's logits ---------------------------------------------
VOCAB = SEQ = 6
SAMPLES, HIDDEN = 8, 4


def lm_model(tmp_path, seq=SEQ, vocab=VOCAB) -> tuple[str, dict]:
    """input_ids [batch, seq] -> logits [batch, seq, vocab] (here seq == vocab)."""
    rng = np.random.default_rng(0)
    weights = {"embed.weight": rng.standard_normal((vocab, HIDDEN)).astype(np.float32),
               "lm_head.weight": rng.standard_normal((HIDDEN, vocab)).astype(np.float32)}
    graph = helper.make_graph(
        [helper.make_node("Gather", ["embed.weight", "input_ids"], ["h"]),
         helper.make_node("MatMul", ["h", "lm_head.weight"], ["logits"])],
        "lm", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", seq])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", seq, vocab])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "lm.onnx"
    onnx.save(model, path)
    return str(path), weights


def lm_data(tmp_path, seq=SEQ, vocab=VOCAB):
    rng = np.random.default_rng(1)
    arrays = {"input_ids": rng.integers(0, vocab, (SAMPLES, seq)),
              "labels": rng.integers(0, vocab, (SAMPLES, seq))}
    return write_npz(tmp_path / "lm.npz", arrays), arrays


def test_cross_entropy_with_two_possible_class_axes_asks_which(tmp_path):
    model, _ = lm_model(tmp_path)
    data, _ = lm_data(tmp_path)
    line = one_error_line(invoke("run", model, "--data", data, "--loss", "cross_entropy",
                                 "--batch-size", "4", "--steps", "1"),
                          "could be on axis 1 or 2", "--class-axis 1 or --class-axis 2")
    assert f"[batch, {SEQ}, {VOCAB}]" in line
    with pytest.raises(GraphoptError, match="axis 1 or 2"):
        prepare_training(onnx.load(model), loss="cross_entropy",
                         label_shapes={"labels": (SAMPLES, SEQ)})


def _first_loss(training, arrays) -> float:
    session = Session(training.proto, device="cpu", training=True, seed=0)
    out = session.run({"input_ids": arrays["input_ids"], "labels": arrays["labels"]},
                      training.losses)
    return float(out[training.losses[0]])


def _reference_loss(weights, arrays, class_axis) -> float:
    logits = weights["embed.weight"][arrays["input_ids"]] @ weights["lm_head.weight"]
    scores = np.moveaxis(logits, class_axis, -1).astype(np.float64)
    scores -= scores.max(-1, keepdims=True)
    log_prob = scores - np.log(np.exp(scores).sum(-1, keepdims=True))
    return float(-np.take_along_axis(log_prob, arrays["labels"][..., None], -1).mean())


@pytest.mark.parametrize("class_axis", [1, 2, -1])
def test_class_axis_chooses_the_layout_when_two_fit(tmp_path, class_axis):
    model, weights = lm_model(tmp_path)
    _, arrays = lm_data(tmp_path)
    forward = onnx.load(model)
    training, _ = prepare_training(forward, loss="cross_entropy", class_axis=class_axis,
                                   label_shapes={"labels": (SAMPLES, SEQ)})
    axis = class_axis % 3
    assert abs(_first_loss(training, arrays) - _reference_loss(weights, arrays, axis)) < 1e-4
    built = build_training_graph(forward, "cross_entropy", class_axis=class_axis)
    assert abs(_first_loss(built, arrays) - _reference_loss(weights, arrays, axis)) < 1e-4


@pytest.mark.parametrize("class_axis, message", [
    (0, "axis 0 is the batch"), (3, "one of the axes 1 to 2"), (-3, "axis 0 is the batch"),
    ("2", "must be an integer"), (True, "must be an integer"),
])
def test_a_class_axis_the_logits_lack_is_refused(tmp_path, class_axis, message):
    forward = onnx.load(lm_model(tmp_path)[0])
    with pytest.raises(GraphoptError, match=message):
        build_training_graph(forward, "cross_entropy", class_axis=class_axis)
    with pytest.raises(GraphoptError, match=message):
        prepare_training(forward, loss="cross_entropy", class_axis=class_axis,
                         label_shapes={"labels": (SAMPLES, SEQ)})


def test_a_class_axis_that_does_not_fit_the_labels_or_the_loss_is_refused(tmp_path):
    forward = onnx.load(lm_model(tmp_path, seq=5, vocab=7)[0])
    with pytest.raises(GraphoptError, match=r"without the class axis 1 .* \[batch, 7\]"):
        prepare_training(forward, loss="cross_entropy", class_axis=1,
                         label_shapes={"labels": (SAMPLES, 5)})
    with pytest.raises(GraphoptError, match="only to loss='cross_entropy'"):
        prepare_training(forward, loss="mse", class_axis=2)
    with pytest.raises(GraphoptError, match="only to loss='cross_entropy'"):
        build_training_graph(forward, "mse", class_axis=2)


def test_class_axis_option_trains_the_chosen_layout(tmp_path):
    model, _ = lm_model(tmp_path)
    data, _ = lm_data(tmp_path)
    result = invoke("run", model, "--data", data, "--loss", "cross_entropy", "--batch-size",
                    SAMPLES, "--steps", "1", "--class-axis", "2")
    assert result.exit_code == 0, result.output


# ---- a .npz of thousands of members -------------------------------------------------------
MEMBERS = 8000


def test_an_npz_of_8000_members_reads_only_the_members_the_graph_uses(tmp_path, monkeypatch):
    from graphopt.trainer import RunOptions, run

    arrays = mlp_data(samples=8)
    extra = {f"unused_{i}": np.zeros(2, np.float32) for i in range(MEMBERS)}
    np.savez(tmp_path / "many.npz", **arrays, **extra)
    used = {"x.npy", "labels.npy"}
    opened, archives = [], []
    real_open, real_init = zipfile.ZipFile.open, zipfile.ZipFile.__init__

    def counting_open(self, name, *args, **kwargs):
        member = name.filename if isinstance(name, zipfile.ZipInfo) else name
        # fail at once, not after a pass over 8,000 members
        assert member in used, f"decompressed {member!r}, which the graph does not read"
        opened.append(member)
        return real_open(self, name, *args, **kwargs)

    def counting_init(self, *args, **kwargs):
        archives.append(args[0] if args else kwargs.get("file"))
        assert len(archives) <= 4, "the archive's directory is parsed again and again"
        return real_init(self, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "open", counting_open)
    monkeypatch.setattr(zipfile.ZipFile, "__init__", counting_init)
    started = time.monotonic()
    outcome = run(RunOptions(model=MLP, data=str(tmp_path / "many.npz"), loss="cross_entropy",
                             batch_size=4, steps=1, device="cpu", quiet=True))
    seconds = time.monotonic() - started
    assert len(outcome.result.history) == 1
    assert set(opened) == used
    assert seconds < 20, seconds


# ---- data parallel: one line from rank 0, no MPI_Abort ------------------------------------


def _two_ranks(*args, timeout=90):
    return subprocess.run([MPIEXEC, "-n", "2", sys.executable, *args], capture_output=True,
                          text=True, timeout=timeout)


def _one_line_from_rank_zero(done, contains: str) -> None:
    assert done.returncode == 1, (done.returncode, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert lines == [lines[0]] and lines[0].startswith("graphopt: error: "), done.stderr
    assert contains in lines[0] and "[rank" not in lines[0], lines[0]
    assert "Abort" not in done.stdout + done.stderr


@needs_mpi
@pytest.mark.parametrize("extra, contains", [
    (("--batch-size", "7"), "--batch-size 7 is the global batch; it must be divisible by the "
                            "2 ranks"),
    (("--bucket-mb", "inf"), "--bucket-mb must be a positive number of MiB, not inf"),
    (("--bucket-mb", "nan"), "--bucket-mb must be a positive number of MiB, not nan"),
    (("--bucket-mb", "0"), "--bucket-mb must be a positive number of MiB, not 0"),
    (("--bucket-mb", "-1"), "--bucket-mb must be a positive number of MiB, not -1"),
])
def test_distributed_settings_refused_in_one_line_from_rank_zero(mlp_files, extra, contains):
    model, data = mlp_files
    done = _two_ranks("-P", "-m", "graphopt.cli", "run", model, "--data", data, "--loss",
                      "cross_entropy", "--batch-size", "8", "--steps", "1", "--device", "cpu",
                      "--distributed", "-q", *extra)
    _one_line_from_rank_zero(done, contains)


START = """
import sys
from graphopt.errors import GraphoptError
from graphopt.trainer import distributed
try:
    distributed.start(True, batch_size=7)
except GraphoptError as exc:
    print("graphopt: error: " + str(exc), file=sys.stderr)
    sys.exit(1)
print("started", file=sys.stderr)
"""


@needs_mpi
def test_distributed_start_refuses_an_indivisible_batch_before_any_collective():
    _one_line_from_rank_zero(_two_ranks("-P", "-c", START),
                             "--batch-size 7 is the global batch")


# ---- names that are not UTF-8 -------------------------------------------------------------
def _non_utf8_model(where: str) -> bytes:
    """A valid model whose name ``xQQQx`` (in ``where``) has its middle replaced by bytes that
    are not UTF-8 in the serialized protobuf."""
    name = "xQQQx"
    node_name = name if where == "node" else "relu"
    graph = helper.make_graph([helper.make_node("Relu", [name], ["y"], name=node_name)], "g",
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    if where == "subgraph":
        inner = helper.make_graph([helper.make_node("Identity", ["y"], ["xQQQx_inner"])], "b",
                                  [], [helper.make_tensor_value_info("xQQQx_inner",
                                                                     TensorProto.FLOAT, [2])])
        graph = helper.make_graph(
            [helper.make_node("Relu", ["x"], ["y"]),
             helper.make_node("If", ["c"], ["o"], then_branch=inner, else_branch=inner)], "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
             helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
            [helper.make_tensor_value_info("o", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString().replace(b"QQQ", b"\xff\xfe\xfd")


@pytest.mark.parametrize("where", ["input", "node", "subgraph"])
@pytest.mark.parametrize("command", ["optimize", "run"])
def test_non_utf8_names_are_one_line(tmp_path, where, command):
    path = tmp_path / "m.onnx"
    path.write_bytes(_non_utf8_model(where))
    data = write_npz(tmp_path / "d.npz", {"x": np.ones((4, 2), np.float32)})
    args = ["--dry-run"] if command == "optimize" else ["--data", data, "--loss", "output"]
    result = invoke(command, path, *args)
    assert result.exit_code == 1, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not valid UTF-8 text" in lines[0], result.stderr


def test_non_utf8_names_through_the_python_api_are_one_error():
    model = onnx.ModelProto()
    model.ParseFromString(_non_utf8_model("input"))
    with pytest.raises(GraphoptError, match="not valid UTF-8"):
        graphopt.optimize(model)


@pytest.mark.parametrize("option,value,message", [
    ("--steps", 0, "--steps must be >= 1, not 0"), ("--epochs", -1, "--epochs must be >= 1"),
    ("--clip-grad-norm", 0, "--clip-grad-norm must be a finite number > 0")])
def test_bad_counts_are_refused_before_the_model_is_read(tmp_path, option, value, message):
    """A wrong count is wrong whatever the model: said before a large model costs its
    preparation (the model here is not even an ONNX file: it is never opened)."""
    model = tmp_path / "not-a-model.onnx"
    model.write_bytes(b"")
    data = tmp_path / "d.npz"
    np.savez(data, x=np.zeros((4, 2), np.float32))
    code, _, stderr = cli("run", model, "--data", data, option, value, "--device", "cpu")
    assert_one_error_line(code, stderr, message)
