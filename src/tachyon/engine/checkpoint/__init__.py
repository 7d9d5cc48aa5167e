"""Engine checkpoints on torch.distributed.checkpoint: atomic, validated on every rank before
any state changes, loadable with any world size and ZeRO stage, exportable as one state_dict.

    engine.save_checkpoint("ckpt", client_state={"epoch": 3})      # ckpt/global_step<N>/, ckpt/latest
    path, client_state = engine.load_checkpoint("ckpt")            # any number of ranks
    state = export_model_state_dict("ckpt")                        # fp32, offline, one process
    save_16bit_model(engine, "hf_out/")                            # model.safetensors + config.json

See docs/checkpoints.md for the layout on disk and the protocols.
"""

from .export import consolidated_state_dict, export_checkpoint, export_model_state_dict, save_16bit_model
from .load import load_checkpoint
from .manifest import CheckpointError
from .save import save_checkpoint

__all__ = ["CheckpointError", "consolidated_state_dict", "export_checkpoint", "export_model_state_dict", "load_checkpoint", "save_16bit_model", "save_checkpoint"]
