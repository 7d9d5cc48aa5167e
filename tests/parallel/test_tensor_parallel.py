"""Tensor and sequence parallelism: shards, refusals and plans in one process (a fake group of
size 2: refusals happen before any collective), then one 2-rank launch for everything that
communicates (layers against their unsharded twins, GPT trained 5 steps, bytes per step)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tachyon.nn import TransformerLayer
from tachyon.parallel.tensor import TPGroup, default_plan, parallelize, vocab_parallel_cross_entropy
from tachyon.parallel.tensor.comm_counter import wire_bytes
from tachyon.parallel.tensor.shard import ShardSpec, shard_spec, shard_tensor, unshard_tensor
from tests.parallel._pp_training import CFG, GLOBAL_BATCH, SEQ, build_gpt
from tests.parallel._tp_checks import assert_matches_reference
from tests.utils import assert_close, run_distributed

FAKE_TP2 = [TPGroup(None, 2, rank) for rank in range(2)]  # never used for a collective below


# ---------------------------------------------------------------------------------- one process


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The models here are tiny: one intra-op thread is fastest (and fair on a shared 2-core CI)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)



@pytest.mark.parametrize(("shape", "dim", "blocks"), [((12, 5), 0, None), ((12, 5), 0, (4, 4, 4)), ((5, 12), 1, None),
                                                     ((20, 3), 0, (8, 4, 8)), ((16,), 0, (8, 8))])
def test_shards_of_every_rank_unshard_to_the_full_tensor(shape, dim, blocks):
    full = torch.randn(shape)
    spec = ShardSpec(dim, 2, shape, blocks)
    shards = [shard_tensor(full, spec, r) for r in range(2)]
    assert all(tuple(s.shape) == spec.local_shape() for s in shards)
    assert torch.equal(unshard_tensor(shards, spec), full)
    if blocks is not None:  # rank 0 holds the first half of every block: [Q0 | K0 | V0]
        halves = [b.chunk(2, dim=dim)[0] for b in full.split(list(blocks), dim=dim)]
        assert torch.equal(shards[0], torch.cat(halves, dim=dim))


def _layer(**kw) -> TransformerLayer:
    torch.manual_seed(0)
    args = dict(hidden_dropout=0.0, attention_dropout=0.0, attn_input_format="bshd")
    args.update(kw)
    return TransformerLayer(args.pop("hidden", 32), args.pop("ffn", 64), args.pop("heads", 4), **args)


def _state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: torch.nn.ModuleList([_layer(heads=2, hidden=30, ffn=64), _layer(heads=3, hidden=30, ffn=64)]),
         r"tensor parallel 1: num_attention_heads=3 is not divisible by the tensor-parallel size tp=2"),
        (lambda: torch.nn.ModuleList([_layer(heads=4, num_gqa_groups=1)]),
         r"num_gqa_groups \(key/value heads\)=1 is not divisible by the tensor-parallel size tp=2"),
        (lambda: torch.nn.ModuleList([_layer(ffn=63)]), r"ffn_hidden_size=63 is not divisible"),
        (lambda: _TiedModel(vocab=65), r"tensor parallel embedding 'embed': num_embeddings \(vocab\)=65 is not divisible"),
    ],
)
def test_tp_not_dividing_heads_kv_heads_ffn_or_vocab_is_refused_before_anything_changes(build, message):
    model = build()
    before = _state(model)
    with pytest.raises(ValueError, match=message):
        parallelize(model, FAKE_TP2[0])
    after = _state(model)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert not any(shard_spec(p) for p in model.parameters()), "a refused layout sharded something"


class _TiedModel(torch.nn.Module):
    def __init__(self, vocab: int = 64) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, 32)
        self.layers = torch.nn.ModuleList([_layer()])
        self.head = torch.nn.Linear(32, vocab, bias=False)
        self.head.weight = self.embed.weight


def test_plans_name_the_bad_entry():
    model = _TiedModel()
    assert default_plan(model) == {"embed": "vocab", "head": "column_gather"}
    cases = [({"embed": "columnwise"}, "plan\\['embed'\\] = 'columnwise'; allowed styles: 'vocab', 'column'"),
             ({"nope": "vocab"}, "plan names 'nope', which is not a submodule of _TiedModel"),
             ({"head": "vocab"}, "plan\\['head'\\] = 'vocab' needs an nn.Embedding; got Linear"),
             ({"embed": "row"}, "plan\\['embed'\\] = 'row' needs a Linear; got Embedding")]
    for plan, message in cases:
        with pytest.raises(ValueError, match=message):
            parallelize(model, FAKE_TP2[0], plan=plan)
    assert default_plan(build_gpt()) == {"token_embedding": "vocab", "lm_head": "column_gather"}


def test_kernel_layers_and_sequence_parallel_outside_a_stack_are_refused():
    from tachyon.nn import TransformerKernelConfig, TransformerKernelLayer

    config = TransformerKernelConfig(batch_size=2, max_seq_length=8, hidden_size=32, intermediate_size=64, heads=4,
                                     attn_dropout_ratio=0.0, hidden_dropout_ratio=0.0, num_hidden_layers=1,
                                     initializer_range=0.02)
    with pytest.raises(ValueError, match="is a TransformerKernelLayer .* has no tensor-parallel form"):
        parallelize(torch.nn.ModuleList([TransformerKernelLayer(config)]), FAKE_TP2[0])

    class Loose(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = _layer()

    with pytest.raises(ValueError, match="sequence_parallel=True needs every TransformerLayer inside an nn.ModuleList"):
        parallelize(Loose(), FAKE_TP2[0], sequence_parallel=True)


def test_a_model_with_nothing_to_split_is_refused_naming_the_conversion():
    """An unconverted HF GPT-2 would get only its tied embedding split (every layer whole on every
    rank); it is refused with the conversion, before anything changes. So are HF BERT and a model
    without any TransformerLayer (unless a plan names what to split)."""
    from transformers import BertConfig, BertModel, GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=64, n_positions=16))
    before = _state(gpt2)
    with pytest.raises(ValueError, match=r"'transformer.h.0' is an unconverted HF GPT2Block \(2 such layer\(s\)\).*"
                                         r"model.transformer.h\[i\] = HFLayerAdapter.from_hf\(layer\)"):
        parallelize(gpt2, FAKE_TP2[0])
    assert all(torch.equal(before[k], v) for k, v in _state(gpt2).items()) and not any(shard_spec(p) for p in gpt2.parameters())
    bert = BertModel(BertConfig(hidden_size=32, num_attention_heads=4, num_hidden_layers=1, intermediate_size=64,
                                vocab_size=64))
    with pytest.raises(ValueError, match="unconverted HF BertLayer .* BERT layers have no tensor-parallel form"):
        parallelize(bert, FAKE_TP2[0])
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match="has no tachyon.nn.TransformerLayer .* and the plan names no module to split"):
        parallelize(mlp, FAKE_TP2[0])
    assert parallelize(mlp, FAKE_TP2[0], plan={"0": "column", "1": "row"}) is mlp  # an explicit plan: split as asked
    assert shard_spec(mlp[0].weight) is not None


SHARDED = ("self_attention.layernorm_qkv.weight", "self_attention.layernorm_qkv.bias", "self_attention.proj.weight",
           "layernorm_mlp.fc1_weight", "layernorm_mlp.fc1_bias", "layernorm_mlp.fc2_weight", "token_embedding.weight")


def test_parameter_bytes_per_rank_are_one_tp_th_of_the_sharded_layers():
    reference = dict(build_gpt().named_parameters())
    sharded_full = sum(p.numel() * p.element_size() for n, p in reference.items() if n.endswith(SHARDED))
    replicated = sum(p.numel() * p.element_size() for n, p in reference.items() if not n.endswith(SHARDED))
    assert sharded_full > 0.5 * (sharded_full + replicated), "the sharded layers should hold most of the model"
    ranks = []
    for tp in FAKE_TP2:  # sharding itself moves no data between ranks
        model = parallelize(build_gpt(), tp)
        params = dict(model.named_parameters())
        assert params.keys() == reference.keys()
        for name, p in params.items():
            expected = reference[name].numel() // (2 if name.endswith(SHARDED) else 1)
            assert p.numel() == expected, f"{name}: {p.numel()} elements on a tp rank, expected {expected}"
            assert (shard_spec(p) is not None) == name.endswith(SHARDED), name
        local = sum(p.numel() * p.element_size() for p in params.values())
        assert local == sharded_full // 2 + replicated
        assert model.lm_head.weight is model.token_embedding.weight, "the tie did not survive sharding"
        ranks.append(params)
    for name in SHARDED[:-1]:  # the two ranks' shards rebuild the full weights, heads in place
        full_name = f"layers.0.{name}"
        rebuilt = unshard_tensor([ranks[0][full_name].detach(), ranks[1][full_name].detach()], shard_spec(ranks[0][full_name]))
        assert torch.equal(rebuilt, reference[full_name].detach()), full_name


def test_vocab_parallel_cross_entropy_at_tp1_is_cross_entropy():
    logits, target = torch.randn(3, 5, 11), torch.randint(0, 11, (3, 5))
    target[0, :2] = -100
    got = vocab_parallel_cross_entropy(logits, target, TPGroup(None, 1, 0))
    assert_close(got, F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=-100))
    with pytest.raises(ValueError, match="reduction must be 'mean', 'sum' or 'none'"):
        vocab_parallel_cross_entropy(logits, target, TPGroup(None, 1, 0), reduction="avg")


def test_tp_size_one_changes_nothing():
    model = build_gpt()
    before = _state(model)
    assert parallelize(model, TPGroup(None, 1, 0)) is model
    assert all(torch.equal(before[k], v) for k, v in _state(model).items())


# ---------------------------------------------------------------------------------- two ranks

LAYER_CASES = {
    "gqa_rmsnorm_swiglu": dict(num_gqa_groups=2, normalization="RMSNorm", activation="swiglu"),
    "bert_post_ln_sbhd": dict(output_layernorm=True, apply_residual_connection_post_layernorm=True,
                              attn_input_format="sbhd", self_attn_mask_type="no_mask"),
    "decoder_geglu_sbhd": dict(layer_type="decoder", activation="geglu", attn_input_format="sbhd"),
}


def _layer_case(name: str, sp: bool, tp) -> dict:
    from tests.parallel._tp_checks import gather_full_grads

    kw = LAYER_CASES[name]
    reference, layer = _layer(**kw), _layer(**kw)
    stack = torch.nn.ModuleList([layer])
    parallelize(stack, tp, sequence_parallel=sp)
    torch.manual_seed(1)
    shape = (2, 8, 32) if kw.get("attn_input_format", "bshd") == "bshd" else (8, 2, 32)
    x, dy = torch.randn(shape), torch.randn(shape)
    extra = {"encoder_output": torch.randn(shape)} if kw.get("layer_type") == "decoder" else {}
    out = {}
    for tag, module in (("ref", reference), ("tp", stack[0])):
        xi = x.clone().requires_grad_()
        y = module(xi, **extra)
        (y * dy).sum().backward()
        out[tag] = (y.detach(), xi.grad)
    out["ref_grads"] = {n: p.grad for n, p in reference.named_parameters()}
    out["tp_grads"] = gather_full_grads(stack[0], tp)
    return out


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _hf_case(kind: str, mesh) -> dict:
    """A tiny HF model with its layers converted by HFLayerAdapter, then parallelize(tp=2): the
    GPT-2 embedding is tied to its LM head (the default plan splits both), Llama's is not (given
    as a plan); Llama has 4 query heads over 2 key/value heads."""
    import copy

    from tachyon.nn.transformer_layer import HFLayerAdapter
    from tachyon.parallel.tensor import tp_group
    from tests.parallel._tp_checks import gather_full_grads

    torch.manual_seed(0)
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(n_embd=64, n_head=4, n_layer=2, vocab_size=96, n_positions=32,
                                           attn_implementation="eager", resid_pdrop=0.0, attn_pdrop=0.0, embd_pdrop=0.0))
        layers, plan = model.transformer.h, None
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                             intermediate_size=176, num_hidden_layers=2, vocab_size=96,
                                             attn_implementation="eager", tie_word_embeddings=False))
        layers, plan = model.model.layers, {"model.embed_tokens": "vocab", "lm_head": "column_gather"}
    for i, layer in enumerate(layers):
        layers[i] = HFLayerAdapter.from_hf(layer)
    reference = copy.deepcopy(model)
    parallelize(model, mesh, plan=plan)
    ids = torch.randint(0, 96, (2, 12))
    got = {}
    for tag, m in (("ref", reference), ("tp", model)):
        result = m(ids, labels=ids, use_cache=False)
        result.loss.backward()
        got[tag] = (result.loss.detach(), result.logits.detach())
    got["ref_grads"] = {n: p.grad for n, p in reference.named_parameters()}
    got["tp_grads"] = gather_full_grads(model, tp_group(mesh))
    return got


def _tp_rank() -> dict:
    from tachyon.parallel import CommCounter, Mesh
    from tachyon.parallel.tensor import (
        ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, parallelize, tp_group,
    )
    from tachyon.nn import Linear
    from tests.parallel import _pp_training as T

    mesh = Mesh(tp=2)
    tp = tp_group(mesh)
    out: dict = {"layers": {f"{name}/sp={sp}": _layer_case(name, sp, tp) for name in LAYER_CASES for sp in (False, True)}}

    # Megatron's layers built directly: the same numbers as their unsharded twins (same seed, same init)
    torch.manual_seed(3)
    col, row, emb = ColumnParallelLinear(32, 64, mesh), RowParallelLinear(64, 32, mesh), VocabParallelEmbedding(64, 32, mesh)
    torch.manual_seed(3)
    col_ref, row_ref, emb_ref = Linear(32, 64), Linear(64, 32), torch.nn.Embedding(64, 32)
    ids = torch.randint(0, 64, (2, 8))
    y = row(F.gelu(col(emb(ids))))
    y_ref = row_ref(F.gelu(col_ref(emb_ref(ids))))
    y.square().sum().backward()
    y_ref.square().sum().backward()
    out["megatron_layers"] = (y.detach(), y_ref.detach(), emb.weight.grad, emb_ref.weight.grad.chunk(2)[tp.rank])

    # vocab-parallel cross-entropy of split logits against F.cross_entropy of the full logits
    torch.manual_seed(4)
    logits, target = torch.randn(4, 6, 64, requires_grad=True), torch.randint(0, 64, (4, 6))
    target[1, :3] = -100
    loss = vocab_parallel_cross_entropy(logits.chunk(2, dim=-1)[tp.rank], target, mesh)
    loss.backward()
    ref_logits = logits.detach().clone().requires_grad_()
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), target.flatten(), ignore_index=-100)
    ref_loss.backward()
    out["vocab_ce"] = (loss.detach(), ref_loss.detach(), logits.grad.chunk(2, dim=-1)[tp.rank],
                       ref_logits.grad.chunk(2, dim=-1)[tp.rank])

    # a TransformerLayer subclass (the pipeline GPT's block, which makes its RoPE tables) stays itself
    from tachyon.parallel.pipeline import PipelineModule
    from tachyon.parallel.pipeline.gpt import GPTBlock, gpt_layer_specs, gpt_loss, gpt_state_dict_to_pipeline
    from tachyon.train.models import GPT

    rope_cfg = dict(CFG, position="rope")
    torch.manual_seed(0)
    gpt = GPT(**rope_cfg)
    net = PipelineModule(gpt_layer_specs(**rope_cfg), loss_fn=gpt_loss)
    net.load_full_state_dict(gpt_state_dict_to_pipeline(gpt.state_dict(), CFG["num_layers"]))
    parallelize(net, mesh, sequence_parallel=True)
    ids, labels = T.batch(0)
    out["rope_blocks"] = (float(gpt_loss(net(ids), labels)), float(gpt(ids, labels=labels)),
                          [type(getattr(net, str(i))).__name__ for i in range(1, 5)],
                          all(isinstance(getattr(net, str(i)), GPTBlock) for i in range(1, 5)))

    # HF GPT-2 and Llama through HFLayerAdapter: logits and every gradient as the unsharded model's
    out["hf"] = {kind: _hf_case(kind, mesh) for kind in ("gpt2", "llama")} if _has_transformers() else None

    # GPT trained 5 steps, with and without sequence parallelism
    out["reference"] = T.reference_state()
    out["initial"] = {k: p.detach().clone() for k, p in T.build_gpt().named_parameters()}
    out["tp2"] = T.train_tensor_parallel(mesh)
    out["tp2_sp"] = T.train_tensor_parallel(mesh, sequence_parallel=True)

    # bytes of one training step
    for sp in (False, True):
        model = parallelize(T.build_gpt(), mesh, sequence_parallel=sp)
        ids, labels = T.batch(0)
        with CommCounter(mesh) as comm:
            model(ids, labels=labels).backward()
        out[f"comm/sp={sp}"] = [(c.kind, c.axis, c.payload, c.dtype) for c in comm.calls]

    # dropout: replicated activations stay equal across tp ranks, and the default RNG streams in step
    from tachyon.parallel.tensor.rng import tp_distinct_rng

    dropout_cfg = dict(CFG, hidden_dropout=0.2, attention_dropout=0.2)
    results = {}
    for sp in (False, True):
        torch.manual_seed(6)
        model = parallelize(GPT(**dropout_cfg), mesh, sequence_parallel=sp).train()
        ids, labels = T.batch(0)
        results[sp] = (float(model(ids, labels=labels)), torch.get_rng_state())
    state = torch.get_rng_state()
    with tp_distinct_rng("cpu", tp.rank):
        split = torch.rand(8)
    after = torch.rand(8)
    torch.set_rng_state(state)
    with tp_distinct_rng("cpu", tp.rank):
        again = torch.rand(8)
    results["streams"] = (split, after, torch.equal(split, again))
    out["dropout"] = results
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_distributed(_tp_rank, 2, timeout=600)


@pytest.mark.distributed
@pytest.mark.parametrize("case", [f"{n}/sp={sp}" for n in LAYER_CASES for sp in (False, True)])
def test_parallel_layer_matches_the_unsharded_layer_forward_and_backward(ranks, case):
    for rank, result in enumerate(ranks):
        got = result["layers"][case]
        where = f"{case}, rank {rank}"
        assert_close(got["tp"][0], got["ref"][0], name=f"{where}: output")
        assert_close(got["tp"][1], got["ref"][1], name=f"{where}: input gradient")
        assert got["tp_grads"].keys() == got["ref_grads"].keys()
        for name, grad in got["ref_grads"].items():
            assert_close(got["tp_grads"][name], grad, name=f"{where}: gradient of {name}")


@pytest.mark.distributed
def test_megatron_layers_and_vocab_parallel_cross_entropy(ranks):
    for rank, result in enumerate(ranks):
        y, y_ref, emb_grad, emb_grad_ref = result["megatron_layers"]
        assert_close(y, y_ref, name=f"rank {rank}: row(gelu(col(embedding)))")
        assert_close(emb_grad, emb_grad_ref, name=f"rank {rank}: VocabParallelEmbedding gradient (own rows)")
        loss, ref_loss, grad, ref_grad = result["vocab_ce"]
        assert_close(loss, ref_loss, name=f"rank {rank}: vocab-parallel cross-entropy")
        assert_close(grad, ref_grad, name=f"rank {rank}: its logits gradient")


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_models_converted_with_hf_layer_adapter(ranks, kind):
    if ranks[0]["hf"] is None:
        pytest.skip("transformers is not installed")
    for rank, result in enumerate(ranks):
        got = result["hf"][kind]
        assert_close(got["tp"][0], got["ref"][0], name=f"HF {kind}, rank {rank}: loss")
        assert_close(got["tp"][1], got["ref"][1], name=f"HF {kind}, rank {rank}: logits")
        assert got["tp_grads"].keys() == got["ref_grads"].keys()
        for name, grad in got["ref_grads"].items():
            assert_close(got["tp_grads"][name], grad, name=f"HF {kind}, rank {rank}: gradient of {name}")


@pytest.mark.distributed
def test_transformer_layer_subclasses_keep_their_forward(ranks):
    """The pipeline GPT's GPTBlock makes RoPE tables in its forward; after parallelize it is a
    ParallelGPTBlock (still a GPTBlock) and the sequence-parallel model computes GPT's loss."""
    for result in ranks:
        loss, reference, names, still_blocks = result["rope_blocks"]
        assert still_blocks and names == ["ParallelGPTBlock"] * 4, names
        assert abs(loss - reference) <= 1e-6 * reference, (loss, reference)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", ["tp2", "tp2_sp"])
def test_tp2_trains_like_one_process(ranks, layout):
    for rank, result in enumerate(ranks):
        assert_matches_reference(result[layout], result["reference"], result["initial"], f"{layout}, rank {rank}")


def _by_kind(calls) -> dict:
    out: dict = {}
    for kind, axis, payload, dtype in calls:
        assert axis == "tp" and dtype == "float32", (kind, axis, payload, dtype)
        out.setdefault(kind, []).append(payload)
    return out


@pytest.mark.distributed
def test_bytes_per_step_are_megatrons(ranks):
    """T tokens, hidden h, L layers, vocab V, fp32, tp=2. Without sequence parallelism: per layer two
    all-reduces of [T, h] forward and two backward, plus the embedding's forward all-reduce, the LM
    head's input-gradient all-reduce and one all-gather of the [T, V/tp] logits. With it each
    all-reduce becomes a reduce-scatter of [T, h] and an all-gather of [T/tp, h] (the same bytes
    sent on a ring); the stack's
    entry and exit add one all-gather each; the norms' and biases' gradients (6 vectors of h per
    layer) are summed over tp."""
    T, h, L, V, tp, b = GLOBAL_BATCH * SEQ, CFG["hidden_size"], CFG["num_layers"], CFG["vocab_size"], 2, 4
    for result in ranks:
        plain = _by_kind(result["comm/sp=False"])
        assert sorted(plain) == ["all_gather", "all_reduce"]
        assert plain["all_reduce"] == [T * h * b] * (4 * L + 2)
        assert plain["all_gather"] == [T * V // tp * b]
        sp = _by_kind(result["comm/sp=True"])
        assert sorted(sp) == ["all_gather", "all_reduce", "reduce_scatter"]
        assert sorted(sp["reduce_scatter"]) == [T * h * b] * (4 * L)
        assert sorted(sp["all_gather"]) == sorted([T // tp * h * b] * (4 * L + 2) + [T * V // tp * b])
        assert sorted(sp["all_reduce"]) == sorted([T * h * b] * 2 + [h * b] * (6 * L))
        # on a ring, the layers' reduce-scatters + all-gathers send what their all-reduces sent
        layer_ag = [T // tp * h * b] * (4 * L)
        sent_sp = sum(wire_bytes("reduce_scatter", n, tp) for n in sp["reduce_scatter"]) + sum(
            wire_bytes("all_gather", n, tp) for n in layer_ag)
        assert sent_sp == sum(wire_bytes("all_reduce", T * h * b, tp) for _ in range(4 * L))


@pytest.mark.distributed
def test_dropout_keeps_replicas_equal_and_split_data_gets_per_rank_streams(ranks):
    """Dropout on replicated activations draws the same masks on both tp ranks (their losses are
    equal), the default RNG streams stay in step, and tp_distinct_rng gives each rank its own
    stream, reproducibly from the same state (what a checkpoint recompute relies on)."""
    for sp in (False, True):
        losses = [result["dropout"][sp][0] for result in ranks]
        states = [result["dropout"][sp][1] for result in ranks]
        assert losses[0] == losses[1], f"sp={sp}: tp ranks computed different losses {losses}"
        assert torch.equal(states[0], states[1]), f"sp={sp}: the default RNG streams of the tp ranks diverged"
    (split0, after0, again0), (split1, after1, again1) = (r["dropout"]["streams"] for r in ranks)
    assert not torch.equal(split0, split1), "tp_distinct_rng drew the same numbers on both ranks"
    assert torch.equal(after0, after1), "after tp_distinct_rng the default streams differ across ranks"
    assert again0 and again1, "tp_distinct_rng is not a function of the generator state"
