"""Data-parallel ``graphopt run --distributed``, run for real: 2 ranks on CPU under
``mpiexec`` (the mpich wheel's) in subprocesses, plus in-process unit tests of the pieces
that need no MPI (sharding, bucket planning)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from support.mpi import MPIEXEC, needs_mpi
from support.training_runs import MLP, mlp_data, mlp_with_dynamic_batch, write_npz

from graphopt.errors import GraphoptError
from graphopt.trainer import RunOptions, run
from graphopt.trainer import checkpoint as ckpt
from graphopt.trainer.data import Batches
from graphopt.trainer.distributed import ShardedBatches, plan_buckets

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "worker.py")





def mpiexec(ranks: int, *args, extra=(), timeout=60):
    command = [MPIEXEC, *extra, "-n", str(ranks), sys.executable, *args]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - started


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The test MLP with a symbolic batch dimension (the fixture's is fixed at 4) and data."""
    folder = tmp_path_factory.mktemp("dist")
    return mlp_with_dynamic_batch(folder), write_npz(folder / "d.npz",
                                                      mlp_data(samples=48, seed=2))


def single_rank(model, data, **overrides):
    base = dict(model=model, data=data, loss="cross_entropy", batch_size=8, steps=12,
                seed=4, device="cpu", quiet=True)
    return run(RunOptions(**{**base, **overrides})).result


def read_weights(path):
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}


def cli(model, data, *args):
    return ["-P", "-m", "graphopt.cli", "run", model, "--data", data, "--loss", "cross_entropy",
            "--batch-size", "8", "--seed", "4", "--device", "cpu", "--distributed",
            "--dist-check-every", "1", *args]


# -- equivalence: 2 ranks x B/2 == 1 rank x B -------------------------------------------------
@needs_mpi
@pytest.mark.parametrize("optimizer,lr,extra", [
    ("sgd", "0.1", ()),                                      # one 25 MiB bucket
    ("sgd", "0.1", ("--no-dist-overlap",)),                  # all-reduce after backward
    ("adamw", "0.01", ("--bucket-mb", "0.002")),             # 3 buckets of ~2 KB
])
def test_two_ranks_equal_one_rank_with_the_whole_batch(tmp_path, files, optimizer, lr, extra):
    model, data = files
    out, log = str(tmp_path / "out.onnx"), str(tmp_path / "log.csv")
    done, _ = mpiexec(2, *cli(model, data, "--steps", "12", "--optimizer", optimizer,
                              "--lr", lr, *extra, "-o", out, "--log", log))
    assert done.returncode == 0, done.stderr
    assert "data parallel over 2 ranks (4 samples per rank per step)" in done.stdout
    buckets = "3 gradient bucket(s)" if "--bucket-mb" in extra else "1 gradient bucket(s)"
    assert buckets in done.stdout
    assert done.stdout.count("step 12/12") == 1          # only rank 0 reports
    assert len(open(log).read().splitlines()) == 1 + 12  # header + one row per global step
    reference = single_rank(model, data, optimizer=optimizer, lr=float(lr))
    got = read_weights(out)
    for name, value in reference.params.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


@needs_mpi
def test_two_ranks_accumulating_equal_one_rank_accumulating(tmp_path, files):
    """--grad-accum 2 over 2 ranks: each micro-batch's gradients all-reduced, their mean
    applied once per step, as one rank accumulating the same micro-batches."""
    model, data = files
    out = str(tmp_path / "out.onnx")
    done, _ = mpiexec(2, *cli(model, data, "--steps", "6", "--optimizer", "adamw", "--lr",
                              "0.01", "--grad-accum", "2", "-o", out, "-q"))
    assert done.returncode == 0, done.stderr
    reference = single_rank(model, data, optimizer="adamw", lr=0.01, steps=6, grad_accum=2)
    got = read_weights(out)
    for name, value in reference.params.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


@needs_mpi
def test_resume_restarts_the_whole_job_from_the_last_checkpoint(tmp_path, files):
    """2 ranks stop at step 6 (checkpoint by rank 0); 2 ranks resume to 12 == 1 rank x 12."""
    model, data = files
    folder, out = str(tmp_path / "ckpt"), str(tmp_path / "out.onnx")
    first, _ = mpiexec(2, *cli(model, data, "--steps", "6", "--optimizer", "adamw",
                               "--lr", "0.01", "--checkpoint", folder, "-q"))
    assert first.returncode == 0, first.stderr
    assert ckpt.load(folder).step == 6
    # a bare resume: rank 0 reads the run's options from the checkpoint and sends them
    second, _ = mpiexec(2, *cli(model, data, "--steps", "12", "--checkpoint", folder,
                                "--resume", "-o", out))
    assert second.returncode == 0, second.stderr
    assert "resumed from" in second.stdout and "at step 6" in second.stdout
    reference = single_rank(model, data, optimizer="adamw", lr=0.01)
    got = read_weights(out)
    for name, value in reference.params.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    history = ckpt.load(folder).history
    assert [r["step"] for r in history] == list(range(1, 13))
    np.testing.assert_allclose([r["loss"] for r in history], reference.losses, rtol=1e-5)


@needs_mpi
def test_every_rank_keeps_rank_0s_batch_norm_statistics(tmp_path):
    """Each rank normalises by its own share of the batch; the running statistics are rank
    0's everywhere afterwards, as DistributedDataParallel broadcasts its buffers."""
    fixture = os.path.join(os.path.dirname(MLP), "cnn_bn_ts17.onnx")
    rng = np.random.default_rng(8)
    data = write_npz(tmp_path / "d.npz", {
        "x": rng.standard_normal((32, 2, 8, 8)).astype(np.float32),
        "labels": rng.integers(0, 5, 32).astype(np.int64)})
    done, _ = mpiexec(2, WORKER, "batchnorm", str(tmp_path), fixture, data)
    assert done.returncode == 0, done.stderr
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in (0, 1)]
    initial = read_weights(fixture)
    statistics = [k for k in ranks[0].files if k.startswith("buffer/")]
    assert len(statistics) == 4
    for key in ranks[0].files:
        np.testing.assert_array_equal(ranks[1][key], ranks[0][key], err_msg=key)
    for key in statistics:
        assert not np.allclose(ranks[0][key], initial[key.removeprefix("buffer/")]), key


# -- overflow agreement ---------------------------------------------------------------------
@needs_mpi
def test_one_ranks_overflow_skips_the_step_on_every_rank(tmp_path, files):
    """Rank 1 alone: an inf gradient at step 3, a local overflow verdict at step 6. Both ranks
    skip both steps, halve the loss scale alike and end with bit-identical weights."""
    model, data = files
    done, _ = mpiexec(2, WORKER, "overflow", str(tmp_path), model, data, "30")
    assert done.returncode == 0, done.stderr
    ranks = [np.load(tmp_path / f"rank{r}.npz") for r in (0, 1)]
    histories = [json.loads(str(r["__history__"])) for r in ranks]
    for history in histories:
        assert [r["step"] for r in history if not r["applied"]] == [3, 6]
        assert [r["loss_scale"] for r in history] == [1024] * 3 + [512] * 3 + [256] * 3
        assert history[-1]["skipped"] == 2
    strip = ("seconds",)
    assert [{k: v for k, v in r.items() if k not in strip} for r in histories[0]] == \
        [{k: v for k, v in r.items() if k not in strip} for r in histories[1]]
    # the single 25 MiB bucket started inside the executor run (overlap), every step
    assert ranks[0]["__launched__"].tolist() == [9, 9]
    for name in ranks[0].files:
        if not name.startswith("__"):
            np.testing.assert_array_equal(ranks[0][name], ranks[1][name], err_msg=name)


# -- a dead or hung rank --------------------------------------------------------------------
@needs_mpi
@pytest.mark.parametrize("scenario,extra", [
    # hydra's default would tear the job down itself when a rank exits (with the dead rank's
    # status, 0 for os._exit(0)); -disable-auto-cleanup leaves rank 0 to find out on its own
    ("die", ("-disable-auto-cleanup",)),
    ("hang", ()),   # alive but silent: only the deadline can end this; MPI_Abort kills rank 1
])
def test_a_missing_rank_is_named_and_the_job_aborts(tmp_path, files, scenario, extra):
    model, data = files
    timeout = 2.0
    done, seconds = mpiexec(2, WORKER, scenario, str(tmp_path), model, data, str(timeout),
                            extra=extra, timeout=45)
    assert done.returncode == 124, (done.returncode, done.stderr)
    assert "[rank 0/2] rank 1 did not reach step 4 within 2 s" in done.stderr
    assert "aborting the job" in done.stderr
    assert seconds < 20   # start-up + 3 steps + the 2 s deadline + a 1 s who-is-there grace
    assert not (tmp_path / "rank0.npz").exists()


@needs_mpi
def test_an_error_on_one_rank_aborts_the_job_at_once(tmp_path, files):
    model, data = files
    done, seconds = mpiexec(2, WORKER, "error", str(tmp_path), model, data, "30", timeout=45)
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "graphopt: error: [rank 1/2] injected failure on rank 1" in done.stderr
    assert seconds < 15   # not the 30 s deadline: the failing rank aborts the job itself


# -- in-process pieces ----------------------------------------------------------------------
def test_shards_tile_the_global_batch():
    arrays = {"x": np.arange(40, dtype=np.float32)[:, None], "y": np.arange(40)}
    whole = Batches(arrays, ["x", "y"], 8, seed=3)
    shards = [ShardedBatches(arrays, ["x", "y"], 8, 3, None, r, 4) for r in range(4)]
    assert all(s.batch_size == 8 and s.local_batch == 2 for s in shards)
    assert shards[0].steps_per_epoch == whole.steps_per_epoch == 5
    for step in (0, 4, 5, 11):  # across epochs: the same global order on every rank
        pieces = [s.batch(step)["y"] for s in shards]
        np.testing.assert_array_equal(np.concatenate(pieces), whole.batch(step)["y"])


def test_sharding_refuses_an_indivisible_or_fixed_batch():
    arrays = {"x": np.zeros((40, 3), np.float32)}
    with pytest.raises(GraphoptError, match="divisible by the 3 ranks"):
        ShardedBatches(arrays, ["x"], 8, 0, None, 0, 3)
    with pytest.raises(GraphoptError, match="with 2 ranks use --batch-size 8"):
        ShardedBatches(arrays, ["x"], 16, 0, {"x": (np.dtype(np.float32), [4, 3])}, 0, 2)


def test_buckets_follow_gradient_production_order_and_size_limit():
    shapes = {"a": (10,), "b": (1000,), "c": (20,), "d": (30,), "e": (5,)}
    produced = {"a": 9, "b": 3, "c": 5, "d": 2}   # e: no producer (filled after the run)
    buckets = plan_buckets(list(shapes), shapes, produced, bucket_bytes=4 * 60)
    assert [b.params for b in buckets] == [["d"], ["b"], ["c", "a"], ["e"]]
    assert [b.ready_at for b in buckets] == [2, 3, 9, float("inf")]
    assert buckets[2].offsets == [0, 20] and buckets[2].numel == 30


def test_distributed_options_need_distributed(files):
    model, data = files
    with pytest.raises(GraphoptError, match="--bucket-mb only apply with --distributed"):
        run(RunOptions(model=model, data=data, loss="cross_entropy", bucket_mb=1.0))


@pytest.mark.gpu
def test_nccl_transport_single_rank_allreduce():
    """The CuPy NCCL path with one rank, float32 and FP16 buckets (bucket sum == itself,
    divided in float32 on the device, finite flag on the device)."""
    cupy = pytest.importorskip("cupy")
    from cupy.cuda import nccl  # imports even without libnccl: ``available`` says

    if not nccl.available:
        pytest.skip("CuPy finds no NCCL library")
    if cupy.cuda.runtime.getDeviceCount() == 0:
        pytest.skip("no GPU")
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("needs mpi4py")
    code = (
        "import cupy, numpy as np\n"
        "from graphopt.executor.backend import select_backend\n"
        "from graphopt.trainer import distributed as d\n"
        "comm = d.world(30)\n"
        "t = d.NcclTransport(comm, select_backend('auto'))\n"
        "for dtype in (np.float32, np.float16):\n"
        "    b = t.buffer(6, dtype); t.stage(b, 0, cupy.arange(6, dtype=cupy.float16))\n"
        "    h = t.start(b); comm.wait(lambda: t.done([h]), 1, 'test')\n"
        "    grads, ok = t.finish(b, 2.0)\n"
        "    assert isinstance(grads, cupy.ndarray) and grads.dtype == np.float32\n"
        "    assert bool(ok) and np.allclose(grads.get(), np.arange(6) / 2), grads\n"
        "print('ok', t.name)\n")
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr


@needs_mpi
def test_gpu_job_without_usable_nccl_falls_back_to_mpi_and_says_why():
    """A GPU backend whose CuPy lacks NCCL (or has no CuPy at all) all-reduces over MPI;
    before, rank 0 died on ``nccl.get_unique_id`` (the module imports without libnccl)."""
    code = (
        "import numpy as np\n"
        "from graphopt.executor.backend import ArrayBackend\n"
        "from graphopt.trainer import distributed as d\n"
        "comm = d.world(30)\n"
        "t = d.make_transport(comm, ArrayBackend('cuda', np))\n"
        "print(type(t).__name__, '|', t.name)\n")
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    kind, name = done.stdout.strip().split(" | ")
    try:
        from cupy.cuda import nccl
        usable = nccl.available
    except ImportError:
        usable = False
    if usable:
        pytest.skip("NCCL is usable here")
    assert kind == "MpiTransport"
    assert "not NCCL" in name and ("NCCL library" in name or "does not import" in name)
