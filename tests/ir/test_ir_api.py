"""The IR answers questions; nobody unpacks its dicts. Code outside graphopt/ir.py reads a
graph through its read API and never touches a private name of the IR (its indexes, type
table, journal helpers): checked on the syntax tree of every Python file in the repository.
Also what the read API answers, on a small graph with a subgraph."""
from __future__ import annotations

import ast
import pathlib
import re

from support.models import model_from_text

from graphopt import modelio

ROOT = pathlib.Path(__file__).resolve().parents[2]
IR = ROOT / "graphopt" / "ir.py"
SKIPPED_FOLDERS = {".git", "venv", ".venv", "build", "node_modules", "__pycache__"}


def _private_names(tree: ast.AST) -> set[str]:
    """Every ``_name`` the classes of ``tree`` define: attributes set on ``self``, methods."""
    names = set()
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == "self":
                names.add(node.attr)
            elif isinstance(node, ast.FunctionDef):
                names.add(node.name)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def _python_files():
    for path in sorted(ROOT.rglob("*.py")):
        if path != IR and not SKIPPED_FOLDERS & set(path.relative_to(ROOT).parts):
            yield path, ast.parse(path.read_text())


def _private_uses(tree: ast.AST, private: set[str], shared: set[str]):
    """``x._name`` (x not self/cls: a class's own ``_name`` is its business) and
    ``getattr(x, "_name")`` for the IR's private names. A name some other class of the
    repository defines too (``shared``) counts only on something called a graph or model."""
    def counts(name, owner: ast.AST) -> bool:
        if name not in private:
            return False
        return name not in shared or bool(re.search(r"graph|model", ast.unparse(owner), re.I))

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and counts(node.attr, node.value) and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            yield node.lineno, ast.unparse(node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) \
                and counts(node.args[1].value, node.args[0]):
            yield node.lineno, ast.unparse(node)


IR_PRIVATE = _private_names(ast.parse(IR.read_text()))


def test_the_ir_has_private_indexes_to_protect():
    assert {"_producer", "_consumers", "_node_inputs", "_op_keys", "_implicit",
            "_types", "_initializers"} <= IR_PRIVATE


def test_no_module_outside_ir_touches_a_private_name_of_the_ir():
    files = list(_python_files())
    shared = IR_PRIVATE & set().union(*(_private_names(tree) for _, tree in files))
    found = [f"{path.relative_to(ROOT)}:{line}: {text}" for path, tree in files
             for line, text in _private_uses(tree, IR_PRIVATE, shared)]
    assert found == []


def test_the_scan_finds_a_private_use():
    """The check above can fail: it sees the kind of use it forbids, and tells a graph's
    private name from another class's private name that happens to be spelled alike."""
    tree = ast.parse("def f(graph, session):\n    return graph._implicit.get(1), "
                     "getattr(graph, '_producer'), m.graph._initializers, "
                     "session._initializers\n")
    uses = {text for _, text in _private_uses(tree, IR_PRIVATE, {"_initializers"})}
    assert uses == {"graph._implicit", "getattr(graph, '_producer')", "m.graph._initializers"}


IF_READS_OUTER = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (bool c, float[2] x) => (float[2] z) {
      t = Relu(x)
      u = Identity(t)
      z = If(c) <then_branch = g1 () => (float[2] a) { a = Neg(u) },
                 else_branch = g2 () => (float[2] b) { b = Abs(t) }>
    }"""


def test_the_read_api_answers_from_the_indexes():
    graph = modelio.load(model_from_text(IF_READS_OUTER)).graph
    relu, identity = graph.nodes_of_type("Relu")[0], graph.nodes_of_type("Identity")[0]
    branch = graph.nodes_of_type("If")[0]
    assert graph.op_key(relu) == ("", "Relu") and graph.op_key(10**6) is None
    assert graph.inputs_of(relu) == ("x",) and graph.outputs_of(relu) == ("t",)
    assert graph.producer_of("t") == relu and graph.producer_of("x") is None
    assert graph.consumers_of("t") == [identity, branch]  # the If reads t in a branch
    assert graph.implicit_inputs(branch) == ["u", "t"]
    assert graph.read_by_subgraph("t") and graph.read_by_subgraph("u")
    assert not graph.read_by_subgraph("x")
    assert graph.owns_subgraphs(branch) and graph.subgraph_owner_ids() == [branch]
    assert graph.order_of(relu) < graph.order_of(identity) < graph.order_of(branch)
    assert graph.is_used("z") and graph.is_used("u") and not graph.is_used("nothing")
    assert graph.is_defined("x") and graph.is_defined("u") and not graph.is_defined("a")
    assert graph.has_tensor("t") and not graph.has_tensor("a")
    assert graph.op_counts() == {("", "Relu"): 1, ("", "Identity"): 1, ("", "If"): 1}
    assert graph.neighbours([identity]) == dict.fromkeys([identity, relu, branch])
    assert graph.node_count() == 3 and graph.name_of(relu) == ""


def test_redirect_readers_rewires_every_input_and_rolls_back():
    graph = modelio.load(model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2] x) => (float[2] z) {
          t = Relu(x)
          z = Add(t, t)
        }""")).graph
    add = graph.nodes_of_type("Add")[0]
    before = graph.index_snapshot()
    graph.begin()
    graph.redirect_readers("t", "x")
    assert graph.inputs_of(add) == ("x", "x") and graph.consumers_of("t") == []
    graph.rollback()
    assert graph.index_snapshot() == before
