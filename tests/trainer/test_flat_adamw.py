"""AdamW's host step for float32 weights updates all of them as one flat array:
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


class PerWeightAdamW(AdamW):
    """AdamW updating weight by weight (the base class's loop), never flat."""
    _step_group = Optimizer._step_group


def test_flat_step_has_the_bits_of_the_weight_by_weight_step():
    flat_params, grads = weights_and_grads(0)
    loop_params = {n: p.copy() for n, p in flat_params.items()}
    flat, loop = AdamW(0.01), PerWeightAdamW(0.01)
    for step, g in enumerate(grads):
        flat.step(flat_params, g, 1.0 / (step + 1))
        loop.step(loop_params, g, 1.0 / (step + 1))
    assert len(flat._flat) == 2  # the flat path ran, once per decay group
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
    assert params["b"].dtype == np.float16
    assert all("b" not in spans for _, spans in optimizer._flat.values())


def test_large_weights_update_in_place_chunk_by_chunk_with_the_bits_of_a_whole_update():
    """A weight larger than one chunk is updated in place (no copy of it, temporaries of one
    chunk): the bits of the update of the whole array at once, for every optimizer."""
    from graphopt.trainer.optimizers import FLAT_STEP_LIMIT, OPTIMIZERS, UPDATE_CHUNK

    rng = np.random.default_rng(3)
    size = max(3 * UPDATE_CHUNK + 5, FLAT_STEP_LIMIT + 1)   # past AdamW's flat step too
    start = rng.standard_normal(size).astype(np.float32)
    grads = [rng.standard_normal(size).astype(np.float32) for _ in range(3)]
    for name, cls in OPTIMIZERS.items():
        chunked, whole = cls(0.01, 0.1, decay_all=True), cls(0.01, 0.1, decay_all=True)
        param = start.copy()
        before = param.__array_interface__["data"][0]
        reference = start.copy()
        for g in grads:
            chunked.step({"w": param}, {"w": g})
            whole.steps += 1
            whole._update("w", reference, g)   # the whole-array arithmetic
        assert param.__array_interface__["data"][0] == before, name   # updated in place
        np.testing.assert_array_equal(param, reference, err_msg=name)
        for slot in cls.slot_names:
            np.testing.assert_array_equal(chunked.slots["w"][slot], whole.slots["w"][slot])


def test_an_update_allocates_no_copy_of_a_large_weight():
    """The update's temporaries are chunk-sized: NumPy's allocations during the step of a
    64 MiB weight (its state allocated by an earlier step) stay far below the weight's size."""
    import tracemalloc

    from graphopt.trainer.optimizers import OPTIMIZERS

    size = 1 << 24
    rng = np.random.default_rng(4)
    param = rng.standard_normal(size).astype(np.float32)
    grad = rng.standard_normal(size).astype(np.float32)
    for name, cls in OPTIMIZERS.items():
        optimizer = cls(1e-3, 0.01)
        optimizer.step({"w": param}, {"w": grad})   # allocates the state
        tracemalloc.start()
        try:
            optimizer.step({"w": param}, {"w": grad})
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < param.nbytes // 16, (name, peak)
