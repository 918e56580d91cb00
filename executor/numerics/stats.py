"""Per-node FP16 denormal diagnostics, split forward / backward.

For each FP16 GEMM-class call we record:
  input_denormals   FP16 subnormal values among both operands;
  output_denormals  FP16 subnormal values in the result actually returned;
  mi200_flushes     what MI200's original implementation flushes: the input subnormals plus
                    the output subnormals before the output flush. When the call ran the
                    alternate (or native) path the output part is estimated from that
                    path's output; on real MI200 hardware the pre-flush output is not
                    observable, so only inputs count there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

PHASES = ("forward", "backward")
UNNAMED_NODE = "<unnamed>"


@dataclass
class DenormalCounts:
    calls: int = 0
    original_calls: int = 0
    alternate_calls: int = 0
    input_values: int = 0
    output_values: int = 0
    input_denormals: int = 0
    output_denormals: int = 0
    mi200_flushes: int = 0

    def add(self, other: DenormalCounts) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)


class DenormalStats:
    def __init__(self):
        self._nodes: dict[str, dict[str, DenormalCounts]] = {}

    def record(self, node: str | None, backward: bool, call: DenormalCounts) -> None:
        phases = self._nodes.setdefault(node or UNNAMED_NODE, {p: DenormalCounts() for p in PHASES})
        phases["backward" if backward else "forward"].add(call)

    def report(self) -> dict:
        """``{"nodes": {node: {"forward": counts, "backward": counts}}, "totals": {...}}``."""
        totals = {p: DenormalCounts() for p in PHASES}
        nodes = {}
        for name, phases in self._nodes.items():
            nodes[name] = {p: asdict(phases[p]) for p in PHASES}
            for p in PHASES:
                totals[p].add(phases[p])
        return {"nodes": nodes, "totals": {p: asdict(totals[p]) for p in PHASES}}


def format_denormal_table(report: dict, top: int = 10) -> str:
    """The ``top`` nodes by MI200 flush count (forward + backward) as a text table."""
    nodes = report.get("nodes", {})

    def flushes(item):
        name, phases = item
        return (-(phases["forward"]["mi200_flushes"] + phases["backward"]["mi200_flushes"]), name)

    rows = sorted(nodes.items(), key=flushes)[:top]
    width = max([len("node")] + [len(name) for name, _ in rows])
    columns = ("in", "out", "flush")
    header = (
        f"{'node':<{width}}  "
        + "  ".join(f"{'fwd ' + c:>10}" for c in columns)
        + "  "
        + "  ".join(f"{'bwd ' + c:>10}" for c in columns)
    )
    lines = [f"FP16 denormals, worst {len(rows)} of {len(nodes)} nodes", header, "-" * len(header)]
    for name, phases in rows:
        cells = []
        for p in PHASES:
            c = phases[p]
            cells += [c["input_denormals"], c["output_denormals"], c["mi200_flushes"]]
        lines.append(f"{name:<{width}}  " + "  ".join(f"{v:>10}" for v in cells))
    lines.append(LEGEND)
    return "\n".join(lines)


# what the columns count; "flush" can exceed in + out: where the original path ran, the
# result it returned had its subnormals flushed already ("out" 0), the count before did not
LEGEND = ("in: FP16 subnormals among the operands; out: in the result returned; flush: what "
          "MI200's original FP16 path flushes to zero, the operands' plus the result's before "
          "that flush (more than in + out where the original path ran and returned the "
          "flushed result)")
