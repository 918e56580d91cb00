"""The emulated alternate's BF16 conversion of weights, cached per WeightGeneration.

``CupyFp16Gemm`` runs on the CPU here: a stand-in module whose conversion kernel is the host
reference (counted per call) and a subclass whose BLAS product is NumPy's on the BF16 values.
A weight read by several alternate GEMMs of one generation is converted once; an in-place
update (same object, same pointer) followed by ``bump`` is converted again; activations are
never cached; the numbers are those of the uncached path, bit for bit.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from graphopt.executor.numerics import Numerics, fp16_bits
from graphopt.executor.numerics.gpu_gemm import (
    CUDA_R_32F,
    CupyFp16Gemm,
    WeightGeneration,
)
from graphopt.executor.numerics.policy import RNZ, TRUNCATE


def _fake_cupy(conversions):
    def elementwise(inputs, outputs, body, name):
        if name == "graphopt_flush_fp16_subnormals":
            def flush(bits):
                conversions.append(("flush", bits.shape))
                return fp16_bits.flush_subnormals(bits.view(np.float16)).view(np.uint16)
            return flush
        if name == "graphopt_fp16_to_bf16_bits":
            def convert(bits, rnz):
                conversions.append(bits.shape)
                rounding = RNZ if rnz else TRUNCATE
                return fp16_bits.fp16_to_bf16_bits(bits.view(np.float16), rounding)
            return convert
        return lambda *args: None

    return SimpleNamespace(
        cuda=SimpleNamespace(runtime=SimpleNamespace(is_hip=False)), uint16=np.uint16,
        float16=np.float16, float32=np.float32, ElementwiseKernel=elementwise,
        ReductionKernel=lambda *args: None)


class HostBlas(CupyFp16Gemm):
    """The BLAS product on the host: BF16 bits in, float32 out (cuBLAS's BF16 -> F32), or
    FP16 in and out."""

    def matmul(self, a, b, in_type, out_type, flags=0):
        if out_type == CUDA_R_32F:
            return fp16_bits.bf16_bits_to_float32(a) @ fp16_bits.bf16_bits_to_float32(b)
        return (a.astype(np.float32) @ b.astype(np.float32)).astype(np.float16)


def _gemm():
    conversions = []
    return HostBlas(_fake_cupy(conversions)), conversions


def test_weights_are_converted_once_per_generation_with_the_same_bits():
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((8, 6)).astype(np.float16)
    xs = [rng.standard_normal((5, 8)).astype(np.float16) for _ in range(3)]
    dys = [rng.standard_normal((5, 6)).astype(np.float16) for _ in range(3)]

    plain, plain_conversions = _gemm()
    want = [plain.alternate(x, weight, RNZ)[0] for x in xs]
    want += [plain.alternate(dy, weight.T, RNZ)[0] for dy in dys]   # dX = dY @ W^T
    assert len(plain_conversions) == 12

    cached, conversions = _gemm()
    generation = WeightGeneration()
    assert cached.cache_weights(generation)
    generation.bump([weight])
    got = [cached.alternate(x, weight, RNZ)[0] for x in xs]
    got += [cached.alternate(dy, weight.T, RNZ)[0] for dy in dys]
    # the activations each time, the weight once per layout it is read in (W and W^T)
    assert len(conversions) == 6 + 2
    assert (cached.weight_cache.hits, cached.weight_cache.misses) == (4, 2)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.view(np.uint16), w.view(np.uint16))
    # another rounding is another conversion
    cached.alternate(xs[0], weight, TRUNCATE)
    assert cached.weight_cache.misses == 3


def test_an_in_place_update_is_seen_after_bump_and_only_then():
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((4, 4)).astype(np.float16)
    x = rng.standard_normal((3, 4)).astype(np.float16)
    gemm, _ = _gemm()
    generation = WeightGeneration()
    assert gemm.cache_weights(generation)
    generation.bump([weight])
    before = gemm.alternate(x, weight, TRUNCATE)[0]
    weight *= np.float16(2)   # the optimizer's in-place update: same object, same pointer
    stale = gemm.alternate(x, weight, TRUNCATE)[0]
    np.testing.assert_array_equal(stale, before)   # within a generation: by contract
    generation.bump([weight])
    after = gemm.alternate(x, weight, TRUNCATE)[0]
    fresh, _ = _gemm()
    np.testing.assert_array_equal(after.view(np.uint16),
                                  fresh.alternate(x, weight, TRUNCATE)[0].view(np.uint16))
    assert not np.array_equal(after, before)


def test_arrays_that_are_not_weights_are_never_cached():
    gemm, conversions = _gemm()
    generation = WeightGeneration()
    assert gemm.cache_weights(generation)
    generation.bump([np.ones((2, 2), np.float16)])
    a = np.ones((3, 4), np.float16)
    b = np.ones((4, 2), np.float16)
    for _ in range(3):
        gemm.alternate(a, b, TRUNCATE)
    assert len(conversions) == 6 and gemm.weight_cache.hits == 0


def test_the_emulated_mi200_flush_of_a_weight_is_cached_too():
    rng = np.random.default_rng(2)
    weight = (rng.standard_normal((6, 4)) * 1e-5).astype(np.float16)   # subnormals
    xs = [rng.standard_normal((3, 6)).astype(np.float16) for _ in range(3)]
    plain, _ = _gemm()
    want = [plain.original_mi200(x, weight)[0] for x in xs]
    gemm, conversions = _gemm()
    generation = WeightGeneration()
    assert gemm.cache_weights(generation)
    generation.bump([weight])
    got = [gemm.original_mi200(x, weight)[0] for x in xs]
    # each x once, the weight once, each output once
    assert len(conversions) == 3 + 1 + 3
    assert (gemm.weight_cache.hits, gemm.weight_cache.misses) == (2, 1)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.view(np.uint16), w.view(np.uint16))


def test_numerics_hands_the_generation_to_the_gpu_kernels_only():
    assert Numerics("native", xp=np).cache_weights(WeightGeneration()) is False   # NumPy
    gemm, _ = _gemm()
    gemm.native_alternate = True   # rocBLAS's own alternate (gfx90a): nothing to convert
    assert gemm.cache_weights(WeightGeneration()) is False and gemm.weight_cache is None
