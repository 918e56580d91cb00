"""Losses: SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss and ORT's gradient of the first."""

from __future__ import annotations

import numpy as np

from ..registry import MS_DOMAIN, kernel
from .nn import exp_of_nonpositive, log_softmax_over


def _uniform_weight(labels, weights, ignore_index):
    """Whether every element's weight is 1 (no class weights, nothing ignored)."""
    return weights is None and (ignore_index is None or not (labels == ignore_index).any())


def _at_labels(scores, labels):
    """NumPy: the index into ``scores`` (N, C, ...) that picks, at every position of the
    labels (N, ...), its label's class: ``scores[index]`` reads those elements (shaped as the
    labels) and writes them. It indexes ``scores`` itself, whatever its layout: a reshape
    could be a copy (a transposed view), and writes through it would be lost."""
    positions = np.indices(labels.shape, sparse=True)
    return (positions[0], labels, *positions[1:])


def _pick(xp, log_prob, safe):
    """log_prob[n, safe[n, ...], ...] for every position of the labels."""
    if xp is not np:
        picked = xp.take_along_axis(log_prob, xp.expand_dims(safe.astype(np.int64), 1), axis=1)
        return xp.squeeze(picked, axis=1)
    return log_prob[_at_labels(log_prob, safe)]


def _picked_weights(xp, labels, weights, ignore_index, dtype):
    """Per-element weight w[label] (1 without weights), 0 where label == ignore_index."""
    safe = labels
    keep = None
    if ignore_index is not None:
        keep = labels != ignore_index
        safe = xp.where(keep, labels, 0)
    w = xp.ones(labels.shape, dtype=dtype) if weights is None else weights[safe].astype(dtype)
    if keep is not None:
        w = w * keep
    return safe, w


def _nll(xp, log_prob, labels, weights, ignore_index, reduction):
    if xp is np and log_prob.size and _uniform_weight(labels, weights, ignore_index):
        # every weight 1: the same sums without the weight tensor (-p * 1 is -p)
        loss = -_pick(xp, log_prob, labels)
        if reduction == "none":
            return loss
        total = loss.sum(dtype=log_prob.dtype)
        if reduction == "sum":
            return total
        count = np.ones(labels.shape, log_prob.dtype).sum(dtype=log_prob.dtype)
        return (total / count).astype(log_prob.dtype)
    safe, w = _picked_weights(xp, labels, weights, ignore_index, log_prob.dtype)
    loss = -_pick(xp, log_prob, safe) * w
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum(dtype=log_prob.dtype)
    return (loss.sum(dtype=log_prob.dtype) / w.sum(dtype=log_prob.dtype)).astype(log_prob.dtype)


@kernel("NegativeLogLikelihoodLoss", since=12)
def nll_loss(ctx, node, log_prob, labels, weights=None):
    return _nll(ctx.xp, log_prob, labels, weights, node.attrs.get("ignore_index"),
                node.attr("reduction"))


@kernel("SoftmaxCrossEntropyLoss", since=12)
def softmax_cross_entropy_loss(ctx, node, scores, labels, weights=None):
    log_prob = log_softmax_over(ctx.xp, scores, (1,))
    loss = _nll(ctx.xp, log_prob, labels, weights, node.attrs.get("ignore_index"),
                node.attr("reduction"))
    return loss, log_prob


@kernel("SoftmaxCrossEntropyLossInternal", domain=MS_DOMAIN)
def softmax_cross_entropy_loss_internal(ctx, node, scores, labels, weights=None, ignore_index=None):
    ignore = (node.attrs.get("ignore_index") if ignore_index is None
              else ctx.host_scalar(ignore_index))
    log_prob = log_softmax_over(ctx.xp, scores, (1,))
    return (_nll(ctx.xp, log_prob, labels, weights, ignore, node.attr("reduction")),
            log_prob)


def softmax_cross_entropy_grad(xp, dy, log_prob, labels, weights, ignore_index, reduction,
                               out=None):
    """d loss / d scores = (softmax - onehot(label)) * w[label] * (dY scaled by reduction).
    ``out``: an array of log_prob's shape and dtype for the result (may be log_prob)."""
    if (xp is np and log_prob.size and reduction != "none"
            and _uniform_weight(labels, weights, ignore_index)):
        # the same operations on NumPy, without the one-hot mask and the broadcast weights:
        # softmax - 1 at the labels only, then one scalar (1 * dY / count or 1 * dY)
        factor = dy.reshape(())
        if reduction == "mean":
            factor = factor / np.ones(labels.shape, log_prob.dtype).sum(dtype=log_prob.dtype)
        grad = exp_of_nonpositive(xp, log_prob, out)
        grad[_at_labels(grad, labels)] -= 1
        grad *= factor
        return grad
    safe, w = _picked_weights(xp, labels, weights, ignore_index, log_prob.dtype)
    if reduction == "mean":
        w = w * (dy.reshape(()) / w.sum(dtype=log_prob.dtype))
    elif reduction == "sum":
        w = w * dy.reshape(())
    else:
        w = w * dy
    grad = exp_of_nonpositive(xp, log_prob, out)
    classes = xp.arange(log_prob.shape[1]).reshape((1, -1) + (1,) * (log_prob.ndim - 2))
    grad -= xp.expand_dims(safe, 1) == classes
    grad *= xp.expand_dims(w, 1)
    return grad.astype(log_prob.dtype, copy=False)


@kernel("SoftmaxCrossEntropyLossGrad", domain=MS_DOMAIN, inplace=True)
@kernel("SoftmaxCrossEntropyLossInternalGrad", domain=MS_DOMAIN, inplace=True)
def softmax_cross_entropy_loss_grad(ctx, node, dy, log_prob, labels, weights=None,
                                    ignore_index=None):
    ignore = (node.attrs.get("ignore_index") if ignore_index is None
              else ctx.host_scalar(ignore_index))
    return softmax_cross_entropy_grad(ctx.xp, dy, log_prob, labels, weights, ignore,
                                      node.attr("reduction"),
                                      # the result takes log_prob's layout either way
                                      ctx.out_for(log_prob.shape, log_prob.dtype, log_prob,
                                                  any_layout=True))
