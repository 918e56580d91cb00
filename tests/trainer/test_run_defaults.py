"""`graphopt run` defaults a user does not have to think about: what is trained (parameters,
not exporter constants), --list-params, float16 models, and a warning when the trained
weights would be thrown away."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
from support.training_runs import MLP, mlp_data, write_npz

from graphopt.cli import main
from graphopt.training.float16 import to_float16


def invoke(*args):
    return CliRunner().invoke(main, ["run", *[str(a) for a in args]])


def one_error_line(result) -> str:
    assert result.exit_code == 1, (result.exit_code, result.output)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphopt: error: "), result.stderr
    return lines[0]


CONSTANTS = {
    "val_35": np.array(4.0, np.float32),                    # a scalar (attention scale)
    "onnx::Add_7": np.full([10], 0.5, np.float32),           # exporter-named constant
    "Constant_3": np.full([10], 2.0, np.float32),            # exporter-named constant
    "resize_scales": np.array([1.0, 1.0], np.float32),      # read only as a shape
}


def exported_like(tmp_path) -> str:
    """The MLP fixture with the constants an exporter leaves behind on its output path."""
    model = onnx.load(MLP)
    graph = model.graph
    out = graph.output[0].name
    graph.node[-1].output[0] = "logits0"
    graph.node.extend([
        helper.make_node("Mul", ["logits0", "val_35"], ["logits1"]),
        helper.make_node("Add", ["logits1", "onnx::Add_7"], ["logits2"]),
        helper.make_node("Mul", ["logits2", "Constant_3"], ["logits3"]),
        helper.make_node("Shape", ["logits3"], ["shape"]),
        helper.make_node("Reshape", ["logits3", "shape"], [out]),
        # a branch reading resize_scales only as Resize's scales: shape arithmetic
        helper.make_node("Resize", ["logits3", "", "resize_scales"], ["resized"]),
    ])
    graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in CONSTANTS.items())
    path = tmp_path / "exported.onnx"
    onnx.save(model, path)
    return str(path)


# ---- 1: what is trained ------------------------------------------------------------------------
def test_default_trains_parameters_not_exporter_constants(tmp_path):
    model = exported_like(tmp_path)
    data = write_npz(tmp_path / "d.npz", mlp_data())
    out = tmp_path / "trained.onnx"
    result = invoke(model, "--data", data, "--loss", "cross_entropy", "--batch-size", "4",
                    "--steps", "3", "--lr", "0.05", "-o", out)
    assert result.exit_code == 0, result.output
    before = {t.name: numpy_helper.to_array(t) for t in onnx.load(model).graph.initializer}
    after = {t.name: numpy_helper.to_array(t) for t in onnx.load(out).graph.initializer}
    for name in CONSTANTS:   # kept exactly, as the PyTorch module keeps its buffers
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)
    for name in ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]:
        assert not np.array_equal(after[name], before[name]), name
    # printed before step 1: count, weights, names; and what was left out, with why
    lines = result.stdout.splitlines()
    trained = lines.index("trained: 4 tensors, 2,410 weights")
    assert trained < next(i for i, line in enumerate(lines) if line.startswith("step 1/"))
    assert lines[trained + 1].split()[0] == "fc1.weight"
    left_out = next(line for line in lines if line.startswith("not trained: "))
    assert "scalars (rank 0): val_35" in left_out
    assert "exporter-generated constant names: onnx::Add_7, Constant_3" in left_out
    assert "read only by shape computations: resize_scales" in left_out


def test_list_params_prints_and_exits_without_data_or_training(tmp_path):
    model = exported_like(tmp_path)
    result = invoke(model, "--list-params")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0] == "trained: 4 tensors, 2,410 weights"
    assert "step 1" not in result.stdout and "== " not in result.stdout
    result = invoke("--example", "mqa", "--list-params")
    assert result.stdout.splitlines()[0].startswith("trained: 16 tensors")


def test_train_and_freeze_override_the_default(tmp_path):
    model = exported_like(tmp_path)
    result = invoke(model, "--list-params", "--train", "val_35", "--freeze", "fc1.*")
    assert result.exit_code == 0, result.output
    names = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")]
    assert names == ["fc2.weight", "fc2.bias", "val_35"]
    assert "--freeze: fc1.weight, fc1.bias" in result.stdout


def test_folded_weights_with_generated_names_are_still_trained():
    """dynamo folds the transposed Linear weights into val_0 and val_41 (read by MatMul): they
    are the module's parameters; val_35, the attention scale, is a scalar constant."""
    from support.models import fixture_path

    result = invoke(fixture_path("mqa_dynamo.onnx"), "--list-params")
    assert result.exit_code == 0, result.output
    names = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")]
    assert names == ["val_0", "val_41"]
    assert "scalars (rank 0): val_35" in result.stdout


def test_nothing_left_to_train_says_how_to_train_the_constants(tmp_path):
    model = exported_like(tmp_path)
    line = one_error_line(invoke(model, "--list-params", "--freeze", "fc*"))
    assert "nothing to train" in line and "--train PATTERN" in line and "val_35" in line


# ---- 2: buffers stay buffers -------------------------------------------------------------
def _renamed(source: str, old: str, new: str, path) -> str:
    """``source`` with initializer ``old`` renamed ``new`` (no name to go by)."""
    model = onnx.load(source)
    for tensor in model.graph.initializer:
        if tensor.name == old:
            tensor.name = new
    for node in model.graph.node:
        node.input[:] = [new if name == old else name for name in node.input]
    onnx.save(model, path)
    return str(path)


def test_rotary_inverse_frequencies_are_a_buffer_not_a_parameter(tmp_path):
    """A dynamo export keeps the rotary embedding's inv_freq buffer as an initializer: named
    as a buffer, it is not trained; renamed, it is still left out, because the logits depend
    on it only through Cos and Sin, and the listing says so; the default trained set is the
    module's parameters (the fixture's record of model.named_parameters())."""
    import json

    from support.models import fixture_path

    source = fixture_path("hf_phi3_dynamo18.onnx")
    meta = json.loads(str(np.load(fixture_path("hf_phi3_dynamo18.npz"))["__meta__"]))
    buffer = "inner.model.rotary_emb.inv_freq"
    result = invoke(source, "--list-params")
    assert result.exit_code == 0, result.output
    names = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")]
    assert f"named as PyTorch names module buffers: {buffer}" in result.stdout
    weights = sum(int(np.prod(t.dims)) for t in onnx.load(source).graph.initializer
                  if t.name in meta["trainable"])
    assert result.stdout.splitlines()[0] == \
        f"trained: {len(meta['trainable'])} tensors, {weights:,} weights"
    assert buffer not in " ".join(names)

    hidden = _renamed(source, buffer, "frequencies", tmp_path / "renamed.onnx")
    result = invoke(hidden, "--list-params")
    assert result.exit_code == 0, result.output
    assert ("no gradient reaches them (their paths to the outputs cross Cos, Sin, which have "
            "no gradient definition): frequencies") in result.stdout
    assert result.stdout.splitlines()[0].startswith(f"trained: {len(meta['trainable'])} tensors")


def test_training_a_tensor_no_gradient_reaches_names_the_tensor(tmp_path):
    from support.models import fixture_path

    hidden = _renamed(fixture_path("hf_phi3_dynamo18.onnx"), "inner.model.rotary_emb.inv_freq",
                      "frequencies", tmp_path / "renamed.onnx")
    d = np.load(fixture_path("hf_phi3_dynamo18.npz"))
    data = write_npz(tmp_path / "d.npz", {"input_ids": d["train_input_ids"],
                                          "labels": d["train_labels"]})
    line = one_error_line(invoke(hidden, "--data", data, "--loss", "cross_entropy",
                                 "--train", "frequencies", "--steps", "1"))
    assert "on the path from frequencies to the loss" in line
    assert "Cos (node" in line and "Sin (node" in line and "--freeze" in line


def test_a_tensor_also_read_through_a_differentiable_op_is_trained(tmp_path):
    """Cos on one path does not block a tensor that reaches the output through Add too; one
    the outputs do not read at all is not blocked either (its gradient is zero)."""
    model = onnx.load(MLP)
    graph = model.graph
    out = graph.output[0].name
    graph.node[-1].output[0] = "logits0"
    graph.node.extend([helper.make_node("Cos", ["phase"], ["wave"]),
                       helper.make_node("Add", ["logits0", "wave"], ["logits1"]),
                       helper.make_node("Add", ["logits1", "phase"], [out]),
                       helper.make_node("Sin", ["only_sin"], ["s"]),
                       helper.make_node("Mul", [out, "s"], ["dangling"])])
    graph.initializer.extend([numpy_helper.from_array(np.ones(10, np.float32), "phase"),
                              numpy_helper.from_array(np.ones(10, np.float32), "only_sin")])
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    result = invoke(path, "--list-params")
    assert result.exit_code == 0, result.output
    names = [line.split()[0] for line in result.stdout.splitlines() if line.startswith("  ")]
    assert "phase" in names and "only_sin" in names
    assert "no gradient reaches" not in result.stdout


# ---- 3: float16 models ---------------------------------------------------------------------
def test_float16_model_trains_in_mixed_precision_by_default(tmp_path):
    model = tmp_path / "mlp16.onnx"
    onnx.save(to_float16(onnx.load(MLP), keep_outputs_fp32=False), model)
    data = write_npz(tmp_path / "d.npz", mlp_data())
    out = tmp_path / "trained16.onnx"
    graph = tmp_path / "train.onnx"
    result = invoke(model, "--data", data, "--loss", "cross_entropy", "--batch-size", "4",
                    "--steps", "3", "-o", out, "--save-graph", graph)
    assert result.exit_code == 0, result.output
    assert "training with --precision mixed" in result.stdout
    assert "precision mixed" in result.stdout
    trained = onnx.load(out)
    assert {t.data_type for t in trained.graph.initializer} == {TensorProto.FLOAT16}
    # the loss is computed in float32, as for a float32 model trained in mixed precision
    training = onnx.load(graph)
    loss = next(n for n in training.graph.node if n.op_type == "SoftmaxCrossEntropyLoss")
    cast = next(n for n in training.graph.node if n.output[0] == loss.input[0])
    assert cast.op_type == "Cast"
    assert next(a.i for a in cast.attribute if a.name == "to") == TensorProto.FLOAT


def test_a_half_model_keeping_some_float32_weights_still_trains_in_mixed(tmp_path):
    """model.half() exports keep a few constants in float32: the weights' elements decide,
    and the line says so."""
    model = to_float16(onnx.load(MLP), keep_outputs_fp32=False)
    graph = model.graph
    out = graph.output[0].name
    graph.node[-1].output[0] = "logits16"
    graph.initializer.append(numpy_helper.from_array(np.full(10, 1.5, np.float32), "scale32"))
    graph.node.extend([helper.make_node("Cast", ["scale32"], ["scale16"], to=TensorProto.FLOAT16),
                       helper.make_node("Mul", ["logits16", "scale16"], [out])])
    path = tmp_path / "mostly16.onnx"
    onnx.save(model, path)
    data = write_npz(tmp_path / "d.npz", mlp_data())
    result = invoke(path, "--data", data, "--loss", "cross_entropy", "--batch-size", "4",
                    "--steps", "2")
    assert result.exit_code == 0, result.output
    assert "99.6% of the model's float weights are float16 (2,410 of 2,420 elements): " \
        "training with --precision mixed" in result.stdout
    assert "step 2/2" in result.stdout


def test_float16_model_with_fp32_precision_says_what_to_use(tmp_path):
    model = tmp_path / "mlp16.onnx"
    onnx.save(to_float16(onnx.load(MLP), keep_outputs_fp32=False), model)
    data = write_npz(tmp_path / "d.npz", mlp_data())
    line = one_error_line(invoke(model, "--data", data, "--loss", "cross_entropy",
                                 "--batch-size", "4", "--steps", "1", "--precision", "fp32"))
    assert "--precision mixed" in line


# ---- 4: weights thrown away ----------------------------------------------------------------
WARNING = "warning: the trained weights will not be saved"


def test_warns_at_the_start_when_nothing_will_be_saved(tmp_path):
    data = write_npz(tmp_path / "d.npz", mlp_data())
    args = [MLP, "--data", data, "--loss", "cross_entropy", "--batch-size", "4", "--steps", "1"]
    result = invoke(*args)
    assert result.exit_code == 0, result.output
    first = result.stdout.splitlines()[0]
    assert first.startswith(WARNING) and "./graphopt-checkpoint/" in first
    for extra in (["-o", tmp_path / "m.onnx"], ["--checkpoint", tmp_path / "ck"]):
        result = invoke(*args, *extra)
        assert result.exit_code == 0 and WARNING not in result.output


def test_every_file_written_is_named(tmp_path):
    data = write_npz(tmp_path / "d.npz", mlp_data())
    log, out, graph = tmp_path / "log.csv", tmp_path / "m.onnx", tmp_path / "train.onnx"
    result = invoke(MLP, "--data", data, "--loss", "cross_entropy", "--batch-size", "4",
                    "--steps", "2", "--log", log, "-o", out, "--save-graph", graph,
                    "--checkpoint", tmp_path / "ck")
    assert result.exit_code == 0, result.output
    for line in (f"wrote the step log to {log}", f"wrote the trained model to {out}",
                 f"wrote the training graph to {graph}",
                 f"checkpoint: {tmp_path / 'ck' / 'checkpoint.npz'}"):
        assert line in result.stdout.splitlines(), line


@pytest.mark.parametrize("switch,words", [("1", "(float32 row kernels: compiled (numba "),
                                          ("0", "(float32 row kernels: NumPy passes "
                                                "(GRAPHOPT_COMPILED_KERNELS=0))")])
def test_the_training_line_says_which_cpu_kernels_run(monkeypatch, switch, words):
    if switch == "1":
        pytest.importorskip("numba")
    monkeypatch.setenv("GRAPHOPT_COMPILED_KERNELS", switch)
    result = invoke("--example", "mqa", "--steps", "1")
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("training "))
    assert line.split("; device cpu ", 1)[1].startswith(words)


# ---- models with several outputs ---------------------------------------------------------
def _with_second_output(tmp_path) -> str:
    """The MLP with its hidden activations as a second output (as an HF export has
    ``present.*`` beside the logits)."""
    model = onnx.load(MLP)
    hidden = model.graph.node[1].output[0]
    model.graph.output.append(helper.make_tensor_value_info(hidden, TensorProto.FLOAT, [4, 32]))
    path = tmp_path / "two_outputs.onnx"
    onnx.save(model, path)
    return str(path)


def test_cross_entropy_names_the_prediction_of_a_model_with_several_outputs(tmp_path):
    data = write_npz(tmp_path / "d.npz", mlp_data())
    common = ["--data", data, "--batch-size", "4", "--steps", "3", "--lr", "0.05",
              "--optimizer", "sgd", "--log"]
    one = invoke(MLP, "--loss", "cross_entropy", *common, tmp_path / "one.jsonl")
    assert one.exit_code == 0, one.output
    two = _with_second_output(tmp_path)
    line = one_error_line(invoke(two, "--loss", "cross_entropy", *common, tmp_path / "x.jsonl"))
    assert "--loss cross_entropy:OUTPUT" in line
    named = invoke(two, "--loss", "cross_entropy:" + onnx.load(MLP).graph.output[0].name,
                   *common, tmp_path / "two.jsonl")
    assert named.exit_code == 0, named.output

    def losses(log):
        import json
        return [json.loads(row)["loss"] for row in open(log) if '"loss"' in row]

    assert losses(tmp_path / "two.jsonl") == losses(tmp_path / "one.jsonl")
    assert len(losses(tmp_path / "one.jsonl")) == 3


def test_loss_output_refuses_a_model_with_several_outputs(tmp_path):
    """It would drive the sum of every output, which is nobody's loss."""
    data = write_npz(tmp_path / "d.npz", mlp_data())
    line = one_error_line(invoke(_with_second_output(tmp_path), "--data", data, "--loss",
                                 "output", "--steps", "1"))
    assert "--loss output trains the sum of every output" in line and "2" in line
    for wrong, words in [("cross_entropy:nothing", "'nothing' is not a graph output"),
                         ("output:x", "only cross_entropy:OUTPUT and mse:OUTPUT")]:
        assert words in one_error_line(invoke(MLP, "--data", data, "--loss", wrong))


def test_mixed_precision_on_the_cpu_says_it_is_emulated_and_slower(tmp_path):
    data = write_npz(tmp_path / "d.npz", mlp_data())
    args = ["--data", data, "--loss", "cross_entropy", "--batch-size", "4", "--steps", "1",
            "--device", "cpu"]
    mixed = invoke(MLP, *args, "--precision", "mixed")
    assert mixed.exit_code == 0, mixed.output
    assert "--precision mixed on the CPU emulates FP16" in mixed.stdout
    plain = invoke(MLP, *args)
    assert plain.exit_code == 0 and "emulates FP16" not in plain.stdout
