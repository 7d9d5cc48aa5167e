"""One INT8 decode step of the injected GPT-2 decoder: its launches and the bytes each layer's
kernels read, pinned on a tiny model, Triton kernels under the interpreter.

Per layer, six launches and nothing else: norm1 runs inside the QKV GEMM (its prologue reads the
layer input and the residual stream and writes their sum), the KV append copies k and v only (q
is read in place from the QKV output: GPT-2 has no RoPE), decode attention, the output GEMM,
norm2 inside the fc1 GEMM with the bias and GELU in its epilogue, and fc2. No norm output, fc1
pre-activation or q copy is written and read back; the learned positions are added inside the
first layer's norm. A change that adds a launch or a byte must change this test and say why.
"""

from __future__ import annotations

import copy

import torch

import tachyon
from tachyon.profiling import TrafficCounter

HIDDEN, HEADS, LAYERS, VOCAB, BATCH, CONTEXT = 64, 4, 2, 96, 3, 8
F32, I32 = 4, 4

LAYER = [
    "tachyon::norm_int8_linear > triton _int8_linear_kernel",  # ln1 + QKV
    "tachyon::rotary_kv_append > triton _kv_append_kernel",  # k, v into the cache
    "tachyon::decode_attention > triton _decode_attention_kernel",
    "tachyon::int8_linear > triton _int8_linear_kernel",  # attention output
    "tachyon::norm_int8_linear > triton _int8_linear_kernel",  # ln2 + fc1 + bias + GELU
    "tachyon::int8_linear > triton _int8_linear_kernel",  # fc2
]


def _gemm_reads(rows: int, k: int, n: int) -> int:
    """int8 weight + fp32 scale and bias per output row + the fp32 input rows."""
    return n * k + n * (F32 + F32) + rows * k * F32


def test_int8_decode_step_launches_and_layer_bytes_are_pinned():
    from transformers import GPT2Config, GPT2LMHeadModel, logging

    logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=HIDDEN, n_head=HEADS, n_layer=LAYERS, vocab_size=VOCAB,
                                       n_positions=64, bos_token_id=1, eos_token_id=2)).eval()
    decoder = tachyon.init_inference(copy.deepcopy(model), dtype=torch.int8).module
    cache = decoder.new_cache(BATCH, CONTEXT + 1)
    prompt = torch.randint(3, VOCAB, (BATCH, CONTEXT), generator=torch.Generator().manual_seed(1))
    nxt = torch.randint(3, VOCAB, (BATCH, 1), generator=torch.Generator().manual_seed(2))
    with torch.no_grad(), tachyon.use_backend("triton"):
        decoder.step(prompt, torch.arange(CONTEXT).expand(BATCH, CONTEXT), cache, last_only=True)
        positions = torch.full((BATCH, 1), CONTEXT)
        with TrafficCounter(track_modules=False) as counter:
            decoder.step(nxt, positions, cache, last_only=True)
    kernels = [e for e in counter.events if e.op.startswith("triton")]
    labels = [e.label for e in kernels]
    assert labels == LAYER * LAYERS + ["tachyon::norm_fwd > triton _norm_fwd_kernel"], \
        f"decode launches changed:\n{counter.table()}"

    h, b = HIDDEN, BATCH
    act = b * h * F32  # one [batch, hidden] fp32 activation
    norm_params = 2 * h * F32
    cache_read = b * 2 * (CONTEXT + 1) * h * F32  # every layer reads its whole cache, the new token's too
    expected = [
        _gemm_reads(b, h, 3 * h) + act + norm_params,  # + the residual stream, the norm's weight and bias
        2 * act + b * I32,  # k and v, the cache lengths
        act + cache_read + b * I32,  # q, the cache, the lengths
        _gemm_reads(b, h, h),
        _gemm_reads(b, h, 4 * h) + act + norm_params,
        _gemm_reads(b, 4 * h, h),
    ] * LAYERS
    got = [e.traffic.read for e in kernels[:-1]]
    assert got == expected, f"per-kernel bytes read {got}, expected {expected}\n{counter.table()}"
    # written: QKV and z, k and v, the context, out, fc1's GELU output and z, fc2
    written = [3 * act + act, 2 * act, act, act, 4 * act + act, act] * LAYERS
    assert [e.traffic.written for e in kernels[:-1]] == written, counter.table()
    assert counter.total.launches - len(kernels) <= 5, "outside the kernels: embeddings, the head GEMM, bookkeeping"
