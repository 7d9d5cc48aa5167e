"""tachyon.zero.Init on tiny Hugging Face models (GPT-2 and BERT configs built offline), run inside
the 2-rank launch of tests/engine/test_zero3.py (`hf_scenarios`): with no ``unit_classes``, the
layer classes the HF model classes list are found and each layer is sharded as its constructor
returns; the HF weight initialization still happens (layer by layer, gathered); the GPT-2 built
that way trains at stage 3 like the same weights in one process (`train_plain`)."""

from __future__ import annotations

import torch

STEPS, LR, BATCH, SEQ, VOCAB = 3, 0.1, 4, 8, 64
GPT2 = dict(n_embd=64, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
BERT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, vocab_size=VOCAB,
            max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
LAYERS = ("GPT2Block", "BertLayer")


def build(kind: str) -> torch.nn.Module:
    from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**GPT2)) if kind == "gpt2" else BertForMaskedLM(BertConfig(**BERT))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return ids, ids.clone()


def _build_under_init(kind: str) -> tuple[torch.nn.Module, dict]:
    """The model built under tachyon.zero.Init() (no unit classes named), and, for every layer
    registered into its parent, whether its parameters were already meta tensors then."""
    import tachyon
    from torch.nn.modules.module import register_module_module_registration_hook

    seen: dict[str, bool] = {}

    def probe(parent, name, child):
        if child is not None and type(child).__name__ in LAYERS:
            seen[f"{type(child).__name__}.{name}"] = all(p.is_meta for p in child.parameters())

    handle = register_module_module_registration_hook(probe)
    try:
        with tachyon.zero.Init():
            model = build(kind)
    finally:
        handle.remove()
    return model, seen


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from tachyon.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        return {name: p.detach().float().clone() for name, p in model.named_parameters()}


def _init_stats(state: dict[str, torch.Tensor], kind: str) -> dict[str, float]:
    if kind == "gpt2":  # HF: normal(0, 0.02) weights, c_proj scaled by 1/sqrt(2 n_layer); Conv1D alone: 0.02
        return {"c_attn": float(state["transformer.h.0.attn.c_attn.weight"].std()),
                "c_proj": float(state["transformer.h.1.attn.c_proj.weight"].std())}
    # HF: normal(0, 0.02); torch's Linear alone: uniform(+-1/sqrt(64)), std 0.072
    return {"query": float(state["bert.encoder.layer.0.attention.self.query.weight"].std()),
            "dense": float(state["bert.encoder.layer.1.output.dense.weight"].std())}


def hf_scenarios() -> dict:
    import torch.distributed as dist

    import tachyon

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    for kind in ("gpt2", "bert"):
        model, seen = _build_under_init(kind)
        state = _full_state(model)
        out[kind] = {"layers_meta_when_attached": seen, "init": _init_stats(state, kind),
                     "all_meta": all(p.is_meta for p in model.parameters())}
        if kind != "gpt2":
            continue
        out[kind]["initial"] = state
        config = {"train_micro_batch_size_per_gpu": BATCH // world, "gradient_accumulation_steps": 1,
                  "steps_per_print": 1000, "zero_optimization": {"stage": 3},
                  "optimizer": {"type": "SGD", "params": {"lr": LR}}}
        engine, *_ = tachyon.initialize(model=model, config=config)
        out[kind]["units"] = sorted({type(m).__name__ for m in engine.zero.units[:-1]})
        losses = []
        for step in range(STEPS):
            ids, labels = batch(step)
            loss = engine(input_ids=ids.chunk(world)[rank], labels=labels.chunk(world)[rank]).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        out[kind]["final"] = {name: p.full_tensor().detach().float().clone() for name, p in model.named_parameters()}
        out[kind]["losses"] = losses
    return out


def train_plain(initial: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The GPT-2 from ``initial``, trained on the whole batches in this process (plain torch)."""
    model = build("gpt2")
    model.load_state_dict(initial, strict=False)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        ids, labels = batch(step)
        opt.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
    return {name: p.detach().clone() for name, p in model.named_parameters()}
