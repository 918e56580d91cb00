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


# glibc's defaults: a freed block raises the mmap threshold to its size and the trim
# threshold to twice that, so three such blocks freed together are trimmed off the heap's top
# and the next round faults them in again; kept, the next round reuses them.
CHURN = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    from graphopt.executor import host_memory

    if sys.argv[1] == "keep":
        host_memory.keep_freed(None)
    def round_():
        blocks = [np.ones(600_000, np.float32) for _ in range(3)]  # 2.4 MB each
        del blocks
    for _ in range(3):
        round_()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(5):
        round_()
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5
    print(json.dumps({"faults": faults, "kept": host_memory.kept_bytes()}))
""")


def _run(script=SCRIPT, *args, **env_changes):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env.update(env_changes)
    done = subprocess.run([sys.executable, "-P", "-c", script, *args], env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_kept_memory_is_not_faulted_in_again():
    released = _run(CHURN, "default")
    assert released["faults"] > 500, released  # 1,140 pages a round on the test machine
    kept = _run(CHURN, "keep")
    assert kept["kept"] >= 64 << 20 and kept["faults"] < 20, kept


def test_a_numpy_session_keeps_what_its_runs_free():
    kept = _run()
    assert kept["kept"] >= 64 << 20
    assert kept["faults"] < 20, kept
    assert _run(GRAPHOPT_KEEP_HOST_MEMORY="0")["kept"] == 0


@pytest.mark.parametrize("setting", [{"MALLOC_TRIM_THRESHOLD_": "131072"},
                                     {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}])
def test_the_users_own_malloc_settings_win(setting):
    assert _run(**setting)["kept"] == 0
