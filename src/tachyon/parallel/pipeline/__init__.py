"""Pipeline parallelism: DeepSpeed's PipelineModule / LayerSpec / TiedLayerSpec on torch.distributed.pipelining.

    net = PipelineModule(layers=[...], num_stages=2, loss_fn=loss_fn, partition_method="parameters")
    schedule = PipelineSchedule(net, micro_batches=8, schedule="1F1B")   # "GPipe", "interleaved_1F1B"
    loss = schedule.train_batch(data_iter)

- spec.py: LayerSpec, TiedLayerSpec. partition.py: partition methods ("parameters", "uniform",
  "type:<regex>"). module.py: PipelineModule, StageModule, tied weights. schedule.py:
  PipelineSchedule (train_batch / eval_batch).
"""

from tachyon.parallel.pipeline.module import PipelineModule, StageModule
from tachyon.parallel.pipeline.partition import partition_balanced, partition_layers, partition_uniform
from tachyon.parallel.pipeline.schedule import SCHEDULES, PipelineSchedule
from tachyon.parallel.pipeline.spec import LayerSpec, TiedLayerSpec

__all__ = [
    "SCHEDULES", "LayerSpec", "PipelineModule", "PipelineSchedule", "StageModule", "TiedLayerSpec", "partition_balanced",
    "partition_layers", "partition_uniform",
]
