"""onnx's node test suite again, every input handed over in another memory layout.

Kernels take shortcuts by layout: a view instead of a copy, a reshape that must be a view for
a write through it to land. A shortcut taken for a layout it does not hold gives wrong values
silently (the cross-entropy gradient once lost its -1 at the labels when its scores were a
transposed view). Here each case of the node suite runs with the same input values laid out
otherwise: arrays of rank 2 and more in Fortran order (every axis reversed in memory), or as a
view taking every other element of a larger buffer (not dense); vectors as such a view. The
expected outputs and tolerances are the suite's own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from support.layouts import relaid

from graphopt.executor.onnx_backend import ExecutorBackend, ExecutorRep, _as_array

from .test_onnx_backend import node_suite


class RelaidRep(ExecutorRep):
    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        if isinstance(inputs, dict):
            inputs = {name: relaid(_as_array(value), position)
                      for position, (name, value) in enumerate(inputs.items())}
        else:
            if not isinstance(inputs, (list, tuple)):
                inputs = [inputs]
            inputs = [relaid(_as_array(value), position)
                      for position, value in enumerate(inputs)]
        return super().run(inputs, **kwargs)


class RelaidBackend(ExecutorBackend):
    @classmethod
    def prepare(cls, model, device: str = "CPU", **kwargs: Any) -> RelaidRep:
        return RelaidRep(ExecutorBackend.prepare(model, device, **kwargs).session)


def test_relaid_inputs_hold_the_same_values_in_other_layouts():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    fortran, strided = relaid(x, 0), relaid(x, 1)
    assert fortran.flags.f_contiguous and not fortran.flags.c_contiguous
    assert not strided.flags.c_contiguous and not strided.flags.f_contiguous
    np.testing.assert_array_equal(fortran, x)
    np.testing.assert_array_equal(strided, x)
    vector = relaid(np.arange(5), 0)
    assert vector.strides == (16,)
    np.testing.assert_array_equal(vector, np.arange(5))


globals().update(node_suite(RelaidBackend, __name__))
