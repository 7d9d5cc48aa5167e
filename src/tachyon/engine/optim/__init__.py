"""Optimizers over ordinary parameters or flat fp32 ZeRO partitions.

- FusedAdam: Adam/AdamW, one Triton multi-tensor launch per step on CUDA (PyTorch elsewhere).
- CPUAdam: FusedAdam over host tensors (ZeRO-Offload's optimizer; DeepSpeed's DeepSpeedCPUAdam).
- Lamb: DeepSpeed FusedLamb semantics, trust ratios per original parameter even when the optimizer
  sees one flat partition (param group ``segments`` / ``num_segments`` + ``optimizer.norm_reducer``).
- OneBitAdam, OneBitLamb: 1-bit Adam / LAMB (DeepSpeed's OnebitAdam / OnebitLamb): a warm-up with
  the plain optimizer, then the momentum averaged over the data-parallel ranks with a 1-bit
  compressed all-reduce (`tachyon.parallel.compression`); ``reshard_onebit_state_dicts`` maps
  their checkpoints to another world size.
- ZeroOneAdam: 0/1 Adam (DeepSpeed's ZeroOneAdam): variance updates at exponentially spaced
  steps, then local steps synchronised with the 1-bit compressed all-reduce.
- SGD: torch.optim.SGD.
- build_optimizer(config.optimizer, params): from the ``optimizer`` config section.
"""

from torch.optim import SGD

from tachyon.engine.optim.adam import CPUAdam, FusedAdam
from tachyon.engine.optim.builder import OPTIMIZERS, build_optimizer
from tachyon.engine.optim.lamb import Lamb, NormReducer
from tachyon.engine.optim.onebit import OneBitOptimizer, reshard_onebit_state_dicts
from tachyon.engine.optim.onebit_adam import OneBitAdam
from tachyon.engine.optim.onebit_lamb import OneBitLamb
from tachyon.engine.optim.zero_one_adam import ZeroOneAdam

OnebitAdam = OneBitAdam
"""DeepSpeed's spelling (deepspeed.runtime.fp16.onebit.adam.OnebitAdam)."""
OnebitLamb = OneBitLamb
"""DeepSpeed's spelling (deepspeed.runtime.fp16.onebit.lamb.OnebitLamb)."""

__all__ = [
    "OPTIMIZERS", "SGD", "CPUAdam", "FusedAdam", "Lamb", "NormReducer", "OneBitAdam", "OneBitLamb", "OneBitOptimizer",
    "OnebitAdam", "OnebitLamb", "ZeroOneAdam", "build_optimizer", "reshard_onebit_state_dicts",
]
