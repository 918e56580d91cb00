"""The rewrite driver: worklist to a bounded fixpoint, checked and journaled rewrites.

Rules are visited only at their anchor op types (from the graph's op-type index); after a
rewrite, only its neighbourhood goes back on the worklist. Each rewrite is a transaction:
it is checked locally (inputs defined, topological order, known types preserved, schemas
exist, per-node ONNX inference succeeds) and rolled back if a check fails. The whole model
is validated once at the end; should that ever fail, the rules are replayed with a full
check after every rewrite, so the offending rewrite is found, rolled back and reported.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from .dsl import NewConstant, OpExpr, OpOutput, Pass, Rule
from .errors import GraphoptError, RewriteRejected
from .ir import (
    MS_DOMAIN,
    STANDARD_DOMAIN,
    Graph,
    Model,
    PendingNode,
    has_subgraphs,
    node_template,
)
from .match import CompiledPattern, Match, Miss, TensorView
from .report import Report
from .vocabulary import BACKWARD_PASS_ATTRIBUTE, STANDARD_DOMAIN_ALIAS, domain_label

STICKY_ATTRIBUTES = (BACKWARD_PASS_ATTRIBUTE,)
MAX_NEAR_MISSES = 50


class Engine:
    def __init__(self, rules: Sequence[Rule | Pass], *, explain: Sequence[str] = (),
                 max_rewrites: int | None = None, validate_each: bool = False):
        self.rules = list(rules)
        self.explain = set(explain)
        self.max_rewrites = max_rewrites
        self.validate_each = validate_each
        self._compiled = {id(r): CompiledPattern(r.match) for r in self.rules
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
        budget = self.max_rewrites or 4 * len(graph.nodes) + 1000
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
                _validate_model(model)
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
                             for node_id in graph.by_type.get(key, ())},
                            key=graph.order.__getitem__)
        queue = deque(candidates)
        queued = set(candidates)
        op_keys = graph.op_keys
        rewrites = 0
        tried: set = set()  # (rule, tensor) fan-out anchors that failed since the last rewrite
        while queue:
            node_id = queue.popleft()
            queued.discard(node_id)
            key = op_keys.get(node_id)
            if key is None:
                continue  # removed by an earlier rewrite
            for rule, compiled, rule_stats, explained, fast in by_anchor[key]:
                if op_keys.get(node_id) != key:
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
                    found = None if explained else compiled.full_match(graph, anchor)
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
                    if neighbour not in queued and op_keys.get(neighbour) in by_anchor:
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
                touched = _rewrite_single(model, graph, rule, m, result)
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
                _validate_model(model)
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
    node = graph.nodes.get(anchor)
    if node is None:
        return "removed node"
    return f"{node.op_type} '{node.name}'" if node.name else f"{node.op_type} #{anchor}"


def _opset_ok(rule, model: Model) -> bool:
    return all((model.opset(d) or 0) >= v for d, v in rule.min_opset.items())


def _opset_gate(rule, model: Model) -> str:
    needs = [f"opset {v} of '{domain_label(d)}' (the model has "
             f"{model.opset(d) or 'none'})"
             for d, v in sorted(rule.min_opset.items()) if (model.opset(d) or 0) < v]
    return "gated by opset: needs " + ", ".join(needs)


_CWD_LOCK = threading.Lock()


def _validate_model(model: Model) -> None:
    proto = model.flush()
    if model.base_dir and model.has_external_data():
        # The checker finds external data relative to the working directory when it is given
        # a proto rather than a path; the model's own folder is the right base.
        with _CWD_LOCK, contextlib.chdir(model.base_dir):
            onnx.checker.check_model(proto)
    else:
        onnx.checker.check_model(proto)
    onnx.shape_inference.infer_shapes(proto, strict_mode=True)


def _rewrite_single(model: Model, graph: Graph, rule: Rule, m: Match, expr: OpExpr):
    """Rewriter.apply for the commonest result, straight-line: one new node from matched
    tensors taking the single-output root's place (its id, order and output), so only what
    differs is re-indexed; the model written out is the same as Rewriter.apply's. Everything
    is checked before the graph changes (RewriteRejected leaves it as it was), so no journal
    is kept. Returns the nodes to revisit, or None (nothing changed) for any other result."""
    roots = m.roots
    if len(roots) != 1 or expr.n_outputs != 1:
        return None
    root = roots[0]
    outputs = graph.node_outputs[root]
    if len(outputs) != 1:
        return None
    old = outputs[0]
    if not old or graph.producer[old] != root:
        return None
    inputs = []
    for value in expr.inputs:
        kind = type(value)
        if kind is TensorView:
            inputs.append(value.name)
        elif value is None:
            inputs.append("")
        elif kind is str:
            inputs.append(value)
        else:
            return None  # an expression to build, a constant to add: the general path
    inputs = tuple(inputs)
    domain = expr.domain or STANDARD_DOMAIN
    if domain == STANDARD_DOMAIN_ALIAS:
        domain = STANDARD_DOMAIN
    op_type = expr.op_type
    root_node = graph.nodes[root]
    sticky = _sticky_attributes(graph, (root,))
    # A standard-domain node is built for per-node inference, one inheriting annotations
    # to carry them; any other stays pending: nothing reads its proto before the model is
    # written.
    build = domain == STANDARD_DOMAIN or sticky
    if build:
        template = node_template(op_type, expr.domain, expr.attrs)
    else:
        node = PendingNode(op_type, expr.domain, expr.attrs, "", inputs, outputs)
    if root in graph.subgraph_owners or has_subgraphs(template if build else node, domain,
                                                      op_type):
        return None  # subgraphs are indexed with their free variables: the general path
    # the new node takes the root's place: everything it reads must come before that
    _check_inputs(model, graph, inputs, graph.order[root])
    # names are taken in the order Rewriter.apply takes them
    name = model.names.fresh(_name_hint(root_node.name or rule.name, op_type))
    if build:
        node = graph.new_node(template)
        node.name = name
        node.input.extend(inputs)
        node.output.append(old)
        if domain == STANDARD_DOMAIN:
            _infer(graph, node, model.opset(STANDARD_DOMAIN) or 1)
        if sticky:
            node.attribute.extend(sticky)
    else:
        node.name = name
    removed_inputs = graph.node_inputs[root]
    graph.replace_node(root, node, inputs, (domain, op_type))
    dead = graph.remove_dead(removed_inputs)
    if expr.domain:
        model.ensure_opset(expr.domain, 1)
    return _neighbourhood(graph, (root,), (*dead, *removed_inputs))


def _sticky_attributes(graph: Graph, roots) -> list[onnx.AttributeProto]:
    """Sticky attributes of the first root that every other root carries too."""
    first = graph.nodes[roots[0]]
    if type(first) is PendingNode:
        return []  # a pending node carries no annotations (those are built at once)
    attributes = first.attribute
    if not attributes:  # the common case, without building a list
        return []
    return [attr for attr in attributes if attr.name in STICKY_ATTRIBUTES
            and all(graph.attr(r, attr.name) is not None for r in roots[1:])]


def _check_inputs(model: Model, graph: Graph, inputs, order: tuple) -> None:
    """The inputs of a node to be put at ``order`` exist and are produced before it (a
    node replaced in place has that order itself, so its outputs are refused too)."""
    producers, order_of = graph.producer, graph.order
    in_main_graph = graph is model.graph
    for name in inputs:
        if not name:
            continue
        producer = producers.get(name)
        if producer is not None:
            if order_of[producer] >= order:
                raise RewriteRejected(f"'{name}' would be used before it is produced")
        elif in_main_graph and name not in graph.initializers and name not in graph.input_set:
            raise RewriteRejected(f"'{name}' is not defined in the graph")


def _check_new_node(model: Model, graph: Graph, node_id: int) -> None:
    """Local checks of a node a rewrite added: its inputs exist and come before it, and
    standard-domain nodes pass ONNX per-node inference agreeing with known types."""
    _check_inputs(model, graph, graph.node_inputs[node_id], graph.order[node_id])
    if graph.op_keys[node_id][0] == STANDARD_DOMAIN:
        _infer(graph, graph.node(node_id), model.opset(STANDARD_DOMAIN) or 1)


def _neighbourhood(graph: Graph, new_ids, lost) -> dict[int, None]:
    """What to revisit: the new nodes, their producers and consumers, and the remaining
    consumers of tensors that lost a consumer or a producer (a fan-out rule on such a
    tensor may match now)."""
    producer, consumers = graph.producer, graph.consumers
    touched = dict.fromkeys(new_ids)
    for node_id in new_ids:
        for name in graph.node_inputs[node_id]:
            if name in producer:
                touched[producer[name]] = None
            users = consumers.get(name)
            if users:
                touched.update(users)
        for name in graph.node_outputs[node_id]:
            users = consumers.get(name)
            if users:
                touched.update(users)
    for name in lost:
        users = consumers.get(name)
        if users:
            touched.update(users)
    return touched


_HINTS: dict[tuple[str, str], str] = {}


def _name_hint(stem: str, op_type: str) -> str:
    """f"{stem}/{op_type}", kept for stems seen before (most are a rule's name: the nodes
    a rule replaces are often unnamed), so the string and its hash are made once."""
    hint = _HINTS.get((stem, op_type))
    if hint is None:
        hint = f"{stem}/{op_type}"
        if len(_HINTS) < 4096:
            _HINTS[stem, op_type] = hint
    return hint


class Rewriter:
    """Turns a rule's result into graph edits inside the current transaction."""

    __slots__ = ("model", "graph", "rule", "match", "new_nodes", "built", "domains",
                 "keep_names")

    def __init__(self, model: Model, graph: Graph, rule: Rule, match: Match):
        self.model, self.graph, self.rule, self.match = model, graph, rule, match
        self.new_nodes: list[tuple[onnx.NodeProto, tuple | None]] = []  # (node, edges)
        self.built: dict[int, list[str]] = {}
        self.domains: dict[str, None] = {}  # in order of first use: deterministic imports
        self.keep_names: dict[tuple[int, int], str] = {}

    def apply(self, result) -> list[int]:
        graph = self.graph
        mapping = self._mapping(result)
        roots = self._roots(mapping)
        keep_names = self.keep_names
        for old, expr in mapping.items():
            # A new tensor takes the name of the tensor it replaces: graph outputs survive
            # and the consumers downstream need no rewiring.
            key = _output_key(expr)
            if key is not None and key not in keep_names:
                keep_names[key] = old
        targets = {old: self._value(expr) for old, expr in mapping.items()}
        sticky = _sticky_attributes(self.graph, roots)
        base = graph.order[roots[0]]
        removed_inputs = []
        for root in roots:
            removed_inputs.extend(graph.node_inputs[root])
            graph.remove_node(root)
        for old, new in targets.items():
            if new != old:
                self._redirect(old, new)
        new_ids = []
        for i, (node, edges) in enumerate(self.new_nodes):
            if sticky:
                node.attribute.extend(sticky)
            new_ids.append(graph.add_node(node, base + (i,), edges))
        self._check(new_ids, targets)
        dead = graph.remove_dead(removed_inputs)
        for domain in self.domains:
            self.model.ensure_opset(domain, 1)
        return list(_neighbourhood(graph, new_ids, dead + removed_inputs))

    def _roots(self, mapping: dict) -> list[int]:
        """The nodes producing the replaced tensors, in graph order; each must be replaced
        whole (an output left out must be unused)."""
        graph = self.graph
        producer, consumers, protected = graph.producer, graph.consumers, graph.protected
        if len(mapping) == 1:
            roots = [producer[old] for old in mapping]
        else:
            roots = list(dict.fromkeys([producer[old] for old in mapping]))
            roots.sort(key=graph.order.__getitem__)
        for root in roots:
            for out in graph.node_outputs[root]:
                if out and out not in mapping and (out in consumers or out in protected):
                    raise RewriteRejected(f"output '{out}' of {graph.nodes[root].op_type} "
                                          "would be left without a producer")
        return roots

    def _redirect(self, old: str, new: str) -> None:
        graph = self.graph
        implicit = graph._implicit
        # A subgraph (If/Loop body) reading ``old`` from the outer scope is a use too, and
        # one that rewiring inputs cannot reach: keep the name alive, as for a graph output.
        if graph.is_output(old) or (implicit and any(
                old in implicit.get(c, ()) for c in graph.consumers_of(old))):
            self.new_nodes.append((onnx.helper.make_node(
                "Identity", [new], [old], name=self.model.names.fresh(f"{old}/Identity")), None))
        else:
            for consumer in graph.consumers_of(old):
                for i, name in enumerate(graph.node_inputs[consumer]):
                    if name == old:
                        graph.replace_input(consumer, i, new)

    # ---- building the replacement ------------------------------------------------------
    def _mapping(self, result) -> dict[str, object]:
        roots = self.match.roots
        if isinstance(result, dict):
            return {(k.name if isinstance(k, TensorView) else k): v for k, v in result.items()}
        if len(roots) != 1:
            raise RewriteRejected("a fan-out rule must return {old tensor: new value}")
        outputs = self.graph.node_outputs[roots[0]]
        values = result if isinstance(result, (tuple, list)) else (result,)
        return {out: v for out, v in zip(outputs, values, strict=False) if v is not None and out}

    def _value(self, expr) -> str:
        """The tensor name an expression evaluates to, creating nodes as needed."""
        if isinstance(expr, OpExpr):
            return self._build(expr)[0]
        if isinstance(expr, TensorView):
            return expr.name
        if isinstance(expr, str):
            return expr
        if isinstance(expr, OpOutput):
            return self._build(expr.op)[expr.index]
        if isinstance(expr, NewConstant):
            return self._constant(expr.value, expr.hint)
        if isinstance(expr, np.ndarray):
            return self._constant(expr, f"{self.rule.name}_const")
        raise RewriteRejected(f"cannot use {type(expr).__name__} as a value in a rewrite")

    def _constant(self, value: np.ndarray, hint: str) -> str:
        name = self.model.names.fresh(hint)
        self.graph.add_initializer(numpy_helper.from_array(np.asarray(value), name))
        return name

    def _build(self, expr: OpExpr) -> list[str]:
        key = id(expr)
        outputs = self.built.get(key)
        if outputs is None:
            inputs = ["" if i is None else i.name if type(i) is TensorView else self._value(i)
                      for i in expr.inputs]  # a matched tensor, the commonest input, inline
            names = self.model.names
            name = names.fresh(self._name_hint(expr.op_type))
            keep_names = self.keep_names
            outputs = [keep_names.get((key, i)) or names.fresh(f"{name}_output_{i}")
                       for i in range(expr.n_outputs)]
            node = self.graph.new_node(node_template(expr.op_type, expr.domain, expr.attrs))
            node.name = name
            node.input.extend(inputs)
            node.output.extend(outputs)
            if expr.domain:
                self.domains[expr.domain] = None
            self.new_nodes.append((node, (tuple(inputs), tuple(outputs))))
            self.built[key] = outputs
        return outputs

    def _name_hint(self, op_type: str) -> str:
        root = self.graph.nodes.get(self.match.roots[0])
        stem = root.name if root is not None and root.name else self.rule.name
        return f"{stem}/{op_type}"

    # ---- checks and cleanup -----------------------------------------------------------
    def _check(self, new_ids: list[int], targets: dict[str, str]) -> None:
        graph = self.graph
        for node_id in new_ids:
            _check_new_node(self.model, graph, node_id)
        for old in targets:
            if old in graph.protected and graph.producer.get(old) is None \
                    and old not in graph.initializers and old not in graph.input_set:
                raise RewriteRejected(f"graph output '{old}' would lose its producer")



def _infer(graph: Graph, node: onnx.NodeProto, opset: int) -> None:
    """Per-node ONNX inference with the input types we know; must agree with old types."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, STANDARD_DOMAIN)
    except onnx.defs.SchemaError:
        raise RewriteRejected(f"{node.op_type} does not exist at opset {opset}") from None
    inputs = list(node.input)
    # the types compared and propagated are inferred ones, not declarations
    graph.verify_declared([*inputs, *node.output])
    known = {}
    for name in inputs:
        if name and name in graph.types:
            known[name] = graph.types[name]
        elif name:
            elem = graph.elem_type(name)
            shape = graph.static_shape(name)
            if elem is None:
                return  # partial knowledge: the final whole-model check decides
            known[name] = onnx.helper.make_tensor_type_proto(elem, shape)
    try:
        inferred = onnx.shape_inference.infer_node_outputs(
            schema, node, known,
            {n: graph.initializers[n] for n in inputs if n in graph.initializers})
    except (onnx.shape_inference.InferenceError, RuntimeError) as exc:
        raise RewriteRejected(f"{node.op_type} '{node.name}': "
                              f"{str(exc).strip().splitlines()[0]}") from None
    for out, type_proto in inferred.items():
        old = graph.types.get(out)
        if old is None:
            graph.set_type(out, type_proto)
        elif not _compatible(old, type_proto):
            raise RewriteRejected(f"'{out}' would change type/shape from "
                                  f"{_type_str(old)} to {_type_str(type_proto)}")


def _output_key(expr) -> tuple[int, int] | None:
    if isinstance(expr, OpExpr):
        return id(expr), 0
    if isinstance(expr, OpOutput):
        return id(expr.op), expr.index
    return None


def _compatible(old: onnx.TypeProto, new: onnx.TypeProto) -> bool:
    if not (old.HasField("tensor_type") and new.HasField("tensor_type")):
        return True
    a, b = old.tensor_type, new.tensor_type
    if a.elem_type and b.elem_type and a.elem_type != b.elem_type:
        return False
    if a.HasField("shape") and b.HasField("shape"):
        if len(a.shape.dim) != len(b.shape.dim):
            return False
        for x, y in zip(a.shape.dim, b.shape.dim, strict=True):
            if x.HasField("dim_value") and y.HasField("dim_value") and x.dim_value != y.dim_value:
                return False
    return True


def _type_str(tp: onnx.TypeProto) -> str:
    t = tp.tensor_type
    dims = [str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
            for d in t.shape.dim] if t.HasField("shape") else ["?"]
    return f"{onnx.helper.tensor_dtype_to_string(t.elem_type)}[{','.join(dims)}]"


def validate(model: Model) -> None:
    """Whole-model check: the ONNX checker and strict shape inference."""
    _validate_model(model)


__all__ = ["Engine", "validate", "MS_DOMAIN"]
