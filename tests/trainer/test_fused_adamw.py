"""The fused AdamW kernel a GPU run uses, compiled here as C (its body is plain C with
CUDA's explicitly rounded intrinsics), against the NumPy optimizer: same bits, step after
step; and the optimizer's checkpoint state stays host arrays."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest
from support.gpu import cupy_with_a_device

from graphopt.trainer.optimizers import ADAMW_BODY, AdamW, array_module, to_host

HARNESS = r"""
#include <math.h>
#define __fmul_rn(a, b) ((float)((a) * (b)))
#define __fadd_rn(a, b) ((float)((a) + (b)))
#define __fsub_rn(a, b) ((float)((a) - (b)))
typedef float P;
void adamw(int n, const float* grads, float* params, float* ms, float* vs, float decay,
           float beta1, float one_minus_beta1, float beta2, float one_minus_beta2,
           float sqrt_bias2, float eps, float step_size) {
  for (int i = 0; i < n; ++i) {
    float grad = grads[i]; float param = params[i]; float m = ms[i]; float v = vs[i];
    BODY
    params[i] = param; ms[i] = m; vs[i] = v;
  }
}
"""


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    folder = tmp_path_factory.mktemp("adamw")
    source = folder / "adamw.c"
    source.write_text(HARNESS.replace("BODY", ADAMW_BODY))
    library = folder / "adamw.so"
    subprocess.run([cc, "-O2", "-ffp-contract=off", "-shared", "-fPIC", "-o", str(library),
                    str(source), "-lm"], check=True, capture_output=True, timeout=120)
    function = ctypes.CDLL(str(library)).adamw
    function.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_float] * 8
    return function


def test_fused_kernel_gives_the_numpy_optimizers_bits(fused):
    rng = np.random.default_rng(5)
    reference, kernel_run = (AdamW(lr=3e-3, weight_decay=0.1, decay_all=True)
                             for _ in range(2))
    param = rng.standard_normal(4096).astype(np.float32)
    ours = param.copy()
    m = np.zeros_like(param)
    v = np.zeros_like(param)
    for _ in range(5):
        grad = (rng.standard_normal(param.size) * 10.0 ** rng.uniform(-6, 1)).astype(np.float32)
        reference.step({"w": param}, {"w": grad})
        kernel_run.steps += 1
        scalars = [float(s) for s in kernel_run._scalars()]
        fused(param.size, grad.ctypes.data, ours.ctypes.data, m.ctypes.data, v.ctypes.data,
              *scalars)
        np.testing.assert_array_equal(ours.view(np.uint32), param.view(np.uint32))
        np.testing.assert_array_equal(m, reference.slots["w"]["exp_avg"])
        np.testing.assert_array_equal(v, reference.slots["w"]["exp_avg_sq"])


def test_state_is_host_arrays_and_the_module_is_numpy_on_the_host():
    optimizer = AdamW(lr=1e-3)
    param = np.ones(3, np.float32)
    optimizer.step({"w": param}, {"w": np.full(3, 0.5, np.float32)})
    _, arrays = optimizer.state()
    assert all(isinstance(value, np.ndarray) for value in arrays.values())
    assert array_module(param) is np and isinstance(to_host(param), np.ndarray)


def test_cupy_accepts_the_kernel_declaration():
    """CuPy parses an ElementwiseKernel's parameter lists when it is built (no GPU needed)."""
    cupy = pytest.importorskip("cupy", reason="CuPy not installed (no GPU needed for this)")
    from graphopt.trainer.optimizers import _adamw_kernel

    kernel = _adamw_kernel(cupy)
    assert kernel.nin == 9 and kernel.nout == 3


@pytest.mark.gpu
def test_fused_kernel_on_the_device_gives_the_host_bits():
    cupy = cupy_with_a_device()
    rng = np.random.default_rng(9)
    host, device = (AdamW(lr=3e-3, weight_decay=0.1, decay_all=True) for _ in range(2))
    for dtype in (np.float32, np.float16):
        key = f"w_{np.dtype(dtype).name}"
        param = rng.standard_normal(10_000).astype(dtype)
        on_device = cupy.asarray(param)
        for _ in range(4):
            grad = rng.standard_normal(param.size).astype(np.float32)
            host.step({key: param}, {key: grad})
            device.step({key: on_device}, {key: cupy.asarray(grad)})
        np.testing.assert_array_equal(on_device.get().view(np.uint8), param.view(np.uint8))
    _, arrays = device.state()
    assert all(isinstance(value, np.ndarray) for value in arrays.values())


@pytest.mark.parametrize("sizes", [
    [(1000, 300), (300,), (77,)],        # laid end to end: one flat update (_flat_step)
    [(2100, 2048), (5000,)],             # beyond the flat step's limit: weight by weight
])
def test_the_compiled_host_update_gives_the_numpy_updates_bits(monkeypatch, sizes):
    """numba's one-pass AdamW on the host against the NumPy passes it replaces: the same
    weights and moments, bit for bit, over steps with decay, a schedule and gradients from
    tiny to large (the NumPy passes run with the compiled kernels switched off)."""
    pytest.importorskip("numba")
    from graphopt.executor.kernels import _compiled

    rng = np.random.default_rng(5)
    start = {f"w{i}": rng.standard_normal(shape).astype(np.float32)
             for i, shape in enumerate(sizes)}
    grads = [{k: (rng.standard_normal(v.shape) * 10.0 ** rng.integers(-8, 2)).astype(np.float32)
              for k, v in start.items()} for _ in range(4)]

    def train(switch):
        monkeypatch.setenv(_compiled.ENV_SWITCH, switch)
        params = {k: v.copy() for k, v in start.items()}
        optimizer = AdamW(lr=1e-3, weight_decay=0.1)
        for step, g in enumerate(grads):
            optimizer.step(params, g, lr_factor=1.0 - 0.2 * step)
        return params, {f"{k}/{s}": np.array(to_host(a)) for k, slots in optimizer.slots.items()
                        for s, a in slots.items()}

    compiled, compiled_state = train("1")
    numpy_params, numpy_state = train("0")
    for name in start:
        np.testing.assert_array_equal(compiled[name], numpy_params[name], err_msg=name)
        assert not np.array_equal(compiled[name], start[name])
    assert compiled_state.keys() == numpy_state.keys()
    for key in numpy_state:
        np.testing.assert_array_equal(compiled_state[key], numpy_state[key], err_msg=key)
