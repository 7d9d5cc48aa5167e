"""GPU-only checks of the inference engine (run by benchmarks/gpu.sh): fp16 and bf16 injection
within 2x of PyTorch's error, INT8 through the Triton GEMM, CUDA-graph decode identical to eager
decode, the Triton decode path (split-K) against the CPU path."""

from __future__ import annotations

import copy

import pytest
import torch

import tachyon
from tests.inference.models import make_model, prompts
from tests.utils import assert_close_to_reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["gpt2", "llama", "gptj"])
def test_low_precision_logits_within_twice_pytorchs_error(name, dtype):
    model = make_model(name, init_std=0.05)
    ids, mask = prompts()
    with torch.no_grad():
        oracle = copy.deepcopy(model).double()(ids, attention_mask=mask).logits
        lowp = copy.deepcopy(model).to("cuda", dtype)(ids.cuda(), attention_mask=mask.cuda()).logits.cpu()
    out = tachyon.init_inference(model, dtype=dtype)(ids, attention_mask=mask).logits.cpu()
    keep = mask.bool()
    assert_close_to_reference(out[keep], lowp[keep], oracle[keep], name=f"{name} {dtype} logits")


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral"])
def test_cuda_graph_decode_equals_eager_decode(name):
    model = make_model(name)
    ids, mask = prompts()
    eager = tachyon.init_inference(copy.deepcopy(model), dtype=torch.float16, max_out_tokens=64)
    graph = tachyon.init_inference(copy.deepcopy(model), dtype=torch.float16, max_out_tokens=64, enable_cuda_graph=True)
    a = eager.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None)
    for _ in range(2):  # the second call replays the graph captured by the first
        b = graph.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None)
        assert torch.equal(a, b)


def test_int8_gpu_matches_int8_cpu_tokens():
    model = make_model("gpt2")
    ids, mask = prompts()
    gpu = tachyon.init_inference(copy.deepcopy(model), dtype=torch.int8)
    assert gpu.module.layers[0].qkv.qweight.is_cuda
    logits = gpu(ids, attention_mask=mask).logits.float().cpu()
    with torch.no_grad():
        ref = model(ids, attention_mask=mask).logits
    keep = mask.bool()
    rel = float((logits[keep] - ref[keep]).norm() / ref[keep].norm())
    assert rel < 0.02, f"INT8 (fp16 activations) logits relative error {rel:.4f}"


def test_tensor_parallel_generate_on_one_gpu_stays_single_rank():
    engine = tachyon.init_inference(make_model("llama"), dtype=torch.float16)
    assert engine.tp_group is None and next(engine.module.parameters()).is_cuda


def test_minilm_fp16_embeddings_within_twice_pytorchs_error():
    from tests.inference.test_injection import _minilm, mean_pool

    model, tokenizer = _minilm()
    batch = tokenizer(["the quick brown fox", "a padded batch mixes lengths: seven, thirteen and five tokens here",
                       "hello there"], padding=True, return_tensors="pt")
    with torch.no_grad():
        oracle = mean_pool(copy.deepcopy(model).double()(**batch).last_hidden_state, batch["attention_mask"])
        half = copy.deepcopy(model).to("cuda", torch.float16)
        lowp = mean_pool(half(**{k: v.cuda() for k, v in batch.items()}).last_hidden_state.cpu(), batch["attention_mask"])
    engine = tachyon.init_inference(copy.deepcopy(model), dtype=torch.float16)
    out = mean_pool(engine(**{k: v.cuda() for k, v in batch.items()}).last_hidden_state.cpu(), batch["attention_mask"])
    assert_close_to_reference(out, lowp, oracle, name="MiniLM fp16 sentence embeddings")
