"""Planning a training job before it runs: memory per GPU, communication, step time, MFU.

    from tachyon.plan import Layout, estimate, preset
    from tachyon.hardware import get_gpu

    plan = estimate(preset("llama-7b"), Layout(tp=2, dp=32, zero=1, micro_batch=2, grad_accum=8),
                    get_gpu("h100"))
    plan.memory_per_gpu, plan.fits, plan.time["mfu"], plan.to_dict()

or from the shell: ``tachyon plan --model llama-7b --gpus 64 [--json]`` (see `tachyon.plan.cli`).

- `tachyon.plan.model`: the architecture (gpt / llama / bert families, presets, HF config.json)
  and exact parameter counts per tensor-parallel rank and pipeline stage;
- `tachyon.plan.activations`: bytes tachyon's layers save for backward (checked against
  measurements), checkpointing, FP8, the BERT kernel's memory flags;
- `tachyon.plan.layout`: a layout (tp, pp, dp, ZeRO stage, batches, checkpointing, dtype) and the
  refusal of impossible ones;
- `tachyon.plan.estimate`: memory, communication and time of one layout;
- `tachyon.plan.search`: every layout the open choices allow, ranked;
- `tachyon.plan.report`: tables and JSON.
"""

from tachyon.plan.estimate import Assumptions, Estimate, estimate, model_flops_per_token
from tachyon.plan.layout import Layout, Precision, check_layout
from tachyon.plan.model import PRESETS, ModelSpec, PlanError, from_hf_config, preset, resolve_model
from tachyon.plan.search import Choices, rank_layouts

__all__ = [
    "PRESETS", "Assumptions", "Choices", "Estimate", "Layout", "ModelSpec", "PlanError", "Precision",
    "check_layout", "estimate", "from_hf_config", "model_flops_per_token", "preset", "rank_layouts",
    "resolve_model",
]
