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
| PipelineModule, LayerSpec, ...     | tachyon.parallel.pipeline (compat.deepspeed.pipe)    |
| __version__                        | the DeepSpeed release the API follows (0.19.6)       |
| zero, comm, pipe, ops, profiling,  | submodules of this package                           |
| module_inject, runtime             |                                                      |
"""

from __future__ import annotations

from tachyon.compat._names import Target, module_getattr, unsupported
from tachyon.compat.deepspeed.arguments import add_config_arguments

__version__ = "0.19.6"
"""The DeepSpeed release whose API this compatibility layer follows (commit edaa722), for scripts
and integrations that check ``deepspeed.__version__``; tachyon's own is ``tachyon.__version__``."""
__version_major__, __version_minor__, __version_patch__ = (int(part) for part in __version__.split("."))
__git_hash__ = __git_branch__ = "[none]"
"""What DeepSpeed reports when it was not built from a git checkout: no DeepSpeed build is present."""

_INFERENCE = ("the inference engine is not in this version of tachyon (it will be tachyon.init_inference, "
              "tachyon.inference); for now run the trained model itself under torch.no_grad()")


def inference_target(name: str) -> Target:
    return Target((("tachyon.inference", name), ("tachyon", name)), _INFERENCE)


_TABLE: dict[str, Target] = {
    "initialize": Target((("tachyon", "initialize"),)),
    "DeepSpeedEngine": Target((("tachyon", "Engine"),)),
    "init_distributed": Target((("tachyon.compat.deepspeed.comm", "init_distributed"),)),
    "DeepSpeedConfig": Target((("tachyon.compat.deepspeed.runtime.config", "DeepSpeedConfig"),)),
    "DeepSpeedConfigError": Target((("tachyon.config", "ConfigError"),)),
    "init_inference": Target((("tachyon.compat.deepspeed.inference", "init_inference"),)),
    "InferenceEngine": inference_target("InferenceEngine"),
    "DeepSpeedTransformerConfig": Target((("tachyon.compat.deepspeed.ops.transformer", "DeepSpeedTransformerConfig"),)),
    "DeepSpeedTransformerLayer": Target((("tachyon.nn", "TransformerKernelLayer"),)),
    "checkpointing": Target((("tachyon.engine.activation_checkpointing", None),)),
    "PipelineModule": Target((("tachyon.compat.deepspeed.pipe", "PipelineModule"),)),
    "OnDevice": unsupported("building a model directly on the meta device or partitioned (ZeRO-3) is not "
                            "implemented by tachyon; build it normally (tachyon.initialize moves it)"),
    "DeepSpeedHybridEngine": unsupported("the RLHF hybrid engine is not implemented by tachyon"),
}
_SUBMODULES = ("accelerator", "comm", "module_inject", "ops", "pipe", "profiling", "runtime", "utils", "zero")


__getattr__ = module_getattr(__name__, "deepspeed", _TABLE, submodules=_SUBMODULES)


def __dir__() -> list[str]:
    return sorted({*globals(), *_TABLE, *_SUBMODULES})


__all__ = ["__version__", "__git_hash__", "__git_branch__", "add_config_arguments", *_TABLE]
