"""tachyon.compat.transformer_engine: TE's names are tachyon's modules; the rest fail clearly."""

from __future__ import annotations

import pytest
import torch

import tachyon
import tachyon.compat.transformer_engine.pytorch as te
import tachyon.nn as tnn
from tachyon.compat.transformer_engine.common import recipe
from tests.utils import assert_close


@pytest.mark.parametrize("name", ["Linear", "LayerNorm", "RMSNorm", "LayerNormLinear", "LayerNormMLP",
                                  "DotProductAttention", "MultiheadAttention", "TransformerLayer",
                                  "RotaryPositionEmbedding"])
def test_modules_are_tachyons(name):
    assert getattr(te, name) is getattr(tnn, name)


def test_autocast_recipes_and_submodules_are_tachyons():
    from tachyon.compat.transformer_engine.pytorch.attention import DotProductAttention
    from tachyon.fp8 import DelayedScaling, Format

    assert te.fp8_autocast is tachyon.fp8_autocast
    assert recipe.Format is Format and recipe.DelayedScaling is DelayedScaling
    assert DotProductAttention is tnn.DotProductAttention
    assert te.distributed.checkpoint is te.checkpoint


def test_checkpoint_takes_tes_keywords_and_matches_no_checkpoint():
    torch.manual_seed(0)
    layer = te.TransformerLayer(32, 64, 4, hidden_dropout=0.0, attention_dropout=0.0)
    x = torch.randn(8, 2, 32, requires_grad=True)
    layer(x).square().sum().backward()
    want = [x.grad.clone(), *(p.grad.clone() for p in layer.parameters())]
    x.grad = None
    layer.zero_grad()
    out = te.checkpoint(layer, x, distribute_saved_activations=False, get_rng_state_tracker=None, tp_group=None,
                        use_reentrant=True)
    out.square().sum().backward()
    got = [x.grad, *(p.grad for p in layer.parameters())]
    for a, b in zip(got, want):
        assert_close(a, b, name="te.checkpoint gradient")
    with pytest.raises(NotImplementedError, match="tensor parallelism"):
        te.checkpoint(layer, x, distribute_saved_activations=True)
    with pytest.raises(NotImplementedError, match="restores the RNG states itself"):
        te.checkpoint(layer, x, get_rng_state_tracker=lambda: None)


@pytest.mark.parametrize("name", ["Format", "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling",
                                  "MXFP8BlockScaling", "QParams", "MMParams", "Recipe"])
def test_recipes_are_tachyons(name):
    assert getattr(recipe, name) is getattr(tachyon.fp8, name)


def test_te2_autocast_runs_the_recipes_and_nvfp4_is_refused():
    """te.autocast(recipe=...) as Transformer Engine 2.x spells it, with TE's recipe arguments."""
    assert te.autocast is tachyon.autocast
    layer = te.Linear(32, 32)
    x = torch.randn(16, 32)
    for fp8_recipe in (recipe.Float8CurrentScaling(fp8_format=recipe.Format.HYBRID),
                       recipe.Float8BlockScaling(fp8_format=recipe.Format.E4M3),
                       recipe.DelayedScaling(fp8_format=recipe.Format.HYBRID, amax_history_len=16, amax_compute_algo="max")):
        with te.autocast(enabled=True, recipe=fp8_recipe, amax_reduction_group=None):
            y = layer(x)
        assert not torch.equal(y, torch.nn.functional.linear(x, layer.weight, layer.bias))  # it ran in FP8
    with pytest.raises(NotImplementedError, match="NVFP4 .* not implemented by tachyon; use DelayedScaling, "
                                                  "Float8CurrentScaling, Float8BlockScaling or MXFP8BlockScaling"):
        recipe.NVFP4BlockScaling()
    if not torch.cuda.is_available():
        assert te.is_fp8_available() is False and te.is_mxfp8_available() is False
        available, reason = te.is_mxfp8_available(return_reason=True)
        assert not available and "compute capability 10.x" in reason


def test_unsupported_features_say_what_to_use():
    with pytest.raises(NotImplementedError, match="use fp8_autocast"):
        with te.fp8_model_init(enabled=True):
            pass
    with pytest.raises(NotImplementedError, match="one Linear per expert"):
        te.GroupedLinear(2, 16, 16)


def test_unknown_names_list_what_is_mapped():
    with pytest.raises(AttributeError, match=r"transformer_engine\.pytorch\.Linaer .*Did you mean 'Linear'"):
        te.Linaer  # noqa: B018
    import tachyon.compat.transformer_engine.common as common

    with pytest.raises(AttributeError, match="it maps: recipe"):
        common.nothing  # noqa: B018
    with pytest.raises(ImportError):
        from tachyon.compat.transformer_engine.common import nothing  # noqa: F401
