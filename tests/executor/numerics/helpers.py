"""Inputs built around FP16 denormals, and a probe telling which implementation ran."""

import numpy as np

from graphopt.executor.numerics import ALTERNATE, ORIGINAL

SUBNORMAL = np.float16(2.0**-20)  # FP16 subnormal (min normal is 2**-14), exact in BF16


def denormal_probe(numerics, op, sign=1.0):
    """Run ``[[d, 1]] @ [[1], [0]]`` (= d, a subnormal) and say which implementation ran.

    Under mode "mi200" the original flushes d to a zero of d's sign; the alternate keeps d
    exactly (a power of two survives BF16 truncation and RNZ alike).
    """
    a = np.array([[sign * SUBNORMAL, 1.0]], dtype=np.float16)
    b = np.array([[1.0], [0.0]], dtype=np.float16)
    out = numerics.matmul(a, b, op=op)
    assert out.dtype == np.float16 and out.shape == (1, 1)
    value = out[0, 0]
    if value == 0:  # (an exact zero sum is +0 whatever the flushed input's sign)
        return ORIGINAL
    assert value == np.float16(sign * SUBNORMAL), f"unexpected result {value!r}"
    return ALTERNATE
