"""A second outside reviewer's mutants: 20 small, plausible bugs written from the
README's promises and the code that carries them, without reading the other MUTANTS lists.

Run: python tools/mutation_check.py --mutants tools/mutants_outside_review_2.py
"""
from mutation_check import m

SCHED = "trainer/schedule.py"
OPT = "trainer/optimizers.py"
SCALE = "trainer/loss_scaling.py"
CKPT = "trainer/checkpoint.py"
BITS = "executor/numerics/fp16_bits.py"
POLICY = "executor/numerics/policy.py"
PARSE = "executor/numerics/c_parsing.py"
GUARD = "executor/numerics/guard.py"
IR = "graphopt/ir.py"
ENGINE = "graphopt/engine.py"
MATH = "graphopt/training/gradients/math.py"
ACT = "graphopt/training/gradients/activations.py"
MODELIO = "graphopt/modelio.py"

T_SCHED = ("tests/trainer/test_schedule_eval_plot.py", "tests/trainer/test_units.py",
           "tests/trainer/test_pytorch_truth.py")
T_OPT = ("tests/trainer/test_pytorch_truth.py", "tests/trainer/test_units.py")
T_SCALE = ("tests/trainer/test_units.py", "tests/trainer/test_loss_scale_unscale.py",
           "tests/trainer/test_pytorch_truth.py")
# the checkpoint tests, and of the training-state file the one that validates checkpoints
T_CKPT = ("tests/trainer/test_checkpoint_promises.py", "tests/trainer/test_resume.py",
          "tests/robustness/test_reliability_training_state.py::"
          "test_item16_every_checkpoint_field_is_validated")
T_BITS = ("tests/executor/numerics/test_bf16_conversion.py",
          "tests/executor/numerics/test_denormal_stats.py",
          "tests/executor/numerics/test_gemm_paths.py")
T_POLICY = ("tests/executor/numerics/test_policy_promises.py",
            "tests/executor/numerics/test_policy_table.py",
            "tests/executor/numerics/test_env_warnings.py")
T_PARSE = ("tests/executor/numerics/test_c_parsing.py",
           "tests/executor/numerics/test_policy_promises.py")
T_GUARD = ("tests/executor/numerics/test_guard.py",
           "tests/executor/numerics/test_session_integration.py")
T_ENGINE = ("tests/engine/test_engine_promises.py", "tests/engine/test_engine.py",
            "tests/ir/test_rollback.py")
T_GRAD = ("tests/training/test_pytorch_op_gradients.py", "tests/training/test_op_gradients.py")
T_MODELIO = ("tests/ir/test_modelio.py", "tests/cli/test_cli.py",
             "tests/robustness/test_reliability_data_loss.py")

MUTANTS = [
    # -- schedules and clipping (train) --
    m("s2-warmup-off-by-one", "train", SCHED,
      "        return step / max(1, warmup)", "        return (step + 1) / max(1, warmup)",
      *T_SCHED),
    m("s2-cosine-half-period", "train", SCHED,
      "math.cos(math.pi * progress)", "math.cos(2 * math.pi * progress)", *T_SCHED),
    # -- optimizers --
    m("s2-adamw-default-decay-zero", "train", OPT,
      "    default_weight_decay = 0.01   # torch.optim.AdamW's",
      "    default_weight_decay = 0.0   # torch.optim.AdamW's", *T_OPT),
    m("s2-adamw-bias2-beta1", "train", OPT,
      "        bias2 = 1.0 - self.beta2 ** self.steps\n        denom",
      "        bias2 = 1.0 - self.beta1 ** self.steps\n        denom", *T_OPT),
    m("s2-sgd-decay-sign", "train", OPT,
      "            grad = grad + self.weight_decay * param\n        param -= self.lr * grad",
      "            grad = grad - self.weight_decay * param\n        param -= self.lr * grad",
      *T_OPT),
    # -- loss scaling --
    m("s2-scaler-no-reset-on-overflow", "train", SCALE,
      "            self.good_steps = 0\n            self.scale = max(",
      "            self.scale = max(", *T_SCALE),
    m("s2-scaler-grows-one-early", "train", SCALE,
      "if self.good_steps >= self.interval:", "if self.good_steps >= self.interval - 1:",
      *T_SCALE),
    # -- checkpoints --
    m("s2-ckpt-accepts-wrong-master-dtype", "train", CKPT,
      "        if value.dtype != master:", "        if value.dtype != master and False:",
      *T_CKPT),
    # -- numerics: MI200 emulation --
    m("s2-flush-drops-sign", "numerics", BITS,
      "np.where((bits & FP16_EXPONENT) == 0, np.uint16(FP16_SIGN), np.uint16(0xFFFF))",
      "np.where((bits & FP16_EXPONENT) == 0, np.uint16(0), np.uint16(0xFFFF))", *T_BITS),
    m("s2-rnz-ties-away", "numerics", BITS,
      "np.add(u, np.uint32(0x7FFF), out=u, where=finite)",
      "np.add(u, np.uint32(0x8000), out=u, where=finite)", *T_BITS),
    m("s2-subnormal-mask-misses-largest", "numerics", BITS,
      "- np.uint16(1)) < np.uint16(FP16_MANTISSA)",
      "- np.uint16(1)) < np.uint16(FP16_MANTISSA - 1)",
      *T_BITS),
    # -- numerics: policy and env parsing --
    m("s2-conv-default-bwd-data-original", "numerics", POLICY,
      "        return ORIGINAL, ALTERNATE, ALTERNATE  # MIOpen's default",
      "        return ORIGINAL, ORIGINAL, ALTERNATE  # MIOpen's default", *T_POLICY),
    m("s2-rnz-env-inverted", "numerics", POLICY,
      "    rounding = TRUNCATE if parsed == 0 else RNZ",
      "    rounding = RNZ if parsed == 0 else TRUNCATE", *T_POLICY),
    m("s2-atoi-negative-clamp", "numerics", PARSE,
      "as_long = -min(magnitude, _LONG_MAX + 1) if negative",
      "as_long = -min(magnitude, _LONG_MAX) if negative", *T_PARSE),
    m("s2-guard-exit-no-restore", "numerics", GUARD,
      "    def __exit__(self, exc_type, exc, tb) -> None:\n"
      "        _state.backward = self._saved.pop()",
      "    def __exit__(self, exc_type, exc, tb) -> None:\n        self._saved.pop()\n"
      "        _state.backward = False", *T_GUARD),
    # -- engine / ir --
    m("s2-rollback-forward-order", "engine", IR,
      "        for undo, *args in reversed(journal):", "        for undo, *args in journal:",
      *T_ENGINE),
    # -- gradients --
    m("s2-sigmoid-grad-wrong", "gradients", ACT,
      "slope = ctx.op(\"Mul\", y, ctx.op(\"Sub\", ctx.scalar(1.0, y), y))",
      "slope = ctx.op(\"Sub\", ctx.scalar(1.0, y), y)", *T_GRAD),
    m("s2-sqrt-grad-factor", "gradients", MATH,
      "ctx.op(\"Mul\", ctx.dy, ctx.scalar(0.5, y)), y)",
      "ctx.op(\"Mul\", ctx.dy, ctx.scalar(2.0, y)), y)",
      *T_GRAD),
    # -- rules --
    m("s2-transpose-compose-swapped", "rules", "rules/fold_transposes.py",
      "perm = [list(inner)[i] for i in outer]", "perm = [list(outer)[i] for i in inner]",
      "tests/rules/test_fold_transposes.py"),
    # -- output path safety --
    m("s2-same-output-realpath-only", "modelio", MODELIO,
      "            keys.append((\"inode\", *_identity(os.stat(path))))",
      "            pass", *T_MODELIO),
]
