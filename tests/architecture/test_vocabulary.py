"""graphopt.vocabulary spells the words the layers share once: a string constant equal to one
of them anywhere else in the source (docstrings aside), or a second definition of a name it
defines, fails here. Tests may spell the words (they check the values independently)."""
import ast
import pathlib
import types

import onnx
import pytest

from graphopt import vocabulary

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFINING_MODULE = ROOT / "graphopt" / "vocabulary.py"
VOCABULARY = {vocabulary.MS_DOMAIN, vocabulary.STANDARD_DOMAIN_ALIAS, vocabulary.YIELD_OP,
              vocabulary.BACKWARD_PASS_ATTRIBUTE}


def source_files():
    for folder in ("graphopt", "rules", "executor", "trainer"):
        yield from sorted((ROOT / folder).rglob("*.py"))
    yield ROOT / "cli.py"


def docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def spelled_again(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    skip = docstrings(tree)
    hits = sorted((node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value in VOCABULARY and id(node) not in skip)
    return [f"{path.relative_to(root)}:{line}: {value!r}" for line, value in hits]


def defined_again(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    """Assignments and definitions of a name graphopt.vocabulary defines (an import, which
    re-exports the one definition, is fine)."""
    names = {name for name, value in vars(vocabulary).items() if not name.startswith("_")
             and not isinstance(value, types.ModuleType) and name != "annotations"}
    hits = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined = [node.name]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined = [t.id for t in targets if isinstance(t, ast.Name)]
        else:
            continue
        hits += [(node.lineno, name) for name in defined if name in names]
    return [f"{path.relative_to(root)}:{line}: {name}" for line, name in sorted(hits)]


SCANS = [spelled_again, defined_again]


@pytest.mark.parametrize("scan", SCANS, ids=["literal spelled again", "name defined again"])
def test_the_vocabulary_is_spelled_and_defined_only_in_graphopt_vocabulary(scan):
    files = [path for path in source_files() if path != DEFINING_MODULE]
    assert len(files) > 50  # the scan sees the tree
    found = [hit for path in files for hit in scan(path)]
    assert not found, "use graphopt.vocabulary's names instead:\n" + "\n".join(found)


@pytest.mark.parametrize("scan, source, expected", [
    (spelled_again, '"""A docstring may say YieldOp."""\nDOMAIN = "com.microsoft"\n'
                    'def f(node):\n    """YieldOp"""\n    return node.op_type == "YieldOp"\n',
     ["x.py:2: 'com.microsoft'", "x.py:5: 'YieldOp'"]),
    (defined_again, "from graphopt.vocabulary import MS_DOMAIN\nFLOAT_TYPES = frozenset({1})\n"
                    "def normalize_domain(domain):\n    return domain\n",
     ["x.py:2: FLOAT_TYPES", "x.py:3: normalize_domain"]),
], ids=["literal spelled again", "name defined again"])
def test_the_scans_find_what_they_look_for(tmp_path, scan, source, expected):
    path = tmp_path / "x.py"
    path.write_text(source)
    assert scan(path, tmp_path) == expected


def test_the_executors_nodes_read_missing_attributes_from_the_schemas():
    from graphopt.executor.plan import PlannedNode

    def planned(op_type, domain="", opset=18, **attrs):
        return PlannedNode(index=0, name="n", op_type=op_type, domain=domain, opset=opset,
                           inputs=("x",), outputs=("y",), attrs=attrs)

    assert planned("ReduceSum").attr("keepdims") == 1
    assert planned("ReduceSum", keepdims=0).attr("keepdims") == 0
    assert planned("SoftmaxCrossEntropyLoss").attr("reduction") == "mean"  # str, as decoded
    assert planned("ReduceSumTraining", "com.microsoft", 1).attr("noop_with_empty_axes") == 0
    assert planned("FusedMatMul", "com.microsoft", 1, transA=1).attr("transA") == 1


def test_is_yield_op_accepts_the_contrib_yield_only():
    make = onnx.helper.make_node
    assert vocabulary.is_yield_op(make("YieldOp", ["x"], ["g"], domain="com.microsoft"))
    assert not vocabulary.is_yield_op(make("YieldOp", ["x"], ["g"]))
    assert not vocabulary.is_yield_op(make("Identity", ["x"], ["y"], domain="com.microsoft"))


@pytest.mark.parametrize("domain", ["", "ai.onnx"])
def test_both_spellings_of_the_standard_domain_normalize_to_one(domain):
    assert vocabulary.normalize_domain(domain) == ""
    assert vocabulary.normalize_domain("com.microsoft") == "com.microsoft"


def test_attribute_defaults_come_from_the_onnx_schemas():
    assert vocabulary.attribute_default("ReduceSum", "keepdims") == 1
    assert vocabulary.attribute_default("ReduceSum", "noop_with_empty_axes") == 0
    assert vocabulary.attribute_default("Gather", "axis") == 0
    assert vocabulary.attribute_default("Softmax", "axis", opset=11) == 1
    assert vocabulary.attribute_default("Softmax", "axis", opset=13) == -1
    assert vocabulary.attribute_default("FusedMatMul", "alpha", "com.microsoft") == 1.0
    # an attribute newer than the opset: the default that keeps the older behaviour
    assert vocabulary.attribute_default("ReduceSum", "noop_with_empty_axes", opset=11) == 0
    # an op ONNX Runtime runs before ONNX defines it (opset 17)
    assert vocabulary.attribute_default("LayerNormalization", "axis", opset=13) == -1
    assert vocabulary.attribute_default("SoftmaxCrossEntropyLoss", "reduction") == b"mean"
    with pytest.raises(KeyError):
        vocabulary.attribute_default("Transpose", "perm")  # no default: the reverse order


# Attribute defaults still written where they are read, and why the schema's would not do.
HAND_WRITTEN_DEFAULTS = {
    # floats: ONNX stores them as float32 (0.01 -> 0.0099999998), which would change float64
    # results; Clip-6's schema bounds are +-FLT_MAX where the kernel clips at +-inf
    ("executor/kernels/elementwise.py", "alpha"), ("executor/kernels/elementwise.py", "beta"),
    ("executor/kernels/elementwise.py", "min"), ("executor/kernels/elementwise.py", "max"),
    ("executor/kernels/nn.py", "epsilon"), ("executor/kernels/nn.py", "momentum"),
    # Softmax's axis as read for the standard op and ONNX Runtime's SoftmaxGrad_13 alike
    ("executor/kernels/nn.py", "axis"),
    # window_geometry reads a decoded attribute dict shared by Conv, the pools and ConvGrad
    ("executor/kernels/conv.py", "auto_pad"),
    # not ONNX attributes with a default: an ATen overload, SpaceToDepth's mode (ONNX has
    # none: the kernel accepts DepthToSpace's), YieldOp's optional list, ConcatTraining's
    # required axis
    ("executor/kernels/aten.py", "overload_name"), ("executor/kernels/shape.py", "mode"),
    ("executor/kernels/training_ops.py", "non_differentiable_outputs"),
    ("executor/output_sizes.py", "non_differentiable_outputs"),
    ("executor/output_sizes.py", "axis"),
}


def literal_defaults(path: pathlib.Path, root: pathlib.Path = ROOT) -> list[tuple[str, str]]:
    """``x.attr("name", <literal>)`` and ``x.attrs.get("name", <literal>)`` calls: an attribute
    read with its default written by hand."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)):
            continue
        reads_attribute = node.func.attr == "attr" or (
            node.func.attr == "get" and "attr" in ast.unparse(node.func.value))
        default = node.args[1]
        literal = isinstance(default, (ast.Constant, ast.UnaryOp, ast.List, ast.Tuple)) or (
            isinstance(default, ast.Attribute) and ast.unparse(default).startswith("math."))
        if reads_attribute and literal:
            found.append((str(path.relative_to(root)), node.args[0].value))
    return found


def test_attribute_defaults_are_not_written_by_hand():
    found = {hit for path in source_files() for hit in literal_defaults(path)}
    unexplained = sorted(found - HAND_WRITTEN_DEFAULTS)
    assert not unexplained, ("read these defaults with graphopt.vocabulary.attribute_default "
                             f"(node.attr in the executor, ctx.attr_or_default in gradients): "
                             f"{unexplained}")
    assert not HAND_WRITTEN_DEFAULTS - found, "an exception above no longer applies: remove it"


def test_the_default_scan_finds_a_hand_written_default(tmp_path):
    path = tmp_path / "x.py"
    path.write_text('a = node.attrs.get("keepdims", 1)\nb = ctx.attr("axis", -1)\n'
                    'c = node.attr("perm")\nd = node.attrs.get("end", rank)\n'
                    'e = node.attrs.get("min", -math.inf)\nf = options.get("level", 1)\n')
    assert literal_defaults(path, tmp_path) == [("x.py", "keepdims"), ("x.py", "axis"),
                                                ("x.py", "min")]
