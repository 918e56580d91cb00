"""Kernel registry: (domain, op_type, opset range) -> kernel function.

A kernel is ``fn(ctx, node, *inputs) -> array | tuple[array, ...]`` where ``ctx`` is the
per-run KernelContext, ``node`` the PlannedNode (attributes already decoded) and ``inputs``
the node's inputs in order, ``None`` for an omitted optional input. Kernels never mutate
their inputs; they may mutate arrays they allocated themselves, and a kernel registered
with ``inplace=True`` may write its result into an input found in ``ctx.donated`` (an
array of input 0 or 1 that no one else holds any more: see Session.run). A kernel registered
with ``reads_also`` may be handed, as keyword arguments, tensors that other nodes of the same
run computed before it (a forward result it would otherwise compute again): see
``KernelSpec.reads_also``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from graphopt.vocabulary import MS_DOMAIN, domain_label, normalize_domain  # noqa: F401 (re-exported)
from graphopt.vocabulary import STANDARD_DOMAIN as ONNX_DOMAIN

LATEST = 10_000  # "no upper bound" on an opset range


@dataclass(frozen=True)
class KernelSpec:
    domain: str
    op_type: str
    since: int
    until: int
    fn: Callable
    gemm: bool  # routes its products through executor.gemm.matmul (FP16 policy applies)
    inplace: bool = False  # may write its result into a donated input (ctx.donated)
    # ``reads_also(node, earlier_readers) -> {keyword: tensor name}``: tensors of the run
    # that the kernel takes as keyword arguments beyond its node's inputs, chosen at plan time
    # among the outputs of the planned nodes that run before it; ``earlier_readers(name)``
    # lists those nodes that read the tensor ``name``. The plan keeps them alive until the
    # kernel has run; the kernel must compute the same result (to rounding) without them.
    reads_also: Callable | None = None

    @property
    def opset_range(self) -> str:
        return f"{self.since}+" if self.until >= LATEST else f"{self.since}-{self.until}"


_REGISTRY: dict[tuple[str, str], list[KernelSpec]] = {}


def kernel(
    *op_types: str,
    domain: str = ONNX_DOMAIN,
    since: int = 1,
    until: int = LATEST,
    gemm: bool = False,
    inplace: bool = False,
    reads_also: Callable | None = None,
) -> Callable[[Callable], Callable]:
    """Register the decorated function for each op type over opsets [since, until]."""

    def register(fn: Callable) -> Callable:
        for op_type in op_types:
            key = (normalize_domain(domain), op_type)
            specs = _REGISTRY.setdefault(key, [])
            for other in specs:
                if other.since <= until and since <= other.until:
                    raise ValueError(f"overlapping kernels for {key} opsets {since}-{until}")
            specs.append(KernelSpec(key[0], op_type, since, until, fn, gemm, inplace,
                                     reads_also))
            specs.sort(key=lambda s: s.since)
        return fn

    return register


def _ensure_loaded() -> None:
    from . import kernels  # noqa: F401, PLC0415  (importing registers every family)


def lookup(domain: str, op_type: str, opset: int) -> KernelSpec | None:
    _ensure_loaded()
    for spec in _REGISTRY.get((normalize_domain(domain), op_type), ()):
        if spec.since <= opset <= spec.until:
            return spec
    return None


def all_specs() -> list[KernelSpec]:
    _ensure_loaded()
    specs = [s for group in _REGISTRY.values() for s in group]
    return sorted(specs, key=lambda s: (s.domain, s.op_type, s.since))


def supported_op_types(domain: str = ONNX_DOMAIN) -> set[str]:
    domain = normalize_domain(domain)
    return {s.op_type for s in all_specs() if s.domain == domain}


def supported_ops_markdown() -> str:
    """The supported-op table, generated from the registry (one row per op type)."""
    rows: dict[tuple[str, str], list[KernelSpec]] = {}
    for spec in all_specs():
        rows.setdefault((spec.domain, spec.op_type), []).append(spec)
    lines = [
        "| Domain | Op | Opsets | GEMM entry point |",
        "|---|---|---|---|",
    ]
    for (domain, op_type), specs in rows.items():
        ranges = ", ".join(s.opset_range for s in specs)
        gemm = "yes" if any(s.gemm for s in specs) else ""
        lines.append(f"| {domain_label(domain)} | {op_type} | {ranges} | {gemm} |")
    counts = {}
    for domain, _ in rows:
        counts[domain_label(domain)] = counts.get(domain_label(domain), 0) + 1
    summary = ", ".join(f"{n} {d}" for d, n in counts.items())
    return "\n".join(lines) + f"\n\n{len(rows)} op types ({summary}).\n"


def supported_ops_compact() -> str:
    """One paragraph per domain listing its op types (GEMM-class ones marked with *)."""
    by_domain: dict[str, dict[str, bool]] = {}
    for spec in all_specs():
        ops = by_domain.setdefault(domain_label(spec.domain), {})
        ops[spec.op_type] = ops.get(spec.op_type, False) or bool(spec.gemm)
    paragraphs = []
    for domain, ops in by_domain.items():
        names = ", ".join(f"{op}*" if gemm else op for op, gemm in sorted(ops.items()))
        paragraphs.append(f"**{domain}** ({len(ops)}): {names}")
    return "\n\n".join(paragraphs) + "\n"
