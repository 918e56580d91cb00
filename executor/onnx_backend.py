"""``onnx.backend.base.Backend`` over the executor, so onnx's node test suite runs on it.

``python -m graphopt.executor.onnx_backend --report`` prints pass/fail counts per op.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.backend.base import Backend, BackendRep

from graphopt.vocabulary import STANDARD_DOMAIN, normalize_domain

from .errors import ExecutorError
from .session import Session


def _as_array(value: Any) -> Any:
    return numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else value


class ExecutorRep(BackendRep):
    def __init__(self, session: Session):
        self.session = session

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        if isinstance(inputs, dict):
            feeds = {k: _as_array(v) for k, v in inputs.items()}
        else:
            if not isinstance(inputs, (list, tuple)):
                inputs = [inputs]
            feeds = dict(zip(self.session.input_names, map(_as_array, inputs), strict=False))
        results = self.session.run(feeds)
        return tuple(results[name] for name in self.session.output_names)


class ExecutorBackend(Backend):
    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        try:
            Session(model, device="cpu")
        except ExecutorError:
            return False
        return True

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> ExecutorRep:
        return ExecutorRep(Session(model, device="cpu" if device.upper() == "CPU" else "auto"))

    @classmethod
    def run_model(cls, model, inputs, device: str = "CPU", **kwargs: Any):
        return cls.prepare(model, device).run(inputs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper() == "CPU"


def _node_cases():
    from onnx.backend.test.loader import load_model_tests  # noqa: PLC0415

    return load_model_tests(kind="node")


def run_case(case) -> tuple[bool, str]:
    """Run one onnx node test case; (passed, reason)."""
    from onnx.backend.test.runner import Runner  # noqa: PLC0415

    try:
        rep = ExecutorBackend.prepare(case.model)
        for inputs, expected in case.data_sets:
            outputs = rep.run(inputs)
            expected = [_as_array(e) for e in expected]
            Runner.assert_similar_outputs(expected, list(outputs), rtol=case.rtol, atol=case.atol,
                                          model_dir=None)
    except Exception as exc:  # a report, not a test: every failure becomes a row
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}"
    return True, ""


def per_op_report(pattern: str | None = None, show_failures: bool = False) -> str:
    from .registry import supported_op_types  # noqa: PLC0415

    claimed = supported_op_types()
    rows: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    failures = []
    for case in _node_cases():
        if pattern and not re.search(pattern, case.name):
            continue
        op_types = {n.op_type for n in case.model.graph.node
                    if normalize_domain(n.domain) == STANDARD_DOMAIN}
        if not op_types or not op_types <= claimed:
            continue
        passed, reason = run_case(case)
        op = (case.model.graph.node[0].op_type if len(case.model.graph.node) == 1
              else "+".join(sorted(op_types)))
        rows[op][0 if passed else 1] += 1
        if not passed:
            failures.append(f"{case.name}: {reason}")
    lines = ["| Op | passed | failed |", "|---|---|---|"]
    for op in sorted(rows):
        lines.append(f"| {op} | {rows[op][0]} | {rows[op][1]} |")
    total_pass = sum(r[0] for r in rows.values())
    total_fail = sum(r[1] for r in rows.values())
    lines.append(f"\n{total_pass} passed, {total_fail} failed over {len(rows)} op groups.")
    if show_failures:
        lines.append("\nFailures:\n" + "\n".join(failures))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--report", action="store_true", help="per-op pass/fail table")
    parser.add_argument("--pattern", help="only test cases whose name matches this regex")
    parser.add_argument("--failures", action="store_true", help="list failing cases")
    args = parser.parse_args(argv)
    if not args.report:
        parser.print_help()
        return 0
    print(per_op_report(args.pattern, args.failures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
