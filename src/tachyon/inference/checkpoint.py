"""``checkpoint=`` for init_inference, and the per-rank shards ``save_mp_checkpoint_path`` writes.

Accepted forms (all load before injection into the HF model, by HF's parameter names, except the
pre-sharded form):

- a tachyon training checkpoint directory (a ``manifest.json`` or a ``latest`` file): its
  consolidated weights, as ``tachyon.engine.checkpoint.export_model_state_dict`` rebuilds them;
- an HF directory (``model.safetensors``, ``model.safetensors.index.json`` shards or
  ``pytorch_model.bin``) or one ``.safetensors`` / ``.bin`` / ``.pt`` file;
- DeepSpeed's checkpoint JSON (a dict, or a path to a ``.json`` file)::

      {"type": "ds_model", "version": 1.0, "checkpoints": ["part-1.safetensors", "part-2.safetensors"]}

  whose files together hold the full state dict (``base_dir`` or the JSON's folder prefixes them);
- the pre-sharded form ``save_mp_checkpoint_path`` writes (``"type": "tachyon-tp"``): each rank's
  injected module as it was built (sliced, possibly INT8), loaded straight into the engine, with
  the same tp_size, dtype and quantization it was saved with (checked).

Weights must match the model exactly: missing keys (other than tied ones), unexpected keys and
shape mismatches raise, naming them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

SHARDED_TYPE = "tachyon-tp"
CONFIG_NAME = "ds_inference_config.json"
FULL_TYPES = ("ds_model", "hf", "tachyon")


def _read_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def _hf_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / f for f in files]
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (folder / name).is_file():
            return [folder / name]
    return []


def load_state_dict_exact(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load ``state`` into ``model`` by name; only tied parameters may be missing."""
    own = model.state_dict()
    unexpected = sorted(set(state) - set(own))
    missing = set(own) - set(state)
    loaded_ptrs = {own[k].data_ptr() for k in state if k in own}
    missing = sorted(k for k in missing if own[k].data_ptr() not in loaded_ptrs)  # tied to a loaded tensor
    bad_shapes = [f"{k}: {tuple(v.shape)} vs the model's {tuple(own[k].shape)}" for k, v in state.items()
                  if k in own and tuple(v.shape) != tuple(own[k].shape)]
    if unexpected or missing or bad_shapes:
        parts = []
        if missing:
            parts.append(f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        if bad_shapes:
            parts.append(f"shape mismatches {bad_shapes[:4]}")
        raise ValueError(f"checkpoint {source} does not match {type(model).__name__}: {'; '.join(parts)}")
    model.load_state_dict(state, strict=False)


def _from_json(spec: dict[str, Any], base: Path) -> tuple[str, list[Path], dict[str, Any]]:
    kind = spec.get("type")
    files = spec.get("checkpoints")
    if kind not in FULL_TYPES + (SHARDED_TYPE,):
        raise ValueError(f"checkpoint json: type={kind!r} is not supported; allowed: {', '.join(FULL_TYPES)} (full "
                         f"state dicts in 'checkpoints') and {SHARDED_TYPE!r} (written by save_mp_checkpoint_path)")
    if isinstance(files, dict):
        files = files.get("tp", []) + files.get("non_tp", []) if kind == SHARDED_TYPE else files.get("non_tp", [])
    if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
        raise ValueError(f"checkpoint json: 'checkpoints' must be a non-empty list of file names; got {files!r}")
    root = Path(spec.get("base_dir") or base)
    return kind, [root / f for f in files], spec


def _resolve(checkpoint: Any, base_dir: str | None) -> tuple[str, list[Path], dict[str, Any]]:
    """(type, files, json spec) of a checkpoint argument."""
    base = Path(base_dir) if base_dir else Path(".")
    if isinstance(checkpoint, dict):
        return _from_json(checkpoint, base)
    if not isinstance(checkpoint, (str, os.PathLike)):
        raise ValueError(f"checkpoint must be a path or DeepSpeed's checkpoint json dict; got {type(checkpoint).__name__}")
    path = Path(checkpoint)
    if not path.is_absolute() and base_dir:
        path = base / path
    if path.is_dir():
        if (path / "manifest.json").is_file() or (path / "latest").is_file():
            return "tachyon", [path], {}
        if (path / CONFIG_NAME).is_file():
            return _from_json(json.loads((path / CONFIG_NAME).read_text()), path)
        files = _hf_files(path)
        if not files:
            raise ValueError(f"checkpoint {path}: no tachyon manifest, {CONFIG_NAME}, model.safetensors(.index.json) "
                             "or pytorch_model.bin in it")
        return "hf", files, {}
    if path.suffix == ".json" and path.is_file():
        return _from_json(json.loads(path.read_text()), path.parent)
    if path.is_file():
        return "hf", [path], {}
    raise ValueError(f"checkpoint {path} does not exist")


def load_checkpoint(model: nn.Module, cfg: Any, rank: int) -> Callable[[Any], None] | None:
    """Load a full checkpoint into ``model`` now; for a pre-sharded one return the function that
    loads this rank's shard into the built engine (after its checks)."""
    if cfg.checkpoint is None:
        return None
    kind, files, spec = _resolve(cfg.checkpoint, cfg.base_dir)
    if kind == SHARDED_TYPE:
        return _sharded_loader(files, spec, cfg, rank)
    if kind == "tachyon" and files[0].is_dir():
        from tachyon.engine.checkpoint.export import export_model_state_dict

        state = export_model_state_dict(files[0])
    else:
        state = {}
        for f in files:
            if not f.is_file():
                raise ValueError(f"checkpoint file {f} does not exist")
            state.update(_read_file(f))
    load_state_dict_exact(model, state, str(cfg.checkpoint))
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _sharded_loader(files: list[Path], spec: dict[str, Any], cfg: Any, rank: int) -> Callable[[Any], None]:
    saved_tp = spec.get("tp_size")
    if saved_tp != cfg.tp_size or len(files) != cfg.tp_size:
        raise ValueError(f"the pre-sharded checkpoint was saved for tp_size={saved_tp} ({len(files)} files) but "
                         f"tensor_parallel.tp_size={cfg.tp_size}; load the full checkpoint to reshard")
    expected = {"dtype": _dtype_name(cfg.dtype), "quant": _quant_spec(cfg)}
    for key, value in expected.items():
        if spec.get(key) != value:
            raise ValueError(f"the pre-sharded checkpoint has {key}={spec.get(key)!r}; this init_inference asks for "
                             f"{value!r} (a shard is loaded as it was built)")

    def load(engine: Any) -> None:
        state = torch.load(files[rank], map_location=next(engine.module.parameters()).device, weights_only=True)
        load_state_dict_exact(engine.module, state, str(files[rank]))

    return load


def _quant_spec(cfg: Any) -> dict[str, Any] | None:
    q = cfg.quant
    return None if q is None else {"num_bits": q.num_bits, "group_size": q.group_size, "q_groups": q.q_groups}


def save_tp_checkpoint(engine: Any, path: Any, rank: int) -> None:
    """Write this rank's injected module to ``path/tp_XX.pt``; rank 0 writes the json that
    ``checkpoint=path`` (or the json itself) loads back."""
    cfg = engine.config
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    files = [f"tp_{r:02d}.pt" for r in range(cfg.tp_size)]
    state = {k: v.detach().cpu() for k, v in engine.module.state_dict().items()}
    torch.save(state, folder / files[rank])
    if rank == 0:
        spec = {"type": SHARDED_TYPE, "version": 1.0, "parallelization": "tp", "tp_size": cfg.tp_size,
                "checkpoints": {"tp": files, "non_tp": []}, "dtype": _dtype_name(cfg.dtype), "quant": _quant_spec(cfg),
                "model_kind": engine.kind, "policy": engine.policy}
        (folder / CONFIG_NAME).write_text(json.dumps(spec, indent=2))
    if engine.tp_group is not None:
        dist.barrier(group=engine.tp_group)


__all__ = ["CONFIG_NAME", "load_checkpoint", "load_state_dict_exact", "save_tp_checkpoint"]
