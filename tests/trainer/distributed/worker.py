"""Run under ``mpiexec -n 2``: ``python worker.py SCENARIO OUT MODEL DATA [TIMEOUT]``.

Scenarios (faults are injected here, in the test, not in the product):
  overflow  rank 1 alone: inf in one raw gradient at step 3; at step 6 its own finiteness
            check alone says "overflow". Every rank writes OUT/rank<r>.npz (weights + history).
  die       rank 1 exits abruptly (os._exit) after step 3.
  hang      rank 1 stops responding (sleeps) after step 3.
  error     rank 1 raises an error after step 3.
  batchnorm MODEL has BatchNorm: 4 SGD steps; every rank writes OUT/rank<r>.npz (weights and
            running statistics).
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

from graphopt.errors import GraphoptError
from graphopt.trainer import RunOptions, distributed, run

REDUCERS: list = []
LAUNCHED = {"all": 0, "in_backward": 0}


def main() -> None:
    scenario, out, model, data = sys.argv[1:5]
    timeout = float(sys.argv[5]) if len(sys.argv) > 5 else 30.0
    comm = distributed.world(timeout)
    rank = comm.rank
    current = {"step": 1}   # the step being computed (1-based)

    def after_step(step, record):
        current["step"] = step + 1
        if rank == 1 and step == 3:
            if scenario == "die":
                os._exit(0)
            if scenario == "hang":
                time.sleep(3600)
            if scenario == "error":
                raise GraphoptError("injected failure on rank 1")

    class Reducer(distributed.GradientReducer):
        """The standard reducer, remembered to read its counters at the end; on rank 1 of
        the overflow scenario it poisons one bucket at step 3 and reports a local overflow
        at step 6."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            REDUCERS.append(self)
            self.poisoned = False

        def stage(self, name, value):
            if scenario == "overflow" and rank == 1 and current["step"] == 3 \
                    and not self.poisoned:
                self.poisoned = True
                value = np.full(np.shape(value), np.inf, np.float32)
            return super().stage(name, value)

        def gradients(self, divisor):
            grads, finite = super().gradients(divisor)
            if scenario == "overflow" and rank == 1:
                finite = finite and current["step"] != 6
            return grads, finite

    if scenario == "batchnorm":
        result = run(RunOptions(model=model, data=data, loss="cross_entropy", steps=4,
                                batch_size=8, optimizer="sgd", lr=0.1, seed=3, device="cpu",
                                quiet=True, distributed=True, dist_timeout=timeout)).result
        np.savez(os.path.join(out, f"rank{rank}.npz"), **result.params,
                 **{f"buffer/{k}": v for k, v in result.buffers.items()})
        return
    outcome = run(RunOptions(model=model, data=data, loss="cross_entropy", steps=9,
                             batch_size=8, optimizer="adamw", lr=0.01, seed=3, device="cpu",
                             loss_scale="dynamic:1024:1000", quiet=True, distributed=True,
                             dist_timeout=timeout, dist_check_every=1), after_step=after_step,
                  gradient_reducer=Reducer)
    result = outcome.result
    LAUNCHED["all"] = REDUCERS[-1].launched
    LAUNCHED["in_backward"] = REDUCERS[-1].launched_in_backward
    np.savez(os.path.join(out, f"rank{rank}.npz"), **result.params,
             __history__=np.array(json.dumps(list(result.history))),
             __launched__=np.array([LAUNCHED["all"], LAUNCHED["in_backward"]]))


if __name__ == "__main__":
    main()
