"""The CuPy backend against the NumPy one: bit-for-bit for the elementwise kernels, within
tolerance for the GEMMs (summation order differs). Skipped without CuPy or a device."""

import numpy as np
import pytest
from support.gpu import cupy_with_a_device

from graphopt.executor.numerics import Fp16Policy, Numerics
from graphopt.executor.numerics import fp16_bits as host_bits

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cp():
    cupy = cupy_with_a_device()
    return cupy


@pytest.fixture(scope="module")
def kernels(cp):
    from graphopt.executor.numerics.gpu_gemm import CupyFp16Gemm

    return CupyFp16Gemm(cp)


ALL_FP16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)


@pytest.mark.parametrize("rounding", ["truncate", "rnz"])
def test_bf16_conversion_bit_exact(cp, kernels, rounding):
    got = kernels.fp16_to_bf16_bits(cp.asarray(ALL_FP16), rounding).get()
    np.testing.assert_array_equal(got, host_bits.fp16_to_bf16_bits(ALL_FP16, rounding))


def test_flush_and_count_bit_exact(cp, kernels):
    device = cp.asarray(ALL_FP16)
    flushed = kernels.flush_subnormals(device).get()
    np.testing.assert_array_equal(flushed.view(np.uint16),
                                  host_bits.flush_subnormals(ALL_FP16).view(np.uint16))
    assert kernels.count_subnormals(device) == host_bits.count_subnormals(ALL_FP16) == 2046
    strided = device.reshape(256, 256)[:, 1::3]
    assert kernels.count_subnormals(strided) == host_bits.count_subnormals(
        ALL_FP16.reshape(256, 256)[:, 1::3])


def _operands(shape_a, shape_b, seed=0):
    rng = np.random.default_rng(seed)
    scale = 2.0 ** rng.uniform(-22, 2, size=shape_a)  # plenty of FP16 subnormals
    a = (scale * rng.choice([-1.0, 1.0], size=shape_a)).astype(np.float16)
    b = rng.uniform(-4, 4, size=shape_b).astype(np.float16)
    return a, b


@pytest.mark.parametrize("mode", ["native", "mi200"])
@pytest.mark.parametrize("gemm", ["original", "alternate"])
@pytest.mark.parametrize("rounding", ["truncate", "rnz"])
@pytest.mark.parametrize(
    "shape_a, shape_b",
    [((64, 96), (96, 48)), ((3, 32, 40), (40, 24)), ((2, 1, 16, 8), (3, 8, 12)), ((8,), (8, 5)),
     ((2, 4, 16, 8), (2, 1, 8, 12)),  # MQA: K/V shared by the heads
     ((2, 4, 16, 8), "T")],           # a transposed view (FusedMatMul transB)
)
def test_gemm_matches_numpy_path(cp, mode, gemm, rounding, shape_a, shape_b):
    transposed = shape_b == "T"
    a, b = _operands(shape_a, (12, 8) if transposed else shape_b)
    b_host = b.T if transposed else b
    b_device = cp.asarray(b).T if transposed else cp.asarray(b)
    policy = Fp16Policy(gemm=gemm, gemm_rounding=rounding)
    host = Numerics(mode=mode, policy=policy, xp=np).matmul(a, b_host)
    device = Numerics(mode=mode, policy=policy, xp=cp).matmul(cp.asarray(a), b_device)
    assert device.dtype == cp.float16 and device.shape == host.shape
    got, want = device.get().astype(np.float64), host.astype(np.float64)
    # Float32 sums in another order differ by a few ulps of sum |a||b| (cancellation makes
    # that large next to the result); FP16 rounds once more; an emulated flush may fall on
    # either side of the smallest normal.
    k = a.shape[-1]
    magnitude = np.abs(np.matmul(np.abs(a.astype(np.float64)), np.abs(b_host.astype(np.float64))))
    floor = 2.0**-14 if mode == "mi200" and gemm == "original" else 2.0**-24
    bound = 2.0**-10 * np.abs(want) + k * 2.0**-23 * magnitude + floor
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) - bound)
    if mode == "mi200" and gemm == "original":  # no subnormal may survive the emulation
        assert host_bits.count_subnormals(device.get()) == 0


def test_denormal_probe_on_device(cp):
    numerics = Numerics(mode="mi200", policy=Fp16Policy(), xp=cp, collect_stats=True)
    a = cp.asarray(np.array([[2.0**-20, 1.0]], np.float16))
    b = cp.asarray(np.array([[1.0], [0.0]], np.float16))
    assert float(numerics.matmul(a, b)[0, 0]) == 0.0
    with numerics.backward_pass():
        assert float(numerics.matmul(a, b)[0, 0]) == 2.0**-20
    report = numerics.denormal_report()["nodes"]["<unnamed>"]
    assert report["forward"]["input_denormals"] == 1
    assert report["backward"]["output_denormals"] == 1
