"""Session: load a model, plan it once, run it many times on numpy or CuPy."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from graphopt.vocabulary import is_yield_op, type_dims

from .backend import select_backend
from .context import KernelContext
from .errors import ExecutorError, FeedError, KernelError, UnsupportedOpsError
from .host_memory import give_back_freed, keep_freed, unshared_owner
from .kernels._compiled import preload as preload_compiled_kernels
from .memory import MemoryGuard
from .plan import Plan, PlannedNode, build_plan, decode_attributes, topological_order
from .registry import lookup, normalize_domain

# integer initializers up to this many elements keep a host copy (KernelContext.host_ints)
SMALL_INTS = 1024

Observer = Callable[[int, str, list[str]], None]
StepHook = Callable[[int, PlannedNode, tuple], None]


def _load(model: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    try:
        return onnx.load(os.fspath(model))
    except (OSError, onnx.onnx_cpp2py_export.checker.ValidationError) as exc:
        raise ExecutorError(f"cannot load model {os.fspath(model)!r}: {exc}") from exc


def value_type(value_info: onnx.ValueInfoProto) -> tuple[np.dtype | None, list | None]:
    """(numpy dtype, dims) of a tensor value_info; a dim is an int, a symbol or None."""
    if not value_info.type.HasField("tensor_type"):
        return None, None
    tensor_type = value_info.type.tensor_type
    dtype = (onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
             if tensor_type.elem_type else None)
    dims = type_dims(value_info.type)
    if dims is None:
        return dtype, None
    return np.dtype(dtype) if dtype is not None else None, dims


def _make_numerics(numerics, xp, fp16_policy, denormal_stats):
    if numerics is None or not isinstance(numerics, str):
        return numerics
    from .numerics import Numerics

    if numerics not in ("auto", "native", "mi200"):
        raise ExecutorError(f"numerics must be 'auto', 'native' or 'mi200', not {numerics!r}")
    return Numerics(None if numerics == "auto" else numerics, fp16_policy, xp=xp,
                    collect_stats=denormal_stats)


class Session:
    """Runs an ONNX model (inference or an ORTModule-style training graph).

    ``model`` is a path or an ``onnx.ModelProto``. ``device`` is ``"auto"`` (CuPy when CuPy
    and a GPU are present, else NumPy), ``"cpu"``, ``"cuda"`` or ``"rocm"``; an unavailable
    GPU device raises a DeviceUnavailableError subclass saying what is missing.
    ``numerics`` decides FP16 GEMM/conv numerics: ``"auto"`` (the device's own:
    MI200 semantics on a real gfx90a, native elsewhere), ``"native"``, ``"mi200"`` (MI200
    denormal flushing emulated bit-exactly), ``None`` (plain products, no FP16 policy), or a
    ready object with ``.matmul(a, b, op=...)``, ``.backward_pass()`` and ``.current_node``.
    ``fp16_policy`` overrides the environment variables (an ``Fp16Policy``);
    ``denormal_stats`` counts FP16 denormals per node (``session.numerics.denormal_report()``).
    ``external_values(tensor)``: the value of an initializer stored as external data (a
    weight a loaded model references in its file: graphopt.modelio.ExternalFiles.array).
    ``fed``: initializers the caller feeds on every run (a trainer's weights, which it keeps
    and updates itself): they are never read from the model nor held here, and a run that
    needs one and does not feed it is refused. ``training`` is the Dropout mode for Dropout
    nodes that do not carry a ``training_mode`` input; ``seed`` seeds Dropout masks.

    Unsupported op types are reported here, all at once, before anything runs.
    """

    def __init__(
        self,
        model: str | os.PathLike | onnx.ModelProto,
        device: str = "auto",
        numerics: Any = "auto",
        *,
        training: bool = False,
        seed: int | None = None,
        fp16_policy: Any = None,
        denormal_stats: bool = False,
        external_values: Callable[[onnx.TensorProto], np.ndarray] | None = None,
        fed: Collection[str] = (),
    ):
        self.model = _load(model)
        self.backend = select_backend(device)
        self.device = self.backend.device
        numerics = _make_numerics(numerics, self.backend.xp, fp16_policy, denormal_stats)
        self.numerics = numerics
        self._ctx = KernelContext(self.backend, numerics, training, seed)
        graph = self.model.graph
        opsets = {normalize_domain(o.domain): o.version for o in self.model.opset_import}

        nodes = []
        for index, proto in enumerate(graph.node):
            domain = normalize_domain(proto.domain)
            nodes.append(
                PlannedNode(
                    index=index,
                    name=proto.name or f"{proto.op_type}_{index}",
                    op_type=proto.op_type,
                    domain=domain,
                    opset=opsets.get(domain, 1),
                    inputs=tuple(proto.input),
                    outputs=tuple(proto.output),
                    attrs=decode_attributes(proto),
                )
            )
        missing = []
        for node in nodes:
            node.spec = lookup(node.domain, node.op_type, node.opset)
            # a kernel serving a family of operators (ATen) says which members it has
            supports = getattr(node.spec.fn, "supports", None) if node.spec else None
            if node.spec is None:
                missing.append((node.name, node.domain, node.op_type, node.opset))
            elif supports is not None and not supports(node):
                missing.append((node.name, node.domain,
                                f"{node.op_type}(operator={node.attrs.get('operator')!r})",
                                node.opset))
        if missing:
            raise UnsupportedOpsError(missing)

        self._initializers = {}
        fed = set(fed)
        # (dtype, shape) of the initializers fed on every run: what their feeds must match
        self._fed_types: dict[str, tuple[np.dtype, list[int]]] = {}
        for init in graph.initializer:
            if init.name in fed:
                self._fed_types[init.name] = (
                    np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type)),
                    [int(d) for d in init.dims])
                continue
            if external_values is not None and init.data_location == onnx.TensorProto.EXTERNAL:
                host = external_values(init)   # read from where the reference points
            else:
                host = numpy_helper.to_array(init)
            self._initializers[init.name] = device = self.backend.to_device(host)
            if host.dtype.kind in "iu" and host.size <= SMALL_INTS:
                self._ctx.remember_constant(device, host)   # axes, shapes: read on the host
        unknown_fed = sorted(fed - set(self._fed_types))
        if unknown_fed:
            raise ExecutorError(f"fed initializer(s) {unknown_fed} are not in the model")
        self._input_types = {
            vi.name: value_type(vi) for vi in graph.input
            if vi.name not in self._initializers and vi.name not in self._fed_types
        }
        self._overridable = {vi.name for vi in graph.input if vi.name in self._initializers}
        self._overridable |= set(self._fed_types)
        self.input_names = list(self._input_types)
        self.output_names = [vi.name for vi in graph.output]
        self.yield_output_names = [
            out for n in nodes if is_yield_op(n)
            for out in n.outputs if out
        ]
        self._known_types = {vi.name: value_type(vi) for vi in graph.value_info}
        self._known_types.update({vi.name: value_type(vi) for vi in graph.output})
        self._available = list(self._input_types) + [
            n for n in (*self._initializers, *self._fed_types) if n not in self._input_types
        ]
        self._ordered = topological_order(nodes, self._available)
        if self.backend.xp is np:  # the compiled kernels' one-off load belongs to set-up
            preload_compiled_kernels(node.op_type for node in nodes)
        self._plans: dict[tuple[str, ...], Plan] = {}
        self._memory = MemoryGuard(self)
        # kernels whose output size comes from the data check it when they run
        self._ctx.memory = self._memory if self._memory.available is not None else None
        # plan the graph outputs now: model errors (and plans that cannot fit) surface here
        self._memory.check_plan(self.plan())

    def planned_peak(self, feeds: Mapping[str, Any], output_names: Sequence[str] | None = None
                     ) -> tuple[int, str | None]:
        """(the planned peak bytes of a run on ``feeds``, the node whose outputs reach it:
        None when the peak is before any node). Sizes come from the static shapes and the
        feeds' (executor/memory.py): a lower bound where a size depends on the data."""
        plan = self.plan(output_names)
        peak, step = self._memory.estimate(plan, feeds)
        return peak, None if step is None else plan.steps[step].node.name

    # -- what the memory guard reads ---------------------------------------------------------
    @property
    def initializer_values(self) -> Mapping[str, Any]:
        """The initializers' arrays as the session holds them (on its device), by name."""
        return self._initializers

    @property
    def overridable(self) -> frozenset[str]:
        """Initializers a run may be fed instead (graph inputs, and the caller's ``fed``)."""
        return frozenset(self._overridable)

    @property
    def ordered_nodes(self) -> list:
        """The graph's nodes in the order the session runs them (plan nodes)."""
        return self._ordered

    @property
    def fed_types(self) -> Mapping[str, tuple]:
        """(dtype, dims) of each initializer the caller feeds on every run (``fed``)."""
        return self._fed_types

    def constants_bytes(self) -> int:
        """Bytes the session holds for the model's initializers (not those it is fed)."""
        return int(self._memory.resident)

    def release_memory(self) -> None:
        """Give back the memory kept for the next run (spare arrays, freed host memory):
        for when no run follows soon (a training run's last step is done)."""
        spares = self._ctx.spares
        if spares is not None:
            spares.clear()
        if self.backend.xp is np:
            give_back_freed()

    def recycle(self, values: dict) -> None:
        """Take back arrays the caller is done with (a run's outputs: a training step's
        gradients, once the optimizer has applied them), emptying ``values``: a later run
        writes its large results into them instead of mapping fresh memory, whose page
        faults a step would otherwise pay again for every gradient of 32 MiB and more (the
        embedding's, each large weight's). Only arrays nothing else references are kept
        (see host_memory.SpareBlocks.offer); the rest are simply dropped."""
        spares = self._ctx.spares
        while values:
            _, value = values.popitem()
            if spares is not None:
                spares.offer(value)
            value = None

    def constant_buffers(self) -> set[int]:
        """The ids of the arrays holding the session's initializers' memory: an output that
        views one of them is the session's (an Identity of a constant), not the caller's to
        change in place."""
        return set(self._memory._resident_owners)

    def reseed(self, seed: int) -> None:
        """Restart the random streams (Dropout masks) from ``seed``: a training loop reseeds
        each step so that a resumed run draws the same masks as an uninterrupted one."""
        self._ctx.reseed(seed)

    @contextlib.contextmanager
    def inference_mode(self):
        """Dropout off and training-mode BatchNorm on its running statistics for the runs
        inside (held-out evaluation in a training session), as model.eval(); a Dropout
        given an explicit ``training_mode`` input still follows it."""
        previous = self._ctx.training, self._ctx.evaluating
        self._ctx.training, self._ctx.evaluating = False, True
        try:
            yield self
        finally:
            self._ctx.training, self._ctx.evaluating = previous

    # -- planning -----------------------------------------------------------------------
    def plan(self, output_names: Sequence[str] | None = None) -> Plan:
        """The (cached) plan computing ``output_names`` (graph outputs by default)."""
        fetches = tuple(output_names) if output_names is not None else tuple(self.output_names)
        plan = self._plans.get(fetches)
        if plan is None:
            plan = build_plan(self._ordered, self._available, fetches)
            self._plans[fetches] = plan
        return plan

    # -- feeds ----------------------------------------------------------------------------
    def _check_feeds(self, feeds: Mapping[str, Any], plan: Plan) -> dict[str, Any]:
        allowed = set(self._input_types) | self._overridable | set(self.yield_output_names)
        unknown = sorted(set(feeds) - allowed)
        if unknown:
            raise FeedError(
                f"unknown feed name(s) {unknown}; the model's inputs are {self.input_names}"
                + (f" and YieldOp gradients {self.yield_output_names}"
                   if self.yield_output_names else "")
            )
        needed_inputs = [n for n in (*self._input_types, *self._fed_types)
                         if plan.last_use.get(n, -1) >= 0 or n in plan.fetches]
        missing = [n for n in needed_inputs if n not in feeds]
        if missing:
            raise FeedError(f"missing feed(s) for graph input(s) {missing}")

        checked: dict[str, Any] = {}
        symbols: dict[str, tuple[int, str]] = {}
        for name, value in feeds.items():
            array = (value if hasattr(value, "dtype") and hasattr(value, "shape")
                     else np.asarray(value))
            expected_dtype, dims = (self._input_types.get(name) or self._known_types.get(name)
                                    or (None, None))
            if name in self._fed_types:
                expected_dtype, dims = self._fed_types[name]
            elif name in self._overridable:
                reference = self._initializers[name]
                expected_dtype, dims = reference.dtype, list(reference.shape)
            if expected_dtype is not None and array.dtype != expected_dtype:
                raise FeedError(
                    f"feed {name!r} has dtype {array.dtype}, the graph declares {expected_dtype}"
                )
            if dims is not None:
                if array.ndim != len(dims):
                    raise FeedError(
                        f"feed {name!r} has shape {tuple(array.shape)} (rank {array.ndim}), "
                        f"the graph declares rank {len(dims)} {dims}"
                    )
                for axis, (size, dim) in enumerate(zip(array.shape, dims, strict=True)):
                    if isinstance(dim, int) and size != dim:
                        raise FeedError(
                            f"feed {name!r} has shape {tuple(array.shape)}, the graph declares "
                            f"{dims} (axis {axis} must be {dim})"
                        )
                    if isinstance(dim, str) and dim:
                        seen = symbols.setdefault(dim, (size, name))
                        if seen[0] != size:
                            raise FeedError(
                                f"feed {name!r} binds dimension {dim!r} to {size} but feed "
                                f"{seen[1]!r} bound it to {seen[0]}"
                            )
            checked[name] = self.backend.to_device(array)
        return checked

    # -- running ------------------------------------------------------------------------
    def run(
        self,
        feeds: Mapping[str, Any],
        output_names: Sequence[str] | None = None,
        *,
        observer: Observer | None = None,
        on_step: StepHook | None = None,
        to_host: bool = True,
    ) -> dict[str, np.ndarray]:
        """Run the graph and return ``{name: numpy array}`` for ``output_names``.

        ``output_names`` defaults to the graph outputs and may name any tensor of the graph
        (intermediates included, for debugging); only the nodes they need are run.
        ``feeds`` maps graph input names to arrays; for a training graph it may also map
        YieldOp output names to the gradients of the module outputs (defaults: ones).
        Feeds are validated (names, dtypes, static and symbolic dims) before any node runs.
        ``observer(step, node_name, live_tensor_names)`` is called after each step, once
        the dead tensors are released (for memory debugging).
        ``on_step(step, node, outputs)`` is called right after the kernel of plan step
        ``step`` (``self.plan(output_names).steps[step]``) ran ``node``, with the node's
        output values in output order, before the step's dead tensors are released: what a
        caller needs to act on a value the moment it exists (a data-parallel trainer starts a
        gradient's all-reduce there; a value it keeps is never reused in place by a later
        kernel). What it raises propagates as it is. Absent, it costs one test per step.
        ``to_host=False`` returns the backend's arrays as they are (CuPy arrays stay on the
        GPU).
        """
        plan = self.plan(output_names)
        checked = self._check_feeds(feeds, plan)
        # refuse what cannot fit before any node runs
        peak = self._memory.check_run(plan, checked)
        donate = self.backend.xp is np  # CuPy arrays: reference counts do not tell ownership
        kept_bytes = None if peak is None else peak - self._memory.resident
        room = self._memory.room   # per step: what spares may hold within the planned peak
        if donate:  # the next run needs the memory this one frees: keep it (host_memory.py)
            keep_freed(kept_bytes)
        values: list[Any] = [None] * plan.num_slots
        for name, slot in plan.slot_of.items():
            if plan.last_use[name] >= 0 or name in plan.fetches:
                if name in checked:
                    values[slot] = checked[name]
                elif name in self._initializers:
                    values[slot] = self._initializers[name]
        ctx = self._ctx
        ctx.yield_feeds = {n: v for n, v in checked.items() if n in self.yield_output_names}
        numerics = self.numerics
        names_by_slot = plan.names_by_slot if observer is not None else None
        blas = ctx.blas
        spares = ctx.spares  # large arrays a later step or run may write into (host_memory)
        donations: list = []
        # small products keep BLAS on one thread until a large one or the end; runs of one
        # plan and feed shapes learn where their mid-size products run faster (blas_threads)
        blas.hold((id(plan),) + tuple(getattr(v, "shape", None) for v in checked.values()))
        self._memory.values = values  # what is live, for memory.check_allocation
        try:
            for index, step in enumerate(plan.steps):
                args = [values[s] if s >= 0 else None for s in step.in_slots]
                also = {k: values[s] for k, s in step.also} if step.also else _NOTHING_ELSE
                if step.donatable and donate:
                    ctx.donated = _donations(step, args, values)
                    if spares is not None:  # offered below, once the step has run
                        donations = list(ctx.donated)
                try:
                    # only GEMM-class products consult the policy (its node name and
                    # BackwardPassGuard): every other node is called directly
                    if numerics is None or not step.gemm:
                        result = step.fn(ctx, step.node, *args, **also)
                    else:
                        result = self._run_with_numerics(step, args, also)
                except ExecutorError:
                    raise
                except Exception as exc:
                    raise KernelError(f"node {step.node.label()} failed: {exc}") from exc
                ctx.donated = ()
                self._store(step, result, values)
                if on_step is not None:
                    blas.restore()  # the caller's code sees BLAS's own thread count
                    on_step(index, step.node,
                            tuple(result) if isinstance(result, (tuple, list)) else (result,))
                result = args = also = None  # hold no reference a later donation check would see
                # an offered array is referenced by ``value`` alone unless something else (a
                # fetch, a hook, a live view, the kernel's result) still holds it
                for slot in step.release:
                    value, values[slot] = values[slot], None
                    if spares is not None:
                        spares.offer(value, None if room is None else room[index])
                while donations:  # donated inputs the kernel did not write into
                    value = donations.pop()
                    spares.offer(value, None if room is None else room[index])
                value = None
                if observer is not None:
                    blas.restore()
                    live = [names_by_slot[s] for s, v in enumerate(values) if v is not None]
                    observer(index, step.node.name, live)
            blas.run_completed()
        finally:
            self._memory.values = None
            blas.release()
            if spares is not None:
                spares.end_run(kept_bytes)
            ctx.yield_feeds = {}
            ctx.donated = ()
            ctx.forget_made()
        if not to_host:
            return {name: values[plan.slot_of[name]] for name in plan.fetches}
        return {name: self.backend.to_host(values[plan.slot_of[name]]) for name in plan.fetches}

    def _run_with_numerics(self, step, args, also):
        numerics = self.numerics
        if step.gemm:
            try:
                numerics.current_node = step.node.name
            except AttributeError:  # a policy object that does not track nodes
                pass
        guard = (
            numerics.backward_pass()
            if step.backward and hasattr(numerics, "backward_pass")
            else contextlib.nullcontext()
        )
        with guard:
            return step.fn(self._ctx, step.node, *args, **also)

    @staticmethod
    def _store(step, result, values) -> None:
        if isinstance(result, (tuple, list)):
            if (len(result) < len(step.out_slots)
                    and any(s >= 0 for s in step.out_slots[len(result):])):
                raise KernelError(
                    f"node {step.node.label()} produced {len(result)} outputs, "
                    f"the graph uses {len(step.out_slots)}"
                )
            for slot, value in zip(step.out_slots, result, strict=False):
                if slot >= 0:
                    values[slot] = value
        else:
            values[step.out_slots[0]] = result


_NOTHING_ELSE: dict = {}  # the keyword arguments of a kernel that reads nothing else


def _donations(step, args, values) -> tuple:
    """The arrays among the step's dying inputs that nothing else references: not a feed, an
    initializer, a fetched tensor, another slot, or a live view (a view holds its base).
    Their slots are cleared now, as the step's release would after it ran."""
    donated = []
    for position, slot in step.donatable:
        values[slot] = None
        array = args[position]
        # two references besides unshared_owner's own: args and this local
        if (unshared_owner(array, 2) is not None and array.flags.writeable
                and 0 not in array.strides):
            donated.append(array)
    return tuple(donated)
