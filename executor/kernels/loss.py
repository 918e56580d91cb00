"""Losses: SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss and ORT's gradient of the first."""

from __future__ import annotations

import numpy as np

from ..registry import MS_DOMAIN, kernel
from .nn import log_softmax_over


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
    safe, w = _picked_weights(xp, labels, weights, ignore_index, log_prob.dtype)
    picked = xp.take_along_axis(log_prob, xp.expand_dims(safe.astype(np.int64), 1), axis=1)
    loss = -xp.squeeze(picked, axis=1) * w
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


def softmax_cross_entropy_grad(xp, dy, log_prob, labels, weights, ignore_index, reduction):
    """d loss / d scores = (softmax - onehot(label)) * w[label] * (dY scaled by reduction)."""
    safe, w = _picked_weights(xp, labels, weights, ignore_index, log_prob.dtype)
    if reduction == "mean":
        w = w * (dy.reshape(()) / w.sum(dtype=log_prob.dtype))
    elif reduction == "sum":
        w = w * dy.reshape(())
    else:
        w = w * dy
    grad = xp.exp(log_prob)
    classes = xp.arange(log_prob.shape[1]).reshape((1, -1) + (1,) * (log_prob.ndim - 2))
    grad -= xp.expand_dims(safe, 1) == classes
    grad *= xp.expand_dims(w, 1)
    return grad.astype(log_prob.dtype, copy=False)


@kernel("SoftmaxCrossEntropyLossGrad", domain=MS_DOMAIN)
@kernel("SoftmaxCrossEntropyLossInternalGrad", domain=MS_DOMAIN)
def softmax_cross_entropy_loss_grad(ctx, node, dy, log_prob, labels, weights=None,
                                    ignore_index=None):
    ignore = (node.attrs.get("ignore_index") if ignore_index is None
              else ctx.host_scalar(ignore_index))
    return softmax_cross_entropy_grad(ctx.xp, dy, log_prob, labels, weights, ignore,
                                      node.attr("reduction"))
