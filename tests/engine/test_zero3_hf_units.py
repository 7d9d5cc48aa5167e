"""The layer classes `tachyon.zero.Init` reads from HF model classes (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from tachyon.engine.zero.hf_units import hf_layer_names


def test_hf_layer_names_from_no_split_modules_and_recorded_outputs():
    transformers = pytest.importorskip("transformers")
    # GPT-2 lists its block in _no_split_modules; BertForMaskedLM lists nothing there (BertModel
    # does, with its embeddings) but records its encoder layer's hidden states
    assert hf_layer_names(transformers.GPT2LMHeadModel) == {"GPT2Block"}
    assert hf_layer_names(transformers.BertForMaskedLM) == {"BertLayer"}
    assert hf_layer_names(transformers.BertModel) == {"BertEmbeddings", "BertLayer"}
    assert hf_layer_names(torch.nn.Linear) == set() and hf_layer_names(torch.nn.TransformerEncoderLayer) == set()

    class Odd(torch.nn.Module):  # malformed attributes are ignored, not trusted
        _no_split_modules = "GPT2Block"
        _can_record_outputs = {"hidden_states": "not a class"}

    assert hf_layer_names(Odd) == set()
