"""A NumPy session keeps the memory its run frees for the next run (executor/host_memory.py):
after the first runs, a step no longer faults its intermediates' pages back in. Page-fault
counts, not times: each case runs in a process of its own (the malloc settings are
process-wide)."""

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="glibc's malloc only")

# The `--example mqa` training step (batch 8): its intermediates, of many sizes between 4 KiB
# and 1 MiB, are allocated and freed at every step.
SCRIPT = textwrap.dedent("""
    import json, resource
    import numpy as np
    from graphopt.examples.mqa import MqaConfig, build_mqa_model
    from graphopt.executor import Session, host_memory
    from graphopt.trainer import build

    config = MqaConfig(vocab=56)
    graph = build(build_mqa_model(config), loss="cross_entropy", labels="labels")
    session = Session(graph.proto, device="cpu")
    ids = np.random.default_rng(0).integers(0, config.vocab, (8, config.seq))
    feeds = {"input_ids": ids, "labels": ids, **graph.initial}
    fetches = graph.losses + list(graph.grads.values())
    for _ in range(3):
        session.run(feeds, fetches)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        session.run(feeds, fetches)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5
    print(json.dumps({"faults": faults, "kept": host_memory.kept_bytes()}))
""")


def _run(**env_changes):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.update(env_changes)
    done = subprocess.run([sys.executable, "-P", "-c", SCRIPT], env=env, capture_output=True,
                          text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_repeated_run_faults_no_pages_back_in():
    kept = _run()
    assert kept["kept"] >= 64 << 20
    assert kept["faults"] < 20, kept
    # the same runs with glibc left alone fault every intermediate's pages in again
    released = _run(GRAPHOPT_KEEP_HOST_MEMORY="0")
    assert released["kept"] == 0
    assert released["faults"] > 150, released


@pytest.mark.parametrize("setting", [{"MALLOC_TRIM_THRESHOLD_": "131072"},
                                     {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}])
def test_the_users_own_malloc_settings_win(setting):
    assert _run(**setting)["kept"] == 0
