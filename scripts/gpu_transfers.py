"""Device->host copies per training step on a real GPU, for scripts/gpu_checks.sh.

The data-parallel trainer with device buckets (the NCCL path's bucket handling, summed over one
rank in process: no MPI, no NCCL needed) trains the mlp fixture in mixed precision on CuPy.
CUDA's own activity records (CUPTI, through ``torch.profiler``, which sees every memcpy of the
process, CuPy's included) count the device->host copies of

* a plain ``Session.run(..., to_host=False)`` of the step's graph: the executor's own reads
  (small integer inputs such as ReduceSum axes, read through ``KernelContext.host_ints``);
* a whole training step.

The trainer's share (step minus run) must be 1: the losses and the finite flag, read together.
A known ``get()`` in the window first checks that CuPy's copies are seen at all. Prints one JSON
object; exit status 1 when the trainer's share is not 1, 0 when it is or nothing could be
measured (the reason is in the JSON).

    python scripts/gpu_transfers.py [--steps 5]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


class OneRank:
    """The communicator of a one-rank job, in process."""

    rank, size, local_size, timeout = 0, 1, 1, 60.0

    def __init__(self):
        self.on_abort = []

    def wait(self, done, step, what, timeout=None):
        while not done():
            pass

    def allreduce_sum(self, values, step, what, timeout=None):
        return np.array(values, copy=True)

    def allgather(self, values, step, what, timeout=None):
        return np.asarray(values)[None]

    def bcast_array(self, array, step, what, timeout=None):
        return None

    def bcast_object(self, obj, step, what, timeout=None):
        return obj


def trainer_on(cupy):
    import onnx

    from graphopt.executor import Session
    from graphopt.executor.backend import ArrayBackend
    from graphopt.executor.session import value_type
    from graphopt.trainer.data import Batches, array_shapes
    from graphopt.trainer.distributed import DeviceBuckets, DistributedTrainer, DistSettings
    from graphopt.trainer.loop import LoopSettings
    from graphopt.trainer.loss_scaling import parse_loss_scale
    from graphopt.trainer.optimizers import make_optimizer
    from graphopt.trainer.training_graph import build

    class Loopback(DeviceBuckets):
        name = "one-rank loopback"

        def start(self, buffer):
            return cupy.cuda.get_current_stream().record()

        def done(self, handles):
            return all(event.done for event in handles)

        def poke(self, handles):
            return True

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rng = np.random.default_rng(0)
    arrays = {"x": rng.standard_normal((16, 64)).astype(np.float32),
              "labels": rng.integers(0, 10, 16).astype(np.int64)}
    graph = build(onnx.load(os.path.join(root, "tests", "fixtures", "mlp.onnx")),
                  loss="cross_entropy", precision="mixed", label_shapes=array_shapes(arrays))
    session = Session(graph.proto, device=ArrayBackend("cuda", cupy), training=True, seed=0)
    types = {vi.name: value_type(vi) for vi in graph.proto.graph.input
             if vi.name in graph.data_inputs}
    trainer = DistributedTrainer(
        graph, session, Batches(arrays, graph.data_inputs, 4, 0, types),
        make_optimizer("adamw", 1e-3), parse_loss_scale("dynamic", "mixed"),
        LoopSettings(1000, "mixed", 0), comm=OneRank(), dist=DistSettings(bucket_mb=0.004),
        transport=Loopback(cupy, 1))
    trainer.broadcast_weights()
    return trainer


def count_d2h(cupy, torch, fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    cupy.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        cupy.cuda.Device().synchronize()
        torch.cuda.synchronize()
    return sum(1 for event in prof.events() if "DtoH" in event.name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    result: dict = {"steps": args.steps}
    try:
        import cupy
        import torch
        if not torch.cuda.is_available():
            raise ImportError("torch sees no CUDA device")
    except ImportError as exc:
        result["not_measured"] = f"needs CuPy and torch with CUDA (CUPTI): {exc}"
        print(json.dumps(result))
        return 0
    torch.cuda.init()
    known = count_d2h(cupy, torch, lambda: cupy.arange(3).get())
    result["calibration_known_copies_seen"] = known
    if known < 1:
        result["not_measured"] = "the profiler does not see CuPy's copies"
        print(json.dumps(result))
        return 0
    trainer = trainer_on(cupy)
    for _ in range(2):   # warm-up: kernels compiled, buckets and optimizer state allocated
        trainer.train_step()
    feeds = trainer.batches.batch(trainer.step)
    for name, value in trainer.params.items():
        feeds[name] = value.astype(trainer.compute_dtype, copy=False)
    run = count_d2h(cupy, torch,
                    lambda: trainer.session.run(feeds, trainer.fetches, to_host=False))

    def steps():
        for _ in range(args.steps):
            trainer.train_step()

    total = count_d2h(cupy, torch, steps)
    per_step = total / args.steps
    result.update({"d2h_per_step": per_step, "d2h_per_executor_run": run,
                   "d2h_trainer_share_per_step": per_step - run,
                   "bucket_dtype": str(trainer.reducer.dtype),
                   "buckets": len(trainer.reducer.buckets)})
    result["ok"] = per_step - run == 1
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
