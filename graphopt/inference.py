"""ONNX shape inference, bounded: the one way graphopt (and the executor) runs it.

ONNX's data propagation (``infer_shapes(..., data_prop=True)``) turns shapes computed by
Shape/Gather/Concat chains into static ones, which the rules and the gradient builders rely
on. It holds every propagated value as a C++ ``TensorShapeProto`` of one dim message per
element (about 70-150 bytes each), with no limit: ``x = Concat(x, x)`` 30 times over a
two-element constant makes a 1 KB model ask for billions of them, and a Cast of a declared
1-D input of length 1e9 makes a billion more (a propagating op reads an input without a
value as "rank-1 tensor of known length L": L unknown dims).

:func:`infer_shapes` therefore runs inference without data propagation first, and then with
it only when :func:`propagation_cost` proves that what propagation may hold stays under
:data:`DATA_PROP_BUDGET` dims; otherwise the first result stands (fewer static shapes,
never a wrong one). The bound follows onnx/defs (1.17-1.23) and onnx/shape_inference:

* values exist for int32/int64 initializers and Constants of rank <= 1 (their elements),
  and for the outputs of the ops with a data propagation function (:data:`PROPAGATING`),
  bounded per op (Concat: the sum of its inputs, Gather: its indices, Shape: the rank, ...);
* an input of such an op with no value, typed rank 1 with a known length L, costs L;
* the second pass can know shapes the first could not only below the ops whose inference
  reads a propagated value (:data:`SHAPE_FROM_VALUES`: Reshape, Expand, ConstantOfShape,
  AffineGrid, Resize); where such a tensor (or one computed from it) has no static length or
  rank in the first pass and a propagating op reads it, the cost is unbounded;
* model-local functions and schema functions run their bodies with propagation: a body
  with a propagating op makes the cost unbounded.

Both passes run on a weight-free view of the model (:func:`weight_free_view`): initializers
above :data:`KEEP_VALUES` elements without their bytes, so inference never copies the
weights (it serializes the model it is given, and parses the result back).
"""
from __future__ import annotations

import math

import onnx

from .vocabulary import STANDARD_DOMAIN, normalize_domain, subgraphs_of, type_dims

# Propagated values ONNX may hold in one inference, in dims (elements of shape-like tensors).
# Real models use a few thousand (a few dims per Shape/Gather/Concat tensor); 1 << 18 dims
# is at most ~40 MB.
DATA_PROP_BUDGET = 1 << 18

# Initializers (and Constant values) up to this many elements keep their values in the view
# inference sees: shape inference reads the values of shape-like tensors only (Reshape
# targets, Slice bounds, axes, split sizes, Resize scales), never of weights.
KEEP_VALUES = 4096
_KEEP_BYTES = 1 << 20  # a "small" tensor whose proto is this big anyway is a weight

# ops with a data propagation function, per onnx/defs (every opset version that has one)
PROPAGATING = frozenset({"Add", "Sub", "Mul", "Cast", "Concat", "Gather", "Shape", "Size",
                         "Slice", "Squeeze", "Unsqueeze"})
# op -> the input whose propagated value the op's shape inference reads (getShapeInput)
SHAPE_FROM_VALUES = {"Reshape": 1, "Expand": 1, "ConstantOfShape": 0, "AffineGrid": 1,
                     "Resize": 3}
_SHAPE_INTS = (onnx.TensorProto.INT32, onnx.TensorProto.INT64)
INF = math.inf


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """``onnx.shape_inference.infer_shapes(model, data_prop=True)``, as far as that stays
    bounded (module docstring), on a weight-free view of ``model``: the result's graph has
    the inferred value_info, inputs and outputs, but not the model's weights (read those,
    and initializer values, from ``model``). Raises what onnx raises."""
    view, declared_inputs = weight_free_view(model)
    first = onnx.shape_inference.infer_shapes(view, data_prop=False)
    if propagation_cost(view, first) <= DATA_PROP_BUDGET:
        inferred = onnx.shape_inference.infer_shapes(view, data_prop=True)
    else:
        inferred = first
    del inferred.graph.input[declared_inputs:]  # the view's stand-ins for large int vectors
    return inferred


# ---- the weight-free view ---------------------------------------------------------------
def _numel(dims) -> int:
    return math.prod(int(d) for d in dims)


def _keeps_values(tensor: onnx.TensorProto) -> bool:
    return _numel(tensor.dims) <= KEEP_VALUES and tensor.ByteSize() <= _KEEP_BYTES


def weight_free_view_differs(tensor: onnx.TensorProto) -> bool:
    """Whether the checker's view (``weight_free_view(for_checker=True)``) shows this
    initializer otherwise than the model does: a large or external one."""
    return tensor.data_location == onnx.TensorProto.EXTERNAL or not _keeps_values(tensor)


def _without_values(tensor: onnx.TensorProto) -> onnx.TensorProto:
    bare = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type)
    bare.dims.extend(tensor.dims)
    return bare


def weight_free_view(model: onnx.ModelProto, *, for_checker: bool = False
                     ) -> tuple[onnx.ModelProto, int]:
    """A copy of ``model`` for shape inference, and how many graph inputs it declares.
    Small initializers are copied; a large one keeps its name, type and dims but not its
    bytes; a large int32/int64 vector (whose value propagation would try to read) becomes a
    graph input of its type instead, appended after the declared ones. Large Constant
    values of the main graph lose their bytes the same way (int vectors stay).

    ``for_checker``: a view the ONNX checker accepts (it refuses a tensor without its bytes):
    every large initializer becomes a graph input of its type, and Constants keep their
    values; so does an external tensor of any size (the checker would look for its file
    relative to the working directory). The checker then checks everything but those
    tensors' contents."""
    view = onnx.ModelProto(ir_version=model.ir_version)
    view.opset_import.extend(model.opset_import)
    view.functions.extend(model.functions)
    src, graph = model.graph, view.graph
    graph.name = src.name
    for node in src.node:
        graph.node.append(node if for_checker else (_light_constant(node) or node))
    graph.input.extend(src.input)
    graph.output.extend(src.output)
    graph.value_info.extend(src.value_info)
    graph.sparse_initializer.extend(src.sparse_initializer)
    declared = len(graph.input)
    inputs = {vi.name for vi in src.input}
    for tensor in src.initializer:
        external = tensor.data_location == onnx.TensorProto.EXTERNAL
        if _keeps_values(tensor) and not (for_checker and external):
            graph.initializer.append(tensor)
        elif for_checker or (tensor.data_type in _SHAPE_INTS and len(tensor.dims) <= 1):
            if tensor.name not in inputs:
                graph.input.append(onnx.helper.make_tensor_value_info(
                    tensor.name, tensor.data_type, list(tensor.dims)))
        else:
            graph.initializer.append(_without_values(tensor))
    return view, declared


def _light_constant(node: onnx.NodeProto) -> onnx.NodeProto | None:
    """A large non-integer Constant without its bytes (None: keep the node as it is)."""
    if node.op_type != "Constant" or normalize_domain(node.domain) != STANDARD_DOMAIN:
        return None
    for index, attr in enumerate(node.attribute):
        if (attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR
                and not _keeps_values(attr.t) and attr.t.data_type not in _SHAPE_INTS):
            light = onnx.NodeProto(name=node.name, op_type=node.op_type, domain=node.domain)
            light.input.extend(node.input)
            light.output.extend(node.output)
            for other, kept in enumerate(node.attribute):
                if other != index:
                    light.attribute.append(kept)
            light.attribute.append(onnx.helper.make_attribute("value", _without_values(attr.t)))
            return light
    return None


# ---- the bound --------------------------------------------------------------------------
def _shape(type_proto: onnx.TypeProto) -> tuple | None:
    """Dims (int, or None where unknown) of a tensor type; None when its rank is unknown."""
    if not type_proto.HasField("tensor_type"):
        return None
    dims = type_dims(type_proto)
    return None if dims is None else tuple(d if isinstance(d, int) else None for d in dims)


def _collect_shapes(graph: onnx.GraphProto, shapes: dict) -> None:
    for vi in (*graph.input, *graph.value_info, *graph.output):
        shapes[vi.name] = _shape(vi.type)
    for tensor in graph.initializer:
        shapes[tensor.name] = tuple(int(d) for d in tensor.dims)
    for node in graph.node:
        for sub in subgraphs_of(node):
            _collect_shapes(sub, shapes)


def _axis(node: onnx.NodeProto) -> int:
    """The axis attribute (0 when absent); a negative one may be axis 0 of a vector."""
    return next((a.i for a in node.attribute if a.name == "axis"), 0)


class _Bound:
    """Upper bounds on the values data propagation may hold, walked in graph order."""

    def __init__(self, model: onnx.ModelProto, shapes: dict):
        self.shapes = shapes  # from inference without propagation
        self.values: dict[str, float] = {}  # name -> most dims its value can have
        self.counted: set[str] = set()
        self.constants: dict[str, int] = {}  # int vectors propagation reads on first use
        self.gains: set[str] = set()  # may get a static shape only with propagation
        self.cost: float = 0
        self.opsets = {normalize_domain(o.domain): o.version for o in model.opset_import}
        self.functions = {(f.domain, f.name): f for f in model.functions}
        self._body_propagates: dict = {}

    # a propagating op's getInputData: a value it has, or L unknown dims from its type
    def read(self, name: str) -> float | None:
        if not name:
            return None
        if name in self.values:
            return self.values[name]
        if name in self.constants:
            size = self.constants[name]
        else:
            shape = self.shapes.get(name)
            if shape is None or (len(shape) == 1 and shape[0] is None):
                return INF if name in self.gains else None
            if len(shape) != 1:
                return None
            size = shape[0]
        self.values[name] = size
        self.cost += size
        return size

    def produce(self, name: str, size: float | None) -> None:
        if name and size is not None:
            self.values[name] = size
            self.cost += size

    def static(self, name: str) -> bool:
        shape = self.shapes.get(name)
        return shape is not None and all(d is not None for d in shape)

    def walk(self, graph: onnx.GraphProto) -> None:
        for tensor in graph.initializer:
            if (tensor.data_type in _SHAPE_INTS and len(tensor.dims) <= 1
                    and _keeps_values(tensor)):
                self.constants[tensor.name] = _numel(tensor.dims)
        for node in graph.node:
            if self.cost == INF:
                return
            inner = set()
            for sub in subgraphs_of(node):
                self.walk(sub)
                inner.update(i for n in sub.node for i in n.input)
            self.node(node)
            if any(i in self.gains for i in (*node.input, *inner)):
                self.gains.update(o for o in node.output if o and not self.static(o))

    def node(self, node: onnx.NodeProto) -> None:
        domain, op = normalize_domain(node.domain), node.op_type
        if domain != STANDARD_DOMAIN:
            if (node.domain, op) in self.functions and self._function_propagates(
                    self.functions[(node.domain, op)]):
                self.cost = INF
            return
        if op == "Constant":
            self._constant(node)
        elif op in PROPAGATING:
            self._propagate(node, op)
        elif self._schema_body_propagates(op):
            self.cost = INF
        index = SHAPE_FROM_VALUES.get(op)
        # getShapeInput: an initializer's value first (the same in both passes), then a
        # propagated one (generated, or the unknown dims an earlier read put there)
        if index is not None and len(node.input) > index and node.input[index] in self.values:
            self.gains.update(o for o in node.output if o and not self.static(o))

    def _constant(self, node: onnx.NodeProto) -> None:
        for attr in node.attribute:
            if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
                if attr.t.data_type in _SHAPE_INTS and len(attr.t.dims) <= 1:
                    self.constants[node.output[0]] = _numel(attr.t.dims)
            elif attr.name == "value_int":
                self.constants[node.output[0]] = 1
            elif attr.name == "value_ints":
                self.constants[node.output[0]] = len(attr.ints)

    def _propagate(self, node: onnx.NodeProto, op: str) -> None:
        ins, out = list(node.input), node.output[0] if node.output else ""
        if op == "Shape":
            shape = self.shapes.get(ins[0]) if ins else None
            if shape is None:
                self.produce(out, INF if ins and ins[0] in self.gains else None)
            else:
                self.produce(out, len(shape))
        elif op == "Size":
            self.produce(out, 1 if ins and self.read(ins[0]) is not None else None)
        elif op == "Concat":
            if _axis(node) > 0:
                return
            total: float = 0
            for name in ins:
                size = self.read(name)
                if size is None:
                    return
                total += size
            self.produce(out, total or None)
        elif op == "Gather":
            if _axis(node) > 0:
                return
            if len(ins) == 2 and self.read(ins[0]) is not None:
                self.produce(out, self.read(ins[1]))
        elif op == "Slice":
            sizes = [self.read(name) for name in ins]
            if sizes and None not in sizes:
                self.produce(out, sizes[0])
        elif op in ("Add", "Sub", "Mul"):
            sizes = [self.read(name) for name in ins[:2]]
            if len(sizes) == 2 and None not in sizes:
                self.produce(out, max(sizes))
        elif ins:  # Cast, Squeeze, Unsqueeze: the value as it is
            self.produce(out, self.read(ins[0]))

    def _propagates(self, nodes, seen: frozenset) -> bool:
        for node in nodes:
            domain = normalize_domain(node.domain)
            if domain == STANDARD_DOMAIN and (node.op_type in PROPAGATING
                                              or self._schema_body_propagates(node.op_type)):
                return True
            key = (node.domain, node.op_type)
            if key in self.functions and key not in seen and self._propagates(
                    self.functions[key].node, seen | {key}):
                return True
            if any(self._propagates(sub.node, seen) for sub in subgraphs_of(node)):
                return True
        return False

    def _function_propagates(self, function: onnx.FunctionProto) -> bool:
        key = ("local", function.domain, function.name)
        if key not in self._body_propagates:
            self._body_propagates[key] = self._propagates(
                function.node, frozenset({(function.domain, function.name)}))
        return self._body_propagates[key]

    def _schema_body_propagates(self, op: str) -> bool:
        """An op ONNX infers by running its function body (no inference function of its
        own: MeanVarianceNormalization, GreaterOrEqual-12, ...) whose body propagates."""
        key = ("schema", op)
        if key not in self._body_propagates:
            self._body_propagates[key] = False
            try:
                schema = onnx.defs.get_schema(op, self.opsets.get(STANDARD_DOMAIN, 1),
                                              STANDARD_DOMAIN)
            except onnx.defs.SchemaError:
                return False
            if not schema.has_type_and_shape_inference_function and schema.has_function:
                self._body_propagates[key] = self._propagates(
                    schema.function_body.node, frozenset())
        return self._body_propagates[key]


def propagation_cost(view: onnx.ModelProto, first: onnx.ModelProto) -> float:
    """Most dims data propagation may hold when inferring ``view`` (math.inf: no bound),
    from the types ``first`` (``view`` inferred without propagation) has."""
    shapes: dict = {}
    _collect_shapes(first.graph, shapes)
    bound = _Bound(view, shapes)
    bound.walk(view.graph)
    return bound.cost
