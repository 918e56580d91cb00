"""Mutation testing with mutmut: do the tests notice when the code behind a promise is wrong?

mutmut (a maintained tool, https://github.com/boxed/mutmut) writes every small change its
operators know (a flipped comparison, an off-by-one constant, a dropped argument, a ``None``
for a value, a changed string) into each function of the modules named, and runs, for each
one, the tests that call that function. A mutant no test notices is a *survivor*: either a
hole in the tests, or an *equivalent* mutant (a change that cannot alter behaviour), which is
recorded in ``tools/mutation_equivalents.toml`` with the reason.

mutmut names a mutant after the module it imports it as, so it runs on a copy of the sources
in the installed package's layout (``graphopt/``, with ``rules/``, ``executor/``, ``trainer/``
and ``cli.py`` inside it, as the wheel holds them): one folder per area under
``build/mutation/``, never the working tree. The tests run from the copy too. mutmut
switches mutants inside the test process, so only tests that call the code in-process can
kill them (the CLI tests do: click's runner); a test that runs ``graphopt`` in a subprocess
runs the original code. For each mutant only the area's tests that call the mutated function
run (mutmut records which do once, before the mutants).

Not part of CI (an area takes from seconds to tens of minutes on 2 cores):

    python tools/mutation.py --list                    # the areas and their modules
    python tools/mutation.py shape-rules               # one area (several may be named)
    python tools/mutation.py checkpoint --jobs 2
    python tools/mutation.py shape-rules --show        # and the diff of every survivor
    python tools/mutation.py modelio --report          # the last run's figures again

It needs ``pip install mutmut==3.8.1`` in the environment that runs the tests. Each run
prints, per module, the mutants, those killed, the equivalent ones, the survivors and the kill
rate (killed / (mutants - equivalent); a mutant no test reaches counts as a survivor), and
writes the same to ``build/mutation/<area>/report.txt``. An equivalent entry whose diff no
longer matches its mutant (the code moved on) is reported as stale and counts as a survivor.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENTS = ROOT / "tools" / "mutation_equivalents.toml"
WORK = ROOT / "build" / "mutation"
# where each source folder lives in the installed package (setup.cfg's package_dir, setup.py)
PACKAGE_PLACES = {"graphopt": "graphopt", "rules": "graphopt/rules",
                  "executor": "graphopt/executor", "trainer": "graphopt/trainer",
                  "cli.py": "graphopt/cli.py"}


@dataclass(frozen=True)
class Area:
    sources: tuple[str, ...]   # repository paths (files or folders)
    tests: tuple[str, ...]     # the test files and folders whose tests may kill them
    about: str


AREAS: dict[str, Area] = {
    "shape-rules": Area(("rules/fold_shapes.py", "rules/shape_of_transpose.py",
                         "rules/remove_identity.py", "rules/shape_dims_from_source.py"),
                        ("tests/rules/test_fold_shapes.py",
                         "tests/rules/test_shape_of_transpose.py",
                         "tests/rules/test_remove_identity.py",
                         "tests/rules/test_shape_dims_from_source.py"),
                        "the shape rules: what is static, what a Shape/Size folds to"),
    "rules": Area(("rules",), ("tests/rules",), "every rewrite rule"),
    "modelio": Area(("graphopt/modelio.py",),
                    ("tests/ir/test_modelio.py", "tests/cli/test_cli.py",
                     "tests/robustness/test_reliability_file_guards.py",
                     "tests/robustness/test_reliability_data_loss.py"),
                    "reading and writing models: the output-path guard, atomic writes, "
                    "external data, refusals"),
    "training": Area(("graphopt/training",), ("tests/training",),
                     "the training graph: gradients, parameters, YieldOp, metadata"),
    "history": Area(("trainer/history.py",), ("tests/trainer/test_history.py",),
                    "the bounded loss history: merged rows, their counts and means"),
    "checkpoint": Area(("trainer/checkpoint.py",),
                       ("tests/trainer/test_resume.py", "tests/trainer/test_history.py",
                        "tests/robustness/test_reliability_checkpoints.py",
                        "tests/robustness/test_reliability_training_state.py",
                        "tests/robustness/test_run_faults.py"),
                       "checkpoints: atomic saves, validation, resume"),
    "trainer": Area(("trainer",), ("tests/trainer", "tests/robustness"),
                    "the training loop, options, optimizers, schedules, loss scaling"),
    "cli": Area(("cli.py",), ("tests/cli",), "the command line"),
    "numerics": Area(("executor/numerics",), ("tests/executor",),
                     "the FP16 policy and the MI200 emulation"),
}
KILLED = {"killed", "timeout", "segfault"}       # a test failed, hung or crashed: noticed
PYTEST_SECTION = re.compile(r"^\[tool\.pytest\.ini_options\]\n(?:(?!^\[).*\n?)*", re.M)


def package_path(repo_path: str) -> str:
    """Where a repository path sits in the installed package (rules/x.py ->
    graphopt/rules/x.py)."""
    head, _, rest = repo_path.partition("/")
    place = PACKAGE_PLACES.get(head)
    if place is None:
        raise SystemExit(f"mutation: {repo_path} is not part of the graphopt package")
    return f"{place}/{rest}" if rest else place


def stage(area_name: str, area: Area) -> Path:
    """A fresh copy of the package and the tests in the installed layout, with mutmut's
    configuration for ``area``."""
    folder = WORK / area_name
    if folder.exists():
        shutil.rmtree(folder)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for repo_path, place in PACKAGE_PLACES.items():
        source, target = ROOT / repo_path, folder / place
        if source.is_dir():
            shutil.copytree(source, target, ignore=ignore)
        else:
            shutil.copy2(source, target)
    shutil.copytree(ROOT / "tests", folder / "tests", ignore=ignore)
    pytest_section = PYTEST_SECTION.search((ROOT / "pyproject.toml").read_text())
    sources = [package_path(p) for p in area.sources]
    config = ("[tool.mutmut]\n"
              f"source_paths = {json.dumps(sources)}\n"
              f"pytest_add_cli_args_test_selection = {json.dumps(list(area.tests))}\n"
              'also_copy = ["graphopt/", "tests/"]\n\n'
              + (pytest_section.group(0) if pytest_section else ""))
    (folder / "pyproject.toml").write_text(config)
    return folder


def mutmut(folder: Path, *args: str, capture: bool = True) -> str:
    done = subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=folder, text=True,
                          capture_output=capture)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout or "").strip().splitlines()[-5:]
        raise SystemExit(f"mutation: mutmut {' '.join(args)} failed in {folder}: "
                         + " | ".join(tail))
    return done.stdout if capture else ""


def results(folder: Path) -> dict[str, str]:
    """mutant name -> its status (killed, survived, no tests, timeout, ...)."""
    out = {}
    for line in mutmut(folder, "results", "--all", "true").splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and "__mutmut_" in name:
            out[name] = status.strip()
    return out


def changed_line(folder: Path, name: str) -> str:
    """The mutant's new line (the diff's ``+`` line), stripped: what an equivalent entry
    records, so that an entry for a mutant the code no longer has is seen as stale."""
    diff = mutmut(folder, "show", name)
    added = [line[1:].strip() for line in diff.splitlines()
             if line.startswith("+") and not line.startswith("+++")]
    return " / ".join(added)


def equivalents() -> dict[str, dict]:
    if not EQUIVALENTS.exists():
        return {}
    entries = tomllib.loads(EQUIVALENTS.read_text()).get("equivalent", [])
    return {entry["mutant"]: entry for entry in entries}


def module_of(name: str) -> str:
    return name.split(".x_")[0].split(".xǁ")[0]


def report(area_name: str, folder: Path, statuses: dict[str, str], show: bool) -> str:
    known = equivalents()
    rows: dict[str, Counter] = defaultdict(Counter)
    survivors, stale = [], []
    for name, status in sorted(statuses.items()):
        module = module_of(name)
        rows[module]["mutants"] += 1
        if status in KILLED:
            rows[module]["killed"] += 1
            continue
        entry = known.get(name)
        if entry is not None:
            if changed_line(folder, name) == entry["line"]:
                rows[module]["equivalent"] += 1
                continue
            stale.append(name)
        rows[module]["survived"] += 1
        survivors.append((name, status))
    lines = [f"mutation testing, area {area_name} ({AREAS[area_name].about})",
             f"{'module':48} {'mutants':>7} {'killed':>7} {'equiv.':>7} {'survived':>8} "
             f"{'kill rate':>9}"]
    total = Counter()
    for module, row in sorted(rows.items()):
        total.update(row)
        lines.append(_row(module, row))
    if len(rows) > 1:
        lines.append(_row("all", total))
    for name in stale:
        lines.append(f"stale equivalent entry (its mutant changed): {name}")
    lines.append(f"survivors: {len(survivors)}"
                 + (" (python tools/mutation.py AREA --show for their diffs)"
                    if survivors and not show else ""))
    for name, status in survivors:
        lines.append(f"  {name}: {status}")
        if show:
            lines.extend("      " + line for line in mutmut(folder, "show", name).splitlines()
                         if line.startswith(("+", "-")) and not line.startswith(("+++", "---")))
    return "\n".join(lines)


def _row(module: str, row: Counter) -> str:
    considered = row["mutants"] - row["equivalent"]
    rate = f"{100 * row['killed'] / considered:.1f}%" if considered else "-"
    return (f"{module:48} {row['mutants']:7} {row['killed']:7} {row['equivalent']:7} "
            f"{row['survived']:8} {rate:>9}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("areas", nargs="*", metavar="AREA", help=", ".join(AREAS))
    parser.add_argument("--list", action="store_true", help="list the areas")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="mutants tested at once (default: the CPU count)")
    parser.add_argument("--show", action="store_true", help="print each survivor's diff")
    parser.add_argument("--report", action="store_true",
                        help="report the area's last run again (after an interrupted run: "
                             "the mutants it tested) without running anything")
    args = parser.parse_args(argv)
    if args.list or not args.areas:
        for name, area in AREAS.items():
            print(f"{name:12} {', '.join(area.sources)}  [tests: {', '.join(area.tests)}]"
                  f"\n{'':12} {area.about}")
        return 0
    unknown = [a for a in args.areas if a not in AREAS]
    if unknown:
        parser.error(f"unknown area {unknown[0]!r}; the areas: {', '.join(AREAS)}")
    for name in args.areas:
        folder = WORK / name
        if not args.report:
            folder = stage(name, AREAS[name])
            print(f"mutation: {name}: mutmut run in {folder}", flush=True)
            mutmut(folder, "run", "--max-children", str(args.jobs))
        elif not (folder / "mutants").is_dir():
            parser.error(f"no earlier run of {name} in {folder}")
        statuses = {n: s for n, s in results(folder).items() if s != "not checked"}
        text = report(name, folder, statuses, args.show)
        (folder / "report.txt").write_text(text + "\n")
        print(text, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
