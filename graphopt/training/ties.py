"""Tied weights the exporter wrote twice: found, and trained as one parameter.

A language model whose output projection is its token embedding (Falcon, GPT-2, Llama with
``tie_word_embeddings``) trains one tensor. The TorchScript exporter folds the projection's
transpose into an initializer of its own (``onnx::MatMul_N`` [hidden, vocab] beside
``word_embeddings.weight`` [vocab, hidden]); other exports keep both names with the same
bytes. Trained as two tensors they drift apart from the first update on, and the model
trains a quarter more weights than PyTorch does.

A *copy* is a trained initializer equal, bit for bit, to another trained initializer (the
*source*) or to its transpose. Small tensors (under :data:`MIN_ELEMENTS`) and tensors whose
elements are all equal (a fresh norm's ones, a zero bias) are never taken for copies: their
equality says nothing about the module they came from. The source is the one whose name is
a module path (``a.b.weight``), else the first in model order. :func:`tie` replaces each copy
by ``Identity(source)`` or ``Transpose(source)`` in the forward graph, so the gradient
builder sums the gradients of both uses into the source's, as autograd does for a shared
parameter; the trainer writes the copy back from the trained source.

Candidates are narrowed by shape (the same dims, or a matrix's reversed dims) and then by a
probe of 16 elements before two tensors are compared whole: each tensor is read once for its
probe and only the pairs whose probes agree are read again.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..vocabulary import FLOAT_TYPES

MIN_ELEMENTS = 1024
PROBE_POINTS = 16


@dataclass(frozen=True)
class Tie:
    """``copy`` holds ``source`` (``transposed``: its transpose) bit for bit."""
    copy: str
    source: str
    transposed: bool

    def describe(self) -> str:
        return f"{self.copy} = {self.source}{'^T' if self.transposed else ''}"


Reader = Callable[[onnx.TensorProto], np.ndarray]


def tie_entries(ties: Sequence[Tie]) -> dict[str, dict]:
    """The ties as a training graph records them (:attr:`.graph.TrainingGraph.tied`)."""
    return {t.copy: {"source": t.source, "transposed": t.transposed} for t in ties}


def find_ties(model: onnx.ModelProto, trained: Sequence[str], read: Reader | None = None
              ) -> list[Tie]:
    """The copies among ``trained`` initializers of ``model`` (see the module's words).
    ``read``: a tensor's value (default: from the proto; an external tensor's from its
    files)."""
    read = read or numpy_helper.to_array
    tensors = {t.name: t for t in model.graph.initializer}
    candidates = [tensors[name] for name in trained if name in tensors
                  and tensors[name].data_type in FLOAT_TYPES
                  and int(np.prod(tensors[name].dims, dtype=np.int64)) >= MIN_ELEMENTS]
    groups: dict[tuple, list[onnx.TensorProto]] = {}
    for tensor in candidates:   # same dtype, same dims up to a matrix's transpose
        dims = tuple(tensor.dims)
        key = (tensor.data_type, tuple(sorted(dims)) if len(dims) == 2 else dims)
        groups.setdefault(key, []).append(tensor)
    pairs = []
    for members in groups.values():
        if len(members) < 2:
            continue
        probes = {}
        for tensor in members:
            value = read(tensor)
            if all_equal(value):
                continue
            probes[tensor.name] = (_probe(value),
                                  _probe(value, transposed=True) if value.ndim == 2 else None)
        names = [t.name for t in members if t.name in probes]
        for i, first in enumerate(names):
            for second in names[i + 1:]:
                straight, transposed = probes[first][0], probes[first][1]
                other = probes[second][0]
                same_dims = tuple(tensors[first].dims) == tuple(tensors[second].dims)
                if same_dims and np.array_equal(straight, other):
                    pairs.append((first, second, False))
                elif (transposed is not None and
                      tuple(tensors[first].dims) == tuple(reversed(tensors[second].dims))
                      and np.array_equal(transposed, other)):
                    pairs.append((first, second, True))
    order = {name: i for i, name in enumerate(trained)}
    # tensors found equal form groups (A = B and B = C^T: one group); ``parent`` points
    # towards a group's root, ``flipped`` says whether a tensor is its parent's transpose
    parent: dict[str, str] = {}
    flipped: dict[str, bool] = {}

    def root(name: str) -> tuple[str, bool]:
        turned = False
        while name in parent:
            turned ^= flipped[name]
            name = parent[name]
        return name, turned

    for first, second, transposed in pairs:
        (a, a_turned), (b, b_turned) = root(first), root(second)
        if a == b or not _equal(read(tensors[first]), read(tensors[second]), transposed):
            continue
        parent[b], flipped[b] = a, a_turned ^ b_turned ^ transposed
    members: dict[str, list[tuple[str, bool]]] = {}
    for name in {n for pair in pairs for n in pair[:2]}:
        top, turned = root(name)
        members.setdefault(top, []).append((name, turned))
    ties = []
    for group in members.values():
        if len(group) < 2:
            continue
        source, source_turned = min(group, key=lambda m: (not is_module_path(m[0]), order[m[0]]))
        ties += [Tie(name, source, turned ^ source_turned) for name, turned in group
                 if name != source]
    return sorted(ties, key=lambda t: order[t.copy])


def tie(model: onnx.ModelProto, ties: Sequence[Tie]) -> None:
    """Replace each copy in ``model`` (in place) by a node computing it from its source: the
    copy's initializer (and its graph input, when the weights are listed as inputs) goes."""
    if not ties:
        return
    graph = model.graph
    copies = {t.copy for t in ties}
    kept = [t for t in graph.initializer if t.name not in copies]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    inputs = [i for i in graph.input if i.name not in copies]
    del graph.input[:]
    graph.input.extend(inputs)
    nodes = [helper.make_node("Transpose" if t.transposed else "Identity", [t.source],
                              [t.copy], name=f"tied/{t.copy}") for t in ties]
    # first, so every reader of a copy comes after the node that makes it
    existing = list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes + existing)


def is_module_path(name: str) -> bool:
    """``transformer.h.0.mlp.weight``: a name the module gave, not the exporter's own
    (``onnx::MatMul_7``, ``val_3``)."""
    return "." in name and "::" not in name


def all_equal(value: np.ndarray) -> bool:
    """Whether every element of ``value`` has the same bits."""
    flat = _bits(value).reshape(-1)
    return bool((flat == flat[0]).all())


def _probe(value: np.ndarray, transposed: bool = False) -> np.ndarray:
    """The bits of PROBE_POINTS elements spread over ``value`` in C order (of its transpose:
    the same flat positions of ``value.T``, read without making the transpose)."""
    where = np.linspace(0, value.size - 1, PROBE_POINTS).astype(np.int64)
    if transposed:   # flat index k of value.T (n, m) is value[k % m, k // m]
        rows = value.shape[0]
        return _bits(value[where % rows, where // rows])
    return _bits(value.reshape(-1)[where] if value.flags.c_contiguous
                 else value[np.unravel_index(where, value.shape)])


def _equal(a: np.ndarray, b: np.ndarray, transposed: bool) -> bool:
    return np.array_equal(_bits(a.T if transposed else a), _bits(b))


def _bits(value: np.ndarray) -> np.ndarray:
    """The elements as unsigned integers of their width: equality bit for bit (NaN, -0)."""
    return value.view(f"u{value.dtype.itemsize}")
