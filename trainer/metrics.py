"""What a run reports beside the loss, as transformers' Trainer and its examples do: the
perplexity (exp of the mean cross-entropy) of every step, and on held-out data the
accuracy of the logits' argmax against the labels (positions labelled ``ignore_index`` not
counted, as the loss does not count them).

Both need the loss to be a mean cross-entropy: the training graph's SoftmaxCrossEntropyLoss
(``reduction="mean"``) producing a loss. Its scores input (classes on axis 1) is what the
evaluation fetches; the labels are the data's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx

from graphopt.ir import normalize_domain
from graphopt.vocabulary import attribute_or_default


@dataclass(frozen=True)
class Classification:
    scores: str                 # the logits the loss reads, classes on axis 1
    labels: str                 # the graph input holding the class indices
    ignore_index: int | None    # labels that do not count


def classification_of(proto: onnx.ModelProto, losses) -> Classification | None:
    """The mean cross-entropy producing one of ``losses``, or None (another loss)."""
    wanted = set(losses)
    inputs = {i.name for i in proto.graph.input}
    for node in proto.graph.node:
        if node.op_type != "SoftmaxCrossEntropyLoss" or normalize_domain(node.domain) \
                or not node.output or node.output[0] not in wanted:
            continue
        if attribute_or_default(node, "reduction") != b"mean" or len(node.input) > 2 \
                or node.input[1] not in inputs:
            return None   # class weights, a sum, computed labels: no plain perplexity
        ignore = next((onnx.helper.get_attribute_value(a) for a in node.attribute
                       if a.name == "ignore_index"), None)   # no default: every label counts
        return Classification(node.input[0], node.input[1], ignore)
    return None


def perplexity(loss: float) -> float:
    """exp(loss), inf past float64's range (a diverged run)."""
    return math.exp(loss) if loss < 709.0 else math.inf


def correct_and_counted(scores, labels, ignore_index: int | None) -> tuple[int, int]:
    """(positions whose argmax over axis 1 is the label, positions that count)."""
    predicted = np.argmax(np.asarray(scores), axis=1)
    labels = np.asarray(labels)
    counted = np.ones(labels.shape, bool) if ignore_index is None else labels != ignore_index
    return int(np.count_nonzero((predicted == labels) & counted)), int(np.count_nonzero(counted))
