"""Applying a rule's result to the graph, two ways that write the same model:

- ``rewrite_in_place``: the commonest result (one new node from matched tensors taking a
  single-output root's place), straight-line and checked before anything changes, so no
  journal is needed;
- ``Rewriter``: any result (several nodes, constants, several replaced tensors), as edits
  inside the graph's current transaction, checked after.

Both return the nodes to revisit (the rewrite's neighbourhood)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from .checks import check_inputs, check_new_node, check_outputs_kept, infer
from .dsl import NewConstant, OpExpr, OpOutput, Rule
from .errors import RewriteRejected
from .ir import STANDARD_DOMAIN, Graph, Model, PendingNode, has_subgraphs, node_template
from .matching import Match, TensorView
from .vocabulary import BACKWARD_PASS_ATTRIBUTE, STANDARD_DOMAIN_ALIAS

STICKY_ATTRIBUTES = (BACKWARD_PASS_ATTRIBUTE,)


def rewrite_in_place(model: Model, graph: Graph, rule: Rule, m: Match, expr: OpExpr):
    """Rewriter.apply for the commonest result, straight-line: one new node from matched
    tensors taking the single-output root's place (its id, order and output), so only what
    differs is re-indexed; the model written out is the same as Rewriter.apply's. Everything
    is checked before the graph changes (RewriteRejected leaves it as it was), so no journal
    is kept. Returns the nodes to revisit, or None (nothing changed) for any other result."""
    roots = m.roots
    if len(roots) != 1 or expr.n_outputs != 1:
        return None
    root = roots[0]
    outputs = graph.outputs_of(root)
    if len(outputs) != 1:
        return None
    old = outputs[0]
    if not old or graph.producer_of(old) != root:
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
    sticky = sticky_attributes(graph, (root,))
    # A standard-domain node is built for per-node inference, one inheriting annotations
    # to carry them; any other stays pending: nothing reads its proto before the model is
    # written.
    build = domain == STANDARD_DOMAIN or sticky
    if build:
        template = node_template(op_type, expr.domain, expr.attrs)
    else:
        node = PendingNode(op_type, expr.domain, expr.attrs, "", inputs, outputs)
    if graph.owns_subgraphs(root) or has_subgraphs(template if build else node, domain,
                                                   op_type):
        return None  # subgraphs are indexed with their free variables: the general path
    # the new node takes the root's place: everything it reads must come before that
    check_inputs(model, graph, inputs, graph.order_of(root))
    # names are taken in the order Rewriter.apply takes them
    name = model.names.fresh(name_hint(graph.name_of(root) or rule.name, op_type))
    if build:
        node = graph.new_node(template)
        node.name = name
        node.input.extend(inputs)
        node.output.append(old)
        if domain == STANDARD_DOMAIN:
            infer(graph, node, model.opset(STANDARD_DOMAIN) or 1)
        if sticky:
            node.attribute.extend(sticky)
    else:
        node.name = name
    removed_inputs = graph.inputs_of(root)
    graph.replace_node(root, node, inputs, (domain, op_type))
    dead = graph.remove_dead(removed_inputs)
    if expr.domain:
        model.ensure_opset(expr.domain, 1)
    # what to revisit: the new node's neighbours, and the remaining readers of tensors that
    # lost a reader or a producer (a fan-out rule on such a tensor may match now)
    return graph.neighbours((root,), (*dead, *removed_inputs))


def sticky_attributes(graph: Graph, roots) -> list[onnx.AttributeProto]:
    """Sticky attributes of the first root that every other root carries too."""
    carried = graph.carried_attributes(roots[0], STICKY_ATTRIBUTES)
    if not carried or len(roots) == 1:
        return carried
    return [attr for attr in carried
            if all(graph.attr(r, attr.name) is not None for r in roots[1:])]


_HINTS: dict[tuple[str, str], str] = {}


def name_hint(stem: str, op_type: str) -> str:
    """f"{stem}/{op_type}": the name a new node is given (made unique by the model's name
    generator). Kept for stems seen before (most are a rule's name: the nodes a rule
    replaces are often unnamed), so the string and its hash are made once."""
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
        sticky = sticky_attributes(self.graph, roots)
        base = graph.order_of(roots[0])
        removed_inputs = []
        for root in roots:
            removed_inputs.extend(graph.inputs_of(root))
            graph.remove_node(root)
        for old, new in targets.items():
            if new != old:
                self._redirect(old, new)
        new_ids = []
        for i, (node, edges) in enumerate(self.new_nodes):
            if sticky:
                node.attribute.extend(sticky)
            new_ids.append(graph.add_node(node, base + (i,), edges))
        for node_id in new_ids:
            check_new_node(self.model, graph, node_id)
        check_outputs_kept(graph, targets)
        dead = graph.remove_dead(removed_inputs)
        for domain in self.domains:
            self.model.ensure_opset(domain, 1)
        return list(graph.neighbours(new_ids, dead + removed_inputs))  # as rewrite_in_place

    def _roots(self, mapping: dict) -> list[int]:
        """The nodes producing the replaced tensors, in graph order; each must be replaced
        whole (an output left out must be unused)."""
        graph = self.graph
        if len(mapping) == 1:
            roots = [graph.producer_of(old) for old in mapping]
        else:
            roots = list(dict.fromkeys([graph.producer_of(old) for old in mapping]))
            roots.sort(key=graph.order_of)
        for root in roots:
            if root is None:
                missing = next(old for old in mapping if graph.producer_of(old) is None)
                raise RewriteRejected(f"'{missing}' has no producer to replace")
            for out in graph.outputs_of(root):
                if out and out not in mapping and graph.is_used(out):
                    raise RewriteRejected(f"output '{out}' of {graph.op_key(root)[1]} "
                                          "would be left without a producer")
        return roots

    def _redirect(self, old: str, new: str) -> None:
        graph = self.graph
        # A subgraph (If/Loop body) reading ``old`` from the outer scope is a use too, and
        # one that rewiring inputs cannot reach: keep the name alive, as for a graph output.
        if graph.is_output(old) or graph.read_by_subgraph(old):
            node = graph.new_node(node_template("Identity", STANDARD_DOMAIN, {}))
            node.name = self.model.names.fresh(f"{old}/Identity")
            node.input.append(new)
            node.output.append(old)
            self.new_nodes.append((node, ((new,), (old,))))
        else:
            graph.redirect_readers(old, new)

    # ---- building the replacement ------------------------------------------------------
    def _mapping(self, result) -> dict[str, object]:
        roots = self.match.roots
        if isinstance(result, dict):
            return {(k.name if isinstance(k, TensorView) else k): v for k, v in result.items()}
        if len(roots) != 1:
            raise RewriteRejected("a fan-out rule must return {old tensor: new value}")
        outputs = self.graph.outputs_of(roots[0])
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
            name = names.fresh(name_hint(self._stem(), expr.op_type))
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

    def _stem(self) -> str:
        """New nodes are named after the first root, or the rule if it has no name."""
        graph, root = self.graph, self.match.roots[0]
        return (graph.name_of(root) if graph.has_node(root) else "") or self.rule.name


def _output_key(expr) -> tuple[int, int] | None:
    if isinstance(expr, OpExpr):
        return id(expr), 0
    if isinstance(expr, OpOutput):
        return id(expr.op), expr.index
    return None
