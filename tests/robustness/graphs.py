"""A hypothesis strategy for random VALID ONNX graphs built around what the rules look for.

Every graph is a DAG of MatMul, Transpose, Mul, Div, Reshape, Gather, GatherND, Slice, Split,
Squeeze, Softmax, Add (and at most one com.microsoft YieldOp with a forward part feeding it
and backward nodes after it), with static shapes. The generator deliberately makes the
patterns of the rules common:

- Gather/Slice groups over one axis of a tensor that tile it (sometimes with an overlap, a
  gap, a missing piece or an extra non-piece consumer), with negative and clamped indices,
  int32 and int64 indices, scalar and [1] Gather indices, axes given or omitted;
- MatMul whose inputs are Transposes with random perms (FusedMatMul-expressible or not);
- Mul / Div of a MatMul input or output by a scalar constant (initializer, Constant node or
  an overridable initializer that is also a graph input), either operand order;
- Transpose -> GatherND(indices [..., 1]) -> Transpose (the dynamo form of fused_qkv[..., [i], :]);
- Gather of a Transpose, two Transposes in a row, small constant subgraphs;
- Identity nodes (also on graph outputs); shape arithmetic: a scale computed from
  ``Shape(x)`` (SDPA's), and ``chunk``-style Slices whose bounds are computed from
  ``Shape(x)`` of an input with symbolic dimensions besides the sliced one;
- fan-out (tensors read by several nodes), graph outputs in the middle of the graph, tensor
  and node names that collide with the names rules like to invent.

``build_model(draw)`` returns ``(model, info)``; ``graphs()`` is the strategy.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import onnx
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

MS = "com.microsoft"
INT64_MAX = 2**63 - 1

# Names the rules and the engine invent for new tensors and nodes: a generated graph that
# already uses them checks that fresh names are really fresh.
TRICKY_NAMES = ["split_sizes", "squeeze_axes", "gather_indices", "const", "Split", "Squeeze",
                "gather_slice_to_split/Split", "gather_slice_to_split/Split_output_0",
                "matmul_scale_to_fused_matmul/FusedMatMul", "Identity", "y/Identity",
                "matmul_transpose_to_fused_matmul/FusedMatMul_output_0", "splits"]

SCALES = [0.125, 0.5, 2.0, 3.0, -1.5, 1.0 / math.sqrt(8.0), 0.1, 1.0, 7.0]


class Builder:
    """Accumulates nodes, initializers, inputs and a pool of float tensors with shapes."""

    def __init__(self, draw, dtype: int, opset: int):
        self.draw = draw
        self.dtype = dtype
        self.np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.overridable: list[str] = []  # initializers also listed as graph inputs
        self.shape: dict[str, tuple[int, ...]] = {}
        self.pool: list[str] = []  # float tensors usable as operands
        self.used_names: set[str] = set()
        self.consumers: dict[str, int] = {}
        self.counter = itertools.count()
        self.rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
        self.backward_from: int | None = None  # index of the YieldOp node

    # ---- names --------------------------------------------------------------------
    def name(self, prefix: str) -> str:
        if self.draw(st.integers(0, 19)) == 0:
            for candidate in TRICKY_NAMES:
                if candidate not in self.used_names:
                    self.used_names.add(candidate)
                    return candidate
        while True:
            candidate = f"{prefix}{next(self.counter)}"
            if candidate not in self.used_names:
                self.used_names.add(candidate)
                return candidate

    def node_name(self, op_type: str) -> str:
        choice = self.draw(st.integers(0, 5))
        if choice == 0:
            return ""  # unnamed nodes: rules must not rely on names
        return self.name(op_type + "_")

    # ---- tensors ------------------------------------------------------------------
    def add(self, name: str, shape) -> str:
        self.shape[name] = tuple(int(d) for d in shape)
        self.pool.append(name)
        return name

    def values(self, shape) -> np.ndarray:
        return self.rng.standard_normal(shape).astype(self.np_dtype)

    def graph_input(self, shape) -> str:
        name = self.name("in")
        self.inputs.append(helper.make_tensor_value_info(name, self.dtype, list(shape)))
        return self.add(name, shape)

    def weight(self, shape, overridable: bool | None = None) -> str:
        name = self.name("w")
        self.inits.append(numpy_helper.from_array(self.values(shape), name))
        if overridable is None:
            overridable = self.draw(st.integers(0, 9)) == 0
        if overridable:
            self.overridable.append(name)
        return self.add(name, shape)

    def leaf(self, shape) -> str:
        """A new graph input or weight of this shape."""
        return self.graph_input(shape) if self.draw(st.booleans()) else self.weight(shape)

    def const(self, value: np.ndarray, prefix: str = "c", allow_node: bool = True) -> str:
        """A constant (not added to the float pool): an initializer or a Constant node."""
        name = self.name(prefix)
        if allow_node and self.draw(st.integers(0, 3)) == 0:
            self.nodes.append(helper.make_node(
                "Constant", [], [name], name=self.node_name("Constant"),
                value=numpy_helper.from_array(np.asarray(value), name)))
        else:
            self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        self.shape[name] = tuple(np.asarray(value).shape)
        return name

    def node(self, op_type, inputs, n_outputs=1, domain=None, out_shapes=None, pool=True,
             **attrs) -> list[str]:
        outputs = [self.name("t") for _ in range(n_outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs,
                                           name=self.node_name(op_type), domain=domain,
                                           **attrs))
        for name in inputs:
            if name:
                self.consumers[name] = self.consumers.get(name, 0) + 1
        for out, shape in zip(outputs, out_shapes or [], strict=False):
            if pool:
                self.add(out, shape)
            else:
                self.shape[out] = tuple(shape)
        return outputs

    def dims(self, rank: int, low: int = 1, high: int = 5) -> list[int]:
        return [self.draw(st.integers(low, high)) for _ in range(rank)]

    def pick(self, min_rank: int = 0, max_rank: int = 4, where=None) -> str:
        """A tensor from the pool (recent ones preferred, for deep chains), or a new leaf."""
        fits = [t for t in self.pool if min_rank <= len(self.shape[t]) <= max_rank
                and (where is None or where(self.shape[t]))]
        if fits and self.draw(st.integers(0, 5)) != 0:
            if self.draw(st.booleans()):
                return fits[-1 - self.draw(st.integers(0, min(2, len(fits) - 1)))]
            return fits[self.draw(st.integers(0, len(fits) - 1))]
        rank = self.draw(st.integers(max(min_rank, 1), max(min(max_rank, 4), 1)))
        for _ in range(20):
            shape = self.dims(rank)
            if where is None or where(tuple(shape)):
                return self.leaf(shape)
        return self.leaf(self._forced(rank, where))

    @staticmethod
    def _forced(rank, where):
        for shape in itertools.product(range(1, 5), repeat=rank):
            if where(shape):
                return list(shape)
        raise AssertionError("no shape satisfies the constraint")

    def perm(self, rank: int) -> list[int]:
        return list(self.draw(st.permutations(list(range(rank)))))

    def axis(self, rank: int) -> int:
        """An axis in [-rank, rank-1] (negative half the time)."""
        axis = self.draw(st.integers(0, rank - 1))
        return axis - rank if self.draw(st.booleans()) else axis

    def int_const(self, values, dtype=np.int64, prefix="i") -> str:
        return self.const(np.array(values, dtype=dtype), prefix)

    # ---- ops ----------------------------------------------------------------------
    def transpose(self, x: str | None = None, perm=None) -> str:
        x = x or self.pick(min_rank=1)
        shape = self.shape[x]
        perm = perm if perm is not None else self.perm(len(shape))
        return self.node("Transpose", [x], out_shapes=[[shape[p] for p in perm]], perm=perm)[0]

    def transposed_source(self, target) -> str:
        """A tensor of shape ``target`` made as Transpose(leaf or pool tensor, random perm)."""
        rank = len(target)
        perm = self.perm(rank)
        src_shape = [0] * rank
        for i, p in enumerate(perm):
            src_shape[p] = target[i]
        existing = [t for t in self.pool if list(self.shape[t]) == src_shape]
        src = existing[-1] if existing and self.draw(st.booleans()) else self.leaf(src_shape)
        return self.transpose(src, perm)

    def matmul(self):
        a = self.pick(min_rank=1)
        a_shape = self.shape[a]
        if len(a_shape) >= 2 and self.draw(st.integers(0, 2)) == 0:
            a = self.transpose(a, self.perm(len(a_shape)))  # a Transpose on the A side
            a_shape = self.shape[a]
        k = a_shape[-1]
        n = self.draw(st.integers(1, 5))
        b_rank = self.draw(st.sampled_from([1, 2, 2, len(a_shape)]))
        if b_rank == 1:
            b_shape = [k]
        elif b_rank == 2 or len(a_shape) < 3:
            b_shape = [k, n]
        else:
            batch = [d if self.draw(st.integers(0, 3)) else 1 for d in a_shape[:-2]]
            b_shape = batch + [k, n]
        choice = self.draw(st.integers(0, 3))
        if choice == 0 and len(b_shape) >= 2:
            b = self.transposed_source(b_shape)
        else:
            existing = [t for t in self.pool if list(self.shape[t]) == b_shape and t != a]
            b = existing[-1] if existing and choice == 1 else self.leaf(b_shape)
        if self.draw(st.integers(0, 3)) == 0:
            b = self.scaled(b)
        if self.draw(st.integers(0, 5)) == 0:
            a = self.scaled(a)
        a_shape, b_shape = self.shape[a], self.shape[b]  # a rank-1 scale keeps the ranks
        out_shape = self._matmul_shape(list(a_shape), list(b_shape))
        inputs = [a, b] if self.draw(st.integers(0, 7)) else [b, a] if (
            len(a_shape) == 1 and len(b_shape) == 1) else [a, b]
        out = self.node("MatMul", inputs, out_shapes=[out_shape])[0]
        if self.draw(st.booleans()):
            self.scaled(out)

    @staticmethod
    def _matmul_shape(a, b):
        a1, b1 = len(a) == 1, len(b) == 1
        if a1:
            a = [1] + a
        if b1:
            b = b + [1]
        batch_a, batch_b = a[:-2], b[:-2]
        rank = max(len(batch_a), len(batch_b))
        batch_a = [1] * (rank - len(batch_a)) + batch_a
        batch_b = [1] * (rank - len(batch_b)) + batch_b
        batch = [max(x, y) for x, y in zip(batch_a, batch_b, strict=True)]
        out = batch + [a[-2], b[-1]]
        if a1:
            del out[-2]
        if b1:
            del out[-1]
        return out

    def scale_const(self, rank: int) -> str:
        value = self.draw(st.sampled_from(SCALES))
        if self.draw(st.integers(0, 15)) == 0:
            value = 0.0  # Div by zero must not be "folded" into alpha = inf
        form = self.draw(st.integers(0, 5))
        if form == 5:  # a graph input that happens to have a scalar initializer: not constant
            name = self.name("s")
            self.inits.append(numpy_helper.from_array(np.array(value, self.np_dtype), name))
            self.overridable.append(name)
            self.shape[name] = ()
            return name
        shape = [(), (), (1,), (1, 1)][min(form, 3 if rank >= 2 else 2)]
        return self.const(np.full(shape, value, self.np_dtype), "s")

    def scaled(self, x: str | None = None) -> str:
        x = x or self.pick()
        s = self.scale_const(len(self.shape[x]))
        op_type = "Div" if self.draw(st.integers(0, 2)) == 0 else "Mul"
        inputs = [x, s] if op_type == "Div" or self.draw(st.booleans()) else [s, x]
        shape = list(self.shape[x])
        s_rank = len(self.shape[s])
        if s_rank > len(shape):
            shape = [1] * (s_rank - len(shape)) + shape
        return self.node(op_type, inputs, out_shapes=[shape])[0]

    def binary(self):
        """Add / Mul / Div of two float tensors (same shape or broadcast)."""
        x = self.pick()
        shape = list(self.shape[x])
        choice = self.draw(st.integers(0, 3))
        if choice == 0 and shape:
            y_shape = shape[self.draw(st.integers(0, len(shape) - 1)):]
        elif choice == 1:
            y_shape = [d if self.draw(st.booleans()) else 1 for d in shape]
        else:
            y_shape = shape
        existing = [t for t in self.pool if list(self.shape[t]) == y_shape and t != x]
        y = existing[-1] if existing and self.draw(st.booleans()) else self.leaf(y_shape)
        op_type = self.draw(st.sampled_from(["Add", "Add", "Mul", "Div"]))
        if op_type == "Div":  # keep divisors away from zero
            y = self.node("Add", [self.node("Mul", [y, y], out_shapes=[y_shape],
                                            pool=False)[0],
                                  self.const(np.array(1.0, self.np_dtype), "one")],
                          out_shapes=[y_shape], pool=False)[0]
        inputs = [x, y] if op_type == "Div" or self.draw(st.booleans()) else [y, x]
        self.node(op_type, inputs, out_shapes=[shape])

    def softmax(self):
        x = self.pick(min_rank=1)
        self.node("Softmax", [x], out_shapes=[self.shape[x]], axis=self.axis(len(self.shape[x])))

    def reshape(self):
        x = self.pick(min_rank=1)
        shape = list(self.shape[x])
        kind = self.draw(st.integers(0, 3))
        if kind == 0 and len(shape) >= 2:  # merge two neighbours
            i = self.draw(st.integers(0, len(shape) - 2))
            new = shape[:i] + [shape[i] * shape[i + 1]] + shape[i + 2:]
        elif kind == 1:  # split a dim into factors
            i = self.draw(st.integers(0, len(shape) - 1))
            d = shape[i]
            factors = [f for f in range(1, d + 1) if d % f == 0]
            f = self.draw(st.sampled_from(factors))
            new = shape[:i] + [f, d // f] + shape[i + 1:]
        elif kind == 2:
            new = [int(np.prod(shape))]
        else:
            new = shape[::-1] if len(shape) <= 3 else [int(np.prod(shape[:2]))] + shape[2:]
        written = list(new)
        if self.draw(st.booleans()) and written:
            written[self.draw(st.integers(0, len(written) - 1))] = -1
        self.node("Reshape", [x, self.int_const(written, prefix="shape")], out_shapes=[new])

    def squeeze(self):
        x = self.pick(min_rank=1, where=lambda s: 1 in s)
        shape = list(self.shape[x])
        ones = [i for i, d in enumerate(shape) if d == 1]
        chosen = sorted(self.draw(st.lists(st.sampled_from(ones), min_size=1, unique=True)))
        axes = [a - len(shape) if self.draw(st.booleans()) else a for a in chosen]
        out = [d for i, d in enumerate(shape) if i not in chosen]
        if self.opset < 13:
            self.node("Squeeze", [x], out_shapes=[out], axes=axes)
        else:
            self.node("Squeeze", [x, self.int_const(axes, prefix="axes")], out_shapes=[out])

    def split(self):
        x = self.pick(min_rank=1, where=lambda s: max(s) >= 2)
        shape = list(self.shape[x])
        axis_choices = [i for i, d in enumerate(shape) if d >= 2]
        axis = self.draw(st.sampled_from(axis_choices))
        sizes = self.partition(shape[axis])
        written_axis = axis - len(shape) if self.draw(st.booleans()) else axis
        outs = []
        for size in sizes:
            out = list(shape)
            out[axis] = size
            outs.append(out)
        if self.opset >= 18 and self.draw(st.booleans()) and shape[axis] % len(sizes) == 0:
            n = len(sizes)
            outs = [shape[:axis] + [shape[axis] // n] + shape[axis + 1:]] * n
            self.node("Split", [x], n_outputs=n, out_shapes=outs, axis=written_axis,
                      num_outputs=n)
            return
        if self.opset < 13:
            self.node("Split", [x], n_outputs=len(sizes), out_shapes=outs, axis=written_axis,
                      split=sizes)
            return
        self.node("Split", [x, self.int_const(sizes, prefix="sizes")], n_outputs=len(sizes),
                  out_shapes=outs, axis=written_axis)

    def partition(self, d: int) -> list[int]:
        cuts = sorted(self.draw(st.lists(st.integers(1, d - 1), unique=True, max_size=3))) \
            if d >= 2 else []
        bounds = [0, *cuts, d]
        return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]

    def gather_or_slice_group(self):
        """Gather/Slice consumers of one tensor that tile an axis (usually)."""
        x = self.pick(min_rank=1, where=lambda s: max(s) >= 2)
        shape = list(self.shape[x])
        rank = len(shape)
        axis = self.draw(st.sampled_from([i for i, d in enumerate(shape) if d >= 2]))
        d = shape[axis]
        sizes = self.partition(d)
        if len(sizes) == 1:
            sizes = [1, d - 1]
        pieces = []
        start = 0
        for size in sizes:
            pieces.append([start, start + size])
            start += size
        defect = self.draw(st.integers(0, 7))
        if defect == 0 and len(pieces) > 2:
            del pieces[self.draw(st.integers(0, len(pieces) - 1))]  # a gap
        elif defect == 1:
            i = self.draw(st.integers(0, len(pieces) - 1))  # an overlap
            pieces[i] = [max(0, pieces[i][0] - 1), min(d, pieces[i][1] + 1)]
        elif defect == 2:  # a duplicate piece
            pieces.append(list(pieces[self.draw(st.integers(0, len(pieces) - 1))]))
        order = self.draw(st.permutations(list(range(len(pieces)))))
        for i in order:
            begin, end = pieces[i]
            if end - begin == 1 and self.draw(st.booleans()):
                self.gather_piece(x, shape, axis, begin)
            else:
                self.slice_piece(x, shape, axis, begin, end)
        if self.draw(st.integers(0, 4)) == 0:  # another consumer that is not a piece
            self.node("Softmax", [x], out_shapes=[shape], axis=self.axis(rank))

    def gather_piece(self, x, shape, axis, index):
        rank, d = len(shape), shape[axis]
        written = index - d if self.draw(st.booleans()) else index
        dtype = np.int32 if self.draw(st.integers(0, 4)) == 0 else np.int64
        scalar = self.draw(st.booleans())
        idx = self.int_const(written if scalar else [written], dtype, prefix="idx")
        out = list(shape)
        if scalar:
            del out[axis]
        else:
            out[axis] = 1
        attrs = {}
        written_axis = axis - rank if self.draw(st.booleans()) else axis
        if written_axis != 0 or self.draw(st.booleans()):
            attrs["axis"] = written_axis
        self.node("Gather", [x, idx], out_shapes=[out], **attrs)

    def slice_piece(self, x, shape, axis, begin, end):
        rank, d = len(shape), shape[axis]
        start = begin - d if begin and self.draw(st.booleans()) else begin
        if end == d and self.draw(st.booleans()):
            stop = self.draw(st.sampled_from([INT64_MAX, d + 3, 2**31 - 1]))
        elif end < d and self.draw(st.booleans()):
            stop = end - d
        else:
            stop = end
        dtype = np.int32 if self.draw(st.integers(0, 5)) == 0 else np.int64
        if dtype == np.int32:
            stop = min(stop, 2**31 - 1)
        inputs = [x, self.int_const([start], dtype, "starts"),
                  self.int_const([stop], dtype, "ends")]
        form = self.draw(st.integers(0, 3))
        if form >= 1 or axis != 0:
            written_axis = axis - rank if self.draw(st.booleans()) else axis
            inputs.append(self.int_const([written_axis], dtype, "axes"))
            if form >= 2:
                inputs.append(self.int_const([1], dtype, "steps"))
        out = list(shape)
        out[axis] = end - begin
        self.node("Slice", inputs, out_shapes=[out])

    def dynamo_gathernd(self):
        """Transpose(axis to the front) -> GatherND(indices [..., 1]) -> Transpose back."""
        x = self.pick(min_rank=2, where=lambda s: max(s) >= 2)
        shape = list(self.shape[x])
        rank = len(shape)
        axis = self.draw(st.integers(0, rank - 1))
        perm = [axis] + [i for i in range(rank) if i != axis]
        if self.draw(st.integers(0, 3)) == 0:
            perm = self.perm(rank)
        t = self.transpose(x, perm)
        t_shape = list(self.shape[t])
        d0 = t_shape[0]
        n = self.draw(st.integers(1, 2))
        values = [self.draw(st.integers(-d0, d0 - 1)) for _ in range(n)]
        idx_shape = self.draw(st.sampled_from([[n, 1], [1, n, 1]])) if n > 1 else \
            self.draw(st.sampled_from([[1], [1, 1], [1, 1, 1]]))
        indices = np.array(values, np.int64).reshape(idx_shape)
        out = list(idx_shape[:-1]) + t_shape[1:]
        g = self.node("GatherND", [t, self.int_const(indices, prefix="nd")], out_shapes=[out])[0]
        if len(out) == rank and self.draw(st.booleans()):
            inverse = [0] * rank
            for i, p in enumerate(perm):
                inverse[p] = i
            self.transpose(g, inverse)

    def gather_of_transpose(self):
        x = self.pick(min_rank=2)
        t = self.transpose(x)
        shape = list(self.shape[t])
        axis = self.draw(st.integers(0, len(shape) - 1))
        d = shape[axis]
        count = self.draw(st.integers(1, 2))
        idx = [self.draw(st.integers(-d, d - 1)) for _ in range(count)]
        out = list(shape)
        out[axis] = count
        written_axis = axis - len(shape) if self.draw(st.booleans()) else axis
        self.node("Gather", [t, self.int_const(idx, prefix="gi")], out_shapes=[out],
                  axis=written_axis)

    def double_transpose(self):
        x = self.pick(min_rank=2)
        t = self.transpose(x)
        if self.draw(st.integers(0, 2)) == 0:  # the exact inverse: the pair cancels
            perm = list(np.argsort(list(self.nodes[-1].attribute[0].ints)))
            self.transpose(t, [int(p) for p in perm])
        else:
            self.transpose(t)

    def constant_chain(self):
        """Small constant subgraph (foldable), then used with a float tensor."""
        x = self.pick()
        shape = list(self.shape[x])
        c = self.const(self.values(shape), "k", allow_node=True)
        self.shape[c] = tuple(shape)
        c2 = self.node("Transpose", [c], out_shapes=[shape[::-1]], pool=False,
                       perm=list(range(len(shape)))[::-1])[0] if len(shape) >= 2 else c
        if c2 != c:
            c2 = self.node("Transpose", [c2], out_shapes=[shape], pool=False,
                           perm=list(range(len(shape)))[::-1])[0]
        self.node("Add", [x, c2], out_shapes=[shape])

    def identity(self):
        x = self.pick()
        self.node("Identity", [x], out_shapes=[self.shape[x]])

    def symbolic_input(self, shape, keep: int) -> str:
        """A graph input whose dims of size 2 (what the feeds give a symbolic dim) other than
        ``keep`` are declared symbolic; not in the pool (the other ops want static shapes)."""
        name = self.name("sym")
        dims = [f"N{i}" if d == 2 and i != keep and self.draw(st.booleans()) else d
                for i, d in enumerate(shape)]
        self.inputs.append(helper.make_tensor_value_info(name, self.dtype, dims))
        self.shape[name] = tuple(shape)
        return name

    def shape_of(self, x: str, axis: int, scalar: bool) -> str:
        """Shape(x)[axis] as Gather (scalar or [1]) or Slice ([1]), int64."""
        rank = len(self.shape[x])
        shape = self.node("Shape", [x], out_shapes=[[rank]], pool=False)[0]
        written = axis - rank if self.draw(st.booleans()) else axis
        if scalar:
            return self.node("Gather", [shape, self.int_const(written, prefix="dim")],
                             out_shapes=[[]], pool=False)[0]
        if self.draw(st.booleans()):
            return self.node("Gather", [shape, self.int_const([written], prefix="dim")],
                             out_shapes=[[1]], pool=False)[0]
        end = INT64_MAX if written == -1 else written + 1
        return self.node("Slice", [shape, self.int_const([written], prefix="from"),
                                   self.int_const([end], prefix="to")],
                         out_shapes=[[1]], pool=False)[0]

    def shape_scale(self):
        """y * 1/sqrt(Shape(x)[axis]), the SDPA scale computed at run time."""
        y = self.pick()
        scalar = len(self.shape[y]) == 0 or self.draw(st.booleans())
        x = self.pick(min_rank=1)
        if self.draw(st.booleans()):
            x = self.symbolic_input(self.shape[x], keep=-1)
        if self.draw(st.integers(0, 2)) == 0:  # the shape of a transposed tensor (MPT's q)
            x = self.node("Transpose", [x], out_shapes=[[]], pool=False,
                          perm=self.perm(len(self.shape[x])))[0]
            perm = list(self.nodes[-1].attribute[0].ints)
            self.shape[x] = tuple(self.shape[self.nodes[-1].input[0]][p] for p in perm)
        axis = self.draw(st.integers(0, len(self.shape[x]) - 1))
        d = self.shape_of(x, axis, scalar)
        out = [] if scalar else [1]
        f = self.node("Cast", [d], out_shapes=[out], pool=False, to=self.dtype)[0]
        f = self.node("Sqrt", [f], out_shapes=[out], pool=False)[0]
        f = self.node("Reciprocal", [f], out_shapes=[out], pool=False)[0]
        inputs = [y, f] if self.draw(st.booleans()) else [f, y]
        self.node("Mul", inputs, out_shapes=[self.shape[y]])

    def shape_chunk(self):
        """chunk(k, axis) with bounds computed from Shape(x)[axis] (GPT-NeoX/MPT's export)."""
        k = self.draw(st.integers(2, 3))
        x = self.pick(min_rank=1, where=lambda s: any(d % k == 0 for d in s))
        shape = list(self.shape[x])
        axis = self.draw(st.sampled_from([i for i, d in enumerate(shape) if d % k == 0]))
        source = x
        if self.draw(st.booleans()):
            source = self.symbolic_input(shape, keep=axis)
            if not self.draw(st.integers(0, 2)):
                x = source  # sliced tensor itself partly symbolic
        n = self.shape_of(source, axis, scalar=True)
        part = self.node("Div", [n, self.int_const(k, prefix="k")], out_shapes=[[]],
                         pool=False)[0]
        zero = self.int_const([0], prefix="zero")
        bounds = [zero]
        for i in range(1, k + 1):
            times = self.node("Mul", [part, self.int_const(i, prefix="i")], out_shapes=[[]],
                              pool=False)[0]
            bounds.append(self.node("Unsqueeze", [times, zero], out_shapes=[[1]],
                                    pool=False)[0] if self.opset >= 13 else
                          self.node("Unsqueeze", [times], out_shapes=[[1]], pool=False,
                                    axes=[0])[0])
        axes = self.int_const([axis - len(shape) if self.draw(st.booleans()) else axis],
                              prefix="axes")
        out = list(shape)
        out[axis] = shape[axis] // k
        for i in range(k):
            self.node("Slice", [x, bounds[i], bounds[i + 1], axes],
                      out_shapes=[out])

    OPS = ("matmul", "matmul", "matmul", "scaled", "binary", "softmax", "reshape", "squeeze",
           "split", "gather_or_slice_group", "gather_or_slice_group", "gather_or_slice_group",
           "dynamo_gathernd", "dynamo_gathernd", "gather_of_transpose", "double_transpose",
           "transpose", "constant_chain", "identity", "shape_scale", "shape_chunk")

    def random_op(self):
        getattr(self, self.draw(st.sampled_from(self.OPS)))()

    # ---- YieldOp ------------------------------------------------------------------
    def yield_op(self):
        produced = [t for t in self.pool if self.is_node_output(t)]
        if not produced:
            self.softmax()
            produced = [self.nodes[-1].output[0]]
        sinks = [t for t in produced if not self.consumers.get(t)] or produced
        count = self.draw(st.integers(1, min(2, len(sinks))))
        forward = sinks[-count:]
        non_diff = []
        if len(forward) == 2 and self.draw(st.integers(0, 2)) == 0:
            non_diff = [1]
        diff = [t for i, t in enumerate(forward) if i not in non_diff]
        grads = [self.name("grad") for _ in diff]
        attrs = {"full_shape_outputs": list(range(len(diff)))}
        if non_diff:
            attrs["non_differentiable_outputs"] = non_diff
        self.backward_from = len(self.nodes)
        self.nodes.append(helper.make_node("YieldOp", forward, grads,
                                           name=self.node_name("YieldOp"), domain=MS, **attrs))
        for t in forward:
            self.consumers[t] = self.consumers.get(t, 0) + 1
        self.yield_outputs = list(zip(grads, diff, strict=True))
        for g, t in self.yield_outputs:
            self.add(g, self.shape[t])
        return grads

    def is_node_output(self, name: str) -> bool:
        return any(name in n.output for n in self.nodes)

    # ---- the model ----------------------------------------------------------------
    def model(self, outputs: list[str], value_info: bool) -> onnx.ModelProto:
        for name in self.overridable:
            self.inputs.append(helper.make_tensor_value_info(
                name, self.dtype, list(self.shape[name])))
        graph = helper.make_graph(
            self.nodes, "random", self.inputs,
            [helper.make_tensor_value_info(o, self.dtype, list(self.shape[o])) for o in outputs],
            initializer=self.inits)
        opsets = [helper.make_opsetid("", self.opset)]
        if any(n.domain == MS for n in self.nodes):
            opsets.append(helper.make_opsetid(MS, 1))
        model = helper.make_model(graph, opset_imports=opsets, producer_name="hypothesis")
        model.ir_version = min(model.ir_version, 8 if self.opset <= 17 else 9)
        if value_info:
            model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        # tensors after YieldOp: give them types (the YieldOp has no ONNX schema)
        known = {vi.name for vi in model.graph.value_info} | set(outputs)
        for g, _ in getattr(self, "yield_outputs", []):
            if g not in known:
                model.graph.value_info.append(
                    helper.make_tensor_value_info(g, self.dtype, list(self.shape[g])))
        return model


@st.composite
def graphs(draw, max_ops: int = 12, yield_probability: float = 0.25):
    """A random valid ONNX model (ModelProto) and a dict describing it."""
    opset = draw(st.sampled_from([11, 12, 13, 14, 17, 17, 18]))
    dtype = draw(st.sampled_from([TensorProto.FLOAT] * 12 + [TensorProto.DOUBLE,
                                                              TensorProto.FLOAT16]))
    b = Builder(draw, dtype, opset)
    n_ops = draw(st.integers(1, max_ops))
    has_yield = draw(st.integers(0, 99)) < round(100 * yield_probability)
    n_forward = draw(st.integers(1, max(1, n_ops - 1))) if has_yield else n_ops
    for _ in range(n_forward):
        b.random_op()
    if has_yield:
        grads = b.yield_op()
        for i in range(max(1, n_ops - n_forward)):
            if i == 0:  # the first backward node reads a gradient (and maybe a forward tensor)
                g = grads[0]
                b.pool.remove(g)
                b.pool.append(g)
            b.random_op()
    produced = [t for n in b.nodes for t in n.output
                if t in b.shape and n.op_type not in ("Constant", "YieldOp")
                and t in set(b.pool)]
    sinks = [t for t in produced if not b.consumers.get(t)]
    middle = [t for t in produced if b.consumers.get(t)]
    outputs = [t for t in sinks if draw(st.integers(0, 9))]
    outputs += [t for t in middle if draw(st.integers(0, 6)) == 0]
    if not outputs:
        outputs = [produced[-1]] if produced else []
    if not outputs:  # only YieldOp/Constant nodes: add something
        b.softmax()
        outputs = [b.nodes[-1].output[0]]
    outputs = list(dict.fromkeys(outputs))
    if has_yield and b.backward_from is not None:
        # make sure something after the YieldOp is an output, so it is not dead code
        after = [t for n in b.nodes[b.backward_from + 1:] for t in n.output if t in outputs]
        if not after:
            last = [t for n in b.nodes[b.backward_from + 1:] for t in n.output
                    if t in b.shape and t in set(b.pool)]
            if last:
                outputs.append(last[-1])
    value_info = draw(st.booleans())
    model = b.model(outputs, value_info)
    info = {"opset": opset, "has_yield": has_yield and b.backward_from is not None,
            "nodes": len(model.graph.node)}
    return model, info
