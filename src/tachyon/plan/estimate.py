"""One layout, estimated: memory per GPU, bytes communicated per step on each axis, step time, MFU.

Memory per GPU (the most loaded pipeline stage):

- model states: `tachyon.engine.zero.model_state_bytes` (the engine's formula, which its own
  ``memory_breakdown`` is tested against: what a rank holds after the boundary backward) over
  the stage's parameters padded as the engine pads them (a multiple of dp * 8 elements), plus the
  optimizer's float32 ``step`` tensor; the dtypes come from the engine's precision objects;
- activations: `tachyon.plan.activations` per micro-batch, times the micro-batches in flight
  (1F1B: stage i holds pp - i; GPipe: all), plus one recomputed layer with full checkpointing;
- buffers during backward: ZeRO-1/2's bucket buffers (one, two with overlap_comm, of the largest
  bucket), ZeRO-3's gathered layers (the running and the prefetched one, model dtype), the
  largest parameter's gradient before the engine folds it into its accumulator, and the logits
  around the loss;
- with ``offload`` (ZeRO-Offload of the optimizer), the model states' ``offloaded`` part is in
  host memory and not counted per GPU;
- during the optimizer step (activations gone): the fp32 master gradients that replace a bf16 /
  fp16 accumulator. The peak is model states + the larger of the backward set and this.

Communication (bytes each GPU sends per optimizer step, ring algorithms: an all-reduce of B bytes
over n ranks sends 2(n-1)/n * B, a reduce-scatter or all-gather (n-1)/n * B), gradients in the
model dtype (DeepSpeed's default ``communication_data_type``):

- dp: ZeRO 0 all-reduces the gradients once per step; ZeRO 1 reduce-scatters them once per step
  (every micro-step when they accumulate in a wider dtype than the model's), ZeRO 2 on every
  micro-step (as DeepSpeed); ZeRO 1/2 then all-gather the updated parameters. ZeRO 3 (FSDP2)
  all-gathers the parameters for every micro-step's forward and backward and reduce-scatters
  the gradients every micro-step: the ZeRO paper's 3 Psi per micro-step; it overlaps them with
  compute (prefetch), so only what exceeds the compute time is exposed.
- tp (Megatron-style with sequence parallelism): per layer and micro-batch two all-gathers and two
  reduce-scatters of the [tokens, hidden] activations forward, as many backward (4 all-reduce
  equivalents), two more when full checkpointing recomputes the layer; two for the embedding and
  LM head.
- pp: each micro-batch's activations forward and their gradients backward across each stage
  boundary; with a tied LM head, its gradient all-reduced between the first and last stage.

Step time = pipeline time + exposed data-parallel communication + optimizer step:

- compute: hardware FLOPs (recomputation included; causal attention at half its FLOPs, as flash
  attention skips masked blocks) at ``compute_efficiency`` of the GPU's dense peak
  (`tachyon.hardware`; FP8 GEMMs at the FP8 peak, attention in bf16);
- tp and pp traffic is on the critical path, at ``comm_efficiency`` of the link (NVLink inside a
  node, the per-GPU NIC across nodes); a pipeline step takes (m + pp - 1) micro-batch slots;
- dp traffic is exposed unless ``overlap_comm``, where it hides behind the backward of the micro-
  batch it follows; the parameter all-gather never hides;
- the optimizer step is memory-bound: ~(24 + 3 g + p) bytes per trained element of the shard
  (masters, moments read and written; gradients read for the norm, the clip and the update).

MFU = model FLOPs (6 * weights * tokens + attention 12 * layers * seq * hidden per token, PaLM's
convention, no recomputation, no causal discount) / (step time * GPUs * peak); FP8 runs are
quoted against the bf16 peak (the FLOPs are the same model FLOPs). The efficiencies are
assumptions, not measurements: pass measured ones for your cluster.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tachyon.engine.zero.layout import ALIGN
from tachyon.engine.zero.memory import model_state_bytes
from tachyon.hardware import GIB, GPUSpec
from tachyon.plan import activations as act
from tachyon.plan.layout import OPTIMIZERS, STEP_TENSOR_BYTES, Layout, Precision
from tachyon.plan.model import ModelSpec, PlanError


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """What the estimate assumes beyond the model and layout (all user-settable)."""

    compute_efficiency: float = 0.6
    """Fraction of the dense peak the FLOPs run at (GEMMs, attention, elementwise together)."""
    comm_efficiency: float = 0.8
    """Fraction of link bandwidth a collective achieves."""
    reserve_bytes: int = 3 * GIB
    """Not available to tensors: CUDA context, NCCL buffers, allocator fragmentation."""
    optimizer: str = "adam"
    grad_accum_dtype: str | None = None
    overlap_comm: bool = False
    reduce_bucket_size: int = 500_000_000
    """Elements (DeepSpeed's ``zero_optimization.reduce_bucket_size``)."""

    def __post_init__(self) -> None:
        for key in ("compute_efficiency", "comm_efficiency"):
            value = getattr(self, key)
            if not 0.0 < value <= 1.0:
                raise PlanError(f"{key} must be in (0, 1]; got {value!r}")
        if self.optimizer not in OPTIMIZERS:
            raise PlanError(f"optimizer must be one of {sorted(OPTIMIZERS)}; got {self.optimizer!r}")
        if self.reserve_bytes < 0:
            raise PlanError(f"reserve must be >= 0 bytes; got {self.reserve_bytes!r}")
        if self.reduce_bucket_size < 1:
            raise PlanError(f"reduce_bucket_size must be >= 1; got {self.reduce_bucket_size!r}")


def _ring_all_reduce(nbytes: float, n: int) -> float:
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


def _ring_gather(nbytes: float, n: int) -> float:
    return (n - 1) / n * nbytes if n > 1 else 0.0


def padded(num_params: int, dp: int) -> int:
    """Parameters as the engine's flat buffer holds them: a multiple of dp * ALIGN elements."""
    quantum = dp * ALIGN
    return max(quantum, -(-num_params // quantum) * quantum)


@dataclasses.dataclass
class StagePlan:
    """One pipeline stage: its parameters and memory per GPU (bytes)."""

    index: int
    layers: int
    params: int
    memory: dict[str, float]

    @property
    def total(self) -> float:
        """Model states + the larger of what backward adds and what the optimizer step adds."""
        m = self.memory
        backward = sum(m.get(k, 0.0) for k in ("activations", "logits", "largest_gradient", "bucket_buffers",
                                               "gathered_layers"))
        device_states = m["model_states"] - m.get("offloaded", 0.0)  # offloaded: in host memory
        return device_states + max(backward, m.get("step_master_gradients", 0.0))


@dataclasses.dataclass
class Estimate:
    """The plan of one layout. ``memory``, ``communication`` and ``time`` are dicts of floats
    (bytes, bytes per step, seconds); ``time`` is None without an architecture."""

    spec: ModelSpec | None
    params: int
    layout: Layout
    gpu: GPUSpec
    assumptions: Assumptions
    stages: list[StagePlan]
    communication: dict[str, dict[str, float]]
    time: dict[str, float] | None
    activation_items: dict[str, float] | None
    per_layer_by_checkpointing: dict[str, float] | None
    """Bytes one layer saves for one micro-batch under each checkpointing mode (per tp rank)."""
    notes: list[str]

    @property
    def binding_stage(self) -> StagePlan:
        return max(self.stages, key=lambda s: s.total)

    @property
    def memory_per_gpu(self) -> float:
        return self.binding_stage.total

    @property
    def usable_memory(self) -> float:
        return self.gpu.memory_bytes - self.assumptions.reserve_bytes

    @property
    def fits(self) -> bool:
        return self.memory_per_gpu <= self.usable_memory

    def to_dict(self) -> dict[str, Any]:
        stage = self.binding_stage
        return {
            "model": self.spec.to_dict() if self.spec is not None else None,
            "params": self.params,
            "gpu": {"name": self.gpu.name, "memory_bytes": self.gpu.memory_bytes, "source": self.gpu.source},
            "layout": self.layout.to_dict(),
            "memory": {
                "per_gpu": dict(stage.memory, total=stage.total),
                "binding_stage": stage.index,
                "usable_bytes": self.usable_memory,
                "fits": self.fits,
                "stages": [{"stage": s.index, "layers": s.layers, "params": s.params, "total": s.total}
                           for s in self.stages],
            },
            "activations_per_layer_per_token": self.activation_items,
            "activations_per_layer_per_micro_batch": self.per_layer_by_checkpointing,
            "communication_bytes_per_step": self.communication,
            "time": self.time,
            "assumptions": dataclasses.asdict(self.assumptions),
            "notes": self.notes,
        }


def _stage_params(spec: ModelSpec | None, params: int, layout: Layout) -> list[tuple[int, int]]:
    """(layers, parameters per GPU) of each stage. Without an architecture the parameters are
    split evenly over tp * pp. A ``params`` other than the architecture's scales every stage."""
    if spec is None:
        share = -(-params // (layout.tp * layout.pp))
        return [(0, share)] * layout.pp
    counts = []
    for i, n in enumerate(layout.stage_layers(spec.layers)):
        count = n * spec.layer_params(layout.tp)
        if i == 0:
            count += spec.embedding_params(layout.tp)
        if i == layout.pp - 1:
            count += spec.head_params(layout.tp, pipeline=layout.pp > 1)
        counts.append((n, count))
    arch = spec.total_params()
    if params != arch:
        counts = [(n, round(c * params / arch)) for n, c in counts]
    return counts


def _largest_param(spec: ModelSpec | None, layout: Layout, stage_params: int, first: bool) -> int:
    if spec is None:
        return 0
    tp, h = layout.tp, spec.hidden
    biggest = max(spec.qkv_width * h, spec.fc1_width * h, h * spec.ffn_size) // tp
    if first:
        biggest = max(biggest, spec.padded_vocab(tp) * h // tp)
    return min(biggest, stage_params)


def estimate(spec: ModelSpec | None, layout: Layout, gpu: GPUSpec, assumptions: Assumptions = Assumptions(),
             params: int | None = None) -> Estimate:
    """The plan for ``layout`` (checked with `check_layout` by the caller). ``spec`` None plans
    model states and data-parallel traffic only (``params`` then required)."""
    if spec is None and params is None:
        raise PlanError("give the model (an architecture) or its parameter count")
    params = params if params is not None else spec.total_params()
    precision = Precision.of(layout.dtype, assumptions.grad_accum_dtype)
    notes: list[str] = []
    if spec is not None and params != spec.total_params():
        notes.append(f"the architecture has {spec.total_params():,} parameters; model states use the given "
                     f"{params:,} (each stage scaled by the ratio), FLOPs and activations the architecture")
    stage_counts = _stage_params(spec, params, layout)
    stages, tokens = [], layout.micro_batch * (spec.seq if spec is not None else 0)
    opt_bytes = OPTIMIZERS[assumptions.optimizer]
    for i, (layers, count) in enumerate(stage_counts):
        first, last = i == 0, i == layout.pp - 1
        flat = padded(count, layout.dp)
        states = model_state_bytes(flat, layout.dp, layout.zero, param_bytes=precision.param_bytes,
                                   grad_accum_bytes=precision.grad_accum_bytes, fp32_master=precision.fp32_master,
                                   optimizer_state_bytes=opt_bytes, gradient_accumulation_steps=layout.grad_accum,
                                   offload=layout.offload)
        states["optimizer_states"] += STEP_TENSOR_BYTES[assumptions.optimizer]
        states["model_states"] += STEP_TENSOR_BYTES[assumptions.optimizer]
        if layout.offload:
            states["offloaded"] += STEP_TENSOR_BYTES[assumptions.optimizer]
        memory = dict(states)
        if spec is not None:
            stage_act = act.stage_activations(spec, layout.dtype, layout.checkpointing, tokens, layers,
                                              first=first, last=last, tp=layout.tp)
            memory["activations"] = stage_act.saved * layout.in_flight(i) + stage_act.recompute
            memory["logits"] = (act.logits_transient_bytes_per_token(spec, layout.dtype, layout.tp) * tokens
                                if last else 0.0)
        memory["largest_gradient"] = _largest_param(spec, layout, count, first) * precision.param_bytes
        if layout.zero == 3 and spec is not None:  # the running and the prefetched layer, gathered
            memory["gathered_layers"] = 2 * spec.layer_params(layout.tp) * precision.param_bytes
        if layout.zero in (1, 2):  # bucket buffers hold at most reduce_bucket_size model-dtype elements' bytes
            quantum = layout.dp * ALIGN
            numel = max(quantum, assumptions.reduce_bucket_size * precision.param_bytes // precision.comm_bytes
                        // quantum * quantum)
            buffers = 2 if assumptions.overlap_comm and flat > numel else 1
            memory["bucket_buffers"] = buffers * min(flat, numel) * precision.comm_bytes
        shard = flat if layout.zero == 0 else flat // layout.dp
        needs_fp32_grads = precision.fp32_master and precision.grad_accum_bytes != 4
        on_device = not layout.offload and layout.zero != 3  # stage 3's gradient shards are fp32 already
        memory["step_master_gradients"] = 4 * shard if needs_fp32_grads and on_device else 0
        stages.append(StagePlan(i, layers, count, memory))
    flat_max = max(padded(c, layout.dp) for _, c in stage_counts)
    communication = _communication(spec, layout, precision, flat_max, tokens)
    time = _time(spec, layout, precision, gpu, assumptions, stages, communication, tokens) if spec else None
    items = by_mode = None
    if spec is not None:
        items = {k: v / layout.tp for k, v in act.layer_items(spec, layout.dtype, layout.checkpointing).items()}
        modes = [m for m in act.CHECKPOINTING if not (spec.family == "bert" and m == "selective")]
        by_mode = {m: act.layer_bytes_per_token(spec, layout.dtype, m, layout.tp) * tokens for m in modes}
    else:
        notes.append("activations and step time need the architecture: give --model or --layers --hidden "
                     "--heads --seq --vocab")
    return Estimate(spec, params, layout, gpu, assumptions, stages, communication, time, items, by_mode, notes)


def _communication(spec: ModelSpec | None, layout: Layout, precision: Precision, flat: int, tokens: int
                   ) -> dict[str, dict[str, float]]:
    d, t, m = layout.dp, layout.tp, layout.grad_accum
    c, p = precision.comm_bytes, precision.param_bytes
    if layout.zero == 0:
        grads = _ring_all_reduce(flat * c, d)
    elif layout.zero == 3:  # FSDP2: every micro-step reduce-scatters, and gathers for forward and backward
        grads = _ring_gather(flat * c, d) * m
    else:  # reduce-scatter: stage 2 every micro-step, stage 1 too when accumulating wider than the model
        every_micro_step = layout.zero == 2 or precision.grad_accum_bytes > precision.param_bytes
        grads = _ring_gather(flat * c, d) * (m if every_micro_step else 1)
    gather = _ring_gather(flat * p, d) * (2 * m if layout.zero == 3 else 1) if layout.zero >= 1 else 0.0
    out = {"dp": {"gradient_reduction": grads, "parameter_allgather": gather, "total": grads + gather}}
    if spec is None:
        return out
    e, _ = act.activation_bytes(layout.dtype)
    activation = tokens * spec.hidden * e
    per_layer = 4 + (2 if layout.checkpointing == "full" else 0) + (1 if spec.attn_dropout_checkpoint else 0)
    most_layers = max(layout.stage_layers(spec.layers))
    tp_bytes = _ring_all_reduce(activation, t) * (per_layer * most_layers + 2) * m
    out["tp"] = {"activations": tp_bytes, "total": tp_bytes}
    if layout.pp > 1:
        directions = 2 if layout.pp > 2 else 1
        p2p = activation / t * directions * m
        tied = _ring_all_reduce(spec.padded_vocab(t) // t * spec.hidden * c, 2) if spec.tied_embeddings else 0.0
        out["pp"] = {"activations": p2p, "tied_embedding": tied, "total": p2p + tied}
    else:
        out["pp"] = {"activations": 0.0, "tied_embedding": 0.0, "total": 0.0}
    return out


def _bandwidth(gpu: GPUSpec, span: int) -> float:
    """Link bandwidth of a group whose ranks span ``span`` consecutive GPUs."""
    return gpu.nvlink_bytes_per_s if span <= gpu.gpus_per_node else gpu.network_bytes_per_s


def model_flops_per_token(spec: ModelSpec) -> float:
    """Forward + backward model FLOPs per token (PaLM's convention): 6 per GEMM weight element,
    12 * layers * seq * (heads * head_dim) for attention, the LM head (bert: at the masked share)."""
    attn_width = spec.heads * spec.kv_channels
    layers = spec.layers * (6.0 * spec.layer_gemm_weights() + 12.0 * spec.seq * attn_width)
    head = 6.0 * spec.padded_vocab() * spec.hidden
    if spec.family == "bert":
        head = spec.mlm_fraction * (head + 6.0 * spec.hidden * spec.hidden)
    return layers + head


def _time(spec: ModelSpec, layout: Layout, precision: Precision, gpu: GPUSpec, assumptions: Assumptions,
          stages: list[StagePlan], communication: dict[str, dict[str, float]], tokens: int) -> dict[str, float]:
    t, m, eff = layout.tp, layout.grad_accum, assumptions.compute_efficiency
    fp8 = layout.dtype == "fp8"
    gemm_peak = gpu.peak_flops(layout.dtype) * eff
    attn_peak = gpu.peak_flops("bf16" if fp8 else layout.dtype) * eff
    causal = 0.5 if spec.causal else 1.0
    gemm_fwd = 2.0 * spec.layer_gemm_weights() / t * tokens
    attn_fwd = 4.0 * spec.seq * spec.heads * spec.kv_channels / t * tokens * causal
    recompute_gemm = gemm_fwd if layout.checkpointing == "full" else 0.0
    recompute_attn = attn_fwd if layout.checkpointing in ("full", "selective") else 0.0
    if spec.attn_dropout_checkpoint:
        recompute_gemm += 2.0 * spec.qkv_width * spec.hidden / t * tokens
        recompute_attn += attn_fwd
    head_fwd = 2.0 * spec.padded_vocab(t) / t * spec.hidden * tokens
    if spec.family == "bert":
        head_fwd = spec.mlm_fraction * (head_fwd + 2.0 * spec.hidden * spec.hidden * tokens)
    comm_bw = assumptions.comm_efficiency
    tp_bw = _bandwidth(gpu, t) * comm_bw
    dp_bw = _bandwidth(gpu, t * layout.dp) * comm_bw
    pp_bw = _bandwidth(gpu, t * layout.dp * layout.pp) * comm_bw
    e, _ = act.activation_bytes(layout.dtype)
    slot = 0.0  # the slowest stage's time per micro-batch
    backward_of_slot = 0.0
    for stage in stages:
        layer_gemm = stage.layers * (3.0 * gemm_fwd + recompute_gemm)
        layer_attn = stage.layers * (3.0 * attn_fwd + recompute_attn)
        head = 3.0 * head_fwd if stage.index == layout.pp - 1 else 0.0
        compute = (layer_gemm + head) / gemm_peak + layer_attn / attn_peak
        per_layer = 4 + (2 if layout.checkpointing == "full" else 0) + (1 if spec.attn_dropout_checkpoint else 0)
        tp_time = _ring_all_reduce(tokens * spec.hidden * e, t) * (per_layer * stage.layers + 2) / tp_bw
        p2p = (2.0 if layout.pp > 1 else 0.0) * tokens * spec.hidden * e / t / pp_bw
        total = compute + tp_time + p2p
        if total > slot:
            slot, backward_of_slot = total, compute * 2.0 / 3.0
    slots = m + layout.pp - 1
    pipeline = slots * slot
    dp = communication["dp"]
    reduce_time = dp["gradient_reduction"] / dp_bw
    every_micro_step = layout.zero == 2 or (layout.zero == 1 and precision.grad_accum_bytes > precision.param_bytes)
    if layout.zero == 3:  # FSDP2 prefetches the next layer's gather and reduce-scatters behind the backward
        exposed = max(0.0, (dp["gradient_reduction"] + dp["parameter_allgather"]) / dp_bw - pipeline)
    elif assumptions.overlap_comm:
        if every_micro_step:
            exposed = m * max(0.0, reduce_time / m - backward_of_slot)
        else:
            exposed = max(0.0, reduce_time - backward_of_slot)
    else:
        exposed = reduce_time
    if layout.zero != 3:
        exposed += dp["parameter_allgather"] / dp_bw
    exposed += communication["pp"]["tied_embedding"] / pp_bw
    shard = max(s.params for s in stages)
    if layout.zero >= 1:
        shard = shard / layout.dp
    optimizer_bytes = 24 + 3 * precision.grad_accum_bytes + precision.param_bytes
    optimizer = shard * optimizer_bytes / gpu.hbm_bytes_per_s
    step = pipeline + exposed + optimizer
    step_tokens = layout.global_batch * spec.seq
    flops = model_flops_per_token(spec) * step_tokens
    peak = gpu.peak_flops("bf16" if fp8 else layout.dtype)
    return {
        "step_s": step,
        "pipeline_s": pipeline,
        "pipeline_bubble_s": (layout.pp - 1) * slot,
        "micro_batch_slot_s": slot,
        "dp_comm_exposed_s": exposed,
        "optimizer_s": optimizer,
        "tokens_per_step": float(step_tokens),
        "tokens_per_s": step_tokens / step,
        "model_flops_per_step": flops,
        "mfu": flops / (step * layout.gpus * peak),
    }


def human_bytes(n: float) -> str:
    """Bytes in GiB (or MiB below 1 GiB), for tables."""
    if n >= GIB or n == 0:
        return f"{n / GIB:.2f} GiB"
    return f"{n / 2**20:.1f} MiB"


__all__ = ["Assumptions", "Estimate", "StagePlan", "estimate", "human_bytes", "model_flops_per_token", "padded"]
