"""A small Falcon-style multi-query attention language model, built with onnx.helper.

token ids -> embedding + learned positions -> LayerNorm -> multi-query attention -> residual
-> LayerNorm -> GELU MLP -> residual -> LayerNorm -> logits over the character vocabulary.

The attention is written the way PyTorch's TorchScript exporter writes Falcon's
``fused_qkv.view(b, t, heads + 2, head_dim)`` followed by ``fused_qkv[..., :-2, :]``,
``fused_qkv[..., [-2], :]`` and ``fused_qkv[..., [-1], :]``: one Slice and two Gathers
(one-element index tensors) on axis 2 of the same tensor. That is the shape
``gather_slice_to_split`` fuses into one Split.

The ``logits`` output is [batch, vocab, seq] (classes on axis 1), the layout ONNX's
SoftmaxCrossEntropyLoss expects, so ``--loss cross_entropy`` applies to it directly with
``labels`` of shape [batch, seq].
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17  # LayerNormalization is a standard op from 17 on


@dataclass(frozen=True)
class MqaConfig:
    vocab: int
    seq: int = 32
    hidden: int = 64
    heads: int = 4
    mlp: int = 128

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


class _GraphWriter:
    """Collects nodes and initializers; names nodes after their first output."""

    def __init__(self, rng: np.random.Generator):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.rng = rng

    def weight(self, name: str, shape, std: float | None = None, value: float | None = None):
        if value is not None:
            array = np.full(shape, value, np.float32)
        else:
            array = (self.rng.standard_normal(shape) * std).astype(np.float32)
        self.initializers.append(numpy_helper.from_array(array, name))
        return name

    def const(self, name: str, array) -> str:
        """A Constant node, as PyTorch exports constants: not an initializer, so the
        training graph builder does not take it for a trainable weight."""
        self.nodes.append(helper.make_node("Constant", [], [name], name=f"/{name}",
                                           value=numpy_helper.from_array(np.asarray(array),
                                                                         name)))
        return name

    def op(self, op_type: str, inputs, output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op_type, list(inputs), [output], name=f"/{output}",
                                           **attrs))
        return output


def _layer_norm(g: _GraphWriter, x: str, prefix: str, hidden: int) -> str:
    scale = g.weight(f"{prefix}.weight", [hidden], value=1.0)
    bias = g.weight(f"{prefix}.bias", [hidden], value=0.0)
    node = helper.make_node("LayerNormalization", [x, scale, bias], [f"{prefix}/out"],
                            name=f"/{prefix}/LayerNormalization", axis=-1, epsilon=1e-5)
    g.nodes.append(node)
    return f"{prefix}/out"


def _attention(g: _GraphWriter, x: str, cfg: MqaConfig) -> str:
    heads, head_dim, hidden, seq = cfg.heads, cfg.head_dim, cfg.hidden, cfg.seq
    std = hidden ** -0.5
    fused = g.op("MatMul", [x, g.weight("attn.query_key_value.weight",
                                        [hidden, (heads + 2) * head_dim], std)],
                 "attn/query_key_value")
    # fused_qkv.view(batch, seq, heads + 2, head_dim): 0 copies the batch and seq dims
    fused = g.op("Reshape", [fused, g.const("attn/qkv_shape",
                                            np.array([0, 0, heads + 2, head_dim], np.int64))],
                 "attn/fused_qkv")
    one = lambda name, v: g.const(name, np.array([v], np.int64))  # noqa: E731
    # fused_qkv[..., :-2, :]                      -> Slice on axis 2
    query = g.op("Slice", [fused, one("attn/q_start", 0), one("attn/q_end", -2),
                           one("attn/q_axis", 2), one("attn/q_step", 1)], "attn/query")
    # fused_qkv[..., [-2], :] and [..., [-1], :]  -> Gather with a one-element index, axis 2
    key = g.op("Gather", [fused, one("attn/k_index", -2)], "attn/key", axis=2)
    value = g.op("Gather", [fused, one("attn/v_index", -1)], "attn/value", axis=2)

    query = g.op("Transpose", [query], "attn/query_t", perm=[0, 2, 1, 3])   # b, h, t, d
    key = g.op("Transpose", [key], "attn/key_t", perm=[0, 2, 3, 1])         # b, 1, d, t
    value = g.op("Transpose", [value], "attn/value_t", perm=[0, 2, 1, 3])   # b, 1, t, d
    scores = g.op("MatMul", [query, key], "attn/scores")
    scores = g.op("Div", [scores, g.const("attn/sqrt_head_dim",
                                          np.array(np.sqrt(head_dim), np.float32))],
                  "attn/scores_scaled")
    # causal mask: -1e4 rather than -inf keeps it finite in float16 too
    mask = np.triu(np.full((seq, seq), -1e4, np.float32), k=1)
    scores = g.op("Add", [scores, g.const("attn/causal_mask", mask)], "attn/scores_masked")
    probs = g.op("Softmax", [scores], "attn/probs", axis=-1)
    context = g.op("MatMul", [probs, value], "attn/context")                # b, h, t, d
    context = g.op("Transpose", [context], "attn/context_t", perm=[0, 2, 1, 3])
    context = g.op("Reshape", [context, g.const("attn/merge_shape",
                                                np.array([0, 0, hidden], np.int64))],
                   "attn/context_merged")
    return g.op("MatMul", [context, g.weight("attn.dense.weight", [hidden, hidden], std)],
                "attn/dense")


def _gelu(g: _GraphWriter, x: str, prefix: str) -> str:
    """0.5 x (1 + erf(x / sqrt 2)), as PyTorch exports nn.GELU() at opset 17."""
    scaled = g.op("Div", [x, g.const(f"{prefix}/sqrt2", np.array(np.sqrt(2.0), np.float32))],
                  f"{prefix}/scaled")
    erf = g.op("Erf", [scaled], f"{prefix}/erf")
    shifted = g.op("Add", [erf, g.const(f"{prefix}/one", np.array(1.0, np.float32))],
                   f"{prefix}/shifted")
    product = g.op("Mul", [x, shifted], f"{prefix}/product")
    return g.op("Mul", [product, g.const(f"{prefix}/half", np.array(0.5, np.float32))],
                f"{prefix}/out")


def _mlp(g: _GraphWriter, x: str, cfg: MqaConfig) -> str:
    hidden, inner = cfg.hidden, cfg.mlp
    up = g.op("MatMul", [x, g.weight("mlp.up.weight", [hidden, inner], hidden ** -0.5)],
              "mlp/up")
    up = g.op("Add", [up, g.weight("mlp.up.bias", [inner], value=0.0)], "mlp/up_biased")
    act = _gelu(g, up, "mlp/gelu")
    down = g.op("MatMul", [act, g.weight("mlp.down.weight", [inner, hidden], inner ** -0.5)],
                "mlp/down")
    return g.op("Add", [down, g.weight("mlp.down.bias", [hidden], value=0.0)], "mlp/out")


def build_mqa_model(cfg: MqaConfig, seed: int = 0) -> onnx.ModelProto:
    """The forward model: input ``input_ids`` int64 [batch, seq], output ``logits``
    float [batch, vocab, seq]."""
    g = _GraphWriter(np.random.default_rng(seed))
    hidden = cfg.hidden
    tokens = g.op("Gather", [g.weight("embed.weight", [cfg.vocab, hidden], 0.5), "input_ids"],
                  "embed/tokens")
    x = g.op("Add", [tokens, g.weight("embed.positions", [cfg.seq, hidden], 0.1)],
             "embed/out")
    attn = _attention(g, _layer_norm(g, x, "ln_attn", hidden), cfg)
    x = g.op("Add", [x, attn], "block/attn_residual")
    mlp = _mlp(g, _layer_norm(g, x, "ln_mlp", hidden), cfg)
    x = g.op("Add", [x, mlp], "block/mlp_residual")
    x = _layer_norm(g, x, "ln_final", hidden)
    logits = g.op("MatMul", [x, g.weight("lm_head.weight", [hidden, cfg.vocab], hidden ** -0.5)],
                  "lm_head/matmul")
    logits = g.op("Add", [logits, g.weight("lm_head.bias", [cfg.vocab], value=0.0)],
                  "lm_head/biased")
    g.op("Transpose", [logits], "logits", perm=[0, 2, 1])  # classes on axis 1
    graph = helper.make_graph(
        g.nodes, "mqa_char_lm",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", cfg.seq])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                       ["batch", cfg.vocab, cfg.seq])],
        g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="graphopt.examples.mqa")
    model.ir_version = 8  # readable by every onnxruntime that has opset 17
    onnx.checker.check_model(model, full_check=True)
    return model
