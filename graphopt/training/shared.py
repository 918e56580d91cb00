"""Parameters the exporter merged because they started equal: found, said, and split.

A freshly initialised model's norms are all ones and its biases all zeros, and both PyTorch
exporters deduplicate equal tensors: TorchScript keeps the first and writes
``Identity(h.0.ln.weight) -> h.1.ln.weight`` for the others, dynamo's optimizer leaves one
initializer read by every layer (each node's ``pkg.torch.onnx.name_scopes`` metadata still
names the module it belongs to). Trained as it arrives, that one tensor gets the sum of every
layer's gradient where PyTorch trains one tensor per layer.

A *merge* is a trained initializer whose elements are all equal and which stands for the
parameter of more than one module: it feeds Identity nodes whose outputs carry module-path
names, or its readers belong to more than one module scope. (A tensor a model really shares,
a tied embedding, holds distinct values: it is never taken for a merge.) graphopt cannot know
what the module was, so a run says so before step 1; :func:`split` gives each module its own
copy, named as the module's parameter (``h.1.ln.weight``), as PyTorch has them.
"""
from __future__ import annotations

import ast
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from ..vocabulary import FLOAT_TYPES
from .ties import all_equal, is_module_path

NAME_SCOPES = "pkg.torch.onnx.name_scopes"   # the dynamo exporter's node metadata
FX_NODE = "pkg.torch.onnx.fx_node"           # and the FX call each node comes from


@dataclass
class Merge:
    """``source`` stands for the parameters ``copies`` (new name -> the nodes, by index in
    the main graph, that read it as that parameter; an Identity node's own index when the
    exporter wrote one) besides its own module's."""
    source: str
    value: float
    copies: dict[str, list[int]] = field(default_factory=dict)

    def describe(self) -> str:
        names = [self.source, *self.copies]
        shown = ", ".join(names[:3]) + (f", ... ({len(names)})" if len(names) > 3 else "")
        return f"{self.source} (all {self.value:g}) stands for {len(names)} parameters: {shown}"


Reader = Callable[[onnx.TensorProto], np.ndarray]


def find_merges(model: onnx.ModelProto, trained: Sequence[str], read: Reader | None = None
                ) -> list[Merge]:
    """The merges among ``trained`` initializers of ``model`` (see the module's words)."""
    read = read or numpy_helper.to_array
    graph = model.graph
    tensors = {t.name: t for t in graph.initializer}
    taken = {t.name for t in graph.initializer} | {v.name for v in graph.input}
    taken |= {o for n in graph.node for o in n.output}
    wanted = {n for n in trained if n in tensors and tensors[n].data_type in FLOAT_TYPES}
    readers: dict[str, list[int]] = {}
    for index, node in enumerate(graph.node):
        for name in set(node.input):
            if name in wanted:
                readers.setdefault(name, []).append(index)
    merges = []
    for name, indices in readers.items():
        groups = _parameters_read(name, [(i, graph.node[i]) for i in indices])
        if len(groups) < 2:
            continue
        value = read(tensors[name])
        if value.size == 0 or not all_equal(value):
            continue
        merge = Merge(name, float(value.reshape(-1)[0]))
        own = _own_group(name, groups)
        for parameter, nodes in groups.items():
            if parameter == own:
                continue
            new = parameter if parameter not in taken or _is_identity_of(
                graph, nodes, name, parameter) else _fresh(parameter, taken)
            taken.add(new)
            merge.copies[new] = nodes
        merges.append(merge)
    return merges


def split(model: onnx.ModelProto, merges: Sequence[Merge]) -> None:
    """Give each parameter of each merge its own initializer, in place: an Identity the
    exporter wrote becomes the initializer its output names; readers grouped by module read
    their module's copy. The copies hold the source's bytes (or the same reference to them)."""
    if not merges:
        return
    graph = model.graph
    tensors = {t.name: t for t in graph.initializer}
    dropped: set[int] = set()
    for merge in merges:
        for new, nodes in merge.copies.items():
            copy = graph.initializer.add()
            copy.CopyFrom(tensors[merge.source])
            copy.name = new
            for index in nodes:
                node = graph.node[index]
                if node.op_type == "Identity" and list(node.output) == [new]:
                    dropped.add(index)
                    continue
                for position, name in enumerate(node.input):
                    if name == merge.source:
                        node.input[position] = new
    if dropped:
        kept = [n for i, n in enumerate(graph.node) if i not in dropped]
        del graph.node[:]
        graph.node.extend(kept)


def _parameters_read(source: str, readers: list[tuple[int, onnx.NodeProto]]
                     ) -> dict[str, list[int]]:
    """Which parameter each reader takes ``source`` for: an Identity's module-path output
    names it; else the reader's module scope (dynamo's metadata) + the source's last name
    part. Readers with neither are left out."""
    last = source.rsplit(".", 1)[-1]
    groups: dict[str, list[int]] = {}
    unscoped = []
    for index, node in readers:
        if node.op_type == "Identity" and is_module_path(node.output[0]):
            groups.setdefault(node.output[0], []).append(index)
            continue
        scope = module_scope(node)
        if scope is None:
            unscoped.append(index)   # TorchScript: the source's own module reads it directly
        else:
            groups.setdefault(f"{scope}.{last}", []).append(index)
    if unscoped and groups:
        groups.setdefault(source, []).extend(unscoped)
    return groups


def _own_group(source: str, groups: dict[str, list[int]]) -> str:
    """The parameter the source keeps: its own name's, else the first read."""
    return source if source in groups else next(iter(groups))


def name_scopes(node: onnx.NodeProto) -> list[str] | None:
    """A dynamo-exported node's module scopes, outermost first (``['', 'm', 'm.h.0', ...]``;
    the last entry is the node's own op name), or None without readable metadata."""
    entry = next((p.value for p in node.metadata_props if p.key == NAME_SCOPES), None)
    if entry is None:
        return None
    try:
        scopes = ast.literal_eval(entry)
    except (ValueError, SyntaxError):
        return None
    if not isinstance(scopes, list) or not all(isinstance(s, str) for s in scopes):
        return None
    return scopes


def fx_node_text(node: onnx.NodeProto) -> str:
    """The FX call a dynamo-exported node comes from (``%embedding : ... = call_function[
    target=torch.ops.aten.embedding.default](args = (...))``), or "" without that metadata."""
    return next((p.value for p in node.metadata_props if p.key == FX_NODE), "")


def module_scope(node: onnx.NodeProto) -> str | None:
    """The deepest module a dynamo-exported node belongs to (its name scopes' last module)."""
    scopes = name_scopes(node)
    if scopes is None or len(scopes) < 2:
        return None
    return scopes[-2] or None


def _is_identity_of(graph, nodes: list[int], source: str, name: str) -> bool:
    """Whether ``name`` is taken only by the Identity of ``source`` that this split removes."""
    return any(graph.node[i].op_type == "Identity" and list(graph.node[i].output) == [name]
               and list(graph.node[i].input) == [source] for i in nodes)


def _fresh(name: str, taken: set[str]) -> str:
    index = 1
    while f"{name}_{index}" in taken:
        index += 1
    return f"{name}_{index}"


