"""tachyon's own ZeRO stages 0, 1 and 2 on torch.distributed collectives (no DDP, no FSDP).

`build_zero_strategy(stage, param_groups, ...)` returns the strategy object the Engine calls;
see `tachyon.engine.zero.stages` for the data flow, `shards.py` for who owns what, and
`memory.py` for the byte formulas and the live-storage count the benchmarks use.
"""

from .base import ZeroStrategy
from .buckets import Bucket, BucketScheduler, cut_buckets
from .comm import CollectiveError, DataParallelComm, Pending
from .layout import FlatParameters, GroupRegion, ParamSlot
from .memory import live_tensor_bytes, live_tensor_storages, model_state_bytes
from .shards import Shards
from .stages import STAGES, Stage0, Stage1, Stage2, build_zero_strategy

__all__ = [
    "STAGES", "Bucket", "BucketScheduler", "CollectiveError", "DataParallelComm", "FlatParameters",
    "GroupRegion", "ParamSlot", "Pending", "Shards", "Stage0", "Stage1", "Stage2", "ZeroStrategy",
    "build_zero_strategy", "cut_buckets", "live_tensor_bytes", "live_tensor_storages", "model_state_bytes",
]
