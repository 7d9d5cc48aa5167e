"""The on-disk layout of one checkpoint, its manifest, and the checks a load starts with.

One checkpoint is one directory ``<save_dir>/<tag>/``::

    manifest.json            written last: every other file's size and sha256
    meta.json                counters, precision, param table, optimizer hyperparameters
    extra_state.pt           client_state and lr-scheduler state (read with weights_only=True)
    rng/rank_00000.pt ...    each rank's RNG states (read with weights_only=True)
    state/.metadata          torch.distributed.checkpoint (DCP) metadata
    state/__<rank>_0.distcp  DCP data: each rank's pieces of the logical tensors

A directory with that name only appears once everything in it, the manifest included, is on
disk (it is written as ``.tmp.<tag>.<nonce>`` and renamed), and ``<save_dir>/latest`` (the tag,
as DeepSpeed writes it) is replaced after that rename. A directory without a valid manifest,
a file whose size or checksum differs from the manifest, or a missing file is refused with a
`CheckpointError` naming the file.

DCP's ``.metadata`` is a pickle; it is read with `SafeFileSystemReader`, whose unpickler only
builds DCP's own metadata classes (and torch.Size / dtypes), and only after the manifest's
checksum of the file matched.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed import checkpoint as dcp

FORMAT = "tachyon-checkpoint"
VERSION = 2
"""2: parameters stored at their full shape as 2-D logical tensors (boxes.py); 1: flat (read too)."""
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
META = "meta.json"
EXTRA = "extra_state.pt"
STATE_DIR = "state"
RNG_DIR = "rng"
LATEST = "latest"
TMP_PREFIX = ".tmp."
OLD_PREFIX = ".old."
_CHUNK = 1 << 22


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not fit this engine."""


def rng_file(rank: int) -> str:
    return f"{RNG_DIR}/rank_{rank:05d}.pt"


def check_tag(tag: Any) -> str:
    """``tag`` as a directory name, or ValueError: a non-empty string without path separators
    that does not start with '.' and is not 'latest'."""
    if not isinstance(tag, str) or not tag or "/" in tag or "\\" in tag or tag.startswith(".") or tag == LATEST:
        raise ValueError(
            f"tag={tag!r} is not a valid checkpoint tag; use a non-empty name without '/' or '\\' that does "
            f"not start with '.' and is not {LATEST!r} (e.g. 'global_step100')"
        )
    return tag


# ---------------------------------------------------------------------- files
def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def describe_files(root: Path, relpaths: list[str]) -> dict[str, dict[str, Any]]:
    """{relpath: {"bytes", "sha256"}} for files under ``root``."""
    return {rel: {"bytes": (root / rel).stat().st_size, "sha256": sha256_of(root / rel)} for rel in relpaths}


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (directory entries: renames and new files)."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() and hasattr(os, "O_DIRECTORY") else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file, fsync and rename."""
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{secrets.token_hex(4)}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def torch_save_synced(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def torch_load_safe(path: Path) -> Any:
    """torch.load with weights_only=True (tensors, containers and primitives only)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"{path}: cannot be read as a weights-only torch file ({error})") from error


def list_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def write_manifest(root: Path, tag: str, world_size: int, files: dict[str, dict[str, Any]]) -> None:
    manifest = {"format": FORMAT, "version": VERSION, "tag": tag, "world_size": world_size, "files": files}
    write_atomic(root / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())


def publish(tmp_dir: Path, final_dir: Path) -> None:
    """Rename the finished ``tmp_dir`` to ``final_dir``. An existing ``final_dir`` (the same tag
    saved again) is first renamed aside to ``.old.<tag>.<nonce>`` and deleted afterwards."""
    fsync_path(tmp_dir)
    old = None
    if final_dir.exists():
        old = final_dir.with_name(f"{OLD_PREFIX}{final_dir.name}.{secrets.token_hex(4)}")
        os.replace(final_dir, old)
    os.replace(tmp_dir, final_dir)
    fsync_path(final_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_latest(save_dir: Path, tag: str) -> None:
    write_atomic(save_dir / LATEST, tag.encode())


def read_latest(load_dir: Path) -> str | None:
    path = load_dir / LATEST
    if not path.is_file():
        return None
    tag = path.read_text().strip()
    try:
        return check_tag(tag)
    except ValueError:
        raise CheckpointError(f"{path} holds {tag!r}, which is not a checkpoint tag") from None


def remove_stale(save_dir: Path) -> None:
    """Delete temporary directories of saves that were killed, and set-aside copies whose tag
    exists again (rank 0, before a save)."""
    for entry in save_dir.iterdir() if save_dir.is_dir() else []:
        if entry.name.startswith(TMP_PREFIX):
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        elif entry.name.startswith(OLD_PREFIX) and entry.is_dir():
            tag = entry.name[len(OLD_PREFIX):].rsplit(".", 1)[0]
            if (save_dir / tag / MANIFEST).is_file():
                shutil.rmtree(entry, ignore_errors=True)


# ---------------------------------------------------------------------- validation
def read_manifest(ckpt_dir: Path) -> dict[str, Any]:
    """The parsed manifest, or CheckpointError when it is missing or malformed."""
    path = ckpt_dir / MANIFEST
    if not ckpt_dir.is_dir():
        hint = ""
        aside = sorted(ckpt_dir.parent.glob(f"{OLD_PREFIX}{ckpt_dir.name}.*")) if ckpt_dir.parent.is_dir() else []
        if aside:
            hint = f"; a save of the same tag was interrupted and left the previous copy at {aside[0]}"
        raise CheckpointError(f"checkpoint directory {ckpt_dir} does not exist{hint}")
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: {ckpt_dir} is not a complete tachyon checkpoint (the manifest is written last)"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"{path} is not valid JSON ({error})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if manifest.get("format") != FORMAT or not isinstance(files, dict):
        raise CheckpointError(f"{path} is not a {FORMAT} manifest")
    if manifest.get("version") not in READABLE_VERSIONS:
        raise CheckpointError(f"{path}: format version {manifest.get('version')!r}; this tachyon reads "
                              f"{', '.join(map(str, READABLE_VERSIONS))}")
    for rel, entry in files.items():
        if (
            not isinstance(rel, str) or rel.startswith("/") or ".." in Path(rel).parts
            or not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int)
            or not isinstance(entry.get("sha256"), str)
        ):
            raise CheckpointError(f"{path}: malformed entry {rel!r}")
    for required in (META, EXTRA, f"{STATE_DIR}/.metadata"):
        if required not in files:
            raise CheckpointError(f"{path} does not list {required}")
    return manifest


def verify_files(ckpt_dir: Path, manifest: dict[str, Any], rank: int = 0, world_size: int = 1) -> str | None:
    """None when every file is present with its manifest size and this rank's share of the
    files (every ``world_size``-th by size, so the ranks together read each file once) has its
    manifest checksum; otherwise a message naming the first bad file. Every rank checks sizes
    of all files; call `agree` on the results before touching state."""
    files = manifest["files"]
    for rel in sorted(files):
        path = ckpt_dir / rel
        if not path.is_file():
            return f"{path} is missing (listed in {ckpt_dir / MANIFEST})"
        size = path.stat().st_size
        if size != files[rel]["bytes"]:
            return f"{path} has {size} bytes; the manifest says {files[rel]['bytes']} (truncated or overwritten)"
    by_size = sorted(files, key=lambda rel: (-files[rel]["bytes"], rel))
    for rel in by_size[rank::world_size]:
        if sha256_of(ckpt_dir / rel) != files[rel]["sha256"]:
            return f"{ckpt_dir / rel} is corrupted: its sha256 differs from the manifest's"
    return None


@contextlib.contextmanager
def quiet_dcp():
    """DCP warns that it runs without a process group (intended here: one process)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


# ---------------------------------------------------------------------- DCP reading without pickle
_DCP_MODULES = ("torch.distributed.checkpoint.metadata",)
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise CheckpointError(f"DCP metadata refers to {module}.{name}, which a checkpoint never needs; refusing to load it")


class SafeFileSystemReader(dcp.FileSystemReader):
    """A FileSystemReader whose ``.metadata`` unpickler builds only DCP metadata classes."""

    def read_metadata(self, *args: Any, **kwargs: Any):
        if kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        path = Path(self.path) / ".metadata"
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class TensorsOnlyLoadPlanner(dcp.DefaultLoadPlanner):
    """Refuses pickled (non-tensor) entries: the state we request holds only tensors (plain, or
    `tachyon.engine.checkpoint.boxes.Boxes` of a logical tensor)."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        from .boxes import Boxes

        # DCP's set-up replaces, in place, every value it does not know (a Boxes) by None
        boxes = {key: value for key, value in state_dict.items() if isinstance(value, Boxes)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(boxes)
        self.state_dict.update(boxes)

    def lookup_tensor(self, index) -> torch.Tensor:
        from .boxes import lookup_box

        found = lookup_box(self.state_dict, index)
        return found if found is not None else super().lookup_tensor(index)

    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object, not a tensor")
