"""``parallelize(model, mesh)``: tensor parallelism applied to a finished model from outside.

    model = tachyon.train.models.GPT(vocab_size=50257, hidden_size=1024, num_layers=24, num_heads=16)
    mesh = tachyon.parallel.Mesh(dp=2, tp=4)
    tachyon.parallel.tensor.parallelize(model, mesh, sequence_parallel=True)
    loss = model(input_ids, labels=labels)              # same numbers, 1/tp of the layer weights per rank

What it changes (torchtitan's rule: model code never touches a process group):

- every ``tachyon.nn.TransformerLayer`` (also inside ``HFLayerAdapter``, i.e. HF GPT-2 / Llama
  models converted with it): attention split by heads, MLP by FFN features
  (tachyon.parallel.tensor.fused);
- embeddings and LM heads by ``plan``, {module name: style}:
  ``"vocab"`` (nn.Embedding -> VocabParallelEmbedding), ``"column_gather"`` (a Linear whose output
  features are split and all-gathered: an LM head whose model computes the loss itself),
  ``"column"`` (split output kept: logits for vocab_parallel_cross_entropy), ``"row"`` (input
  features split), ``"replicate"`` (leave it). Default plan: an nn.Embedding whose weight is
  also a Linear's weight (a tied LM head) gets "vocab" and the Linear "column_gather"; every
  other module stays replicated (correct, only without the memory saving);
- ``sequence_parallel=True``: the hidden states between the layers of each run of
  TransformerLayers in an nn.ModuleList / nn.Sequential are split along the sequence (split
  before the run's first layer, all-gathered after its last), so the norms, dropouts and
  residual adds run on seq / tp tokens per rank.

Everything is checked before anything changes: tp must divide every layer's query heads,
key/value heads and FFN size and every split vocabulary (ValueError naming the module and
the size). A TransformerKernelLayer (the fused BERT kernel) is refused. parallelize never
returns a model it did not split: HF transformer layers it cannot split as they are (GPT-2's
``GPT2Block``, Llama-style decoder layers, BERT's ``BertLayer``) are refused with the conversion
that makes them splittable (``HFLayerAdapter.from_hf`` for GPT-2 / Llama; BERT has no
tensor-parallel layer in tachyon but ``TransformerLayer`` built post-LN), and so is a model with
no TransformerLayer at all unless the plan names modules to split.

Numbers: without dropout, the parallel model computes what the original computes up to
floating-point summation order (the row-parallel sums add tp partial products).
"""

from __future__ import annotations

from torch import Tensor, nn

from tachyon.nn.transformer_layer import HFLayerAdapter, TransformerLayer
from tachyon.parallel.tensor.comm import TPGroup, gather_from_tp, scatter_to_tp, tp_group
from tachyon.parallel.tensor.fused import check_transformer_layer, parallelize_transformer_layer, seq_dim_of
from tachyon.parallel.tensor.layers import to_column_parallel, to_row_parallel, to_vocab_parallel
from tachyon.parallel.tensor.shard import check_shardable

STYLES = ("vocab", "column", "column_gather", "row", "replicate")


def default_plan(model: nn.Module) -> dict[str, str]:
    """{embedding name: "vocab", head name: "column_gather"} for every nn.Embedding whose weight a
    Linear shares (a tied LM head)."""
    modules = dict(model.named_modules())
    plan: dict[str, str] = {}
    for e_name, emb in modules.items():
        if not isinstance(emb, nn.Embedding):
            continue
        for l_name, lin in modules.items():
            if isinstance(lin, nn.Linear) or _is_tachyon_linear(lin):
                if lin.weight is emb.weight:
                    plan[e_name], plan[l_name] = "vocab", "column_gather"
    return plan


def _is_tachyon_linear(module: nn.Module) -> bool:
    from tachyon.nn.linear import Linear

    return isinstance(module, Linear)


def _check_plan(model: nn.Module, plan: dict[str, str], tp: int) -> None:
    modules = dict(model.named_modules())
    for name, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"parallelize: plan[{name!r}] = {style!r}; allowed styles: {', '.join(map(repr, STYLES))}")
        if name not in modules:
            raise ValueError(f"parallelize: plan names {name!r}, which is not a submodule of {type(model).__name__}")
        module = modules[name]
        if style == "replicate":
            continue
        if style == "vocab":
            if not isinstance(module, nn.Embedding):
                raise ValueError(f"parallelize: plan[{name!r}] = 'vocab' needs an nn.Embedding; got {type(module).__name__}")
            check_shardable(f"tensor parallel embedding {name!r}", module.num_embeddings, tp, "num_embeddings (vocab)")
            continue
        if not (isinstance(module, nn.Linear) or _is_tachyon_linear(module)):
            raise ValueError(f"parallelize: plan[{name!r}] = {style!r} needs a Linear; got {type(module).__name__}")
        if style == "row":
            check_shardable(f"tensor parallel linear {name!r}", module.in_features, tp, "in_features")
        else:
            check_shardable(f"tensor parallel linear {name!r} (an LM head: out_features is the vocabulary)",
                            module.out_features, tp, "out_features")


def _layer_runs(model: nn.Module) -> list[list[TransformerLayer]]:
    """Maximal runs of consecutive TransformerLayers among the children of every ModuleList /
    Sequential, and in the stages of a PipelineModule (its ``ordered_layer_lists()``): the
    stacks whose hidden states sequence parallelism splits."""
    sequences = [list(m.children()) for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]
    ordered = getattr(model, "ordered_layer_lists", None)
    if callable(ordered):
        sequences += ordered()
    runs: list[list[TransformerLayer]] = []
    for sequence in sequences:
        run: list[TransformerLayer] = []
        for child in sequence:
            if isinstance(child, TransformerLayer):
                run.append(child)
                continue
            if run:
                runs.append(run)
            run = []
        if run:
            runs.append(run)
    return runs


def _split_hidden(tp: TPGroup, seq_dim: int):
    def hook(module, args, kwargs):
        if args:
            return (scatter_to_tp(args[0], tp, seq_dim), *args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = scatter_to_tp(kwargs["hidden_states"], tp, seq_dim)
        return args, kwargs

    return hook


def _gather_hidden(tp: TPGroup, seq_dim: int):
    def hook(module, args, output: Tensor) -> Tensor:
        return gather_from_tp(output, tp, seq_dim)

    return hook


def _check_sequence_parallel(model: nn.Module, layers: list[tuple[str, TransformerLayer]]) -> list[list[TransformerLayer]]:
    adapters = [n for n, m in model.named_modules() if isinstance(m, HFLayerAdapter)]
    if adapters:
        raise ValueError(
            f"parallelize: sequence_parallel=True is not supported for HF models run through HFLayerAdapter "
            f"({adapters[0]!r}, ...): the HF model hands every layer full-sequence masks and positions; use "
            f"sequence_parallel=False"
        )
    runs = _layer_runs(model)
    in_runs = {id(layer) for run in runs for layer in run}
    loose = [name for name, layer in layers if id(layer) not in in_runs]
    if loose:
        raise ValueError(
            f"parallelize: sequence_parallel=True needs every TransformerLayer inside an nn.ModuleList or nn.Sequential "
            f"(the sequence is split before the first layer of a run and gathered after the last); {loose[0]!r} is not"
        )
    for run in runs:
        if len({seq_dim_of(layer) for layer in run}) > 1:
            raise ValueError("parallelize: sequence_parallel=True needs one attn_input_format (bshd or sbhd) per stack")
    return runs


HF_LAYERS = {
    "GPT2Block": "gpt2", "LlamaDecoderLayer": "llama", "MistralDecoderLayer": "llama", "Qwen2DecoderLayer": "llama",
    "BertLayer": "bert", "RobertaLayer": "bert", "GPTNeoBlock": "other", "GPTJBlock": "other",
}
"""HF transformer layer classes parallelize cannot split as they are, by what converts them."""


def _unconverted_hf_layers(model: nn.Module) -> tuple[str, str, str, int] | None:
    """(first name, class, kind, count) of HF transformer layers in ``model`` (not converted to
    tachyon.nn.TransformerLayer), or None."""
    found = [(n, type(m).__name__) for n, m in model.named_modules() if type(m).__name__ in HF_LAYERS]
    if not found:
        return None
    name, cls = found[0]
    return name, cls, HF_LAYERS[cls], len(found)


def _refuse_unsplit(model: nn.Module, layers: list, plan: dict[str, str], tp_size: int) -> None:
    """ValueError when parallelize would leave transformer layers whole (module docstring)."""
    hf = _unconverted_hf_layers(model)
    if hf is not None:
        name, cls, kind, count = hf
        parent = name.rsplit(".", 1)[0] if "." in name else "<the layer list>"
        if kind in ("gpt2", "llama"):
            how = (f"convert them first (tachyon.nn.transformer_layer.HFLayerAdapter): `for i, layer in "
                   f"enumerate(model.{parent}): model.{parent}[i] = HFLayerAdapter.from_hf(layer)`, then call "
                   "parallelize")
        elif kind == "bert":
            how = ("BERT layers have no tensor-parallel form in tachyon (the fused kernel layer of replace_bert_layers "
                   "is not splittable either): build the encoder from tachyon.nn.TransformerLayer (output_layernorm="
                   "True, apply_residual_connection_post_layernorm=True is BERT's post-LN layer), or train it "
                   "data-parallel (tp_size 1)")
        else:
            how = "tachyon has no converter for this layer: build the model from tachyon.nn.TransformerLayer"
        raise ValueError(
            f"parallelize: {name!r} is an unconverted HF {cls} ({count} such layer(s)); split over {tp_size} ranks "
            f"they would stay whole on every rank. {how}"
        )
    if not layers and not any(style != "replicate" for style in plan.values()):
        raise ValueError(
            f"parallelize: {type(model).__name__} has no tachyon.nn.TransformerLayer (nor an HFLayerAdapter) to split "
            f"over {tp_size} ranks, and the plan names no module to split; every weight would stay whole on every "
            "rank. Build the model from tachyon.nn.TransformerLayer, convert HF GPT-2 / Llama layers with "
            "HFLayerAdapter.from_hf, or pass plan={name: 'column' | 'row' | 'vocab' | 'column_gather'}"
        )


def check_parallelizable(model: nn.Module, tp_size: int, *, sequence_parallel: bool = False,
                         plan: dict[str, str] | None = None) -> tuple[list, dict[str, str], list]:
    """Every check of :func:`parallelize` for a tensor-parallel size ``tp_size``, touching nothing
    and no process group (`tachyon.initialize` runs it before it creates any): ValueError naming
    the module and the size for a TransformerKernelLayer, heads / key-value heads / FFN size /
    vocabulary not divisible by tp, a bad plan, or a model already tensor parallel. Returns what
    parallelize applies: (layers, plan, sequence-parallel runs)."""
    if getattr(model, "_tachyon_tp", None) is not None:
        raise ValueError("parallelize: the model is already tensor parallel (parallelize was applied twice)")
    kernels = [n for n, m in model.named_modules() if type(m).__name__ == "TransformerKernelLayer"]
    if kernels and tp_size > 1:
        raise ValueError(
            f"parallelize: {kernels[0]!r} is a TransformerKernelLayer (the fused BERT kernel), which has no tensor-parallel "
            f"form; build the model from tachyon.nn.TransformerLayer (output_layernorm=True with "
            f"apply_residual_connection_post_layernorm=True is BERT's post-LN layer) to split it"
        )
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, TransformerLayer)]
    for name, layer in layers:
        check_transformer_layer(layer, tp_size, name)
    plan = default_plan(model) if plan is None else dict(plan)
    _check_plan(model, plan, tp_size)
    if tp_size > 1:
        _refuse_unsplit(model, layers, plan, tp_size)
    runs = _check_sequence_parallel(model, layers) if sequence_parallel else []
    return layers, plan, runs


def parallelize(model: nn.Module, mesh, *, sequence_parallel: bool = False, plan: dict[str, str] | None = None) -> nn.Module:
    """Make ``model`` tensor parallel over the mesh's "tp" axis, in place (see the module docstring).

    model: any nn.Module containing tachyon.nn.TransformerLayers (directly or in HFLayerAdapters).
    mesh: a tachyon Mesh, a mesh_from_mpu view, an mpu or a tp ProcessGroup. sequence_parallel:
    split the hidden states between layers along the sequence. plan: {module name: style} for
    embeddings / heads / other Linears (default: :func:`default_plan`; pass {} to shard only the
    layers). Returns the model. At tp size 1 nothing changes.
    """
    tp = tp_group(mesh)
    if getattr(model, "_tachyon_tp", None) is not None:
        raise ValueError("parallelize: the model is already tensor parallel (parallelize was applied twice)")
    if tp.size == 1:
        return model
    # ---- checks first: a refused layout leaves the model untouched
    layers, plan, runs = check_parallelizable(model, tp.size, sequence_parallel=sequence_parallel, plan=plan)
    # ---- apply
    modules = dict(model.named_modules())
    for name, layer in layers:
        parallelize_transformer_layer(layer, tp, sequence_parallel)
    for name, style in plan.items():
        module = modules[name]
        if style == "vocab":
            to_vocab_parallel(module, tp)
        elif style in ("column", "column_gather"):
            to_column_parallel(module, tp, gather_output=style == "column_gather")
        elif style == "row":
            to_row_parallel(module, tp, input_is_parallel=True)
    for run in runs:
        seq_dim = seq_dim_of(run[0])
        run[0].register_forward_pre_hook(_split_hidden(tp, seq_dim), with_kwargs=True)
        run[-1].register_forward_hook(_gather_hidden(tp, seq_dim))
    model._tachyon_tp = tp
    return model


__all__ = ["STYLES", "check_parallelizable", "default_plan", "parallelize"]
