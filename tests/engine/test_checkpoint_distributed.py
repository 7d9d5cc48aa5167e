"""Checkpoints across gloo ranks: resharding N -> M (ZeRO 0/1/2), a save killed with SIGKILL
half-way, corrupted and truncated files refused by every rank with nothing changed, resume
from step k reaching step 2k bit-identical to an uninterrupted run, tag validation,
node-local storage on one node.

Four rank launches in all (spawning is the cost): 2 ranks train and save; 2 ranks are killed
mid-save; 2 ranks meet the corrupted copies and resume; 4 ranks load the 2-rank checkpoints.
The 1-process loads run in the test process itself.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.engine.zero_cases import IN, OUT, make_model
from tests.utils import RankFailure, assert_close, run_distributed

pytestmark = pytest.mark.distributed

GLOBAL_BATCH, K = 4, 3
"""Rows per step (every world size sees the same ones); checkpoint at step K, train to 2K."""


# ---------------------------------------------------------------------- rank side
def _rank_world():
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def make_engine(stage: int):
    import tachyon

    _, world = _rank_world()
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world,
        "train_batch_size": GLOBAL_BATCH,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 40, "allgather_bucket_size": 50},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "checkpoint": {"tag_validation": "Fail"},
    }
    engine, _, _, _ = tachyon.initialize(model=make_model(), config=config)
    return engine


def train(engine, until: int) -> list[float]:
    """Steps engine.global_steps .. until-1 on this rank's rows of each step's global batch;
    returns each step's loss averaged over the ranks (the global batch's loss)."""
    import torch.distributed as dist

    rank, world = _rank_world()
    losses = []
    while engine.global_steps < until:
        gen = torch.Generator().manual_seed(7000 + engine.global_steps)
        x, y = torch.randn(GLOBAL_BATCH, IN, generator=gen), torch.randn(GLOBAL_BATCH, OUT, generator=gen)
        rows = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        loss = F.mse_loss(engine(x[rows]), y[rows])
        engine.backward(loss)
        engine.step()
        total = loss.detach().reshape(1).clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def snapshot(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def save_runs(root: str) -> dict:
    """2 ranks: for each stage train K steps, save, train to 2K. Also a tag mismatch."""
    rank, _ = _rank_world()
    out = {}
    for stage in (2, 1, 0):
        engine = make_engine(stage)
        train(engine, K)
        engine.save_checkpoint(f"{root}/stage{stage}", client_state={"epoch": 1, "seen": torch.arange(3)})
        losses = train(engine, 2 * K)
        out[stage] = {"losses": losses, "params": [p.tolist() for p in snapshot(engine)]}
    try:
        engine.save_checkpoint(f"{root}/mismatch", tag=f"rank{rank}")
        out["mismatch"] = "saved"
    except ValueError as error:
        out["mismatch"] = str(error)
    out["mismatch_dir"] = os.path.exists(f"{root}/mismatch")
    engine.config.checkpoint.tag_validation = "Warn"  # logs, then every rank uses rank 0's tag
    out["warn_saved"] = engine.save_checkpoint(f"{root}/warned", tag=f"rank{rank}")
    engine.config.checkpoint.use_node_local_storage = True  # one node: its disk is every rank's
    out["node_local"] = engine.load_checkpoint(f"{root}/warned")[0]
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # as if each rank were on its own node
    try:
        engine.save_checkpoint(f"{root}/two_nodes")
    except ValueError as error:
        out["two_nodes"] = str(error)
    return out


def killed_run(root: str, markers: str) -> None:
    """Save at step K, train to 2K, then pause inside the next save (every file of this rank
    written, no manifest yet) until the parent kills the rank."""
    from tachyon.engine.checkpoint import save as save_module

    rank, _ = _rank_world()
    engine = make_engine(2)
    train(engine, K)
    engine.save_checkpoint(root)
    train(engine, 2 * K)

    def pause(stage: str) -> None:
        if stage == "written":
            Path(markers, f"rank{rank}").write_text(str(os.getpid()))
            time.sleep(120)

    save_module._PAUSE_HOOK = pause
    engine.save_checkpoint(root)
    raise AssertionError("the save should have been killed")


def refuse_then_resume(root: str, bad_roots: list[str]) -> dict:
    """Bad checkpoints are refused on every rank with nothing changed; then resume from
    ``root``'s latest (step K) and train to 2K; then save again (cleans the killed save)."""
    from tachyon.engine.checkpoint import CheckpointError

    engine = make_engine(2)
    train(engine, 1)
    before = snapshot(engine)
    state_before = {k: v.clone() for k, v in engine.optimizer.state[engine.zero.masters[0]].items()}
    errors = []
    for bad in bad_roots:
        try:
            engine.load_checkpoint(bad)
            errors.append(None)
        except CheckpointError as error:
            errors.append(str(error))
    unchanged = all(torch.equal(a, b) for a, b in zip(before, snapshot(engine)))
    state_after = engine.optimizer.state[engine.zero.masters[0]]
    unchanged &= all(torch.equal(v, state_after[k]) for k, v in state_before.items())
    unchanged &= engine.global_steps == 1 and engine.lr_scheduler.last_batch_iteration == 0
    path, client = engine.load_checkpoint(root)
    resumed_at = engine.global_steps
    losses = train(engine, 2 * K)
    engine.save_checkpoint(root)
    return {
        "errors": errors, "unchanged": unchanged, "path": path, "client": client, "resumed_at": resumed_at,
        "losses": losses, "params": [p.tolist() for p in snapshot(engine)],
    }


def load_runs(root: str, plan: list[tuple[int, str]]) -> dict:
    """For each (stage, checkpoint): a fresh engine of ``stage`` loads it and trains to 2K."""
    out = {}
    for stage, name in plan:
        engine = make_engine(stage)
        _, client = engine.load_checkpoint(f"{root}/{name}")
        out[(stage, name)] = {
            "losses": train(engine, 2 * K), "params": [p.tolist() for p in snapshot(engine)],
            "client_epoch": client["epoch"], "steps": engine.global_steps,
        }
    return out


# ---------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    results = run_distributed(save_runs, 2, str(root), timeout=300)
    yield root, results
    torch.set_num_threads(threads)


def _close(actual: dict, expected: dict, what: str) -> None:
    assert_close(torch.tensor(actual["losses"]), torch.tensor(expected["losses"]), name=f"{what}: losses")
    for i, (a, e) in enumerate(zip(actual["params"], expected["params"])):
        assert_close(torch.tensor(a), torch.tensor(e), name=f"{what}: parameter {i}")


def test_checkpoint_layout_and_tag_validation(saved):
    root, results = saved
    ckpt = root / "stage2"
    assert (ckpt / "latest").read_text() == f"global_step{K}"
    files = sorted(str(p.relative_to(ckpt / f"global_step{K}")) for p in (ckpt / f"global_step{K}").rglob("*") if p.is_file())
    assert files == [
        "extra_state.pt", "manifest.json", "meta.json", "rng/rank_00000.pt", "rng/rank_00001.pt",
        "state/.metadata", "state/__0_0.distcp", "state/__1_0.distcp",
    ]
    assert not [p for p in ckpt.iterdir() if p.name.startswith(".tmp")]
    for rank_result in results:
        assert "ranks use different tags ['rank0', 'rank1']" in rank_result["mismatch"]
        assert not rank_result["mismatch_dir"], "a refused save must not create its directory"
        assert rank_result["warn_saved"] is True and (root / "warned" / "rank0" / "manifest.json").is_file()
        assert rank_result["node_local"] == str(root / "warned" / "rank0")
        assert "use_node_local_storage: true is supported only when all ranks run on one node" in rank_result["two_nodes"]
    assert not (root / "two_nodes").exists()


@pytest.mark.parametrize("stage", [2, 1, 0])
def test_ranks_agree_after_save(saved, stage):
    _, results = saved
    assert results[0][stage] == results[1][stage]


def test_reshard_to_one_process(saved):
    """Stage 2 and stage 1 checkpoints of 2 ranks continue in one process like on 2 ranks."""
    root, results = saved
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for stage in (2, 1):
            engine = make_engine(stage)
            path, client = engine.load_checkpoint(root / f"stage{stage}")
            assert path == str(root / f"stage{stage}" / f"global_step{K}")
            assert client["epoch"] == 1 and torch.equal(client["seen"], torch.arange(3))
            assert engine.global_steps == K and engine.lr_scheduler.last_batch_iteration == K - 1
            got = {"losses": train(engine, 2 * K), "params": [p.tolist() for p in snapshot(engine)]}
            _close(got, results[0][stage], f"stage {stage}: 2 ranks -> 1 process")
    finally:
        torch.set_num_threads(threads)


def test_reshard_to_four_ranks(saved):
    """Stage 2 (into stage 2 and stage 1) and stage 0 checkpoints of 2 ranks continue on 4."""
    root, results = saved
    plan = [(2, "stage2"), (1, "stage2"), (0, "stage0")]
    runs = run_distributed(load_runs, 4, str(root), plan, timeout=300)
    for stage, name in plan:
        expected = results[0][int(name[-1])]
        for rank, run in enumerate(runs):
            assert run[(stage, name)]["steps"] == 2 * K and run[(stage, name)]["client_epoch"] == 1
            _close(run[(stage, name)], expected, f"{name} loaded into stage {stage} on 4 ranks (rank {rank})")


def _kill_when_paused(markers: Path, world: int, deadline_s: float, killed: list) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        files = list(markers.glob("rank*"))
        if len(files) == world and all(f.read_text() for f in files):
            for f in files:
                pid = int(f.read_text())
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            return
        time.sleep(0.1)


def _flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_killed_save_keeps_previous_checkpoint_and_bad_files_are_refused(saved, tmp_path):
    _, results = saved
    root, markers = tmp_path / "run", tmp_path / "markers"
    markers.mkdir()
    killed: list[int] = []
    killer = threading.Thread(target=_kill_when_paused, args=(markers, 2, 240, killed), daemon=True)
    killer.start()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.raises(RankFailure, match="exited with code -9"):
            run_distributed(killed_run, 2, str(root), str(markers), timeout=300)
        killer.join()
        assert len(killed) == 2
        # the killed save left only a temporary directory; latest still names step K
        assert (root / "latest").read_text() == f"global_step{K}"
        assert not (root / f"global_step{2 * K}").exists()
        partial = [p for p in root.iterdir() if p.name.startswith(f".tmp.global_step{2 * K}.")]
        assert len(partial) == 1 and not (partial[0] / "manifest.json").exists()
        assert (partial[0] / "state" / ".metadata").exists(), "the pause came after every rank wrote its data"

        good = root / f"global_step{K}"
        corrupt, truncated = tmp_path / "corrupt", tmp_path / "truncated"
        for copy in (corrupt, truncated):
            shutil.copytree(good, copy / f"global_step{K}")
            (copy / "latest").write_text(f"global_step{K}")
        _flip_byte(corrupt / f"global_step{K}" / "state" / "__1_0.distcp", 100)
        victim = truncated / f"global_step{K}" / "state" / "__0_0.distcp"
        victim.write_bytes(victim.read_bytes()[:-10])
        listing = sorted(p.name for p in corrupt.rglob("*"))

        runs = run_distributed(refuse_then_resume, 2, str(root), [str(corrupt), str(truncated)], timeout=300)
    finally:
        torch.set_num_threads(threads)
    for rank, run in enumerate(runs):
        corrupt_error, truncated_error = run["errors"]
        assert corrupt_error is not None and "__1_0.distcp is corrupted" in corrupt_error, corrupt_error
        assert truncated_error is not None and "__0_0.distcp has" in truncated_error and "truncated" in truncated_error
        assert run["unchanged"], f"rank {rank} changed state while refusing a bad checkpoint"
        assert run["path"] == str(good) and run["resumed_at"] == K and run["client"] == {}
        # resumed at K, reached 2K: identical to the uninterrupted 2-rank stage-2 run
        expected = results[0][2]
        assert run["losses"] == expected["losses"]
        for i, (a, e) in enumerate(zip(run["params"], expected["params"])):
            assert torch.equal(torch.tensor(a), torch.tensor(e)), f"parameter {i} differs after resuming"
    assert sorted(p.name for p in corrupt.rglob("*")) == listing, "a refused load must not write"
    assert (root / "latest").read_text() == f"global_step{2 * K}"
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp")], "the next save removes the killed one's leftovers"
