"""The fused-QKV families (tests/fixtures/make_hf_fixtures.py): tiny Hugging Face models of
eleven families, TorchScript opset 17 and dynamo opset 18, dynamic batch and sequence.
Optimized, they compute PyTorch's logits in onnxruntime and in the executor, every layer's
fused projection is split by one Split, there are at least as many FusedMatMuls as
onnxruntime makes, and training them matches PyTorch's SGD run."""
from __future__ import annotations

import numpy as np
import pytest
from support import hf_families

import graphopt

pytest.importorskip("onnxruntime")
NAMES = hf_families.fixture_names()


@pytest.fixture(scope="module")
def surveys(tmp_path_factory):
    scratch = str(tmp_path_factory.mktemp("ort") / "ort.onnx")
    return {name: hf_families.survey(name, scratch) for name in NAMES}


def test_every_family_is_there_for_both_exporters():
    families = {hf_families.load(n)[2]["family"] for n in NAMES}
    assert len(families) >= 10
    assert NAMES == sorted(f"hf_{f}_{e}" for f in families for e in hf_families.EXPORTERS)


@pytest.mark.parametrize("name", NAMES)
def test_optimized_export_computes_pytorch_logits(surveys, name):
    result = surveys[name]
    assert result.ort_error < 1e-5 and result.executor_error < 1e-5, result


@pytest.mark.parametrize("name", NAMES)
def test_the_fused_projection_is_split_in_every_layer(surveys, name):
    # the fusion makes one per layer, unless the exporter already wrote them (GPT-2's and
    # BigCode's split(), dynamo's Split for MPT's chunk)
    result = surveys[name]
    assert result.splits >= result.layers, result
    assert result.splits_made >= result.layers or result.exporter_splits >= result.layers, \
        result


@pytest.mark.parametrize("name", ["hf_gpt_neox_ts17", "hf_mpt_ts17"])
def test_chunk_with_shape_computed_bounds_is_split_where_onnxruntime_does_not(surveys, name):
    # chunk(3, -1) on a dynamic export: Slice bounds from Shape(fused)[-1], a fixed axis;
    # one three-way Split (q, k, v) per layer, none from onnxruntime
    result = surveys[name]
    assert result.ort_splits == 0, result
    optimized, _ = graphopt.optimize(hf_families.load(name)[0], level=2)
    qkv = [n for n in optimized.graph.node if n.op_type == "Split" and len(n.output) == 3]
    assert len(qkv) == result.layers, result


@pytest.mark.parametrize("name", NAMES)
def test_at_least_as_many_fused_matmuls_and_no_more_transposes_than_onnxruntime(surveys, name):
    result = surveys[name]
    # counted with the GELU fusions: where graphopt fuses a GELU onnxruntime leaves
    # (BigCode's tanh GELU), its 0.5 goes into the FastGelu and the product after it has no
    # scale left for a FusedMatMul to absorb; one fusion for one, in nine nodes fewer
    assert result.fused + result.gelus >= result.ort_fused + result.ort_gelus, result
    assert result.fused >= result.ort_fused or result.gelus > result.ort_gelus, result
    assert result.matmul_like <= result.ort_matmul_like, result


@pytest.mark.parametrize("name", NAMES)
def test_every_gelu_is_fused_and_never_fewer_than_onnxruntime(surveys, name):
    result = surveys[name]
    assert result.gelus == result.layers or result.family in ("persimmon", "phi3"), result
    assert result.gelus >= result.ort_gelus, result


@pytest.mark.parametrize("name", [n for n in NAMES if n.endswith("_ts17")])
def test_optimizing_again_changes_nothing(name):
    path = hf_families.load(name)[0]
    once, _ = graphopt.optimize(path, level=2)
    twice, report = graphopt.optimize(once, level=2)
    assert twice.SerializeToString() == once.SerializeToString(), report.fired


@pytest.mark.parametrize("name", NAMES)
def test_training_matches_pytorch_step_for_step(name):
    path, data, meta = hf_families.load(name)
    losses = np.array(hf_families.graphopt_losses(path, data, meta))
    reference = data["torch_losses"]
    assert losses[-1] < losses[0] - 0.5  # it trained
    np.testing.assert_allclose(losses, reference, rtol=1e-5)
