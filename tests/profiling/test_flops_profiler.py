"""The flops profiler's API (DeepSpeed's names and return values), the per-module tree and the
printed report, bad arguments, and the engine's ``flops_profiler`` section: the profile of
``profile_step`` is written with measured forward and backward counts (ZeRO's gradient hooks not
counted) and training goes on unchanged."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tachyon
from tachyon.profiling import FlopsProfiler, get_model_profile
from tachyon.profiling.report import number_to_string, params_to_string

IN, HID, OUT, ROWS = 16, 32, 8, 6


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HID), nn.GELU(), nn.Linear(HID, OUT))


FC1, ACT, FC2 = 2 * ROWS * IN * HID, ROWS * HID, 2 * ROWS * HID * OUT


def test_module_tree_is_inclusive_and_ignored_modules_count_in_their_parent():
    model = mlp()
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(ROWS, IN))
    prof.stop_profile()
    fc1, act, fc2 = (prof.module_stats(m) for m in model)
    assert (fc1.flops, act.flops, fc2.flops) == (FC1, ACT, FC2)
    assert (fc1.macs, act.macs, fc2.macs) == (FC1 // 2, 0, FC2 // 2)
    assert prof.get_total_flops() == FC1 + ACT + FC2 and prof.get_total_macs() == (FC1 + FC2) // 2
    assert all(s.calls == 1 and s.duration > 0 for s in (fc1, act, fc2))
    assert prof.get_total_duration() >= fc1.duration + act.duration + fc2.duration

    prof.start_profile(ignore_list=[nn.GELU])
    model(torch.randn(ROWS, IN))
    prof.stop_profile()
    assert prof.module_stats(model[1]) is None
    assert prof.get_total_flops() == FC1 + ACT + FC2


def test_counts_accumulate_over_forwards_until_stopped_and_reset_clears_them():
    model = mlp()
    prof = FlopsProfiler(model)
    prof.start_profile()
    with pytest.raises(RuntimeError, match="already started"):
        prof.start_profile()
    model(torch.randn(ROWS, IN))
    model(torch.randn(ROWS, IN))
    assert prof.get_total_flops() == 2 * (FC1 + ACT + FC2)
    prof.reset_profile()
    assert prof.get_total_flops() == 0
    model(torch.randn(ROWS, IN))
    prof.stop_profile()
    model(torch.randn(ROWS, IN))  # not counted any more
    assert prof.get_total_flops() == FC1 + ACT + FC2
    assert prof.get_total_flops(as_string=True) == number_to_string(FC1 + ACT + FC2)
    prof.end_profile()
    assert prof.get_total_flops() == 0 and not prof.started


def test_forward_ops_outside_the_model_are_reported_apart():
    model = mlp()
    prof = FlopsProfiler(model, count_backward=True)
    prof.start_profile()
    out = model(torch.randn(ROWS, IN))
    loss = (out * 2).sum()  # outside the model: mul + sum
    loss.backward()
    prof.stop_profile()
    assert prof.get_total_flops() == FC1 + ACT + FC2
    assert prof.outside_flops == 2 * ROWS * OUT
    # backward: 2 GEMMs per Linear except no input gradient for the first one (x needs no grad),
    # bias gradients, GELU backward (2 per element), and the mul's backward (1 per element)
    assert prof.get_total_backward_flops() == 2 * FC2 + FC1 + ROWS * (HID + OUT) + 2 * ACT + ROWS * OUT


def test_get_model_profile_returns_deepspeeds_strings_and_numbers(tmp_path, capsys):
    model = nn.Linear(512, 1024)
    assert get_model_profile(model, input_shape=(4, 512), print_profile=False) == ("4.19 M", "2.1 MMACs", "525.31 K")
    flops, macs, params = get_model_profile(model, args=[torch.randn(4, 512)], print_profile=False, as_string=False,
                                            warm_up=0)
    assert (flops, macs, params) == (2 * 4 * 512 * 1024, 4 * 512 * 1024, 512 * 1024 + 1024)
    get_model_profile(model, kwargs={"input": torch.randn(4, 512)}, module_depth=0, top_modules=1)
    printed = capsys.readouterr().out
    assert "tachyon flops profiler" in printed and "fwd MACs per rank:" in printed and "2.1 MMACs" in printed
    assert params_to_string(110.08e6) == "110.08 M" and params_to_string(1.5e9) == "1.5 B"


def test_print_model_profile_depth_top_modules_and_output_file(tmp_path):
    model = nn.Sequential(mlp(), nn.Sequential(nn.Linear(OUT, OUT), nn.ReLU()))
    prof = FlopsProfiler(model, peak_flops=1e12)
    prof.start_profile()
    model(torch.randn(ROWS, IN))
    prof.stop_profile()
    path = tmp_path / "profile.txt"
    prof.print_model_profile(profile_step=3, module_depth=1, top_modules=2, output_file=str(path))
    text = path.read_text()
    assert "Profile summary at step 3:" in text
    assert "peak FLOPS (given):" in text and "MFU:" in text
    assert "depth 1:" in text and "depth 2:" not in text
    assert "params      - {'Sequential': '" in text
    tree = text.split("Detailed profile per rank")[1]
    assert "  (0): Sequential:" in tree and "(1): Sequential:" in tree
    assert "(0): Linear" not in tree, "module_depth=1 must hide depth-2 modules"
    root = next(line for line in tree.splitlines() if line.startswith("Sequential:"))
    assert "100.00% params" in root and "100.00% FLOPs" in root and "100.00% latency" in root
    prof.print_model_profile(detailed=False, output_file=str(path))
    assert "Detailed profile" not in path.read_text()


@pytest.mark.parametrize("call, match", [
    (lambda: FlopsProfiler("model"), "model must be a torch.nn.Module"),
    (lambda: FlopsProfiler(nn.Linear(2, 2), recompute_fwd_factor=-1), "recompute_fwd_factor must be a number >= 0"),
    (lambda: FlopsProfiler(nn.Linear(2, 2), peak_flops=0), "peak_flops must be a positive number"),
    (lambda: FlopsProfiler(nn.Linear(2, 2)).start_profile(ignore_list=[int]), "ignore_list must hold nn.Module"),
    (lambda: FlopsProfiler(nn.Linear(2, 2)).print_model_profile(module_depth=-2), "module_depth must be an int >= -1"),
    (lambda: FlopsProfiler(nn.Linear(2, 2)).print_model_profile(top_modules=0), "top_modules must be an int >= 1"),
    (lambda: get_model_profile(nn.Linear(2, 2)), "give input_shape, or args and/or kwargs"),
    (lambda: get_model_profile(nn.Linear(2, 2), input_shape=(2, 2), args=[torch.ones(2, 2)]), "not both"),
    (lambda: get_model_profile(nn.Linear(2, 2), input_shape=(2, 0)), "input_shape must be a tuple of positive ints"),
    (lambda: get_model_profile(nn.Linear(2, 2), input_shape=(2, 2), warm_up=-1), "warm_up must be an int >= 0"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = mlp()

    def forward(self, x):
        return self.body(x)


def run(config: dict, steps: int = 4) -> tuple[list[float], tachyon.Engine]:
    engine, *_ = tachyon.initialize(model=Regressor(), config=config)
    losses = []
    for step in range(steps):
        for micro in range(engine.gradient_accumulation_steps()):
            gen = torch.Generator().manual_seed(10 * step + micro)
            loss = F.mse_loss(engine(torch.randn(ROWS, IN, generator=gen)), torch.randn(ROWS, OUT, generator=gen))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses, engine


@pytest.mark.parametrize("stage", [0, 2])
def test_engine_writes_the_profile_at_profile_step_and_training_goes_on(tmp_path, stage):
    base = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 100},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    path = tmp_path / "flops.txt"
    profiled = {**base, "flops_profiler": {"enabled": True, "profile_step": 2, "module_depth": 2,
                                           "output_file": str(path)}}
    losses, engine = run(profiled)
    plain_losses, _ = run(base)
    assert losses == plain_losses, "profiling must not change training"
    assert engine.global_steps == 4 and engine.telemetry.profiler is None
    text = path.read_text()
    assert "Profile summary at step 2:" in text and "bwd FLOPs per rank (counted)" in text
    assert "gradient accumulation steps:" in text and "iter latency:" in text and "MFU:" in text
    profile = engine.telemetry.flops_profile
    assert profile["step"] == 2
    micro_batches = 2
    assert profile["fwd_flops"] == micro_batches * (FC1 + ACT + FC2)
    assert profile["fwd_macs"] == micro_batches * (FC1 + FC2) // 2
    # the backward counts the model's gradient math only, not ZeRO's accumulation / reduction hooks;
    # mse_loss's own backward kernel has no formula (0); the engine's loss / gradient_accumulation_steps
    # adds one division per micro-batch
    assert profile["bwd_flops"] == micro_batches * (2 * FC2 + FC1 + ROWS * (HID + OUT) + 2 * ACT + 1)
    assert profile["timings"].iteration_s > profile["timings"].backward_s > 0


def test_engine_profile_without_output_file_goes_to_the_step_printer(capsys):
    config = {"train_micro_batch_size_per_gpu": ROWS, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
              "flops_profiler": {"enabled": True, "profile_step": 0, "detailed": False}}
    _, engine = run(config, steps=2)
    out = capsys.readouterr().out
    assert out.count("Profile summary at step 0:") == 1 and "Detailed profile" not in out
    assert engine.telemetry.flops_profile["fwd_flops"] == FC1 + ACT + FC2


def test_a_container_never_called_reports_its_childrens_sum(tmp_path):
    class Looped(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(IN, IN), nn.Linear(IN, IN)])

        def forward(self, x):
            for block in self.blocks:  # the ModuleList itself is never called
                x = block(x)
            return x

    model = Looped()
    prof = FlopsProfiler(model)
    prof.start_profile()
    model(torch.randn(ROWS, IN))
    prof.stop_profile()
    path = tmp_path / "p.txt"
    prof.print_model_profile(output_file=str(path))
    line = next(line for line in path.read_text().splitlines() if "(blocks): ModuleList" in line)
    assert f"{number_to_string(2 * 2 * ROWS * IN * IN)}FLOPs = 100.00% FLOPs" in line


def test_engine_profile_of_deepspeeds_test_model_is_deepspeeds_count():
    """DeepSpeed's tests/unit/profiling/flops_profiler: Linear(10, 10) + CrossEntropyLoss inside the
    model's forward, batch 1: 200 FLOPs (the GEMM; the loss counts 0 as in DeepSpeed) and 110
    parameters, read from engine.flops_profiler after the profiled step."""
    import tachyon.compat.deepspeed as deepspeed

    class SimpleModel(torch.nn.Module):
        def __init__(self, hidden):
            super().__init__()
            self.linears = torch.nn.ModuleList([torch.nn.Linear(hidden, hidden)])
            self.cross_entropy_loss = torch.nn.CrossEntropyLoss()

        def forward(self, x, y):
            return self.cross_entropy_loss(self.linears[0](x), y)

    config = {"train_batch_size": 1, "steps_per_print": 100, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
              "flops_profiler": {"enabled": True, "step": 1, "module_depth": -1, "top_modules": 3,
                                 "output_file": os.devnull}}
    engine, *_ = deepspeed.initialize(config=config, model=SimpleModel(10))
    for _ in range(3):
        engine.backward(engine(torch.randn(1, 10), torch.randint(0, 10, (1,))))
        engine.step()
    assert engine.flops_profiler.flops == 200 and engine.flops_profiler.params == 110
