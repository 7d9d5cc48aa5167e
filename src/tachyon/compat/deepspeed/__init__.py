"""``import tachyon.compat.deepspeed as deepspeed``: DeepSpeed's top-level names on tachyon.

    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args()                       # --deepspeed --deepspeed_config ds.json
    deepspeed.init_distributed()
    engine, optimizer, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=params)
    loss = engine(batch); engine.backward(loss); engine.step()

| DeepSpeed                          | tachyon                                              |
| ---------------------------------- | ---------------------------------------------------- |
| initialize, DeepSpeedEngine        | tachyon.initialize, tachyon.Engine                   |
| init_distributed                   | tachyon.init_distributed                             |
| init_inference, InferenceEngine    | tachyon.init_inference, tachyon.inference            |
| add_config_arguments               | this package (DeepSpeed's four arguments)            |
| DeepSpeedTransformerConfig/Layer   | tachyon.nn.TransformerKernelConfig/Layer (the config |
|                                    | with max_seq_length optional, as in DeepSpeed's API) |
| checkpointing                      | tachyon.checkpointing (activation checkpointing)     |
| PipelineModule, LayerSpec, ...     | tachyon.parallel.pipeline (when it exists)           |
| zero, comm, pipe, ops, profiling,  | submodules of this package                           |
| module_inject, runtime             |                                                      |
"""

from __future__ import annotations

import importlib

from tachyon.compat._names import Target, module_getattr, unsupported
from tachyon.compat.deepspeed.arguments import add_config_arguments

_PIPELINE = ("pipeline parallelism is not in this version of tachyon (it will be tachyon.parallel.pipeline); "
             "train with data parallelism and ZeRO stages 0-2 meanwhile")
_INFERENCE = ("the inference engine is not in this version of tachyon (it will be tachyon.init_inference, "
              "tachyon.inference); for now run the trained model itself under torch.no_grad()")


def pipeline_target(name: str) -> Target:
    return Target((("tachyon.parallel.pipeline", name), ("tachyon.parallel", name)), _PIPELINE)


def inference_target(name: str) -> Target:
    return Target((("tachyon.inference", name), ("tachyon", name)), _INFERENCE)


_TABLE: dict[str, Target] = {
    "initialize": Target((("tachyon", "initialize"),)),
    "DeepSpeedEngine": Target((("tachyon", "Engine"),)),
    "init_distributed": Target((("tachyon", "init_distributed"),)),
    "init_inference": Target((("tachyon.compat.deepspeed.inference", "init_inference"),)),
    "InferenceEngine": inference_target("InferenceEngine"),
    "DeepSpeedTransformerConfig": Target((("tachyon.compat.deepspeed.ops.transformer", "DeepSpeedTransformerConfig"),)),
    "DeepSpeedTransformerLayer": Target((("tachyon.nn", "TransformerKernelLayer"),)),
    "checkpointing": Target((("tachyon.engine.activation_checkpointing", None),)),
    "PipelineModule": pipeline_target("PipelineModule"),
    "OnDevice": unsupported("building a model directly on the meta device or partitioned (ZeRO-3) is not "
                            "implemented by tachyon; build it normally (tachyon.initialize moves it)"),
    "DeepSpeedHybridEngine": unsupported("the RLHF hybrid engine is not implemented by tachyon"),
}
_SUBMODULES = ("accelerator", "comm", "module_inject", "ops", "pipe", "profiling", "runtime", "utils", "zero")


def _submodules() -> list[str]:
    return list(_SUBMODULES)


_lookup = module_getattr(__name__, "deepspeed", _TABLE, _submodules)


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    return _lookup(name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_TABLE, *_SUBMODULES})


__all__ = ["add_config_arguments", *_TABLE]
