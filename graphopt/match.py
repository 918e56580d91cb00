"""Compiles DSL patterns into matcher closures and gives rules a view of what matched."""
from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np
import onnx

from .dsl import AttrBinding, Const, Expr, FanOut, OneOf, OpExpr, OpOutput, Var
from .ir import Graph


class Miss:
    """Why a pattern did not match; the text is only built when someone asks."""

    __slots__ = ("fmt", "args")

    def __init__(self, fmt: str, *args):
        self.fmt, self.args = fmt, args

    def __str__(self) -> str:
        return self.fmt.format(*self.args)


class _RecheckedMiss(Miss):
    """A Miss found by a cheap pre-check; its reason comes from running the full matcher,
    and only if someone shows it (the engine does so at once, before the graph changes)."""

    __slots__ = ("matcher", "graph", "anchor")

    def __init__(self, matcher, graph: Graph, anchor):
        self.matcher, self.graph, self.anchor = matcher, graph, anchor

    def __str__(self) -> str:
        found = self.matcher(self.graph, self.anchor)
        return str(found) if isinstance(found, Miss) else "no match"


class _JoinedMiss(Miss):
    """The misses of several alternatives, joined only when shown."""

    __slots__ = ("misses",)

    def __init__(self, misses: list[Miss]):
        self.misses = misses

    def __str__(self) -> str:
        return "; ".join(str(m) for m in self.misses)


class _NodeLabel:
    """A node's name for a Miss, formatted only if the Miss is ever shown."""

    __slots__ = ("node",)

    def __init__(self, node: onnx.NodeProto):
        self.node = node

    def __str__(self) -> str:
        node = self.node
        return f"{node.op_type} '{node.name}'" if node.name else f"{node.op_type} (unnamed)"


def _node_label(graph: Graph, node_id: int) -> _NodeLabel:
    return _NodeLabel(graph.nodes[node_id])


def _same_attr(actual, expected) -> bool:
    if isinstance(actual, bytes):
        actual = actual.decode()
    if isinstance(expected, (list, tuple)):
        return actual is not None and list(actual) == list(expected)
    return actual == expected


class Bindings(dict):
    """name -> tensor name / node id / attribute value, plus the matched nodes in order."""

    __slots__ = ("nodes", "kinds")

    def __init__(self):
        super().__init__()
        self.nodes: list[int] = []
        self.kinds: dict[str, str] = {}

    def copy(self) -> Bindings:
        other = Bindings()
        other.update(self)
        other.nodes = list(self.nodes)
        other.kinds = dict(self.kinds)
        return other


Matcher = Callable[[Graph, int, Bindings], "Miss | None"]


def compile_op(pattern: OpExpr) -> Matcher:
    """A closure matching ``pattern`` rooted at a node id; fills bindings, returns a Miss."""
    op_type, bind = pattern.op_type, pattern.bind
    key = (pattern.domain, op_type)
    attr_checks = list(pattern.attrs.items())
    inputs = [_compile_input(p) for p in pattern.inputs]
    arity = len(inputs)
    commutative = pattern.commutative and arity == 2

    def match(graph: Graph, node_id: int, b: Bindings):
        if graph.op_keys[node_id] != key:
            return Miss("{} is not {}", _node_label(graph, node_id), op_type)
        names = graph.node_inputs[node_id]
        if len(names) < arity:
            return Miss("{} has {} inputs, pattern needs {}", _node_label(graph, node_id),
                        len(names), arity)
        if attr_checks:
            miss = _check_attributes(graph, node_id, attr_checks, b)
            if miss is not None:
                return miss
        if bind:
            b[bind] = node_id
            b.kinds[bind] = "node"
        b.nodes.append(node_id)
        if commutative:
            return _match_either_order(graph, names, inputs, b)
        for position, match_input in enumerate(inputs):
            miss = match_input(graph, names[position], b)
            if miss is not None:
                return miss
        return None
    return match


def _check_attributes(graph: Graph, node_id: int, attr_checks, b: Bindings):
    for name, expected in attr_checks:
        actual = graph.attr(node_id, name)
        if isinstance(expected, AttrBinding):
            b[expected.name] = expected.default if actual is None else actual
            b.kinds[expected.name] = "attr"
        elif callable(expected):
            if not expected(actual):
                return Miss("{} attribute {}={} rejected", _node_label(graph, node_id),
                            name, actual)
        elif not _same_attr(actual, expected):
            return Miss("{} attribute {}={}, pattern needs {}",
                        _node_label(graph, node_id), name, actual, expected)
    return None


def _match_either_order(graph: Graph, names, inputs, b: Bindings):
    """Both operand orders of a commutative op, each on a copy of the bindings; the first
    that matches is kept. When both miss, the reported Miss is the one from the order that
    got further (more operands and nodes matched): that is the near miss a user would mean."""
    best, best_progress = None, (-1, -1)
    for order in ((0, 1), (1, 0)):
        trial = b.copy()
        miss = None
        for position, input_index in enumerate(order):
            miss = inputs[position](graph, names[input_index], trial)
            if miss is not None:
                break
        if miss is None:
            b.clear()
            b.update(trial)
            b.nodes[:] = trial.nodes
            b.kinds.update(trial.kinds)
            return None
        progress = (position, len(trial.nodes))
        if progress > best_progress:
            best, best_progress = miss, progress
    return best


def compile_precheck(pattern: OpExpr):
    """A cheap necessary condition for ``pattern`` to match at a node, or None if there is
    nothing cheap to test: enough inputs, and each input the pattern wants produced by an op
    comes from a node of that (domain, op_type). It needs no bindings and builds no Miss, so
    the engine can discard most alternatives of a rule with a few dict lookups."""
    arity = len(pattern.inputs)
    required = [(position, (p.op.domain, p.op.op_type) if isinstance(p, OpOutput)
                 else (p.domain, p.op_type))
                for position, p in enumerate(pattern.inputs) if isinstance(p, (OpExpr, OpOutput))]
    if not required and not arity:
        return None
    layouts = [required]
    if pattern.commutative and arity == 2 and required:
        layouts.append([(1 - position, key) for position, key in required])
    if len(layouts) == 1 and len(required) == 1:
        return _single_producer_precheck(arity, *required[0])

    def precheck(graph: Graph, node_id: int) -> bool:
        names = graph.node_inputs[node_id]
        if len(names) < arity:
            return False
        producers, op_keys = graph.producer, graph.op_keys
        for layout in layouts:
            for position, key in layout:
                producer = producers.get(names[position])
                if producer is None or op_keys[producer] != key:
                    break
            else:
                return True
        return False
    return precheck


def _compile_input(pattern) -> Callable[[Graph, str, Bindings], Miss | None]:
    if isinstance(pattern, Var):
        name = pattern.name

        def match_var(graph, tensor, b):
            if not tensor:
                return Miss("optional input '{}' is absent", name)
            bound = b.get(name)
            if bound is not None and bound != tensor:
                return Miss("'{}' must be the same tensor in both places ({} vs {})",
                            name, bound, tensor)
            b[name] = tensor
            b.kinds[name] = "tensor"
            return None
        return match_var
    if isinstance(pattern, Const):
        return _compile_const(pattern)
    if isinstance(pattern, (OpExpr, OpOutput)):
        op_pattern = pattern.op if isinstance(pattern, OpOutput) else pattern
        output_index = pattern.index if isinstance(pattern, OpOutput) else 0
        inner = compile_op(op_pattern)

        def match_producer(graph, tensor, b):
            producer = graph.producer.get(tensor)
            if producer is None:
                return Miss("'{}' is not produced by a {} node", tensor, op_pattern.op_type)
            outputs = graph.node_outputs[producer]
            if len(outputs) <= output_index or outputs[output_index] != tensor:
                return Miss("'{}' is not output {} of {}", tensor, output_index,
                            _node_label(graph, producer))
            return inner(graph, producer, b)
        return match_producer
    raise TypeError(f"cannot use {pattern!r} as a pattern input")


def _compile_const(pattern: Const):
    name = pattern.name

    def match_const(graph, tensor, b):
        value = graph.constant_value(tensor) if tensor else None
        if value is None:
            return Miss("'{}' ({}) is not a constant", name, tensor or "absent")
        if pattern.scalar and value.size != 1:
            return Miss("'{}' ({}) has {} elements, not one", name, tensor, value.size)
        if pattern.predicate is not None and not pattern.predicate(value):
            return Miss("'{}' ({}): {}", name, tensor, pattern.reason)
        b[name] = tensor
        b.kinds[name] = "tensor"
        return None
    return match_const


def _single_producer_precheck(arity: int, position: int, key: tuple[str, str]):
    """compile_precheck's test when one input must come from one op type (the usual case)."""

    def precheck(graph: Graph, node_id: int) -> bool:
        names = graph.node_inputs[node_id]
        if len(names) < arity:
            return False
        producer = graph.producer.get(names[position])
        return producer is not None and graph.op_keys[producer] == key
    return precheck


def _binding_kinds(pattern: OpExpr, kinds: dict) -> bool:
    """Collects name -> kind of everything ``pattern`` binds; False if a name is bound with
    two kinds (the generated matcher keeps one variable per name; such patterns keep the
    closure matcher, whose shared dict they rely on)."""
    def put(name, kind):
        if kinds.setdefault(name, kind) != kind:
            raise ValueError
    try:
        stack = [pattern]
        while stack:
            p = stack.pop()
            for expected in p.attrs.values():
                if isinstance(expected, AttrBinding):
                    put(expected.name, "attr")
            if p.bind:
                put(p.bind, "node")
            for i in p.inputs:
                if isinstance(i, Var):
                    put(i.name, "tensor")
                elif isinstance(i, Const):
                    put(i.name, "tensor")
                elif isinstance(i, OpOutput):
                    stack.append(i.op)
                elif isinstance(i, OpExpr):
                    stack.append(i)
                else:
                    return False
    except ValueError:
        return False
    return True


class _Emitter:
    """Writes one specialised Python function per anchor op type of a rule: every
    alternative's pre-check and full match, inlined, with a local variable per binding.

    It does exactly what the closure matchers do after a passing pre-check, in the same
    order (a Var bound twice compares, a Const and an attribute predicate are evaluated at
    the same point), and a commutative op tries its operand orders greedily as
    _match_either_order does (the first order that matches its subtree is kept, without
    backtracking into it later). Instead of a Miss it leaves the alternative (``break``);
    the closure matchers still say why, for --explain."""

    def __init__(self):
        self.lines: list[str] = []
        self.namespace: dict = {"_same_attr": _same_attr}
        self.counter = 0

    def const(self, value) -> str:
        name = f"K{len(self.namespace)}"
        self.namespace[name] = value
        return name

    def fresh(self, stem: str) -> str:
        self.counter += 1
        return f"{stem}{self.counter}"

    def emit(self, indent: int, line: str) -> None:
        self.lines.append("    " * indent + line)

    def alternative(self, pattern: OpExpr, indent: int) -> None:
        """One alternative at node ``nid`` (already known to have the anchor op type)."""
        kinds: dict = {}
        _binding_kinds(pattern, kinds)
        self.variables = {name: f"v_{i}" for i, name in enumerate(kinds)}
        self.node_vars = self._preorder(pattern, ())
        self.prechecked: set[tuple] = set()  # paths whose producer the pre-check found
        self.emit(indent, "while True:")
        indent += 1
        self._precheck(pattern, indent)
        self._node(pattern, (), "ins", indent, set())
        values = ", ".join(f"{name!r}: {var}" for name, var in self.variables.items())
        self.emit(indent, f"return {self.const(match_class(kinds))}(graph, {{{values}}}, "
                          f"{self.const(kinds)}, [{', '.join(self.node_vars)}], [nid])")

    def _precheck(self, pattern: OpExpr, indent: int) -> None:
        """compile_precheck's test, literally (it runs before anything else matches)."""
        arity = len(pattern.inputs)
        required = [(position, (p.op.domain, p.op.op_type) if isinstance(p, OpOutput)
                     else (p.domain, p.op_type))
                    for position, p in enumerate(pattern.inputs)
                    if isinstance(p, (OpExpr, OpOutput))]
        if not required and not arity:
            return
        self.emit(indent, f"if len(ins) < {arity}: break")
        layouts = [required]
        if pattern.commutative and arity == 2 and required:
            layouts.append([(1 - position, key) for position, key in required])
        if len(layouts) == 1:
            # one layout: the producers it looks up are the ones the match goes on with
            for position, key in required:
                producer = self._node_var((position,))
                self.emit(indent, f"{producer} = producer_get(ins[{position}])")
                self.emit(indent, f"if op_keys_get({producer}) != {self.const(key)}: break")
                self.prechecked.add((position,))
            return
        conditions = [" and ".join(f"op_keys_get(producer_get(ins[{position}])) == "
                                   f"{self.const(key)}" for position, key in layout)
                      for layout in layouts if layout]
        if conditions:
            self.emit(indent, f"if not ({' or '.join(f'({c})' for c in conditions)}): break")

    @staticmethod
    def _node_var(path: tuple) -> str:
        return "nid" if not path else "n_" + "_".join(map(str, path))

    def _preorder(self, pattern: OpExpr, path: tuple) -> list[str]:
        """The matched node ids in the order the closure matcher appends them: a node, then
        its inputs by pattern position (in either operand order of a commutative op)."""
        found = [self._node_var(path)]
        for position, p in enumerate(pattern.inputs):
            if isinstance(p, (OpExpr, OpOutput)):
                found += self._preorder(p.op if isinstance(p, OpOutput) else p,
                                        path + (position,))
        return found

    def _node(self, pattern: OpExpr, path: tuple, ins: str, indent: int, bound: set) -> set:
        nid = self._node_var(path)
        arity = len(pattern.inputs)
        if path:
            if path not in self.prechecked:
                self.emit(indent, f"if op_keys[{nid}] != "
                                  f"{self.const((pattern.domain, pattern.op_type))}: break")
            self.emit(indent, f"{ins} = node_inputs[{nid}]")
            self.emit(indent, f"if len({ins}) < {arity}: break")
        # (the root's arity was tested by the pre-check)
        if pattern.attrs:
            for name, expected in pattern.attrs.items():
                actual = f"attr_of({nid}, {name!r})"
                if isinstance(expected, AttrBinding):
                    var = self.variables[expected.name]
                    value = self.fresh("a")
                    self.emit(indent, f"{value} = {actual}")
                    self.emit(indent, f"{var} = {self.const(expected.default)} if {value} is None "
                                      f"else {value}")
                    bound = bound | {expected.name}
                elif callable(expected):
                    self.emit(indent, f"if not {self.const(expected)}({actual}): break")
                else:
                    self.emit(indent, f"if not _same_attr({actual}, {self.const(expected)}): break")
        if pattern.bind:
            self.emit(indent, f"{self.variables[pattern.bind]} = {nid}")
            bound = bound | {pattern.bind}
        if pattern.commutative and arity == 2:
            done = self.fresh("done")
            self.emit(indent, f"{done} = False")
            after = set()
            for order in ((0, 1), (1, 0)):
                if order == (1, 0):
                    self.emit(indent, f"if not {done}:")
                    indent += 1
                self.emit(indent, "while True:")
                trial = bound
                for position, input_index in enumerate(order):
                    trial = self._input(pattern.inputs[position], f"{ins}[{input_index}]",
                                        path + (position,), indent + 1, trial)
                self.emit(indent + 1, f"{done} = True")
                self.emit(indent + 1, "break")
                after = trial
                if order == (1, 0):
                    indent -= 1
            self.emit(indent, f"if not {done}: break")
            return after
        for position, p in enumerate(pattern.inputs):
            bound = self._input(p, f"{ins}[{position}]", path + (position,), indent, bound)
        return bound

    def _input(self, pattern, tensor_expr: str, path: tuple, indent: int, bound: set) -> set:
        if isinstance(pattern, Var) and pattern.name not in bound:
            # a first binding: straight into its variable (a miss leaves the alternative,
            # or the operand order, and nothing reads the variable before its next write)
            var = self.variables[pattern.name]
            self.emit(indent, f"{var} = {tensor_expr}")
            self.emit(indent, f"if not {var}: break")
            return bound | {pattern.name}
        tensor = self.fresh("t")
        self.emit(indent, f"{tensor} = {tensor_expr}")
        if isinstance(pattern, Var):
            var = self.variables[pattern.name]
            self.emit(indent, f"if not {tensor}: break")
            self.emit(indent, f"if {var} != {tensor}: break")
            return bound | {pattern.name}
        if isinstance(pattern, Const):
            value = self.fresh("c")
            self.emit(indent, f"{value} = constant_value({tensor}) if {tensor} else None")
            self.emit(indent, f"if {value} is None: break")
            if pattern.scalar:
                self.emit(indent, f"if {value}.size != 1: break")
            if pattern.predicate is not None:
                self.emit(indent, f"if not {self.const(pattern.predicate)}({value}): break")
            self.emit(indent, f"{self.variables[pattern.name]} = {tensor}")
            return bound | {pattern.name}
        op_pattern = pattern.op if isinstance(pattern, OpOutput) else pattern
        output_index = pattern.index if isinstance(pattern, OpOutput) else 0
        producer = self._node_var(path)
        if path not in self.prechecked:
            self.emit(indent, f"{producer} = producer_get({tensor})")
            self.emit(indent, f"if {producer} is None: break")
        if output_index:  # (output 0 exists: the producer produces the tensor)
            outputs = self.fresh("outs")
            self.emit(indent, f"{outputs} = node_outputs[{producer}]")
            self.emit(indent, f"if len({outputs}) <= {output_index} or "
                              f"{outputs}[{output_index}] != {tensor}: break")
        else:
            self.emit(indent, f"if node_outputs[{producer}][0] != {tensor}: break")
        return self._node(op_pattern, path, self.fresh("ins"), indent, bound)


_PROLOGUE = (("node_inputs", "graph.node_inputs"), ("op_keys", "graph.op_keys"),
             ("op_keys_get", "graph.op_keys.get"), ("producer_get", "graph.producer.get"),
             ("node_outputs", "graph.node_outputs"), ("attr_of", "graph.attr"),
             ("constant_value", "graph.constant_value"))


def _generatable(pattern: OpExpr) -> bool:
    return _binding_kinds(pattern, {})


def compile_fast(alternatives: list[tuple[OpExpr, Callable]]):
    """For the alternatives anchored at one op type, ``bind(graph)``: a function
    ``fast(node_id)`` trying them in order at a node of ``graph``, giving the Match of the
    first that matches, or None. (Binding to one graph makes its index dicts closure
    variables: the matcher runs at every candidate and would otherwise look them up on
    the graph at each call.)
    ``alternatives``: (pattern, fallback) pairs; an alternative the generator does not
    cover (a name bound with two kinds) runs ``fallback(graph, node_id)`` instead."""
    emitter = _Emitter()
    emit = emitter.emit
    for pattern, fallback in alternatives:
        if _generatable(pattern):
            emitter.alternative(pattern, 2)
        else:
            found = emitter.fresh("found")
            emit(2, f"{found} = {emitter.const(fallback)}(graph, nid)")
            emit(2, f"if {found} is not None: return {found}")
    emit(2, "return None")
    body = "\n".join(emitter.lines)
    lines = ["def bind(graph):", *(f"    {name} = {value}" for name, value in _PROLOGUE),
             "    def fast(nid):", "        ins = node_inputs[nid]"]
    source = "\n".join(lines) + "\n" + body + "\n    return fast"
    namespace = emitter.namespace
    exec(compile(source, "<graphopt matcher>", "exec"), namespace)
    bind = namespace["bind"]
    bind.source = source
    return bind


class CompiledPattern:
    """What the engine drives: anchor op types and two ways to match at an anchor.

    ``match(graph, anchor)`` returns (bindings, roots) or a Miss saying why not (for
    --explain and fan-out rules). ``fast_by_key[op key](graph)`` binds the generated
    matcher the engine runs otherwise to a graph: ``fast(node)``, a Match or None, with no
    Miss built."""

    def __init__(self, pattern: Expr | FanOut | OneOf):
        self.pattern = pattern
        self.precheck = None  # an op pattern's compile_precheck, used by an enclosing one_of
        if isinstance(pattern, OneOf):
            alternatives = [CompiledPattern(p) for p in pattern.alternatives]
            if any(isinstance(p, FanOut) for p in pattern.alternatives):
                raise TypeError("one_of takes op patterns only")
            self.anchor_types = list(dict.fromkeys(
                key for alt in alternatives for key in alt.anchor_types))
            self.match = self._first_of(alternatives)
            self.full_match = self.match
            by_key: dict[tuple[str, str], list] = {}
            for alt in alternatives:
                for key in alt.anchor_types:
                    by_key.setdefault(key, []).append((alt.pattern, alt._fallback()))
            self.fast_by_key = {key: compile_fast(alts) for key, alts in by_key.items()}
            self.anchors_at_node = True
            self.anchor_of = lambda graph, node_id: node_id
        elif isinstance(pattern, FanOut):
            self.anchor_types = [("", t) for t in pattern.consumer_types]
            self.match = self.full_match = self._fan_out_matcher(pattern)
            self.anchors_at_node = False  # at the tensor the consumers read
            self.anchor_of = lambda graph, node_id: (
                graph.node_inputs[node_id][pattern.input_index]
                if len(graph.node_inputs[node_id]) > pattern.input_index else None)
        elif isinstance(pattern, OpExpr):
            self.anchor_types = [(pattern.domain, pattern.op_type)]
            self.full_match = self._op_matcher(pattern)
            self.precheck = compile_precheck(pattern)
            self.match = self._checked(self.precheck, self.full_match)
            self.fast_by_key = {self.anchor_types[0]: compile_fast([(pattern, self._fallback())])}
            self.anchors_at_node = True
            self.anchor_of = lambda graph, node_id: node_id
        else:
            raise TypeError("a rule's match must be an op pattern or a fan_out")

    def _fallback(self):
        """What compile_fast runs for an alternative it does not generate code for: the
        pre-check, then the full matcher; (bindings, kinds, nodes, roots) or None."""
        precheck, full_match = self.precheck, self.full_match

        def fallback(graph, node_id):
            if precheck is not None and not precheck(graph, node_id):
                return None
            found = full_match(graph, node_id)
            if isinstance(found, Miss):
                return None
            bindings, roots = found
            return Match(graph, bindings, bindings.kinds, bindings.nodes, roots)
        return fallback

    @staticmethod
    def _first_of(alternatives):
        by_anchor: dict[tuple[str, str], list[CompiledPattern]] = {}
        for alt in alternatives:
            for key in alt.anchor_types:
                by_anchor.setdefault(key, []).append(alt)

        def match(graph, node_id):
            misses = []
            for alt in by_anchor.get(graph.op_keys[node_id], ()):
                found = alt.match(graph, node_id)
                if not isinstance(found, Miss):
                    return found
                misses.append(found)
            return misses[0] if len(misses) == 1 else _JoinedMiss(misses)
        return match

    @staticmethod
    def _checked(precheck, full_match):
        """The pre-check, then the full matcher (whose Miss is built only if shown)."""
        if precheck is None:
            return full_match

        def match(graph, node_id):
            if not precheck(graph, node_id):
                return _RecheckedMiss(full_match, graph, node_id)
            return full_match(graph, node_id)
        return match

    @staticmethod
    def _op_matcher(pattern: OpExpr):
        inner = compile_op(pattern)

        def full_match(graph, node_id):
            b = Bindings()
            miss = inner(graph, node_id, b)
            if miss is not None:
                return miss
            return b, [node_id]
        return full_match

    @staticmethod
    def _fan_out_matcher(pattern: FanOut):
        types = set(pattern.consumer_types)
        index, source = pattern.input_index, pattern.source.name

        def match(graph, tensor):
            op_keys, node_inputs = graph.op_keys, graph.node_inputs
            users = [u for u in graph.consumers.get(tensor, ())
                     if op_keys[u][1] in types and not op_keys[u][0]
                     and len(node_inputs[u]) > index and node_inputs[u][index] == tensor]
            if len(users) < pattern.min_consumers:
                return Miss("'{}' has {} {} consumer(s), needs at least {}", tensor,
                            len(users), "/".join(pattern.consumer_types), pattern.min_consumers)
            users.sort(key=graph.order.__getitem__)
            b = Bindings()
            b[source] = tensor
            b.kinds[source] = "tensor"
            b[pattern.bind] = users
            b.kinds[pattern.bind] = "nodes"
            b.nodes.extend(users)
            return b, users
        return match


class NodeView:
    """A matched node as rules see it."""

    __slots__ = ("graph", "id")

    def __init__(self, graph: Graph, node_id: int):
        self.graph, self.id = graph, node_id

    proto = property(lambda self: self.graph.node(self.id))
    name = property(lambda self: self.graph.nodes[self.id].name)  # a pending node has it
    # from the index: reading the proto makes a Python string every time
    op_type = property(lambda self: self.graph.op_keys[self.id][1])
    inputs = property(lambda self: [TensorView(self.graph, n) for n in self.proto.input])
    outputs = property(lambda self: [TensorView(self.graph, n) for n in self.proto.output])

    def attr(self, name: str, default=None):
        return self.graph.attr(self.id, name, default)

    def input(self, index: int) -> TensorView | None:
        names = self.proto.input
        return TensorView(self.graph, names[index]) if index < len(names) and names[index] \
            else None

    def __repr__(self) -> str:
        return f"<{self.op_type} {self.name!r}>"


class TensorView:
    """A tensor as rules see it: name, type, static shape, constant value, neighbours."""

    __slots__ = ("graph", "name")

    def __init__(self, graph: Graph, name: str):
        self.graph, self.name = graph, name

    elem_type = property(lambda self: self.graph.elem_type(self.name))
    shape = property(lambda self: self.graph.static_shape(self.name))

    @property
    def value(self) -> np.ndarray | None:
        return self.graph.constant_value(self.name)

    @property
    def producer(self) -> NodeView | None:
        node_id = self.graph.producer.get(self.name)
        return None if node_id is None else NodeView(self.graph, node_id)

    @property
    def consumers(self) -> list[NodeView]:
        return [NodeView(self.graph, i) for i in self.graph.consumers_of(self.name)]

    def __float__(self) -> float:
        return float(self._scalar())

    def __int__(self) -> int:
        return int(self._scalar())

    def _scalar(self):
        value = self.value
        if value is None or value.size != 1:
            raise ValueError(f"'{self.name}' is not a scalar constant")
        return value.reshape(()).item()

    def __repr__(self) -> str:
        return f"<tensor {self.name!r}>"


class Match:
    """Attribute access to a pattern's bindings: ``m.a`` (tensor), ``m.t`` (node), ...

    Views are made on first access and kept as instance attributes (later reads are plain
    attribute hits): most rules read a few of their bindings, so building all of them up
    front is wasted. Node lists are made on every access (a fresh list each time: the rule
    may change it). A binding named like a Match attribute (``roots``, ``get``...) is
    shadowed by it. Generated matchers build a subclass made for their bindings
    (match_class), whose views come from descriptors rather than a failed lookup."""

    def __init__(self, graph: Graph, bindings: dict, kinds: dict, nodes: list,
                 roots: list[int]):
        self._graph, self._bindings, self._kinds = graph, bindings, kinds
        self.roots, self.nodes = roots, nodes

    def __getattr__(self, name: str):
        try:
            kind = self.__dict__["_kinds"][name]
        except KeyError:
            raise AttributeError(f"pattern binds no '{name}'") from None
        return _VIEWS[kind](name).__get__(self, type(self))

    def get(self, name: str, default=None):
        return getattr(self, name) if name in self._bindings else default

    @property
    def graph(self) -> Graph:
        return self._graph

    @property
    def opset(self) -> int:
        return self._graph.model.opset("") or 1


class _TensorBinding:
    """A binding's view, made on first access and then kept in the instance's __dict__
    (a non-data descriptor: the instance attribute wins from then on)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __get__(self, m, owner=None):
        if m is None:
            return self
        view = m.__dict__[self.name] = TensorView(m._graph, m._bindings[self.name])
        return view


class _NodeBinding(_TensorBinding):
    __slots__ = ()

    def __get__(self, m, owner=None):
        if m is None:
            return self
        view = m.__dict__[self.name] = NodeView(m._graph, m._bindings[self.name])
        return view


class _ValueBinding(_TensorBinding):
    __slots__ = ()

    def __get__(self, m, owner=None):
        if m is None:
            return self
        value = m.__dict__[self.name] = m._bindings[self.name]
        return value


class _NodesBinding(_TensorBinding):
    __slots__ = ()

    def __get__(self, m, owner=None):
        if m is None:
            return self
        return [NodeView(m._graph, i) for i in m._bindings[self.name]]


_VIEWS = {"tensor": _TensorBinding, "node": _NodeBinding, "nodes": _NodesBinding}
_VIEWS = collections.defaultdict(lambda: _ValueBinding, _VIEWS)
_OWN_NAMES = frozenset(dir(Match)) | {"_graph", "_bindings", "_kinds", "roots", "nodes"}


def bound_tensor(m: Match, name: str) -> str:
    """``getattr(m, name).name`` without making the view when ``name`` is a tensor binding
    not yet looked at (constraints ask for many names and use nothing else)."""
    try:
        if m._kinds.get(name) == "tensor" and name not in m.__dict__ \
                and name not in _OWN_NAMES:
            return m._bindings[name]
    except AttributeError:  # not a Match
        pass
    return getattr(m, name).name


def match_class(kinds: dict) -> type:
    """A Match subclass with a descriptor per binding of these kinds (names that Match
    itself uses stay Match's: they are shadowed, as with a plain Match)."""
    namespace = {}
    for name, kind in kinds.items():
        if name not in _OWN_NAMES and name.isidentifier():
            namespace[name] = _VIEWS[kind](name)
    return type("GeneratedMatch", (Match,), namespace)


def tensor_dtype(elem_type: int) -> np.dtype:
    return onnx.helper.tensor_dtype_to_np_dtype(elem_type)
