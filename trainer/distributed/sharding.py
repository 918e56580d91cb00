"""Data for ``graphopt run --distributed``: rank ``r`` of N takes rows ``[r*B/N, (r+1)*B/N)``
of every global batch of the same per-epoch order, so N ranks with B/N each see exactly the
samples one rank with B sees."""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from graphopt.errors import GraphoptError

from ..data import Batches
from .job import RefusedOnEveryRank, check_global_batch


class ShardedBatches(Batches):
    """Rank ``rank``'s slice of every global batch. ``batch_size`` stays the global batch
    (progress counts global samples; checkpoints and ``--resume`` speak global steps), the
    arrays fed to the graph have ``local_batch`` rows."""

    def __init__(self, arrays: Mapping[str, np.ndarray], input_names: Sequence[str],
                 batch_size: int, seed: int, input_types: Mapping[str, tuple] | None,
                 rank: int, ranks: int, accumulate: int = 1):
        # Every refusal here follows from the command, the data and the graph, the same on
        # every rank: each rank stops on its own, rank 0 says why (RefusedOnEveryRank)
        try:
            if batch_size >= 1:   # Batches refuses the others
                check_global_batch(batch_size, ranks)
            super().__init__(arrays, input_names, batch_size, seed, None, accumulate)
            self.rank, self.ranks, self.local_batch = rank, ranks, batch_size // ranks
            types = dict(input_types or {})
            for name, (_, dims) in types.items():
                if dims and isinstance(dims[0], int) and dims[0] != self.local_batch:
                    raise GraphoptError(f"graph input {name!r} has a fixed batch size "
                                        f"{dims[0]}; with {ranks} ranks use --batch-size "
                                        f"{dims[0] * ranks} (the global batch)")
            self.batch_size = self.local_batch   # the shape checks speak the per-rank batch
            try:
                self._check_types(types)
            finally:
                self.batch_size = batch_size
        except RefusedOnEveryRank:
            raise
        except GraphoptError as exc:
            raise RefusedOnEveryRank(str(exc)) from None

    def batch(self, step: int, micro: int = 0) -> dict[str, np.ndarray]:
        rows = self.rows(step, micro)
        mine = rows[self.rank * self.local_batch:(self.rank + 1) * self.local_batch]
        return {name: array[mine] for name, array in self.arrays.items()}
