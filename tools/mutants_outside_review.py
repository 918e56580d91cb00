"""An outside reviewer's mutants: written from the README's promises and the code
that carries them, without reading the built-in list in mutation_check.py.

    python tools/mutation_check.py --mutants tools/mutants_outside_review.py
"""
from mutation_check import m

PARSE = "executor/numerics/c_parsing.py"
POLICY = "executor/numerics/policy.py"
MARK = "rules/mark_backward_pass.py"
ENGINE = "graphopt/engine.py"
REWRITE = "graphopt/rewrite.py"
SPLIT = "rules/gather_slice_to_split.py"
SCALE_MM = "rules/matmul_scale_to_fused_matmul.py"
ACT = "graphopt/training/gradients/activations.py"
OPT = "trainer/optimizers.py"
SCALE = "trainer/loss_scaling.py"
CKPT = "trainer/checkpoint.py"

T_PARSE = ("tests/executor/numerics/test_c_parsing.py",)
T_POLICY = ("tests/executor/numerics/test_policy_table.py",
            "tests/executor/numerics/test_rocblas_env.py")
T_ENVPOL = ("tests/executor/numerics/test_policy_promises.py",
            "tests/executor/numerics/test_env_warnings.py")
T_MARK = ("tests/rules/test_mark_backward_pass.py",)
T_ENGINE = ("tests/engine/test_engine_promises.py", "tests/engine/test_engine.py")
T_SPLIT = ("tests/rules/test_gather_slice_to_split.py",)
T_SCALE_MM = ("tests/rules/test_matmul_scale_to_fused_matmul.py",)
T_GRAD = ("tests/training/test_op_gradients.py",)
T_OPT = ("tests/trainer/test_units.py", "tests/trainer/test_pytorch_truth.py")
T_SCALE = ("tests/trainer/test_units.py", "tests/trainer/test_loss_scale_unscale.py")
T_CKPT = ("tests/trainer/test_checkpoint_promises.py", "tests/trainer/test_resume.py")
T_CLI = ("tests/cli/test_exit_codes.py",)

MUTANTS = [
    # -- numerics: the C parsers and the policy read from the environment -----------------
    m("strtoull_leading_zero_is_decimal", "numerics", PARSE,
      "            base = 8\n", "            base = 10\n", *T_PARSE),
    m("atoi_negative_clamp_one_short", "numerics", PARSE,
      "-min(magnitude, _LONG_MAX + 1)", "-min(magnitude, _LONG_MAX)", *T_PARSE,
      "tests/executor/numerics/test_env_warnings.py"),
    m("miopen_conv_fwd_any_nonzero", "numerics", POLICY,
      '"fwd": ALTERNATE if value == 1 else ORIGINAL',
      '"fwd": ALTERNATE if value != 0 else ORIGINAL', *T_ENVPOL),
    m("rocblas_env_does_not_override_convs", "numerics", POLICY,
      "conv=impl or (self.conv_fwd,", "conv=(self.conv_fwd,", *T_POLICY),
    # -- backward-pass marking, sticky attributes, engine rollback ---------------------------
    m("mark_ignores_implicit_subgraph_inputs", "marking_engine", MARK,
      "for name in (*graph.inputs_of(node_id), *graph.implicit_inputs(node_id)):",
      "for name in graph.inputs_of(node_id):", *T_MARK),
    m("mark_constants_too", "marking_engine", MARK,
      'if graph.op_key(node_id) == (STANDARD_DOMAIN, "Constant"):',
      'if graph.op_key(node_id)[1] == "Constant" and graph.op_key(node_id)[0] != STANDARD_DOMAIN:',
      *T_MARK),
    m("sticky_needs_another_root", "marking_engine", REWRITE,
      "if all(graph.attr(r, attr.name) is not None for r in roots[1:])]",
      "if any(graph.attr(r, attr.name) is not None for r in roots[1:])]", *T_ENGINE),
    m("pass_with_one_change_not_validated", "marking_engine", ENGINE,
      "if changes and self.validate_each:", "if changes > 1 and self.validate_each:",
      *T_ENGINE, "tests/ir/test_rollback.py"),
    # -- rules ------------------------------------------------------------------------------
    m("split_gather_index_off_by_one", "rules", SPLIT,
      "if not 0 <= index < dim:", "if not 0 <= index <= dim:", *T_SPLIT),
    m("split_accepts_partial_cover", "rules", SPLIT,
      "if covered == dim:", "if covered <= dim:", *T_SPLIT),
    m("scale_div_not_reciprocal", "rules", SCALE_MM,
      'return 1.0 / value if m.scaler.op_type == "Div" else value', "return value",
      *T_SCALE_MM),
    # -- gradients ----------------------------------------------------------------------------
    m("tanh_grad_sign_flipped", "gradients", ACT,
      'ctx.op("Sub", ctx.scalar(1.0, y), ctx.op("Mul", y, y))',
      'ctx.op("Sub", ctx.op("Mul", y, y), ctx.scalar(1.0, y))', *T_GRAD),
    m("sigmoid_grad_operands_swapped", "gradients", ACT,
      'ctx.op("Mul", y, ctx.op("Sub", ctx.scalar(1.0, y), y))',
      'ctx.op("Mul", y, ctx.op("Sub", y, ctx.scalar(1.0, y)))', *T_GRAD),
    m("erf_grad_missing_neg", "gradients", ACT,
      'ctx.op("Exp", ctx.op("Neg", ctx.op("Mul", x, x)))', 'ctx.op("Exp", ctx.op("Mul", x, x))',
      *T_GRAD),
    # -- optimizers, loss scaling, checkpoints ------------------------------------------------
    m("adamw_bias2_uses_beta1", "train", OPT,
      "bias2 = 1.0 - self.beta2 ** self.steps\n        denom",
      "bias2 = 1.0 - self.beta1 ** self.steps\n        denom", *T_OPT),
    m("momentum_steps_with_raw_grad", "train", OPT,
      "param -= self.lr * buf", "param -= self.lr * grad", *T_OPT),
    m("scaler_grows_one_step_late", "train", SCALE,
      "if self.good_steps >= self.interval:", "if self.good_steps > self.interval:", *T_SCALE),
    # (replaces resume_allows_another_lr, equivalent at every entry point: --resume compares
    # the run's options with the checkpoint's, --lr included, before the optimizer loads)
    m("adamw_decay_not_scaled_by_lr", "train", OPT,
      "param *= 1.0 - self.lr * self.weight_decay", "param *= 1.0 - self.weight_decay", *T_OPT),
    # (replaces checkpoint_slot_shape_unchecked, equivalent: Optimizer.check_arrays checks
    # the same shapes on every resume path before any of them is used)
    m("checkpoint_longer_history_accepted", "train", CKPT,
      "if not isinstance(history, list) or len(history) != step:",
      "if not isinstance(history, list) or len(history) < step:", *T_CKPT),
    # -- CLI exit codes ---------------------------------------------------------------------
    m("out_of_memory_traceback", "cli", "cli.py",
      'click.echo("graphopt: error: out of memory", err=True)\n            sys.exit(1)',
      "raise", *T_CLI),
]
