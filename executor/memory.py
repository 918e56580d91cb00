"""Planned peak memory: refuse a run that cannot fit, before anything executes.

The estimate walks a Plan's steps the way Session.run does: initializers stay resident for
the session's life, feeds are live from the start, each step allocates its outputs while its
inputs are still alive, and the slots listed in ``step.release`` (built from the plan's
last-use table) are freed after it. Tensor sizes come from static shapes (the graph's
value_info, or ONNX shape inference, and for the com.microsoft kernels ONNX does not know,
the estimates of executor/output_sizes.py, propagated through the nodes after them); dims
that stay symbolic are bound from the feed shapes when ``run()`` starts, before any node
executes. Tensors whose size stays unknown (data-dependent shapes) count as zero, so the
estimate is a lower bound: it refuses only what certainly cannot fit. A kernel without an
output-size estimate makes the guard refuse the graph rather than count it as free.

What the plan could not see is checked when it runs: a kernel whose output size comes from
the data (ConstantOfShape, Range, Tile, Expand, OneHot, Pad, NonZero) calls
``check_allocation`` with the shape it is about to allocate, and when the plan did not count
that size, the bytes live at that moment plus the new output must fit, or the run stops
there (AllocationLimitError) before the allocation.

Available memory: CPU, /proc/meminfo MemAvailable (else sysconf), capped by a cgroup limit
when there is one; GPU, cupy.cuda.runtime.memGetInfo(). ``GRAPHOPT_MEMORY_LIMIT`` replaces
the device's figure: bytes as an integer or decimal with an optional K/M/G/T suffix (powers
of 1024; ``512M``, ``1.5G``, ``2GiB``, ``64MB``), or ``off`` (also ``0``) to disable the check.
Anything else (``nan``, ``1e400``, ``-1G``, ``one gig``) is refused where the limit is read
(MemorySettingError), never taken for "no limit".
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction

import numpy as np
import onnx

from graphopt.errors import GraphoptError
from graphopt.tensor_types import infer_types as service_types

from .errors import ExecutorError
from .output_sizes import NoSizeEstimateError, output_types
from .registry import normalize_domain

ENV = "GRAPHOPT_MEMORY_LIMIT"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class MemoryLimitError(ExecutorError):
    """The plan's peak memory exceeds what the device has; nothing was run."""

    def __init__(self, peak: int, available: int, device: str, where: str):
        self.peak, self.available, self.device = peak, available, device
        super().__init__(
            f"planned peak memory {human(peak)} exceeds the {human(available)} available on "
            f"{device} ({where}); nothing was run")


class AllocationLimitError(MemoryLimitError):
    """A node's output, whose size came from the data, would not fit next to what is live;
    the run stopped before allocating it."""

    def __init__(self, node, shape, dtype, nbytes: int, live: int, available: int,
                 device: str):
        self.peak, self.available, self.device = live + nbytes, available, device
        self.nbytes, self.live = nbytes, live
        ExecutorError.__init__(
            self,
            f"node {node.label()} would allocate {human(nbytes)} ({nbytes} bytes) for its "
            f"output {list(shape)} {np.dtype(dtype).name}, a size that came from the data, "
            f"with {human(live)} already live: more than the {human(available)} available "
            f"on {device} ({limit_source()}); nothing more was run (a higher "
            f"{ENV}, or {ENV}=off, lifts the limit)")


class MemorySettingError(ExecutorError, GraphoptError):
    """GRAPHOPT_MEMORY_LIMIT says something that is not a size (nor ``off``)."""


def human(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (``381.5 MiB``)."""
    for unit, shift in (("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def limit_source() -> str:
    """Where the available figure came from, for messages."""
    override = os.environ.get(ENV)
    return f"{ENV}={override.strip()}" if override else "the memory free at start"


# ---- available memory ------------------------------------------------------------------
_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*(?:([KMGT])(?:I?B)?|B)?", re.IGNORECASE)


def parse_limit(text: str) -> int | None:
    """Bytes of a ``GRAPHOPT_MEMORY_LIMIT`` value; None for ``off`` (or ``0``). Anything
    else than a size raises MemorySettingError: a guard silently turned off by a typo is
    the failure this exists to prevent."""
    word = text.strip()
    if word.lower() == "off" or word == "0":
        return None
    match = _SIZE.fullmatch(word)
    limit = (int(Fraction(match[1]) * _UNITS[(match[2] or "").upper()])
             if match is not None else 0)
    if limit < 1:
        raise MemorySettingError(
            f"{ENV}={text!r} is not a memory size: give bytes as an integer or decimal with "
            f"an optional K, M, G or T suffix (512M, 1.5G, 2GiB), or off to turn the memory "
            f"check off")
    return limit


def _cpu_available() -> int | None:
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:  # cgroup v2: a container's limit can be far below the host's free memory
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read().strip())
        if limit != "max":
            available = min(available, max(0, int(limit) - current))
    except (OSError, ValueError):
        pass
    return available


def _gpu_available(xp) -> int | None:
    """The driver's free bytes plus what CuPy's pool holds unused (reusable by this process,
    but counted as used by the driver)."""
    try:
        free, _total = xp.cuda.runtime.memGetInfo()
        pooled = xp.get_default_memory_pool().free_bytes()
        return int(free) + int(pooled)
    except Exception:  # no runtime, no device: do not guess
        return None


def available_bytes(backend) -> int | None:
    """Bytes the device can still give, or None when unknown (or the check is off). An
    empty GRAPHOPT_MEMORY_LIMIT counts as unset; one that is not a size raises
    MemorySettingError (also a GraphoptError: the CLI prints it as one line)."""
    override = os.environ.get(ENV)
    if override:
        return parse_limit(override)
    if getattr(backend, "is_gpu", False):
        return _gpu_available(backend.xp)
    return _cpu_available()


# ---- sizes ----------------------------------------------------------------------------
def _as_type(type_proto: onnx.TypeProto) -> tuple[int, list] | None:
    """(elem_type, dims) of a tensor type with an element type and a rank, else None."""
    tt = type_proto.tensor_type if type_proto.HasField("tensor_type") else None
    if tt is None or not tt.elem_type or not tt.HasField("shape"):
        return None
    return tt.elem_type, [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                          for d in tt.shape.dim]


def _value_info_types(graph: onnx.GraphProto) -> dict[str, tuple[int, list]]:
    found = {vi.name: _as_type(vi.type)
             for vi in [*graph.input, *graph.value_info, *graph.output]}
    return {name: t for name, t in found.items() if t is not None}


def _itemsize(elem_type: int) -> int | None:
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        return None
    return None if dtype.kind in "OUS" else dtype.itemsize


def _bytes(elem_type: int, dims: list, symbols: Mapping[str, int]) -> int | None:
    size = _itemsize(elem_type)
    if size is None:
        return None
    total = size
    for d in dims:
        if isinstance(d, str):
            d = symbols.get(d)
        if d is None or d < 0:
            return None
        total *= int(d)  # Python ints: 2**62 x 2**62 does not overflow
    return total


def infer_types(model: onnx.ModelProto,
                input_shapes: Mapping[str, tuple] | None = None) -> dict[str, tuple[int, list]]:
    """name -> (elem_type, dims) from value_info plus graphopt's type service (ONNX shape
    inference on the model without its weights' bytes, completed after the com.microsoft
    ops; with the given input shapes substituted, when run() knows them)."""
    types = _value_info_types(model.graph)
    try:
        inferred = service_types(model, input_shapes)
    except Exception:  # partial knowledge is fine: unknown sizes count as zero
        return types
    for name, type_proto in inferred.items():
        value = _as_type(type_proto)
        if value is None:
            continue
        old = types.get(name)
        if old is None or any(not isinstance(d, int) for d in old[1]):
            types[name] = value
    return types


def _type_proto(t) -> onnx.TypeProto:
    elem, dims = t  # dims: int, symbol (str) or None (unknown), as make_tensor_type_proto takes
    return onnx.helper.make_tensor_type_proto(elem, list(dims))


# ops whose small integer outputs the plan computes from known small inputs (the shape
# arithmetic: Shape -> Gather -> Concat -> Reshape), when ONNX's data propagation was not run
VALUE_OPS = frozenset({
    "Gather", "Concat", "Unsqueeze", "Squeeze", "Slice", "Cast", "Add", "Sub", "Mul", "Div",
    "Equal", "Less", "Greater", "Where", "Identity", "Neg", "Abs", "Max", "Min", "Not", "Mod",
    "ReduceProd", "Size", "Reshape", "Flatten", "Transpose"})
VALUE_CONTRIB_OPS = frozenset({"BroadcastGradientArgs"})   # com.microsoft: reduction axes
VALUE_ELEMENTS = 4096   # the largest value the plan computes or keeps


def complete_types(nodes, model: onnx.ModelProto, types: dict, constant,
                   evaluate=None) -> dict:
    """Fill in what ONNX inference left out: outputs of the non-ONNX kernels (their
    estimates) and of the standard nodes after them (per-node inference), in plan order.
    ``constant(name)``: a small initializer's value, else None. ``evaluate(node, values)``:
    the node's outputs computed by its kernel (None: not available), used for the VALUE_OPS
    nodes whose inputs are all known small values, so that the shapes computed from the
    data's shape (a Reshape's target, a Range's length) are known too."""
    graph_nodes = model.graph.node
    for init in model.graph.initializer:  # inference lists no initializer in value_info
        types.setdefault(init.name, (init.data_type, list(init.dims)))
    opsets = {normalize_domain(o.domain): o.version for o in model.opset_import}
    shapes: dict[str, np.ndarray] = {}  # Shape outputs whose value the static dims give
    outer = constant

    def constant(name):  # noqa: F811  (initializers, then the Shape values found so far)
        value = shapes.get(name)
        return value if value is not None else outer(name)

    for node in nodes:
        if node.op_type == "Shape" and node.domain == "" and node.inputs:
            t = types.get(node.inputs[0])
            if t is not None and not _unknown(t) and all(isinstance(d, int) for d in t[1]):
                rank = len(t[1])
                start, end = node.attr("start"), node.attrs.get("end", rank)
                shapes[node.outputs[0]] = np.array(t[1], np.int64)[slice(start, end)]
        if (evaluate is not None and node.inputs
                and node.op_type in (VALUE_OPS if node.domain == "" else VALUE_CONTRIB_OPS)):
            _propagate_values(node, types, shapes, constant, evaluate)
        missing = [o for o in node.outputs if o and _unknown(types.get(o))]
        if node.domain != "":
            inputs = [types.get(n) if n else None for n in node.inputs]
            names = node.inputs
            try:
                outs = output_types(node, inputs,
                                    lambda i, names=names: constant(names[i])
                                    if i < len(names) and names[i] else None)
            except NoSizeEstimateError:
                raise
            except Exception:  # odd attributes or ranks: the kernel will say; size unknown
                continue
            for name, t in zip(node.outputs, outs, strict=False):
                if name in missing and t is not None:
                    types[name] = (t[0], list(t[1]))
            continue
        if not missing or any(n and n not in types for n in node.inputs):
            continue
        proto = graph_nodes[node.index]
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for a in proto.attribute):
            continue
        try:
            schema = onnx.defs.get_schema(proto.op_type, opsets.get("", 1), "")
            data = {}
            for n in proto.input:
                value = constant(n) if n else None
                if value is not None:
                    data[n] = onnx.numpy_helper.from_array(np.asarray(value), n)
            inferred = onnx.shape_inference.infer_node_outputs(
                schema, proto, {n: _type_proto(types[n]) for n in proto.input if n}, data,
                opset_imports=[onnx.helper.make_opsetid("", opsets.get("", 1))])
        except Exception:  # partial knowledge is fine: unknown sizes count as zero
            continue
        for name in missing:
            tp = inferred.get(name)
            tt = tp.tensor_type if tp is not None and tp.HasField("tensor_type") else None
            if tt is not None and tt.elem_type and tt.HasField("shape"):
                types[name] = (tt.elem_type, [
                    d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                    for d in tt.shape.dim])
    return types


def _propagate_values(node, types: dict, values: dict, constant, evaluate) -> None:
    """Compute a VALUE_OPS node's outputs from its inputs' known values (small ones only)
    into ``values``, and their types into ``types``."""
    args = []
    for name in node.inputs:
        value = constant(name) if name else None
        if name and (value is None or np.size(value) > VALUE_ELEMENTS):
            return
        args.append(value)
    try:
        outputs = evaluate(node, args)
    except Exception:  # noqa: BLE001 (the kernel will say what is wrong when it runs)
        return
    if not isinstance(outputs, (tuple, list)):
        outputs = (outputs,)
    for name, value in zip(node.outputs, outputs, strict=False):
        if isinstance(value, np.generic):   # a kernel's 0-d result as a numpy scalar
            value = np.asarray(value)
        if not name or not isinstance(value, np.ndarray) or value.size > VALUE_ELEMENTS:
            continue
        values[name] = value
        try:
            elem = onnx.helper.np_dtype_to_tensor_dtype(value.dtype)
        except (KeyError, TypeError, ValueError):
            continue
        types[name] = (elem, [int(d) for d in value.shape])


def _unknown(t) -> bool:
    """Whether a type leaves a dim unknown: None, or a symbol ONNX inference made up
    (``unk__N``: no feed ever binds it), unlike a declared symbol (``batch``)."""
    return t is None or any(d is None or (isinstance(d, str) and d.startswith("unk__"))
                            for d in t[1])


# ---- the estimate ---------------------------------------------------------------------
def planned_peak(plan, sizes: Mapping[str, int | None], resident: int,
                 feeds: Mapping[str, int]) -> tuple[int, int | None]:
    """(peak bytes, index of the step where it is reached; None: before any step).

    ``resident``: bytes alive all along (initializers); ``feeds``: name -> bytes of the
    tensors handed in; ``sizes``: name -> bytes of every other tensor (None: unknown)."""
    peak, peak_step, _, _ = planned_profile(plan, sizes, resident, feeds)
    return peak, peak_step


def planned_profile(plan, sizes: Mapping[str, int | None], resident: int,
                    feeds: Mapping[str, int]
                    ) -> tuple[int, int | None, list[int], list[int]]:
    """:func:`planned_peak` and, per step, the bytes live after its release (``after``)
    and while it runs (``during``: its outputs made, nothing released yet)."""
    names = plan.names_by_slot
    produced = {o for step in plan.steps for o in step.node.outputs if o}
    live = resident + sum(feeds.values())
    peak, peak_step = live, None
    after: list[int] = []
    during: list[int] = []
    for index, step in enumerate(plan.steps):
        for slot in step.out_slots:
            if slot >= 0:
                live += sizes.get(names[slot]) or 0
        during.append(live)
        if live > peak:
            peak, peak_step = live, index
        for slot in step.release:
            name = names[slot]
            if name in feeds:
                live -= feeds[name]
            elif name in produced:
                live -= sizes.get(name) or 0
        after.append(live)
    return peak, peak_step, after, during


def spare_room(peak: int, after: list[int], during: list[int]) -> list[int]:
    """Per step, what memory kept for reuse (host_memory.SpareBlocks) may hold once the step
    released its dead tensors, so that the process stays within the run's planned peak from
    there to the end: a spare kept now is still held while later steps make their tensors."""
    room = [0] * len(after)
    lowest = peak
    for index in range(len(after) - 1, -1, -1):
        room[index] = min(lowest, peak - after[index])
        lowest = min(lowest, peak - during[index])
    return room


class MemoryGuard:
    """Per-session: sizes from static shapes once; re-bound from feed shapes when needed."""

    def __init__(self, session):
        self.session = session
        self.device = session.backend.device
        self.resident = sum(int(getattr(a, "nbytes", 0)) for a in
                            session.initializer_values.values())
        self.available = available_bytes(session.backend)
        if (self.available is not None and getattr(session.backend, "is_gpu", False)
                and not os.environ.get(ENV)):
            # the initializers were uploaded before this reading: the driver's free figure
            # already excludes them, and planned_peak counts them as resident again
            self.available += self.resident
        self.types = self._infer() if self.available is not None else {}
        self._cache: dict[tuple, dict[str, int | None]] = {}
        self._verdicts: dict[tuple, tuple[int, list[int]]] = {}
        self.room: list[int] | None = None   # the running plan's room per step (check_run)
        # during a run: its slot values (Session.run sets them) and the sizes its plan counted
        self.values: list | None = None
        self.run_sizes: Mapping[str, int | None] | None = None
        self._resident_owners = frozenset(id(memory_owner(a)) for a in
                                          session.initializer_values.values())

    def _constant(self, name: str):
        value = self.session.initializer_values.get(name)
        if (value is None or name in self.session.overridable
                or getattr(value, "size", 1 << 20) > 4096):
            return None
        return self.session.backend.to_host(value)

    def _infer(self, input_shapes=None) -> dict[str, tuple[int, list]]:
        types = infer_types(self.session.model, input_shapes)
        for name, shape in (input_shapes or {}).items():   # what the feeds are, exactly
            if name in types:
                types[name] = (types[name][0], [int(d) for d in shape])
        return complete_types(self.session.ordered_nodes, self.session.model, types, self._constant,
                              self._evaluate if self.session.backend.xp is np else None)

    def _evaluate(self, node, args):
        """``node``'s outputs by its own kernel, on host arrays (plan time, small values)."""
        spec = node.spec
        if spec is None or spec.reads_also is not None:
            return None
        return spec.fn(self.session._ctx, node, *args)

    def _sizes(self, symbols: Mapping[str, int], types=None) -> dict[str, int | None]:
        return {name: _bytes(elem, dims, symbols) for name, (elem, dims) in
                (types or self.types).items()}

    def check_plan(self, plan, where: str = "at plan time") -> None:
        """Refuse when the static shapes alone prove the plan cannot fit."""
        if self.available is None:
            return
        sizes = self._sizes({})
        feeds = {n: sizes.get(n) or 0 for n in self.session.input_names}
        feeds.update(self.fed_bytes())
        peak, _ = planned_peak(plan, sizes, self.resident, feeds)
        if peak > self.available:
            raise MemoryLimitError(peak, self.available, self.device, where)

    def fed_bytes(self) -> dict[str, int]:
        """Bytes of each initializer the caller feeds on every run (Session's ``fed``)."""
        return {name: int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
                for name, (dtype, dims) in self.session.fed_types.items()}

    def check_run(self, plan, feeds: Mapping[str, object]) -> int | None:
        """At run() start: bind dims from the feeds and refuse before any node runs.
        Returns the planned peak bytes (None when the check is off)."""
        self.room = None
        if self.available is None:
            return None
        shapes = {n: tuple(int(d) for d in getattr(v, "shape", ())) for n, v in feeds.items()}
        key = tuple(sorted(shapes.items()))
        sizes = self._cache.get(key)
        self.run_sizes = sizes  # None (the cache was full): check_allocation counts all
        verdict = self._verdicts.get((id(plan), key))
        if verdict is not None:  # a training loop: same plan, same shapes, every step
            peak, self.room = verdict
            if peak > self.available:
                raise MemoryLimitError(peak, self.available, self.device,
                                       "for these feed shapes, before running")
            return peak
        if sizes is None:
            sizes = self._sizes_for(shapes, key)
            self.run_sizes = sizes
        fed = {n: int(getattr(v, "nbytes", 0)) for n, v in feeds.items()}
        peak, _, after, during = planned_profile(plan, sizes, self.resident, fed)
        self.room = spare_room(peak, after, during)
        if len(self._verdicts) < 256:
            self._verdicts[(id(plan), key)] = (peak, self.room)
        if peak > self.available:
            raise MemoryLimitError(peak, self.available, self.device,
                                   "for these feed shapes, before running")
        return peak

    def _sizes_for(self, shapes: Mapping[str, tuple[int, ...]], key) -> dict[str, int | None]:
        """Every tensor's bytes for these feed shapes: the symbolic dims bound from them, and
        inference run again with them where a size stays unknown (cached by ``key``)."""
        symbols: dict[str, int] = {}
        for name, shape in shapes.items():
            _, dims = self.types.get(name, (None, []))
            for d, actual in zip(dims, shape, strict=False):
                if isinstance(d, str):
                    symbols.setdefault(d, actual)
        sizes = self._sizes(symbols)
        if any(v is None for v in sizes.values()):  # still unknown: infer with shapes
            sizes = self._sizes(symbols, self._infer(shapes))
        if len(self._cache) < 64:
            self._cache[key] = sizes
        return sizes

    def estimate(self, plan, feeds: Mapping[str, object]) -> tuple[int, int | None]:
        """(planned peak bytes of running ``plan`` on ``feeds``, index of the step reaching
        it: None before any), whether or not the check is on (what a caller reports)."""
        if not self.types:
            self.types = self._infer()
        shapes = {n: tuple(int(d) for d in getattr(v, "shape", ())) for n, v in feeds.items()}
        key = tuple(sorted(shapes.items()))
        sizes = self._cache.get(key) or self._sizes_for(shapes, key)
        fed = {n: int(getattr(v, "nbytes", 0)) for n, v in feeds.items()}
        return planned_peak(plan, sizes, self.resident, fed)

    def check_allocation(self, node, shape: Sequence[int], dtype) -> None:
        """See the module function: refuse an output the plan did not count when it does
        not fit beside what is live now."""
        nbytes = np.dtype(dtype).itemsize
        for d in shape:
            d = int(d)
            if d < 0:
                return  # not a shape: the kernel itself says what is wrong
            nbytes *= d  # Python ints: no overflow
        sizes = self.run_sizes
        if sizes is not None and node.outputs and sizes.get(node.outputs[0]) == nbytes:
            return  # the planned peak, checked at run start, counted it
        live = self.live_bytes()
        if live + nbytes > self.available:
            raise AllocationLimitError(node, shape, dtype, nbytes, live, self.available,
                                       self.device)

    def live_bytes(self) -> int:
        """Bytes held now by the session's initializers and the running plan's slots, each
        buffer once (a view counts as the array it views)."""
        total, seen = self.resident, set(self._resident_owners)
        for value in self.values or ():
            if value is None:
                continue
            owner = memory_owner(value)
            if id(owner) not in seen:
                seen.add(id(owner))
                total += int(getattr(owner, "nbytes", 0))
        return total


def memory_owner(array):
    """The array whose memory ``array`` views (itself when it owns it)."""
    base = getattr(array, "base", None)
    while base is not None and hasattr(base, "nbytes"):
        array, base = base, getattr(base, "base", None)
    return array


def check_allocation(ctx, node, shape: Sequence[int], dtype) -> None:
    """Call in a kernel before it allocates an output whose shape came from the data (input
    values read on the host, not only input shapes): the planned peak, checked before the run
    started, could not count it. Raises AllocationLimitError, naming the node, when the
    session's live bytes plus that output would exceed the available memory; costs one
    attribute test when the memory check is off and a dict lookup when the plan had counted
    the output."""
    guard = ctx.memory
    if guard is not None:
        guard.check_allocation(node, shape, dtype)


def estimate_peak(model: onnx.ModelProto, input_shapes: Mapping[str, Sequence[int]]) -> int | None:
    """The executor's planned peak bytes for ``model`` run on the CPU with inputs of
    ``input_shapes`` (what ``optimize --check`` is about to feed), estimated before anything
    is loaded or allocated; None when the executor cannot plan the model (an op it has no
    kernel or size estimate for, an invalid graph)."""
    from .plan import PlannedNode, build_plan, decode_attributes, topological_order
    from .registry import lookup, normalize_domain

    graph = model.graph
    opsets = {normalize_domain(o.domain): o.version for o in model.opset_import}
    try:
        nodes = []
        for index, proto in enumerate(graph.node):
            domain = normalize_domain(proto.domain)
            node = PlannedNode(index=index, name=proto.name or f"{proto.op_type}_{index}",
                               op_type=proto.op_type, domain=domain,
                               opset=opsets.get(domain, 1), inputs=tuple(proto.input),
                               outputs=tuple(proto.output), attrs=decode_attributes(proto))
            node.spec = lookup(domain, proto.op_type, node.opset)
            if node.spec is None:
                return None
            nodes.append(node)
        initializers = {t.name: t for t in graph.initializer}
        inputs = [vi.name for vi in graph.input if vi.name not in initializers]
        available = inputs + [n for n in initializers if n not in inputs]
        ordered = topological_order(nodes, available)
        plan = build_plan(ordered, available, [o.name for o in graph.output])
        overridable = {vi.name for vi in graph.input} & set(initializers)

        def constant(name):
            t = initializers.get(name)
            if (t is None or name in overridable or t.data_location == onnx.TensorProto.EXTERNAL
                    or _bytes(t.data_type, list(t.dims), {}) is None
                    or np.prod(list(t.dims), dtype=object) > 4096):
                return None
            return onnx.numpy_helper.to_array(t)

        types = complete_types(ordered, model, infer_types(model, input_shapes), constant)
    except Exception:  # noqa: BLE001 (no kernel or size estimate, an odd graph: the
        return None    # runtime will say what is wrong; here there is just no estimate)
    sizes = {name: _bytes(elem, dims, {}) for name, (elem, dims) in types.items()}
    resident = sum(_bytes(t.data_type, list(t.dims), {}) or 0 for t in graph.initializer)
    feeds = {n: sizes.get(n) or 0 for n in inputs}
    peak, _ = planned_peak(plan, sizes, resident, feeds)
    return peak
