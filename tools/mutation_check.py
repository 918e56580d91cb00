"""Mutation check: do the tests notice when the code that carries a README promise is wrong?

Each mutant below is one small, plausible bug (a wrong sign, an off-by-one, a dropped fsync,
a missing journal entry) in a module that carries a promise of the README. For each one the
script copies the tree once into a temporary folder, applies the mutant there (never in the
working tree), runs only the test files that cover that code (with a timeout), restores the
file, and counts the mutant as killed when the tests fail. It reports the kill rate per area
and lists the survivors.

The source folders run only as an installed package (setup.cfg maps rules/, executor/ and
trainer/ into graphopt, setup.py places cli.py), so the copy is built once with the project's
own build, as a strict editable install (pip install -e, editable_mode=strict) into a folder
of its own: a tree of links to the copy's files, which the tests import (PYTHONPATH) instead
of any graphopt this environment has installed. A mutant written into the copy is what they
run, with no build per mutant. The environment needs pip and setuptools (no network).

Not part of CI (it runs the relevant tests once per mutant):

    python tools/mutation_check.py                   # every mutant
    python tools/mutation_check.py --area optimizers --area cli
    python tools/mutation_check.py --id adamw_bias1_one_step_ahead -v
    python tools/mutation_check.py --list
    python tools/mutation_check.py --mutants tools/mutants_outside_review.py  # another list

A mutant whose text is no longer in the file (the code moved on) is reported as STALE, not
as killed (``--list`` marks those too): update its ``old`` text. Before the mutants run, the
union of their test files runs once unmutated; if that fails, nothing is reported (a failing
suite kills everything).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Mutant:
    id: str
    area: str
    path: str
    edits: tuple[tuple[str, str], ...]  # (old, new): each ``old`` occurs exactly once
    tests: tuple[str, ...]  # pytest arguments: files, node ids, "-k", expressions


def m(id, area, path, old, new, *tests, more=()):
    return Mutant(id, area, path, ((old, new), *more), tests)


# test files, by what they cover
T_OPT = ("tests/trainer/test_pytorch_truth.py", "tests/trainer/test_units.py")
T_SCALE = ("tests/trainer/test_pytorch_truth.py", "tests/trainer/test_units.py",
           "tests/trainer/test_loss_scale_unscale.py")
T_POLICY = ("tests/executor/numerics/test_policy_promises.py",
            "tests/executor/numerics/test_policy_table.py",
            "tests/executor/numerics/test_env_warnings.py")
T_PARSE = ("tests/executor/numerics/test_c_parsing.py",
           "tests/executor/numerics/test_policy_promises.py")
T_GUARD = ("tests/executor/numerics/test_guard.py",
           "tests/executor/numerics/test_session_integration.py",
           "tests/executor/numerics/test_policy_promises.py")
T_MARK = ("tests/rules/test_mark_backward_pass.py",)
T_STICKY = ("tests/engine/test_engine_promises.py", "tests/engine/test_engine.py")
T_SPLIT = ("tests/rules/test_gather_slice_to_split.py",)
T_FOLD = ("tests/rules/test_fold_constants.py",)
T_FOLDT = ("tests/rules/test_fold_transposes.py",)
T_GATHERND = ("tests/rules/test_gathernd_to_gather.py",)
T_SCALE_MM = ("tests/rules/test_matmul_scale_to_fused_matmul.py",)
T_TRANS_MM = ("tests/rules/test_matmul_transpose_to_fused_matmul.py",)
T_TG = ("tests/rules/test_transpose_gather_to_gather_transpose.py",)
T_ENGINE = ("tests/engine/test_engine_promises.py", "tests/engine/test_engine.py",
            "tests/ir/test_rollback.py", "tests/ir/test_pending_nodes.py")
T_GRAD = ("tests/training/test_pytorch_op_gradients.py", "tests/training/test_op_gradients.py")
T_CKPT = ("tests/trainer/test_checkpoint_promises.py", "tests/trainer/test_resume.py",
          "tests/robustness/test_run_faults.py::test_load_refuses_truncated_and_damaged_"
          "checkpoints",
          "tests/robustness/test_run_faults.py::test_disk_full_during_a_checkpoint_save_keeps_"
          "the_previous_one")
T_CLI = ("tests/cli/test_exit_codes.py", "tests/cli/test_cli.py")

OPT = "trainer/optimizers.py"
SCALE = "trainer/loss_scaling.py"
LOOP = "trainer/loop.py"
POLICY = "executor/numerics/policy.py"
PARSE = "executor/numerics/c_parsing.py"
GUARD = "executor/numerics/guard.py"
PLAN = "executor/plan.py"
MARK = "rules/mark_backward_pass.py"
ENGINE = "graphopt/engine.py"
REWRITE = "graphopt/rewrite.py"
IR = "graphopt/ir.py"
SPLIT = "rules/gather_slice_to_split.py"
FOLD = "rules/fold_constants.py"
CKPT = "trainer/checkpoint.py"
CLI = "cli.py"
MATH = "graphopt/training/gradients/math.py"
ACT = "graphopt/training/gradients/activations.py"
SHAPE = "graphopt/training/gradients/shape.py"
NN = "graphopt/training/gradients/nn.py"

MUTANTS: list[Mutant] = [
    # ---- optimizers: PyTorch's update formulas -------------------------------------------
    m("adamw_bias1_one_step_ahead", "optimizers", OPT,
      "        bias1 = 1.0 - self.beta1 ** self.steps\n"
      "        bias2 = 1.0 - self.beta2 ** self.steps\n        denom",
      "        bias1 = 1.0 - self.beta1 ** (self.steps + 1)\n"
      "        bias2 = 1.0 - self.beta2 ** self.steps\n        denom",
      *T_OPT),
    m("adamw_bias2_dropped", "optimizers", OPT,
      "        bias2 = 1.0 - self.beta2 ** self.steps\n        denom",
      "        bias2 = 1.0\n        denom", *T_OPT),
    m("adamw_decay_after_the_step", "optimizers", OPT,
      "        param *= 1.0 - self.lr * self.weight_decay\n        m = self._slot",
      "        m = self._slot", *T_OPT,
      more=(("        param -= np.float32(self.lr / bias1) * (m / denom)\n",
             "        param -= np.float32(self.lr / bias1) * (m / denom)\n"
             "        param *= 1.0 - self.lr * self.weight_decay\n"),)),
    m("adamw_decay_coupled", "optimizers", OPT,
      "        param *= 1.0 - self.lr * self.weight_decay\n        m = self._slot",
      "        grad = grad + self.weight_decay * param\n        m = self._slot", *T_OPT),
    m("adamw_eps_inside_sqrt", "optimizers", OPT,
      "denom = np.sqrt(v) / np.float32(np.sqrt(bias2)) + np.float32(self.eps)",
      "denom = np.sqrt(v / np.float32(bias2) + np.float32(self.eps))", *T_OPT),
    m("adamw_beta1_for_v", "optimizers", OPT,
      "v += (1.0 - self.beta2) * grad * grad", "v += (1.0 - self.beta1) * grad * grad", *T_OPT),
    m("sgd_weight_decay_sign", "optimizers", OPT,
      "            grad = grad + self.weight_decay * param\n        param -= self.lr * grad",
      "            grad = grad - self.weight_decay * param\n        param -= self.lr * grad",
      *T_OPT),
    m("momentum_dampening", "optimizers", OPT,
      "            buf += grad\n", "            buf += (1.0 - self.momentum) * grad\n", *T_OPT),
    m("momentum_first_step_zero_buffer", "optimizers", OPT,
      "            buf[...] = grad\n", "            buf[...] = (1.0 - self.momentum) * grad\n",
      *T_OPT),
    m("momentum_weight_decay_dropped", "optimizers", OPT,
      "            grad = grad + self.weight_decay * param\n        fresh",
      "            pass\n        fresh", *T_OPT),
    m("adamw_default_weight_decay", "optimizers", OPT,
      "    default_weight_decay = 0.01   # torch.optim.AdamW's",
      "    default_weight_decay = 0.0   # torch.optim.AdamW's",
      *T_OPT),
    m("skipped_step_counts_for_bias_correction", "optimizers", LOOP,
      "        if applied:\n            self.optimizer.step(self.params, grads, factor)\n",
      "        self.optimizer.steps += 0 if applied else 1\n"
      "        if applied:\n            self.optimizer.step(self.params, grads, factor)\n",
      *T_SCALE),
    # ---- loss scaling ---------------------------------------------------------------------
    m("gradients_not_unscaled", "loss scaling", LOOP,
      "                grad /= np.float32(scale)", "                pass", *T_SCALE),
    m("no_back_off_on_overflow", "loss scaling", SCALE,
      "self.scale = max(self.scale / 2.0, MIN_SCALE)", "self.scale = max(self.scale, MIN_SCALE)",
      *T_SCALE),
    m("growth_one_step_late", "loss scaling", SCALE,
      "if self.good_steps >= self.interval:", "if self.good_steps > self.interval:", *T_SCALE),
    m("good_steps_survive_overflow", "loss scaling", SCALE,
      "            self.good_steps = 0\n            self.scale = max",
      "            self.scale = max", *T_SCALE),
    m("overflow_step_applied", "loss scaling", SCALE,
      "            return False\n        self.good_steps += 1",
      "            return True\n        self.good_steps += 1", *T_SCALE),
    m("back_off_below_1", "loss scaling", SCALE,
      "self.scale = max(self.scale / 2.0, MIN_SCALE)", "self.scale = self.scale / 2.0",
      *T_SCALE),
    # ---- FP16 policy and env parsing ------------------------------------------------------
    m("gemm_mapping_backward_defaults_original", "numerics policy", POLICY,
      '_check_impl(gemm.get("backward", ALTERNATE), "gemm backward")',
      '_check_impl(gemm.get("backward", ORIGINAL), "gemm backward")', *T_POLICY),
    m("gemm_mapping_forward_defaults_alternate", "numerics policy", POLICY,
      '_check_impl(gemm.get("forward", ORIGINAL), "gemm forward")',
      '_check_impl(gemm.get("forward", ALTERNATE), "gemm forward")', *T_POLICY),
    m("rnz_only_for_1", "numerics policy", POLICY,
      "rounding = TRUNCATE if parsed == 0 else RNZ", "rounding = RNZ if parsed == 1 else TRUNCATE",
      *T_POLICY),
    m("gemm_env_only_1_is_alternate", "numerics policy", POLICY,
      "impl = ORIGINAL if parsed == 0 else ALTERNATE",
      "impl = ALTERNATE if parsed == 1 else ORIGINAL",
      *T_POLICY),
    m("conv_fwd_any_non_zero", "numerics policy", POLICY,
      '"fwd": ALTERNATE if value == 1 else ORIGINAL',
      '"fwd": ALTERNATE if value != 0 else ORIGINAL',
      *T_POLICY),
    m("conv_default_bwd_data_original", "numerics policy", POLICY,
      "return ORIGINAL, ALTERNATE, ALTERNATE  # MIOpen",
      "return ORIGINAL, ORIGINAL, ALTERNATE  # MIOpen", *T_POLICY),
    m("strtoull_minus_zero_without_modulo", "env parsing", PARSE,
      "return (-magnitude) % 2**64 if negative else magnitude",
      "return (2**64 - magnitude) if negative else magnitude", *T_PARSE),
    m("strtoull_overflow_keeps_sign", "env parsing", PARSE,
      "        return _ULLONG_MAX  # ERANGE", "        return 1 if negative else _ULLONG_MAX  #",
      *T_PARSE),
    m("atoi_no_clamp", "env parsing", PARSE,
      "as_long = -min(magnitude, _LONG_MAX + 1) if negative else min(magnitude, _LONG_MAX)",
      "as_long = -magnitude if negative else magnitude", *T_PARSE),
    m("leading_zero_not_octal", "env parsing", PARSE,
      '        elif i < n and text[i] == "0":\n            base = 8\n',
      '        elif i < n and text[i] == "0":\n            base = 10\n', *T_PARSE),
    m("c_int_truncation_unsigned", "env parsing", PARSE,
      "return ((value + 2**31) % 2**32) - 2**31", "return value % 2**32", *T_PARSE),
    m("whitespace_not_skipped", "env parsing", PARSE,
      "    while i < n and text[i] in _C_WHITESPACE:\n        i += 1\n", "", *T_PARSE),
    # ---- guard ----------------------------------------------------------------------------
    m("backwardpass_0_is_backward", "guard", PLAN,
      "return self.attrs.get(BACKWARD_ATTR, 0) == 1", "return BACKWARD_ATTR in self.attrs",
      *T_GUARD),
    m("guard_exit_clears_instead_of_restoring", "guard", GUARD,
      "_state.backward = self._saved.pop()", "self._saved.pop(); _state.backward = False",
      *T_GUARD),
    m("guard_ignores_active_false", "guard", GUARD,
      "_state.backward = self._active", "_state.backward = True", *T_GUARD),
    # ---- marking --------------------------------------------------------------------------
    m("forward_marks_not_cleared", "marking", MARK,
      "        if node_id in forward and marked:", "        if False:", *T_MARK),
    m("constants_marked", "marking", MARK,
      'if graph.op_key(node_id) == (STANDARD_DOMAIN, "Constant"):', "if False:", *T_MARK),
    m("implicit_inputs_ignored", "marking", MARK,
      "for name in (*graph.inputs_of(node_id), *graph.implicit_inputs(node_id)):",
      "for name in graph.inputs_of(node_id):", *T_MARK),
    m("two_yields_accepted", "marking", MARK,
      "    if len(yields) + len(nested) > 1 or nested:", "    if nested:", *T_MARK),
    m("yield_itself_forward", "marking", MARK,
      "    ancestors: set[int] = set()", "    ancestors: set[int] = {yield_id}", *T_MARK),
    # ---- sticky attributes ----------------------------------------------------------------
    m("general_path_drops_sticky", "sticky attributes", REWRITE,
      "            if sticky:\n                node.attribute.extend(sticky)\n            new_ids",
      "            new_ids", *T_STICKY),
    m("sticky_from_first_root_only", "sticky attributes", REWRITE,
      "    return [attr for attr in carried\n"
      "            if all(graph.attr(r, attr.name) is not None for r in roots[1:])]",
      "    return carried",
      *T_STICKY),
    m("fast_path_drops_sticky", "sticky attributes", REWRITE,
      "        if sticky:\n            node.attribute.extend(sticky)\n    else:",
      "        pass\n    else:", *T_STICKY, *T_MARK),
    # ---- rules ----------------------------------------------------------------------------
    m("split_tiling_one_short", "rules", SPLIT,
      "if covered == dim:", "if covered >= dim - 1:", *T_SPLIT),
    m("split_overlap_accepted", "rules", SPLIT,
      "if start != covered:", "if start > covered:", *T_SPLIT),
    m("split_single_consumer_fused", "rules", SPLIT,
      "        if len(nodes) < 2:\n            continue\n", "", *T_SPLIT),
    m("fold_output_size_limit_dropped", "rules", FOLD,
      "if values is None or any(np.asarray(v).size > MAX_FOLDED_ELEMENTS for v in values):",
      "if values is None:", *T_FOLD),
    m("fold_graph_output_producer", "rules", FOLD,
      " or any(graph.is_output(o) for o in node.output):", ":", *T_FOLD),
    m("fold_random_ops", "rules", FOLD,
      '"RandomUniformLike", "Multinomial", "Bernoulli", "Dropout"})',
      '"RandomUniformLike"})', *T_FOLD),
    m("fold_transposes_identity_kept", "rules", "rules/fold_transposes.py",
      "    if perm == sorted(perm):\n        return m.x\n", "", *T_FOLDT),
    m("fold_transposes_composed_backwards", "rules", "rules/fold_transposes.py",
      "perm = [list(inner)[i] for i in outer]", "perm = [list(outer)[i] for i in inner]",
      *T_FOLDT),
    m("gathernd_batch_dims_ignored", "rules", "rules/gathernd_to_gather.py",
      "batch_dims=lambda v: v in (None, 0)", "batch_dims=lambda v: True", *T_GATHERND),
    m("gathernd_last_dim_not_checked", "rules", "rules/gathernd_to_gather.py",
      "value.shape[-1] == 1 and ", "", *T_GATHERND),
    m("scale_div_not_inverted", "rules", "rules/matmul_scale_to_fused_matmul.py",
      "return 1.0 / value if m.scaler.op_type == \"Div\" else value", "return value",
      *T_SCALE_MM),
    m("scale_alpha_replaced", "rules", "rules/matmul_scale_to_fused_matmul.py",
      'attrs["alpha"] = attrs["alpha"] * _factor(m)', 'attrs["alpha"] = _factor(m)',
      *T_SCALE_MM),
    m("scale_rank1_on_rank0", "rules", "rules/matmul_scale_to_fused_matmul.py",
      'return len(shape) >= 1 or "a rank-1', 'return True or "a rank-1', *T_SCALE_MM),
    m("fused_flags_trans_batch_wrong", "rules", "rules/_fused_matmul.py",
      "perm = list(range(1, rank - 1)) + [0, rank - 1]",
      "perm = [rank - 2] + list(range(0, rank - 2)) + [rank - 1]", *T_TRANS_MM),
    m("fused_flags_swapped", "rules", "rules/_fused_matmul.py",
      "return None if flags is None else (int(flags[0]), int(flags[1]))",
      "return None if flags is None else (int(flags[1]), int(flags[0]))", *T_TRANS_MM),
    m("transpose_gather_axis_not_mapped", "rules",
      "rules/transpose_gather_to_gather_transpose.py",
      "axis=perm[axis]), perm=perm)", "axis=axis), perm=perm)", *T_TG),
    m("transpose_gather_negative_axis", "rules", "rules/transpose_gather_to_gather_transpose.py",
      "    axis += len(perm) if axis < 0 else 0\n", "", *T_TG),
    # ---- engine: rollback and determinism -------------------------------------------------
    m("rollback_keeps_added_initializers", "engine rollback", IR,
      "        self._log(self._initializers.pop, tensor.name)", "        self.changed = True",
      *T_ENGINE),
    m("replace_input_not_journaled", "engine rollback", IR,
      "        self._log(self._set_input, node_id, index, old)", "        self.changed = True",
      *T_ENGINE),
    m("remove_initializer_not_journaled", "engine rollback", IR,
      "        self._log(self._initializers.__setitem__, name, tensor)",
      "        self.changed = True", *T_ENGINE),
    m("rollback_in_journal_order", "engine rollback", IR,
      "for undo, *args in reversed(journal):", "for undo, *args in journal:", *T_ENGINE),
    m("replaced_tensors_in_hash_order", "engine determinism", REWRITE,
      "targets = {old: self._value(expr) for old, expr in mapping.items()}",
      "targets = {old: self._value(mapping[old]) for old in set(mapping)}", *T_ENGINE),
    # ---- gradients ------------------------------------------------------------------------
    m("sub_grad_not_negated", "gradients", MATH,
      'grad_b = _to_input(ctx, 1, ctx.op("Neg", ctx.dy))', "grad_b = _to_input(ctx, 1, ctx.dy)",
      *T_GRAD),
    m("div_grad_sign", "gradients", MATH,
      'grad_b = _to_input(ctx, 1, ctx.op("Neg", ctx.op("Mul", ctx.dy, ctx.op("Div", y, b))))',
      'grad_b = _to_input(ctx, 1, ctx.op("Mul", ctx.dy, ctx.op("Div", y, b)))', *T_GRAD),
    m("sqrt_grad_factor", "gradients", MATH,
      "ctx.scalar(0.5, y)), y)]", "ctx.scalar(1.0, y)), y)]", *T_GRAD),
    m("mul_grad_swapped", "gradients", MATH,
      'grad_a = _to_input(ctx, 0, ctx.op("Mul", ctx.dy, b))',
      'grad_a = _to_input(ctx, 0, ctx.op("Mul", ctx.dy, a))', *T_GRAD),
    m("reduce_mean_not_divided", "gradients", MATH,
      '_spread(ctx, axes, ctx.op("Div", ctx.dy, count))', "_spread(ctx, axes, ctx.dy)", *T_GRAD),
    m("tanh_grad_uses_input", "gradients", ACT,
      "    y = ctx.output(0)\n    one_minus_square", "    y = ctx.input(0)\n    one_minus_square",
      *T_GRAD),
    m("sigmoid_grad_missing_factor", "gradients", ACT,
      'slope = ctx.op("Mul", y, ctx.op("Sub", ctx.scalar(1.0, y), y))',
      'slope = ctx.op("Sub", ctx.scalar(1.0, y), y)', *T_GRAD),
    m("erf_grad_constant", "gradients", ACT,
      "ctx.scalar(2.0 / math.sqrt(math.pi), x)", "ctx.scalar(1.0 / math.sqrt(math.pi), x)",
      *T_GRAD),
    m("softmax_axis_default", "gradients", ACT,
      '_13", ctx.dy, ctx.output(0), axis=ctx.attr_or_default("axis"))',
      '_13", ctx.dy, ctx.output(0), axis=ctx.attr("axis", 0))', *T_GRAD),
    m("transpose_grad_not_inverted", "gradients", SHAPE,
      "        inverse[axis] = position\n    return [ctx.op(\"Transpose\", ctx.dy, perm=inverse)]",
      "        inverse[axis] = position\n    return [ctx.op(\"Transpose\", ctx.dy, perm=perm)]",
      *T_GRAD),
    m("gemm_grad_beta_ignored", "gradients", MATH,
      "grad_c = dy if beta == 1.0 else", "grad_c = dy if True else", *T_GRAD),
    m("gemm_grad_alpha_ignored_for_a", "gradients", MATH,
      "grads[0] = ctx.op(\"Gemm\", dy, b, transB=1 - trans_b, alpha=alpha)",
      "grads[0] = ctx.op(\"Gemm\", dy, b, transB=1 - trans_b)", *T_GRAD),
    m("where_grad_branches_swapped", "gradients", SHAPE,
      "grads[1] = ctx.sum_to(ctx.op(\"Where\", condition, ctx.dy, zero)",
      "grads[1] = ctx.sum_to(ctx.op(\"Where\", condition, zero, ctx.dy)", *T_GRAD),
    m("layernorm_grad_axis_default", "gradients", NN,
      'axis=ctx.attr_or_default("axis"), outputs=3)', 'axis=ctx.attr("axis", 0), outputs=3)',
      *T_GRAD),
    # ---- checkpoints ----------------------------------------------------------------------
    m("no_fsync_before_rename", "checkpoints", CKPT,
      "            f.flush()\n            os.fsync(f.fileno())\n", "            f.flush()\n",
      *T_CKPT),
    m("stale_temp_cleanup_removes_live_writers", "checkpoints", CKPT,
      " and not process_alive(int(pid)):", ":", *T_CKPT),
    m("stale_temp_cleanup_never_runs", "checkpoints", CKPT,
      "    _remove_stale_temporaries(directory)\n    return target",
      "    return target", *T_CKPT),
    m("failed_write_leaves_temp", "checkpoints", CKPT,
      "            with contextlib.suppress(OSError):\n                os.unlink(tmp)",
      "            pass", *T_CKPT),
    # ---- CLI exit codes -------------------------------------------------------------------
    m("interrupted_run_exits_0", "cli exit codes", CLI,
      "    if outcome.result.interrupted:\n        sys.exit(128 + (outcome.result.stop_signal"
      " or signal.SIGINT))",
      "    if outcome.result.interrupted:\n        sys.exit(0)", *T_CLI),
    m("out_of_memory_exits_2", "cli exit codes", CLI,
      'click.echo("graphopt: error: out of memory", err=True)\n            sys.exit(1)',
      'click.echo("graphopt: error: out of memory", err=True)\n            sys.exit(2)', *T_CLI),
    m("user_error_exits_2", "cli exit codes", CLI,
      'click.echo(f"graphopt: error: {cli_words(str(exc))}", err=True)\n            sys.exit(1)',
      'click.echo(f"graphopt: error: {cli_words(str(exc))}", err=True)\n            sys.exit(2)',
      *T_CLI),
    m("keyboard_interrupt_exits_1", "cli exit codes", CLI,
      'else INTERRUPTED, err=True)\n    sys.exit(130)',
      'else INTERRUPTED, err=True)\n    sys.exit(1)', *T_CLI),
]


# ---- running ---------------------------------------------------------------------------------
def copy_tree(target: str) -> None:
    """The tracked and untracked-but-not-ignored files of the working tree (what git would
    commit), with any symlinks kept as links."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True).stdout.split(b"\0")
    for raw in listed:
        if not raw:
            continue
        rel = raw.decode()
        src, dst = os.path.join(ROOT, rel), os.path.join(target, rel)
        if not os.path.lexists(src):
            continue  # deleted in the working tree, not yet in the index
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)


def install_tree(tree: str, site: str) -> str:
    """Build ``tree`` into ``site`` as a strict editable install and return the folder that
    puts its graphopt on ``sys.path``: setuptools' tree of links to ``tree``'s files (named
    by the install's .pth file), so an edit of a file in ``tree`` is what imports see."""
    done = subprocess.run([sys.executable, "-P", "-m", "pip", "install", "-q", "--no-deps",
                           "--no-build-isolation", "--no-input", "--target", site,
                           "--config-settings", "editable_mode=strict", "-e", tree],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"mutation_check: cannot build the copied tree (pip install -e):\n"
                         f"{done.stderr.strip()}")
    paths = [line.strip() for name in sorted(os.listdir(site)) if name.endswith(".pth")
             for line in open(os.path.join(site, name), encoding="utf-8")
             if line.strip() and not line.startswith(("#", "import"))]
    if len(paths) != 1:
        raise SystemExit(f"mutation_check: expected one path in the install's .pth files in "
                         f"{site}, found {paths}")
    return paths[0]


# Which files the tests import: one module from each mapped folder and cli.py.
WHERE_FROM = ("import graphopt.cli, graphopt.engine, graphopt.executor, graphopt.rules, "
              "graphopt.trainer, os, sys\n"
              "for m in (graphopt.cli, graphopt.engine, graphopt.executor, graphopt.rules, "
              "graphopt.trainer):\n"
              "    print(os.path.realpath(m.__file__))\n")


def tests_env(linked: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": linked, "PYTHONDONTWRITEBYTECODE": "1"}


def check_imports_from(tree: str, env: dict[str, str]) -> None:
    """Refuse to run when the tests would import graphopt from anywhere but ``tree`` (every
    mutant would then survive, or be killed, for the wrong reason)."""
    done = subprocess.run([sys.executable, "-P", "-c", WHERE_FROM], cwd=tree, env=env,
                          capture_output=True, text=True)
    real = os.path.realpath(tree) + os.sep
    files = done.stdout.split()
    if done.returncode != 0 or len(files) != 5 or not all(f.startswith(real) for f in files):
        raise SystemExit(f"mutation_check: the tests would not import the copied tree "
                         f"{tree}:\n{done.stdout}{done.stderr}")


def run_tests(tree: str, env: dict[str, str], tests, timeout: float,
              verbose: bool) -> tuple[str, float]:
    """('pass' | 'fail' | 'timeout' | 'error', seconds) of pytest on ``tests`` in ``tree``.
    ``-P``: the root of ``tree`` must not be on sys.path (its graphopt/ folder is only part
    of the package)."""
    cmd = [sys.executable, "-P", "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           "-m", "not slow and not gpu", *tests]
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - started
    seconds = time.perf_counter() - started
    if verbose:
        print(done.stdout[-3000:], done.stderr[-2000:], sep="\n")
    # 0: passed; 1: tests failed; 2: interrupted (a collection error counts as killed: the
    # mutant broke an import); 4/5: usage error / nothing collected = a broken mutant list
    return {0: "pass", 1: "fail", 2: "fail"}.get(done.returncode, "error"), seconds


def apply_edits(mu: Mutant, text: str) -> str | None:
    """``text`` with the mutant's edits, or None when an ``old`` text no longer occurs exactly
    once (the code moved on: the mutant must be updated)."""
    for old, new in mu.edits:
        if text.count(old) != 1:
            return None
        text = text.replace(old, new)
    return text


def load_mutants(path: str) -> list[Mutant]:
    """The MUTANTS list of another file (e.g. an outside reviewer's), which builds its entries
    with this module's ``Mutant`` / ``m``."""
    import runpy
    sys.modules.setdefault("mutation_check", sys.modules[__name__])
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    return list(runpy.run_path(path)["MUTANTS"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--area", action="append", help="only these areas (repeatable)")
    parser.add_argument("--id", action="append", help="only these mutants (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mutant")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the unmutated run of the selected tests")
    parser.add_argument("-v", "--verbose", action="store_true", help="show pytest's output")
    parser.add_argument("--mutants", metavar="FILE",
                        help="a Python file whose MUTANTS list replaces the built-in one")
    args = parser.parse_args(argv)

    mutants = load_mutants(args.mutants) if args.mutants else MUTANTS
    chosen = [mu for mu in mutants if (not args.area or mu.area in args.area)
              and (not args.id or mu.id in args.id)]
    if args.list:
        for mu in chosen:
            with open(os.path.join(ROOT, mu.path), encoding="utf-8") as f:
                stale = apply_edits(mu, f.read()) is None
            print(f"{mu.area:20} {mu.id:45} {mu.path}" + ("  STALE" if stale else ""))
        return 0
    if not chosen:
        parser.error("no mutant selected")

    with tempfile.TemporaryDirectory(prefix="graphopt-mutants-") as folder:
        tree = os.path.join(folder, "tree")
        copy_tree(tree)
        started = time.perf_counter()
        env = tests_env(install_tree(tree, os.path.join(folder, "site")))
        check_imports_from(tree, env)
        print(f"built the copied tree in {time.perf_counter() - started:.0f}s", flush=True)
        if not args.no_baseline:
            union = list(dict.fromkeys(t for mu in chosen for t in mu.tests))
            outcome, seconds = run_tests(tree, env, union, args.timeout * 2, args.verbose)
            print(f"baseline (unmutated, {len(union)} test targets): {outcome} in {seconds:.0f}s",
                  flush=True)
            if outcome != "pass":
                print("the unmutated tests do not pass: fix them first", file=sys.stderr)
                return 2
        results: dict[str, list[tuple[Mutant, str]]] = defaultdict(list)
        for mu in chosen:
            target = os.path.join(tree, mu.path)
            with open(target, encoding="utf-8") as f:
                original = f.read()
            mutated = apply_edits(mu, original)
            outcome = None if mutated is not None else "stale"
            seconds = 0.0
            if outcome is None:
                with open(target, "w", encoding="utf-8") as f:
                    f.write(mutated)
                try:
                    outcome, seconds = run_tests(tree, env, mu.tests, args.timeout, args.verbose)
                finally:
                    with open(target, "w", encoding="utf-8") as f:
                        f.write(original)
            verdict = {"fail": "killed", "timeout": "killed (timeout)", "pass": "SURVIVED",
                       "stale": "STALE", "error": "ERROR"}[outcome]
            print(f"{verdict:17} {mu.area:20} {mu.id} ({seconds:.0f}s)", flush=True)
            results[mu.area].append((mu, verdict))

    print("\nkill rate per area")
    total = killed = 0
    for area, rows in results.items():
        k = sum(v.startswith("killed") for _, v in rows)
        total, killed = total + len(rows), killed + k
        print(f"  {area:20} {k}/{len(rows)}")
    print(f"  {'all':20} {killed}/{total} = {100 * killed / total:.1f}%")
    bad = [(mu.id, v) for rows in results.values() for mu, v in rows
           if not v.startswith("killed")]
    for mu_id, verdict in bad:
        print(f"  {verdict}: {mu_id}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
