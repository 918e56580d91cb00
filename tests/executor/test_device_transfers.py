"""Device->host copies per training step, counted without a GPU.

The training loop runs on ``ArrayBackend("cuda", RecordingXp(device_arrays=True))``: the GPU
branches of the executor, the trainer and the data-parallel reducer, on NumPy arrays that
count each read back to the host where CuPy would copy (``get()``, ``float()``, ``bool()``...).
A data-parallel step with an NCCL-like transport (buckets on the device, here a one-rank
loopback) must read back one array per step, the losses with the finite flag; and one rank of
it must train exactly as the single-GPU trainer does.
"""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from support.cupy_api import DeviceArray, RecordingXp, cupy_incompatibilities
from support.models import fixture_path

from graphopt.executor import Session
from graphopt.executor.backend import ArrayBackend
from graphopt.executor.session import value_type
from graphopt.trainer.data import Batches, array_shapes
from graphopt.trainer.distributed import (
    DeviceBuckets,
    DistributedTrainer,
    DistSettings,
    NcclTransport,
)
from graphopt.trainer.loop import LoopSettings, Trainer
from graphopt.trainer.loss_scaling import parse_loss_scale
from graphopt.trainer.optimizers import make_optimizer
from graphopt.trainer.training_graph import build

STEPS = 3


class OneRank:
    """The communicator of a one-rank job, in process (no MPI)."""

    rank, size, local_size, timeout = 0, 1, 1, 30.0

    def __init__(self):
        self.on_abort = []

    def wait(self, done, step, what, timeout=None):
        assert done(), what

    def allreduce_sum(self, values, step, what, timeout=None):
        return np.array(values, copy=True)

    def allgather(self, values, step, what, timeout=None):
        return np.asarray(values)[None]

    def bcast_array(self, array, step, what, timeout=None):
        assert type(array) is np.ndarray, "MPI broadcasts host arrays"

    def bcast_object(self, obj, step, what, timeout=None):
        return obj


class Loopback(DeviceBuckets):
    """NCCL's bucket handling (DeviceBuckets) with a one-rank collective: the sum of one."""

    name = "loopback"

    def __init__(self, xp):
        super().__init__(xp, 1)
        self.started: list = []

    def start(self, buffer):
        self.started.append(buffer)
        return len(self.started)

    def done(self, handles):
        return True

    def poke(self, handles):
        return True


def _make(precision, distributed, xp):
    rng = np.random.default_rng(3)
    arrays = {"x": rng.standard_normal((16, 64)).astype(np.float32),
              "labels": rng.integers(0, 10, 16).astype(np.int64)}
    graph = build(onnx.load(fixture_path("mlp.onnx")), loss="cross_entropy",
                  precision=precision, label_shapes=array_shapes(arrays))
    session = Session(graph.proto, device=ArrayBackend("cuda", xp), training=True, seed=0)
    types = {vi.name: value_type(vi) for vi in graph.proto.graph.input
             if vi.name in graph.data_inputs}
    parts = (graph, session, Batches(arrays, graph.data_inputs, 4, 0, types),
             make_optimizer("adamw", 1e-3),
             parse_loss_scale("dynamic:1024:3" if precision != "fp32" else None, precision),
             LoopSettings(STEPS, precision, 0))
    if not distributed:
        return Trainer(*parts)
    trainer = DistributedTrainer(*parts, comm=OneRank(), dist=DistSettings(bucket_mb=0.004),
                                 transport=Loopback(xp))
    trainer.broadcast_weights()
    return trainer


@pytest.mark.parametrize("precision", ["mixed", "fp32"])
def test_nccl_like_step_reads_back_one_array_the_losses(precision):
    xp = RecordingXp(device_arrays=True)
    trainer = _make(precision, True, xp)
    assert all(isinstance(v, DeviceArray) for v in trainer.params.values())
    reducer = trainer.reducer
    assert len(reducer.buckets) > 1   # several buckets, started during the backward pass
    want = np.float16 if precision == "mixed" else np.float32
    assert reducer.dtype == want
    assert all(b.buffer.dtype == want and isinstance(b.buffer, DeviceArray)
               for b in reducer.buckets)
    reads = xp.recorder.reads
    for _ in range(STEPS):
        reads.clear()
        record = trainer.train_step()
        # the executor reads the small integer inputs (axes, shapes) it needs as Python
        # ints from their host copies, so the step's one read is the trainer's
        assert len(reads) == 1 and "_reduce_on_device" in reads[0], reads
        assert np.isfinite(record["loss"])
    assert reducer.launched_in_backward > 0
    # each step starts a weight generation with the weights it feeds (the FP16 alternate's
    # conversion cache forgets the weights the optimizer updated in place)
    generation = trainer.weight_generation
    assert generation.value == STEPS and len(generation.weights) == len(trainer.params)
    assert all(isinstance(v, DeviceArray) for v in trainer.params.values())
    # the new calls (bucket staging, unscaling, the packed read) exist in CuPy as made
    if importlib.util.find_spec("cupy") is not None:   # CuPy installs without a GPU
        problems = cupy_incompatibilities(xp.recorder)
        assert not problems, "\n".join(problems)


@pytest.mark.parametrize("precision", ["mixed", "fp16", "fp32"])
def test_one_rank_of_the_device_path_trains_as_one_gpu_does(precision):
    """FP16 buckets, unscaled in float32 after the (one-rank) sum: the same bits as the
    single-GPU trainer's own float32 unscaling."""
    runs = []
    for distributed in (False, True):
        trainer = _make(precision, distributed, RecordingXp(device_arrays=True))
        losses = [trainer.train_step()["loss"] for _ in range(STEPS)]
        runs.append((losses, {n: np.asarray(v).copy() for n, v in trainer.params.items()}))
    (want_losses, want), (got_losses, got) = runs
    assert got_losses == want_losses
    for name in want:
        np.testing.assert_array_equal(got[name].view(np.uint8), want[name].view(np.uint8),
                                      err_msg=name)


def _nccl_sum(buffers):
    """NCCL's FP16 ring sum: one FP16 addition per hop (FuncSum<half> is __hadd2)."""
    total = buffers[0].copy()
    with np.errstate(over="ignore"):
        for buffer in buffers[1:]:
            total = (total + buffer).astype(buffers[0].dtype)
    return total


def test_fp16_buckets_hold_the_mean_so_the_sum_does_not_overflow():
    ranks, scale = 4, 1024.0
    grads = [np.full(3, 60000.0, np.float16), np.full(3, 50000.0, np.float16),
             np.full(3, 40000.0, np.float16), np.full(3, 30000.0, np.float16)]
    transport = DeviceBuckets(np, ranks)
    buffers = []
    for grad in grads:
        buffer = transport.buffer(3, transport.bucket_dtype(grad.dtype))
        transport.stage(buffer, 0, grad)
        buffers.append(buffer)
    assert buffers[0].dtype == np.float16
    assert not np.isfinite(_nccl_sum(grads)).all()   # summing the raw gradients overflows
    summed = _nccl_sum(buffers)
    out, finite = transport.finish(summed, ranks * scale)
    assert bool(finite) and out.dtype == np.float32
    np.testing.assert_allclose(out, 45000.0 / scale, rtol=1e-3)
    # an overflow a rank brings is seen by all (an inf in the all-reduced bucket)
    transport.stage(buffers[1], 0, np.full(3, np.inf, np.float16))
    assert not bool(transport.finish(_nccl_sum(buffers), ranks * scale)[1])


def test_nccl_all_reduces_the_bucket_in_its_own_dtype():
    calls = []
    event = SimpleNamespace()
    stream = SimpleNamespace(ptr=7, wait_event=lambda e: None, record=lambda: event)
    fake = SimpleNamespace(
        cupy=SimpleNamespace(cuda=SimpleNamespace(get_current_stream=lambda: stream)),
        stream=stream, nccl=SimpleNamespace(NCCL_FLOAT16=6, NCCL_FLOAT32=7, NCCL_SUM=0),
        nccl_comm=SimpleNamespace(allReduce=lambda *args: calls.append(args)))
    for dtype, nccl_type in ((np.float16, 6), (np.float32, 7)):
        buffer = SimpleNamespace(dtype=np.dtype(dtype), size=5, data=SimpleNamespace(ptr=99))
        assert NcclTransport.start(fake, buffer) is event
        assert calls[-1] == (99, 99, 5, nccl_type, 0, 7)


def test_shape_arithmetic_reads_no_device_array_back():
    # Reshape reads its target shape, Shape's output, and ReduceSum its axes, an
    # initializer, as Python ints: both from the host copies the executor keeps
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Reshape", ["y", "s"], ["z"]),
             helper.make_node("ReduceSum", ["z", "axes"], ["r"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                     helper.make_tensor_value_info("y", TensorProto.FLOAT, [6])],
        [helper.make_tensor_value_info("r", TensorProto.FLOAT, [2])],
        [helper.make_tensor("axes", TensorProto.INT64, [1], [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    xp = RecordingXp(device_arrays=True)
    session = Session(model, device=ArrayBackend("cuda", xp))
    xp.recorder.reads.clear()
    out = session.run({"x": np.zeros((2, 3), np.float32),
                       "y": np.arange(6, dtype=np.float32)}, to_host=False)
    assert xp.recorder.reads == []
    np.testing.assert_array_equal(np.asarray(out["r"]), [3, 12])
