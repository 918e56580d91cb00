"""Data-parallel training behind ``graphopt run --distributed``.

Launch N copies with ``mpirun -n N`` / ``mpiexec -n N`` / ``srun``; every copy reads its rank
and the world size from MPI itself (``MPI.COMM_WORLD``), never from launcher variables.

What each rank does, per step:

- data: the same global order for the epoch (:class:`~..data.Batches`, a pure function of
  (seed, epoch)); ``--batch-size B`` is the *global* batch and rank ``r`` takes rows
  ``[r*B/N, (r+1)*B/N)`` of every global batch, so N ranks with B/N each see exactly the
  samples one rank with B sees (:class:`ShardedBatches`);
- gradients: flattened into a few contiguous buckets (``--bucket-mb``, 25 MiB by default,
  filled in the order the backward pass produces the gradients) and summed with one
  all-reduce per bucket, then divided by N (and by the loss scale): float32 on the host over
  MPI; on the GPU with NCCL, in the gradients' own dtype (FP16 under mixed/fp16 precision,
  pre-divided by N as PyTorch DDP does: see ``transport``), and nothing but one small array
  (losses and finite flag) comes back to the host per step. With overlap on (the
  default) a bucket's non-blocking all-reduce starts inside the executor run, right after
  the node producing its last gradient, while the rest of the backward pass computes
  (through ``Session.run(on_step=...)``, see :class:`GradientReducer`);
- agreement: one more tiny all-reduce carries (loss, overflow flag, Ctrl-C flag), so the
  reported loss is the global mean, one rank's inf/NaN skips the step on every rank (the
  loss scaler moves identically everywhere) and Ctrl-C stops every rank after the same step;
- weights: rank 0's initial (or resumed) weights are broadcast before the first step;
  ``--dist-check-every K`` compares a CRC of the weights across ranks every K steps;
- output: rank 0 alone writes the log, checkpoints, plot and model and shows progress (its
  samples/s are global: the global batch per step).

Every collective waits with a deadline (non-blocking request + Test polling, ``--dist-timeout``
seconds). On expiry the waiting ranks ask each other, point to point on a separate
communicator, which ranks are still alive, print ``rank K did not reach step S within T s``
naming the silent ones, and abort the job (``MPI_Abort``, exit status 124). A rank that fails
with an error prints it with its rank and aborts the job at once. ``--resume`` restarts the
whole job from the last checkpoint (written by rank 0; read by rank 0 and broadcast, so other
nodes need not see the file system). The checkpoint stores the global batch size, so a job
may resume on a different number of ranks.

GPUs: each rank binds the GPU ``local_rank % devices`` and all-reduces the buckets on the
device with NCCL (RCCL on ROCm) through ``cupy.cuda.nccl``, bootstrapped by broadcasting
NCCL's unique id over MPI; completion is polled through CUDA events with the same deadline,
and a timeout aborts the NCCL communicator before MPI_Abort. Where NCCL cannot serve every
rank (no NCCL library, more ranks than GPUs on a host, a failed set-up), all ranks agree to
all-reduce over MPI through the host instead and the banner says why.

Rooms, each importing only those above it:

  job        job control: settings, the world communicator (ranks, ranks per host, deadlines,
             who-is-missing, abort), one GPU per rank, ``start``
  sharding   each rank's slice of every global batch
  transport  moving a gradient bucket: MPI through the host, or NCCL/RCCL on the GPU
  buckets    packing gradients into buckets and starting each as its last gradient appears
  trainer    the data-parallel :class:`~..loop.Trainer` and the start-of-job settings check
"""
from .buckets import Bucket, GradientReducer, plan_buckets
from .job import (
    ABORT_GRACE,
    EXIT_ERROR,
    EXIT_TIMEOUT,
    MIB,
    SETUP_TIMEOUT_MIN,
    Communicator,
    Distributed,
    DistSettings,
    RefusedOnEveryRank,
    bind_device,
    check_global_batch,
    import_mpi,
    refuse_on_every_rank,
    start,
    world,
)
from .sharding import ShardedBatches
from .trainer import DistributedTrainer, fingerprint, weights_checksum
from .transport import (
    DeviceBuckets,
    MpiTransport,
    NcclTransport,
    make_transport,
    nccl_unusable,
)

__all__ = [
    "ABORT_GRACE", "EXIT_ERROR", "EXIT_TIMEOUT", "MIB", "SETUP_TIMEOUT_MIN", "Bucket",
    "Communicator", "DeviceBuckets", "DistSettings", "Distributed", "DistributedTrainer",
    "GradientReducer",
    "MpiTransport", "NcclTransport", "RefusedOnEveryRank", "ShardedBatches", "bind_device",
    "check_global_batch", "fingerprint", "import_mpi", "make_transport", "nccl_unusable",
    "plan_buckets", "refuse_on_every_rank", "start", "weights_checksum", "world",
]
