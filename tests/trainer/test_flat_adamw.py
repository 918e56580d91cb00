"""AdamW's host step for float32 weights updates all of them as one flat array (issue 15):
it must give the bits of the update weight by weight, keep one slot array per weight for
checkpoints, and take back slots loaded from one."""
from __future__ import annotations

import numpy as np

from graphopt.trainer.optimizers import AdamW, Optimizer

SHAPES = {"w": (4, 6), "b": (6,), "scale": (), "emb": (5, 3)}


def weights_and_grads(seed: int):
    rng = np.random.default_rng(seed)
    params = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    grads = [{n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
             for _ in range(4)]
    return params, grads


def per_weight_step(optimizer, params, grads, factor):
    Optimizer.step(optimizer, params, grads, factor)  # the weight-by-weight loop


def test_flat_step_has_the_bits_of_the_weight_by_weight_step():
    flat_params, grads = weights_and_grads(0)
    loop_params = {n: p.copy() for n, p in flat_params.items()}
    flat, loop = AdamW(0.01), AdamW(0.01)
    for step, g in enumerate(grads):
        flat.step(flat_params, g, 1.0 / (step + 1))
        per_weight_step(loop, loop_params, g, 1.0 / (step + 1))
    assert flat._flat is not None  # the flat path ran
    for name in SHAPES:
        np.testing.assert_array_equal(flat_params[name], loop_params[name])
        for slot in AdamW.slot_names:
            np.testing.assert_array_equal(flat.slots[name][slot], loop.slots[name][slot])
            assert flat.slots[name][slot].shape == SHAPES[name]


def test_a_checkpoint_of_the_slots_resumes_to_the_same_bits():
    params, grads = weights_and_grads(1)
    straight = AdamW(0.02)
    for g in grads:
        straight.step(params, g)
    resumed_params, _ = weights_and_grads(1)
    first = AdamW(0.02)
    for g in grads[:2]:
        first.step(resumed_params, g)
    scalars, arrays = first.state()
    arrays = {k: v.copy() for k, v in arrays.items()}  # as written to and read from a file
    second = AdamW(0.02)
    second.load_state(scalars, arrays)
    for g in grads[2:]:
        second.step(resumed_params, g)
    for name in SHAPES:
        np.testing.assert_array_equal(resumed_params[name], params[name])


def test_float16_weights_keep_the_weight_by_weight_step():
    params, grads = weights_and_grads(2)
    params["b"] = params["b"].astype(np.float16)
    optimizer = AdamW(0.01)
    optimizer.step(params, grads[0])
    assert optimizer._flat is None and params["b"].dtype == np.float16
