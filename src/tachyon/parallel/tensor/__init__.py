"""Tensor (Megatron-style) and sequence parallelism, applied to models from outside.

    tachyon.parallel.tensor.parallelize(model, mesh, sequence_parallel=True)

- `parallelize` (parallelize.py): shards every tachyon.nn.TransformerLayer and the planned
  embeddings / heads of a finished model in place.
- `ColumnParallelLinear`, `RowParallelLinear`, `VocabParallelEmbedding`,
  `vocab_parallel_cross_entropy` (layers.py): Megatron's layers, for models written with them.
- `fused` (fused.py): the tensor-parallel forms of LayerNormLinear, LayerNormMLP,
  MultiheadAttention and TransformerLayer.
- `comm` (comm.py): the collectives as autograd functions; `shard` (shard.py): ShardSpec,
  full_state_dict / shard_state_dict; `rng` (rng.py): per-rank dropout streams.
"""

from tachyon.parallel.tensor.comm import TPGroup, tp_group
from tachyon.parallel.tensor.layers import (
    ColumnParallelLinear, ColumnParallelTorchLinear, RowParallelLinear, RowParallelTorchLinear, VocabParallelEmbedding,
    to_column_parallel, to_row_parallel, to_vocab_parallel, vocab_parallel_cross_entropy,
)
from tachyon.parallel.tensor.parallelize import STYLES, check_parallelizable, default_plan, parallelize
from tachyon.parallel.tensor.shard import ShardSpec, full_state_dict, shard_spec, shard_state_dict

__all__ = [
    "STYLES", "ColumnParallelLinear", "ColumnParallelTorchLinear", "RowParallelLinear", "RowParallelTorchLinear",
    "ShardSpec", "TPGroup", "VocabParallelEmbedding", "check_parallelizable", "default_plan", "full_state_dict", "parallelize", "shard_spec",
    "shard_state_dict", "to_column_parallel", "to_row_parallel", "to_vocab_parallel", "tp_group",
    "vocab_parallel_cross_entropy",
]
