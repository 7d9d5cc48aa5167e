"""Typed, validated config: a DeepSpeed-style JSON file or dict in, a `TachyonConfig` out.

    from tachyon.config import load_config
    config = load_config("ds_config.json", world_size=8)
    config.zero_stage, config.precision, config.train_micro_batch_size_per_gpu

Key names and defaults are DeepSpeed's. Unknown keys, wrong types, inconsistent batch sizes and
DeepSpeed features tachyon does not implement yet raise `ConfigError`, naming the key path and
what is allowed. Keys accepted with no effect are listed in `ACCEPTED_IGNORED_KEYS` and reported
per config by `TachyonConfig.ignored_keys`; refused features are in `UNSUPPORTED_KEYS`.
"""

from .batch import resolve_batch_sizes
from .config import TachyonConfig, load_config, parse_config, read_config_file
from .errors import ConfigError
from .keys import ACCEPTED_IGNORED_KEYS, OFF_VALUES, UNSUPPORTED_KEYS
from .quantize_training import MoQConfig
from .optim import (
    OPTIMIZER_PARAMS,
    SCHEDULER_PARAMS,
    UNSUPPORTED_OPTIMIZERS,
    UNSUPPORTED_SCHEDULERS,
)
from .sections import (
    ActivationCheckpointingConfig,
    BF16Config,
    CheckpointConfig,
    DataTypesConfig,
    FlopsProfilerConfig,
    FP16Config,
    MonitorConfig,
    OptimizerConfig,
    PipelineConfig,
    ProgressiveLayerDropConfig,
    QuantizeTrainingConfig,
    SchedulerConfig,
    TensorParallelConfig,
    ZeroConfig,
)

__all__ = [
    "ACCEPTED_IGNORED_KEYS",
    "OFF_VALUES",
    "OPTIMIZER_PARAMS",
    "SCHEDULER_PARAMS",
    "UNSUPPORTED_KEYS",
    "UNSUPPORTED_OPTIMIZERS",
    "UNSUPPORTED_SCHEDULERS",
    "ActivationCheckpointingConfig",
    "BF16Config",
    "CheckpointConfig",
    "ConfigError",
    "DataTypesConfig",
    "FP16Config",
    "FlopsProfilerConfig",
    "MoQConfig",
    "MonitorConfig",
    "OptimizerConfig",
    "PipelineConfig",
    "ProgressiveLayerDropConfig",
    "QuantizeTrainingConfig",
    "SchedulerConfig",
    "TachyonConfig",
    "TensorParallelConfig",
    "ZeroConfig",
    "load_config",
    "parse_config",
    "resolve_batch_sizes",
    "read_config_file",
]
