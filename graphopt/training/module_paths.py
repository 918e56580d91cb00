"""Module paths for the weights an exporter renamed.

TorchScript writes a Linear's weight transposed into a new initializer named
``onnx::MatMul_664``; the node reading it keeps the module's path in its name
(``/model/layers.0/self_attn/q_proj/MatMul``), and the dynamo exporter keeps it in the node's
``pkg.torch.onnx.name_scopes`` metadata. :func:`module_paths` gives each such weight the name
PyTorch's ``named_parameters()`` gives it (``model.layers.0.self_attn.q_proj.weight``), so a
listing shows it by that name and ``--freeze``/``--train`` patterns reach it by it.
"""
from __future__ import annotations

import fnmatch

import onnx

from .selection import EXPORTER_CONSTANT_NAMES
from .shared import NAME_SCOPES, module_scope

# (op type, input index) -> the parameter of the module that op belongs to
_ROLES = {("MatMul", 1): "weight", ("Gemm", 1): "weight", ("Gemm", 2): "bias",
          ("Conv", 1): "weight", ("Conv", 2): "bias", ("ConvTranspose", 1): "weight",
          ("ConvTranspose", 2): "bias"}


def _module_of(node: onnx.NodeProto) -> str | None:
    """The module path a node was exported from: its dynamo name scopes, or its TorchScript
    name ``/a/b.0/c/Op`` (the last part is the op's own)."""
    if any(prop.key == NAME_SCOPES for prop in node.metadata_props):
        return module_scope(node)
    if node.name.startswith("/") and node.name.count("/") >= 2:
        return ".".join(p for p in node.name.split("/")[1:-1] if p) or None
    return None


def module_paths(model: onnx.ModelProto) -> dict[str, str]:
    """Exporter-named initializer -> its parameter's module path name, where the graph says
    it unambiguously (one module reads it, in a weight or bias position, and no other
    initializer has that name)."""
    graph = model.graph
    names = {t.name for t in graph.initializer}
    generated = {n for n in names
                 if any(fnmatch.fnmatchcase(n, p) for p in EXPORTER_CONSTANT_NAMES)}
    found: dict[str, set[str]] = {}
    for node in graph.node:
        for index, name in enumerate(node.input):
            role = _ROLES.get((node.op_type, index))
            if name in generated and role:
                module = _module_of(node)
                found.setdefault(name, set()).add(f"{module}.{role}" if module else "")
    paths = {name: next(iter(found_paths)) for name, found_paths in found.items()
             if len(found_paths) == 1 and next(iter(found_paths))}
    counts: dict[str, int] = {}
    for path in paths.values():
        counts[path] = counts.get(path, 0) + 1
    return {name: path for name, path in paths.items() if counts[path] == 1 and path not in names}
