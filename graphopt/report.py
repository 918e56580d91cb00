"""What the optimizer did, per rule: for people (a table) and for tools (JSON)."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class RuleStats:
    name: str
    kind: str
    level: int
    candidates: int = 0
    rewrites: int = 0
    rollbacks: int = 0
    seconds: float = 0.0
    rollback_reasons: list[str] = field(default_factory=list)
    near_misses: list[dict] = field(default_factory=list)


@dataclass
class Report:
    model: str = ""
    rules: dict[str, RuleStats] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    gated: dict[str, str] = field(default_factory=dict)  # rule name -> why it did not run
    nodes_before: int = 0
    nodes_after: int = 0
    seconds: float = 0.0
    validation_seconds: float = 0.0
    validated: bool = False
    op_types_before: dict[str, int] = field(default_factory=dict)   # op type -> nodes
    op_types_after: dict[str, int] = field(default_factory=dict)
    written: list[str] = field(default_factory=list)   # files the save published

    def stats(self, rule) -> RuleStats:
        if rule.name not in self.rules:
            self.rules[rule.name] = RuleStats(rule.name, rule.kind, rule.level)
        return self.rules[rule.name]

    @property
    def total_rewrites(self) -> int:
        return sum(s.rewrites for s in self.rules.values())

    @property
    def fired(self) -> list[str]:
        return [s.name for s in self.rules.values() if s.rewrites]

    @property
    def op_type_changes(self) -> dict[str, dict[str, int]]:
        """Op types whose count changed: ``{"Split": {"before": 0, "after": 1}, ...}``."""
        before, after = self.op_types_before, self.op_types_after
        return {op: {"before": before.get(op, 0), "after": after.get(op, 0)}
                for op in sorted(set(before) | set(after))
                if before.get(op, 0) != after.get(op, 0)}

    def format_op_types(self) -> str:
        """One line: what disappeared, what appeared, what changed in number."""
        changes = self.op_type_changes
        if not changes:
            return "op types: unchanged"
        gone = [f"{op} {c['before']}" for op, c in changes.items() if not c["after"]]
        new = [f"{op} {c['after']}" for op, c in changes.items() if not c["before"]]
        fewer_more = [f"{op} {c['before']} -> {c['after']}" for op, c in changes.items()
                      if c["before"] and c["after"]]
        parts = ([f"removed {', '.join(gone)}"] if gone else []) + \
                ([f"added {', '.join(new)}"] if new else []) + \
                ([f"changed {', '.join(fewer_more)}"] if fewer_more else [])
        return "op types: " + "; ".join(parts)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["op_type_changes"] = self.op_type_changes
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False)

    def format_table(self) -> str:
        header = ("rule", "level", "candidates", "rewrites", "rollbacks", "ms")
        rows = [(s.name, str(s.level), str(s.candidates), str(s.rewrites), str(s.rollbacks),
                 f"{s.seconds * 1e3:.1f}") for s in self.rules.values()]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(row, widths, strict=True)))
                 for row in [header, *rows]]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append("")
        lines.append(f"nodes: {self.nodes_before} -> {self.nodes_after}; "
                     f"rewrites: {self.total_rewrites}; "
                     f"time: {self.seconds * 1e3:.1f} ms"
                     + (f" (validation {self.validation_seconds * 1e3:.1f} ms)"
                        if self.validated else ""))
        lines.append(self.format_op_types())
        fired = self.fired
        lines.append("fired: " + (", ".join(fired) if fired else "none"))
        for stats in self.rules.values():
            for reason in stats.rollback_reasons:
                lines.append(f"rolled back ({stats.name}): {reason}")
        lines.extend(f"warning: {w}" for w in self.warnings)
        return "\n".join(lines)

    def format_explain(self, rule_name: str) -> str:
        stats = self.rules.get(rule_name)
        if stats is None:
            why = self.gated.get(rule_name, "not selected")
            return f"{rule_name}: did not run: {why}"
        if not stats.near_misses:
            return (f"{rule_name}: {stats.candidates} candidate(s), {stats.rewrites} rewrite(s), "
                    "no near misses")
        lines = [f"{rule_name}: {stats.candidates} candidate(s), {stats.rewrites} rewrite(s); "
                 "why it did not match:"]
        lines += [f"  at {miss['at']}: {miss['reason']}" for miss in stats.near_misses]
        return "\n".join(lines)
