"""The one matcher semantics: each pattern feature (an op check, an input binding, an
attribute constraint, a constant test, a commutative op's operand orders) is written once
below, as a condition with the reason it fails, and emitted as Python in two modes:

- ``EXPLAIN``: a failed check records a Miss saying why, and the matcher returns it (what
  ``--explain`` shows);
- ``FAST``: a failed check just leaves the alternative; the engine runs this at every
  candidate, so it also gets a pre-check (a necessary condition, tested first) and skips
  the checks that pre-check already made.

The two matchers come from the same walk over the same pattern with the same conditions,
so they cannot disagree on what matches or on what is bound; only what happens on a
failure differs. A commutative op tries its operand orders greedily: the first order that
matches its subtree is kept, without backtracking into it later; when both miss, the Miss
reported is the one from the order that got further (more operands, then more nodes).

Each anchor op type of a rule gets one specialised function per mode: every alternative
anchored there, in order, inlined, with a local variable per binding. ``generate`` returns
``bind(graph)``, which makes the graph's index readers closure variables (the matcher
runs at every candidate and would otherwise look them up on the graph at each call) and
returns ``matcher(node_id)``: in FAST mode a Match or None, in EXPLAIN mode
(Bindings, roots) or a Miss.
"""
from __future__ import annotations

from collections.abc import Callable

from ..patterns import AttrBinding, Const, OpExpr, OpOutput, Var
from .misses import JoinedMiss, Miss, NodeLabel
from .views import match_class

FAST, EXPLAIN = "fast", "explain"


def same_attr(actual, expected) -> bool:
    """An attribute's value equals the literal a pattern gives (a list equals a tuple)."""
    if isinstance(actual, bytes):
        actual = actual.decode()
    if isinstance(expected, (list, tuple)):
        return actual is not None and list(actual) == list(expected)
    return actual == expected


class Bindings(dict):
    """name -> tensor name / node id / attribute value, plus the matched nodes in order."""

    __slots__ = ("nodes", "kinds")

    def __init__(self, values: dict | None = None, kinds: dict | None = None,
                 nodes: list[int] | None = None):
        super().__init__(values or ())
        self.nodes: list[int] = nodes if nodes is not None else []
        self.kinds: dict[str, str] = dict(kinds) if kinds else {}


def binding_kinds(pattern: OpExpr) -> dict[str, str]:
    """name -> kind ("tensor", "node", "attr") of everything ``pattern`` binds, in the
    order the matcher binds them. A name bound with two kinds is refused: each name is one
    variable of the generated matcher, and a rule reading it would get one or the other."""
    kinds: dict[str, str] = {}

    def put(name: str, kind: str) -> None:
        if kinds.setdefault(name, kind) != kind:
            raise TypeError(f"pattern binds '{name}' both as a {kinds[name]} and as a {kind}")

    def walk(p: OpExpr) -> None:
        for expected in p.attrs.values():
            if isinstance(expected, AttrBinding):
                put(expected.name, "attr")
        if p.bind:
            put(p.bind, "node")
        for i in p.inputs:
            if isinstance(i, (Var, Const)):
                put(i.name, "tensor")
            elif isinstance(i, (OpExpr, OpOutput)):
                walk(i.op if isinstance(i, OpOutput) else i)
            else:
                raise TypeError(f"cannot use {i!r} as a pattern input")
    walk(pattern)
    return kinds


def _op_of(p) -> OpExpr:
    return p.op if isinstance(p, OpOutput) else p


def _node_count(pattern: OpExpr) -> int:
    return 1 + sum(_node_count(_op_of(p)) for p in pattern.inputs
                   if isinstance(p, (OpExpr, OpOutput)))


# The graph's readers each matcher binds once (see generate).
_PROLOGUE = (("inputs_of", "graph.inputs_of"), ("op_key", "graph.op_key"),
             ("producer_of", "graph.producer_of"), ("outputs_of", "graph.outputs_of"),
             ("attr_of", "graph.attr"), ("constant_value", "graph.constant_value"),
             ("nodes", "graph.nodes"))


class _Emitter:
    def __init__(self, mode: str):
        self.mode = mode
        self.explain = mode == EXPLAIN
        self.lines: list[str] = []
        self.namespace: dict = {"same_attr": same_attr, "Miss": Miss, "Label": NodeLabel,
                                "Bindings": Bindings, "JoinedMiss": JoinedMiss}
        self.counter = 0
        # per enclosing commutative trial: [operand position, nodes matched in the trial]
        self.trials: list[list[int]] = []

    def const(self, value) -> str:
        name = f"K{len(self.namespace)}"
        self.namespace[name] = value
        return name

    def fresh(self, stem: str) -> str:
        self.counter += 1
        return f"{stem}{self.counter}"

    def emit(self, indent: int, line: str) -> None:
        self.lines.append("    " * indent + line)

    # ---- the failure of a check: the only thing the two modes do differently ----------
    def check(self, indent: int, condition: str, reason: str | None = None, *args: str,
              miss: str | None = None) -> None:
        """``condition`` (Python source) must hold; otherwise the match fails, with the
        Miss ``reason.format(*args)`` (``args``: Python source) or the one in ``miss``."""
        if not self.explain:
            self.emit(indent, f"if not ({condition}): break")
            return
        if miss is None:
            miss = f"Miss({reason!r}, {', '.join(args)})"
        self.emit(indent, f"if not ({condition}):")
        self.emit(indent + 1, f"miss = {miss}")
        if self.trials:
            self.emit(indent + 1, f"prog = {tuple(self.trials[-1])!r}")
        self.emit(indent + 1, "break")

    def label(self, node_var: str) -> str:
        return f"Label(nodes[{node_var}])"

    def node_matched(self, count: int = 1) -> None:
        if self.trials:
            self.trials[-1][1] += count

    # ---- alternatives ------------------------------------------------------------------
    def alternative(self, pattern: OpExpr, indent: int) -> None:
        """One alternative at node ``nid`` (already known to have the anchor op type)."""
        kinds = binding_kinds(pattern)
        self.variables = {name: f"v_{i}" for i, name in enumerate(kinds)}
        self.node_vars = self._preorder(pattern, ())
        self.prechecked: set[tuple] = set()  # paths whose producer the pre-check found
        self.emit(indent, "while True:")
        indent += 1
        if not self.explain:
            self._precheck(pattern, indent)
        self._node(pattern, (), "ins", indent, set())
        values = "{" + ", ".join(f"{name!r}: {var}" for name, var in self.variables.items()) \
            + "}"
        nodes = f"[{', '.join(self.node_vars)}]"
        if self.explain:
            self.emit(indent, f"return Bindings({values}, {self.const(kinds)}, {nodes}), [nid]")
        else:
            self.emit(indent, f"return {self.const(match_class(kinds))}(graph, {values}, "
                              f"{self.const(kinds)}, {nodes}, [nid])")

    def _precheck(self, pattern: OpExpr, indent: int) -> None:
        """FAST only: a cheap necessary condition tested before anything else: enough inputs,
        and each input the pattern wants produced by an op comes from a node of that
        (domain, op_type); for a commutative op, in either operand order."""
        arity = len(pattern.inputs)
        required = [(position, (_op_of(p).domain, _op_of(p).op_type))
                    for position, p in enumerate(pattern.inputs)
                    if isinstance(p, (OpExpr, OpOutput))]
        if not arity:
            return
        self.emit(indent, f"if len(ins) < {arity}: break")
        self.prechecked.add(())  # the root's arity
        layouts = [required]
        if pattern.commutative and arity == 2 and required:
            layouts.append([(1 - position, key) for position, key in required])
        if len(layouts) == 1:
            # one layout: the producers it looks up are the ones the match goes on with
            for position, key in required:
                producer = self._node_var((position,))
                self.emit(indent, f"{producer} = producer_of(ins[{position}])")
                self.emit(indent, f"if op_key({producer}) != {self.const(key)}: break")
                self.prechecked.add((position,))
            return
        conditions = [" and ".join(f"op_key(producer_of(ins[{position}])) == "
                                   f"{self.const(key)}" for position, key in layout)
                      for layout in layouts]
        self.emit(indent, f"if not ({' or '.join(f'({c})' for c in conditions)}): break")

    @staticmethod
    def _node_var(path: tuple) -> str:
        return "nid" if not path else "n_" + "_".join(map(str, path))

    def _preorder(self, pattern: OpExpr, path: tuple) -> list[str]:
        """The matched node ids in match order: a node, then its inputs by pattern position
        (in either operand order of a commutative op)."""
        found = [self._node_var(path)]
        for position, p in enumerate(pattern.inputs):
            if isinstance(p, (OpExpr, OpOutput)):
                found += self._preorder(_op_of(p), path + (position,))
        return found

    # ---- the features --------------------------------------------------------------
    def _node(self, pattern: OpExpr, path: tuple, ins: str, indent: int, bound: set) -> set:
        """An op node at node id variable ``nid`` (its op type, for an input, not yet
        checked): arity, attributes, its binding, then its inputs."""
        nid = self._node_var(path)
        arity = len(pattern.inputs)
        if path:
            if path not in self.prechecked:
                key = self.const((pattern.domain, pattern.op_type))
                self.check(indent, f"op_key({nid}) == {key}", "{} is not {}",
                           self.label(nid), repr(pattern.op_type))
            self.emit(indent, f"{ins} = inputs_of({nid})")
        if arity and (path or () not in self.prechecked):
            self.check(indent, f"len({ins}) >= {arity}", "{} has {} inputs, pattern needs {}",
                       self.label(nid), f"len({ins})", str(arity))
        for name, expected in pattern.attrs.items():
            value = self.fresh("a")
            self.emit(indent, f"{value} = attr_of({nid}, {name!r})")
            if isinstance(expected, AttrBinding):
                self.emit(indent, f"{self.variables[expected.name]} = "
                                  f"{self.const(expected.default)} if {value} is None "
                                  f"else {value}")
                bound = bound | {expected.name}
            elif callable(expected):
                self.check(indent, f"{self.const(expected)}({value})",
                           "{} attribute {}={} rejected", self.label(nid), repr(name), value)
            else:
                self.check(indent, f"same_attr({value}, {self.const(expected)})",
                           "{} attribute {}={}, pattern needs {}", self.label(nid), repr(name),
                           value, self.const(expected))
        if pattern.bind:
            self.emit(indent, f"{self.variables[pattern.bind]} = {nid}")
            bound = bound | {pattern.bind}
        self.node_matched()
        if pattern.commutative and arity == 2:
            return self._either_order(pattern, path, ins, indent, bound)
        for position, p in enumerate(pattern.inputs):
            bound = self._input(p, f"{ins}[{position}]", path + (position,), indent, bound)
        return bound

    def _either_order(self, pattern: OpExpr, path: tuple, ins: str, indent: int,
                      bound: set) -> set:
        done = self.fresh("done")
        best, best_progress = self.fresh("best"), self.fresh("best_progress")
        self.emit(indent, f"{done} = False")
        after = bound
        for order in ((0, 1), (1, 0)):
            inner = indent
            if order == (1, 0):
                self.emit(indent, f"if not {done}:")
                inner += 1
            self.emit(inner, "while True:")
            self.trials.append([0, 0])
            trial = bound  # names first bound in one order are first bound in the other too
            for position, input_index in enumerate(order):
                self.trials[-1][0] = position
                trial = self._input(pattern.inputs[position], f"{ins}[{input_index}]",
                                    path + (position,), inner + 1, trial)
            self.trials.pop()
            self.emit(inner + 1, f"{done} = True")
            self.emit(inner + 1, "break")
            if self.explain:
                if order == (0, 1):
                    self.emit(inner, f"if not {done}: {best}, {best_progress} = miss, prog")
                else:
                    self.emit(inner, f"if not {done} and prog > {best_progress}: {best} = miss")
            after = trial
        self.check(indent, done, miss=best)
        self.node_matched(sum(_node_count(_op_of(p)) for p in pattern.inputs
                              if isinstance(p, (OpExpr, OpOutput))))
        return after

    def _input(self, pattern, tensor_expr: str, path: tuple, indent: int, bound: set) -> set:
        """Input ``tensor_expr`` (Python source naming the tensor) against ``pattern``."""
        if isinstance(pattern, Var) and pattern.name not in bound:
            # a first binding: straight into its variable (a miss leaves the alternative,
            # or the operand order, and nothing reads the variable before its next write)
            var = self.variables[pattern.name]
            self.emit(indent, f"{var} = {tensor_expr}")
            self.check(indent, var, "optional input '{}' is absent", repr(pattern.name))
            return bound | {pattern.name}
        tensor = self.fresh("t")
        self.emit(indent, f"{tensor} = {tensor_expr}")
        if isinstance(pattern, Var):
            var = self.variables[pattern.name]
            self.check(indent, tensor, "optional input '{}' is absent", repr(pattern.name))
            self.check(indent, f"{var} == {tensor}",
                       "'{}' must be the same tensor in both places ({} vs {})",
                       repr(pattern.name), var, tensor)
            return bound | {pattern.name}
        if isinstance(pattern, Const):
            value, name = self.fresh("c"), repr(pattern.name)
            self.emit(indent, f"{value} = constant_value({tensor}) if {tensor} else None")
            self.check(indent, f"{value} is not None", "'{}' ({}) is not a constant", name,
                       f"{tensor} or 'absent'")
            if pattern.scalar:
                self.check(indent, f"{value}.size == 1", "'{}' ({}) has {} elements, not one",
                           name, tensor, f"{value}.size")
            if pattern.predicate is not None:
                self.check(indent, f"{self.const(pattern.predicate)}({value})",
                           "'{}' ({}): {}", name, tensor, repr(pattern.reason))
            self.emit(indent, f"{self.variables[pattern.name]} = {tensor}")
            return bound | {pattern.name}
        op_pattern = _op_of(pattern)
        output_index = pattern.index if isinstance(pattern, OpOutput) else 0
        producer = self._node_var(path)
        if path not in self.prechecked:
            self.emit(indent, f"{producer} = producer_of({tensor})")
            self.check(indent, f"{producer} is not None", "'{}' is not produced by a {} node",
                       tensor, repr(op_pattern.op_type))
        if output_index:
            outputs = self.fresh("outs")
            self.emit(indent, f"{outputs} = outputs_of({producer})")
            condition = (f"len({outputs}) > {output_index} and "
                         f"{outputs}[{output_index}] == {tensor}")
        else:  # (output 0 exists: the producer produces the tensor)
            condition = f"outputs_of({producer})[0] == {tensor}"
        self.check(indent, condition, "'{}' is not output {} of {}", tensor, str(output_index),
                   self.label(producer))
        return self._node(op_pattern, path, self.fresh("ins"), indent, bound)


def generate(alternatives: list[OpExpr], mode: str) -> Callable:
    """``bind(graph)`` for the alternatives anchored at one op type, tried in order (see the
    module docstring); ``bind.source`` is the generated source."""
    emitter = _Emitter(mode)
    emit = emitter.emit
    if mode == EXPLAIN:
        emit(2, "misses = []")
    for pattern in alternatives:
        emitter.alternative(pattern, 2)
        if mode == EXPLAIN:
            emit(2, "misses.append(miss)")
    emit(2, "return misses[0] if len(misses) == 1 else JoinedMiss(misses)"
         if mode == EXPLAIN else "return None")
    lines = ["def bind(graph):", *(f"    {name} = {value}" for name, value in _PROLOGUE),
             "    def matcher(nid):", "        ins = inputs_of(nid)"]
    source = "\n".join([*lines, *emitter.lines, "    return matcher"])
    namespace = emitter.namespace
    exec(compile(source, f"<graphopt {mode} matcher>", "exec"), namespace)
    bind = namespace["bind"]
    bind.source = source
    return bind
