"""The rewrite driver: worklist to a bounded fixpoint, checked and journaled rewrites.

Rules are visited only at their anchor op types (from the graph's op-type index); after a
rewrite, only its neighbourhood goes back on the worklist. Each rewrite is a transaction:
it is checked locally (inputs defined, topological order, known types preserved, schemas
exist, per-node ONNX inference succeeds) and rolled back if a check fails. The whole model
is validated once at the end; should that ever fail, the rules are replayed with a full
check after every rewrite, so the offending rewrite is found, rolled back and reported.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

import onnx

from .checks import validate
from .dsl import OpExpr, Pass, Rule
from .errors import GraphoptError, RewriteRejected
from .ir import Graph, Model
from .matching import Match, Miss, compiled_pattern
from .report import Report
from .rewrite import Rewriter, rewrite_in_place
from .vocabulary import domain_label

MAX_NEAR_MISSES = 50


class Engine:
    def __init__(self, rules: Sequence[Rule | Pass], *, explain: Sequence[str] = (),
                 max_rewrites: int | None = None, validate_each: bool = False):
        self.rules = list(rules)
        for rule in self.rules:
            if not isinstance(rule, (Rule, Pass)):
                raise GraphoptError(f"the engine runs Rule and Pass objects, not "
                                    f"{type(rule).__name__} {rule!r} (select rules by name "
                                    "with graphopt.select_rules)")
        explain = [explain] if isinstance(explain, str) else list(explain)
        for name in explain:
            if not isinstance(name, str):
                raise GraphoptError(f"explain: rule names are strings, not "
                                    f"{type(name).__name__} {name!r}")
        self.explain = set(explain)
        self.max_rewrites = max_rewrites
        self.validate_each = validate_each
        self._compiled = {id(r): compiled_pattern(r.match) for r in self.rules
                          if isinstance(r, Rule)}

    # ---- driver --------------------------------------------------------------------
    def run(self, model: Model, report: Report) -> None:
        levels = sorted({r.level for r in self.rules})
        changed = 0
        for rule in self.rules:
            if not _opset_ok(rule, model):
                report.gated[rule.name] = _opset_gate(rule, model)
        for i, level in enumerate(levels):
            rules = [r for r in self.rules if r.level == level and _opset_ok(r, model)]
            if i and changed:
                # the rules of this level see the facts a second optimize would see
                model.refresh_types()
            changed = 0
            for graph in list(model.graphs()):
                changed += self._run_level(model, graph, rules, report)
        # A pass states a graph-wide invariant (which nodes are backward, ...) that a later
        # level's rewrites can invalidate: passes of earlier levels get a last word.
        if len(levels) > 1:
            passes = [r for r in self.rules if isinstance(r, Pass) and r.level < levels[-1]
                      and _opset_ok(r, model)]
            for graph in list(model.graphs()):
                for rule in passes:
                    self._run_pass(model, graph, rule, report)

    def _run_level(self, model: Model, graph: Graph, rules, report: Report) -> int:
        """Passes and rules of one level until nothing changes; returns how many changes."""
        budget = self.max_rewrites or 4 * graph.node_count() + 1000
        passes = [r for r in rules if isinstance(r, Pass)]
        patterns = [r for r in rules if isinstance(r, Rule)]
        changes = 0
        for round_ in range(8):
            pass_changes = sum(self._run_pass(model, graph, p, report) for p in passes)
            changes += pass_changes
            # A node a rewrite made from computed inputs got types with unknown dims; once a
            # pass folds those inputs, inference knows more, and a rule that needs it (on a
            # Split's pieces, their shapes) can match now instead of in a second optimize.
            typed = model.refresh_types() if round_ else 0
            if round_ and not (pass_changes or typed):
                return changes  # the pattern worklist reached its fixpoint last round
            # another round while anything changed: a pass's result can be another pass's
            # input (fold_shapes makes the constants fold_constants folds further)
            rewrites = self._run_patterns(model, graph, patterns, report, budget)
            changes += rewrites
            if not passes or not (rewrites or pass_changes or typed):
                return changes
            if round_ == 7:
                report.warnings.append(
                    f"level {rules[0].level}: passes and rules still changing the graph after "
                    "8 rounds; stopped (the result is valid but may not be a fixpoint)")
        return changes

    def _run_pass(self, model: Model, graph: Graph, rule: Pass, report: Report) -> int:
        stats = report.stats(rule)
        start = time.perf_counter()
        graph.begin()
        try:
            changes = rule.run(graph, report)
            if changes and self.validate_each:
                validate(model)
        except GraphoptError:
            graph.rollback()
            raise
        except (RewriteRejected, onnx.checker.ValidationError,
                onnx.shape_inference.InferenceError) as exc:
            graph.rollback()
            stats.rollbacks += 1
            stats.rollback_reasons.append(str(exc).strip().splitlines()[0])
            changes = 0
        else:
            graph.commit()
        stats.candidates += 1
        stats.rewrites += changes
        stats.seconds += time.perf_counter() - start
        return changes

    def _run_patterns(self, model, graph: Graph, rules: list[Rule], report: Report,
                      budget: int) -> int:
        if not rules:
            return 0
        # (domain, op_type) -> (rule, compiled pattern, stats, explained?, generated matcher)
        # for the rules anchored there, everything the loop below needs per candidate
        by_anchor: dict[tuple[str, str], list[tuple]] = {}
        for rule in rules:
            compiled = self._compiled[id(rule)]
            stats, explained = report.stats(rule), rule.name in self.explain
            for key in compiled.anchor_types:
                # the matcher generated for this anchor type (None: a fan-out, matched at
                # the tensor the node reads)
                fast = compiled.fast_by_key[key](graph) if compiled.anchors_at_node else None
                by_anchor.setdefault(key, []).append((rule, compiled, stats, explained, fast))
        candidates = sorted({node_id for key in by_anchor
                             for node_id in graph.nodes_of_type(key[1], key[0])},
                            key=graph.order_of)
        queue = deque(candidates)
        queued = set(candidates)
        op_key = graph.op_key
        rewrites = 0
        tried: set = set()  # (rule, tensor) fan-out anchors that failed since the last rewrite
        while queue:
            node_id = queue.popleft()
            queued.discard(node_id)
            key = op_key(node_id)
            if key is None:
                continue  # removed by an earlier rewrite
            for rule, compiled, rule_stats, explained, fast in by_anchor[key]:
                if op_key(node_id) != key:
                    break  # removed, or replaced in place by another op: revisited as such
                if fast is not None:
                    anchor = node_id
                    rule_stats.candidates += 1
                    if explained:
                        found = None  # _try runs the matcher that says why it missed
                    else:
                        found = fast(node_id)
                        if found is None:
                            continue  # most candidates: rejected by the first checks
                else:  # a fan-out: anchored at the tensor the node reads
                    anchor = compiled.anchor_of(graph, node_id)
                    if anchor is None or (id(rule), anchor) in tried:
                        continue
                    tried.add((id(rule), anchor))
                    rule_stats.candidates += 1
                    found = None if explained else compiled.match(graph, anchor)
                    if isinstance(found, Miss):
                        continue
                    if found is not None:
                        bindings, roots = found
                        found = Match(graph, bindings, bindings.kinds, bindings.nodes, roots)
                start = time.perf_counter()
                touched = self._try(model, graph, rule, compiled, anchor, rule_stats, found)
                rule_stats.seconds += time.perf_counter() - start
                if touched is None:
                    continue
                rewrites += 1
                if tried:
                    tried.clear()
                # Only nodes some rule is anchored at are worth a visit; a node's op type
                # never changes, so filtering here is the same as filtering when popped.
                for neighbour in touched:
                    if neighbour not in queued and op_key(neighbour) in by_anchor:
                        queued.add(neighbour)
                        queue.append(neighbour)
                if rewrites >= budget:
                    report.warnings.append(
                        f"stopped after {rewrites} rewrites (budget {budget}); the graph is "
                        "valid but rules may still apply (possible rule cycle)")
                    return rewrites
        return rewrites

    def _try(self, model, graph, rule: Rule, compiled, anchor, stats, found=None):
        """Check and rewrite a match; returns the node ids to revisit, or None.

        ``found``: the Match found; None to run the matcher that records why a candidate
        misses (rules being explained)."""
        if found is None:
            found = compiled.match(graph, anchor)
            if isinstance(found, Miss):
                self._near_miss(graph, rule, anchor, found, stats)
                return None
            bindings, roots = found
            found = Match(graph, bindings, bindings.kinds, bindings.nodes, roots)
        m = found
        for constraint in rule.where:
            verdict = constraint(m)
            if verdict is not True and verdict is not None:
                reason = verdict if isinstance(verdict, str) else getattr(
                    constraint, "reason", "a where-constraint failed")
                self._near_miss(graph, rule, anchor, reason, stats)
                return None
        result = rule.rewrite(m)
        if result is None or isinstance(result, str):
            self._near_miss(graph, rule, anchor, result or "the rewrite declined", stats)
            return None
        if type(result) is OpExpr and not self.validate_each:
            # the commonest result, checked before anything changes: no journal needed
            try:
                touched = rewrite_in_place(model, graph, rule, m, result)
            except RewriteRejected as exc:
                self._rejected(graph, anchor, stats, exc)
                return None
            if touched is not None:
                stats.rewrites += 1
                return touched
        graph.begin()
        try:
            touched = Rewriter(model, graph, rule, m).apply(result)
            if self.validate_each:
                validate(model)
        except (RewriteRejected, onnx.checker.ValidationError,
                onnx.shape_inference.InferenceError) as exc:
            graph.rollback()
            self._rejected(graph, anchor, stats, exc)
            return None
        graph.commit()
        stats.rewrites += 1
        return touched

    @staticmethod
    def _rejected(graph, anchor, stats, exc) -> None:
        stats.rollbacks += 1
        stats.rollback_reasons.append(
            f"at {_anchor_label(graph, anchor)}: {str(exc).strip().splitlines()[0]}")

    def _near_miss(self, graph, rule, anchor, reason, stats) -> None:
        if rule.name in self.explain and len(stats.near_misses) < MAX_NEAR_MISSES:
            stats.near_misses.append({"at": _anchor_label(graph, anchor), "reason": str(reason)})


def _anchor_label(graph: Graph, anchor) -> str:
    if isinstance(anchor, str):
        return f"tensor '{anchor}'"
    if not graph.has_node(anchor):
        return "removed node"
    op_type, name = graph.op_key(anchor)[1], graph.name_of(anchor)
    return f"{op_type} '{name}'" if name else f"{op_type} #{anchor}"


def _opset_ok(rule, model: Model) -> bool:
    return all((model.opset(d) or 0) >= v for d, v in rule.min_opset.items())


def _opset_gate(rule, model: Model) -> str:
    needs = [f"opset {v} of '{domain_label(d)}' (the model has "
             f"{model.opset(d) or 'none'})"
             for d, v in sorted(rule.min_opset.items()) if (model.opset(d) or 0) < v]
    return "gated by opset: needs " + ", ".join(needs)


__all__ = ["Engine", "validate"]
