"""Distributed start-up, launcher, (later) tensor/pipeline parallelism. Modules in tachyon.nn never import this.

- `tachyon.parallel.distributed`: init_distributed (torchrun / OpenMPI / SLURM environments), the
  stored process-group timeout and `new_group` that always passes it, get_rank/get_world_size/get_local_rank,
  `shutdown_distributed` (barrier, then every group destroyed; run at exit after init_distributed).
- `tachyon.parallel.launch`: ``tachyon launch``, which builds and runs a torchrun command.
"""
