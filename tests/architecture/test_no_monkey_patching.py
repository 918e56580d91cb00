"""No monkey-patching (a house rule): the runtime (``executor/``), the
application (``trainer/``), the optimizer (``graphopt/``, ``rules/``) and ``cli.py`` change only
what they own. A static scan of every module flags

- an attribute assigned (or deleted) on an imported name: a module, class or function that
  belongs to someone else (``session_module.Session.run = ...``);
- ``X.fn = ...`` on anything but ``self``: the plan's step functions belong to the plan (the
  distributed trainer used to wrap them to launch all-reduces; ``Session.run(on_step=...)``
  is the way in);
- a method replaced on an object the function did not create (a parameter, or a value reached
  through one): a callable assigned (a lambda, a function defined here, ``functools.partial``)
  or any assignment to a name that is a method of some class of the project;
- a class's attribute assigned from outside its body, and ``setattr``/``delattr`` on anything
  but ``self``.

Owned, and so allowed: ``self``'s attributes, objects the function built (``x = Thing()``),
this module's own functions and globals (a kernel's ``fn.supports = ...``), and plain data
fields of anything (``proto.elem_type = ...``: protobuf and dataclass fields are data).
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCANNED = ("executor", "trainer", "graphopt", "rules", "cli.py")
DEFINING = ("graphopt", "executor", "trainer", "rules")   # whose methods count as methods


def _root(expr: ast.expr) -> ast.expr:
    """The expression an attribute chain / call / subscript hangs off."""
    while True:
        if isinstance(expr, (ast.Attribute, ast.Subscript, ast.Starred)):
            expr = expr.value
        elif isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
            expr = expr.func.value   # obj.method(...) returns something obj owns
        else:
            return expr


def _is_property(function) -> bool:
    """Assigning a property goes through its setter: data, not a replaced method."""
    return any(ast.unparse(d).endswith(("property", ".setter")) for d in function.decorator_list)


def _data(value: ast.expr | None) -> bool:
    """A value that cannot be a function: a literal, arithmetic, a CONSTANT."""
    if isinstance(value, (ast.Constant, ast.JoinedStr, ast.List, ast.Tuple, ast.Set, ast.Dict,
                          ast.BinOp, ast.UnaryOp, ast.Compare, ast.BoolOp)):
        return True
    last = value.id if isinstance(value, ast.Name) else (
        value.attr if isinstance(value, ast.Attribute) else None)
    return last is not None and last.isupper()


def method_names(folders=DEFINING) -> set[str]:
    names = set()
    for folder in folders:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    names.update(item.name for item in node.body
                                 if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                                 and not _is_property(item)
                                 and not (item.name.startswith("__") and item.name != "__init__"))
    return names


class _Scope:
    def __init__(self, parent: _Scope | None, foreign: set[str], owner: str | None = None):
        self.parent, self.foreign, self.owner = parent, set(foreign), owner
        self.functions: set[str] = set()   # defined here by def: owned callables
        self.owned: set[str] = set()       # assigned here from something owned

    def is_foreign(self, name: str) -> bool:
        scope = self
        while scope is not None:
            if name in scope.owned or name in scope.functions:
                return False
            if name in scope.foreign:
                return True
            scope = scope.parent
        return False

    def is_function(self, name: str) -> bool:
        scope = self
        while scope is not None:
            if name in scope.functions:
                return True
            scope = scope.parent
        return False


class Scanner(ast.NodeVisitor):
    """Collects ``(line, what)`` for every patch in one module."""

    def __init__(self, methods: set[str]):
        self.methods = methods
        self.found: list[tuple[int, str]] = []
        self.imported: set[str] = set()
        self.classes: set[str] = set()
        self.scope = _Scope(None, set())
        self.class_stack: list[str] = []
        self.method_ids: set[int] = set()   # functions defined directly in a class body

    # -- scopes ---------------------------------------------------------------------------
    def visit_Module(self, node: ast.Module) -> None:
        for item in ast.walk(node):
            if isinstance(item, (ast.Import, ast.ImportFrom)):
                self.imported.update((a.asname or a.name).split(".")[0] for a in item.names)
            elif isinstance(item, ast.ClassDef):
                self.classes.add(item.name)
        self.scope.foreign |= self.imported
        self._predeclare(node.body)
        self.generic_visit(node)

    def _predeclare(self, body) -> None:
        for item in body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.scope.functions.add(item.name)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.method_ids.update(id(item) for item in node.body
                               if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)))
        self.class_stack.append(node.name)
        self.generic_visit(node)
        self.class_stack.pop()

    def visit_FunctionDef(self, node) -> None:
        self.scope.functions.add(node.name)
        params = [a.arg for a in (*node.args.posonlyargs, *node.args.args,
                                  *node.args.kwonlyargs)]
        params += [a.arg for a in (node.args.vararg, node.args.kwarg) if a is not None]
        owner = params[0] if id(node) in self.method_ids and params else None
        self.scope = _Scope(self.scope, {p for p in params if p != owner}, owner)
        self._predeclare(node.body)
        for item in node.body:
            self.visit(item)
        self.scope = self.scope.parent

    visit_AsyncFunctionDef = visit_FunctionDef

    # -- bindings -------------------------------------------------------------------------
    def _owned_value(self, value: ast.expr | None) -> bool:
        if value is None:
            return False
        if isinstance(value, ast.Call):
            maker = _root(value.func)
            if isinstance(value.func, ast.Name) or (isinstance(maker, ast.Name)
                                                    and maker.id in self.imported):
                return True                    # built here: a class, a factory, np.zeros(...)
        root = _root(value)
        if isinstance(root, ast.Name):
            return root.id == self.scope.owner or not self.scope.is_foreign(root.id)
        return True                            # literals, comprehensions, lambdas

    def _bind(self, target: ast.expr, owned: bool) -> None:
        for sub in ast.walk(target):
            if isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Store):
                (self.scope.owned if owned else self.scope.foreign).add(sub.id)
                (self.scope.foreign if owned else self.scope.owned).discard(sub.id)

    def visit_For(self, node: ast.For) -> None:
        self._bind(node.target, self._owned_value(node.iter))
        self.generic_visit(node)

    visit_AsyncFor = visit_For

    def visit_comprehension(self, node: ast.comprehension) -> None:
        self._bind(node.target, self._owned_value(node.iter))
        self.generic_visit(node)

    def visit_withitem(self, node: ast.withitem) -> None:
        if node.optional_vars is not None:
            self._bind(node.optional_vars, self._owned_value(node.context_expr))
        self.generic_visit(node)

    def visit_NamedExpr(self, node: ast.NamedExpr) -> None:
        self._bind(node.target, self._owned_value(node.value))
        self.generic_visit(node)

    # -- stores ---------------------------------------------------------------------------
    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            self._store(target, node.value, node.lineno)
            self._bind(target, self._owned_value(node.value))
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._store(node.target, node.value, node.lineno)
        self._bind(node.target, self._owned_value(node.value))
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._store(node.target, node.value, node.lineno)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for target in node.targets:
            self._store(target, None, node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args:
            root = _root(node.args[0])
            if not (isinstance(root, ast.Name) and root.id == self.scope.owner):
                self.found.append((node.lineno, f"{func.id}({ast.unparse(node.args[0])}, ...) "
                                                "on an object it does not own"))
        self.generic_visit(node)

    def _callable(self, value: ast.expr | None) -> bool:
        if isinstance(value, ast.Lambda):
            return True
        if isinstance(value, ast.Name):
            return self.scope.is_function(value.id)
        if isinstance(value, ast.Call):
            name = ast.unparse(value.func)
            return name in ("partial", "functools.partial", "types.MethodType")
        return False

    def _store(self, target: ast.expr, value: ast.expr | None, line: int) -> None:
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                self._store(element, None, line)
            return
        if isinstance(target, ast.Subscript) and isinstance(target.value, ast.Attribute) \
                and target.value.attr == "__dict__":
            target = target.value   # obj.__dict__[k] = v: a store on obj
        if not isinstance(target, ast.Attribute):
            return
        text = ast.unparse(target)
        root = _root(target)
        name = root.id if isinstance(root, ast.Name) else None
        on_self = name is not None and name == self.scope.owner
        if target.attr == "fn" and not (on_self and isinstance(target.value, ast.Name)):
            self.found.append((line, f"{text} = ...: replaces a step function it does not own"))
        elif name in self.imported and not self.scope.is_function(name) \
                and name not in self.scope.owned:
            self.found.append((line, f"{text} = ...: patches the imported {name!r}"))
        elif name in self.classes and (not self.class_stack or self.class_stack[-1] != name) \
                and not on_self:
            self.found.append((line, f"{text} = ...: changes class {name!r} from outside it"))
        elif name is not None and not on_self and self.scope.is_foreign(name) and (
                self._callable(value) or (target.attr in self.methods and not _data(value))):
            self.found.append((line, f"{text} = ...: replaces a method of an object it does "
                                     "not own"))


def scan(source: str, methods: set[str] | None = None) -> list[tuple[int, str]]:
    scanner = Scanner(method_names() if methods is None else methods)
    scanner.visit(ast.parse(source))
    return scanner.found


# -- the scanner itself, on small examples --------------------------------------------------
PATCHES = {
    "wrapped step function": """
def install(plan, wrap):
    for step in plan.steps:
        step.fn = wrap(step.fn)
""",
    "step function through self": """
class Reducer:
    def install(self):
        for step in self.plan.steps:
            step.fn = self.wrap(step.fn)
""",
    "imported module": """
from graphopt.executor import session
session.Session.run = lambda self, feeds: {}
""",
    "imported class inside a function": """
def patch():
    from graphopt.trainer.distributed import GradientReducer
    GradientReducer.stage = None
""",
    "lambda onto a parameter": """
def hook(session):
    session.run = lambda *a, **k: {}
""",
    "local function onto a parameter's attribute": """
def hook(trainer):
    def quiet(*args):
        return None
    trainer.session.reseed = quiet
""",
    "method name onto a value reached through a parameter": """
def hook(trainer, other):
    session = trainer.session
    session.run = other
""",
    "setattr on a parameter": """
def hook(obj, fn):
    setattr(obj, "run", fn)
""",
    "class attribute from outside": """
class Session:
    pass

def later(fn):
    Session.run = fn
""",
}

ALLOWED = {
    "own attributes": """
class Step:
    def __init__(self, fn):
        self.fn = fn
        self.run = lambda: None
        setattr(self, "count", 0)
""",
    "objects built here": """
def build(spec):
    node = Node()
    node.spec = spec
    node.run = lambda: None
    return node
""",
    "this module's function": """
def kernel(ctx, node):
    return None

def supports(node):
    return True

kernel.supports = supports
""",
    "data fields of a parameter": """
def to_float16(model):
    for value in model.graph.input:
        value.type.tensor_type.elem_type = HALF
        value.run = 3
""",
}


@pytest.mark.parametrize("name", PATCHES)
def test_the_scanner_finds_each_kind_of_patch(name):
    assert scan(PATCHES[name], {"run", "stage", "reseed"}), name


@pytest.mark.parametrize("name", ALLOWED)
def test_the_scanner_allows_what_code_owns(name):
    assert scan(ALLOWED[name], {"run", "stage", "reseed"}) == [], name


# -- the project ----------------------------------------------------------------------------
def test_the_source_patches_nothing_it_does_not_own():
    methods = method_names()
    found, scanned = [], set()
    for folder in SCANNED:
        paths = [ROOT / folder] if folder.endswith(".py") else (ROOT / folder).rglob("*.py")
        for path in sorted(paths):
            scanned.add(path.relative_to(ROOT).as_posix())
            for line, what in scan(path.read_text(), methods):
                found.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert {"executor/session.py", "trainer/distributed/buckets.py", "cli.py"} <= scanned
    assert found == [], "\n".join(found)
