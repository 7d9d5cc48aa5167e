"""Fixtures for the compat tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

UPSTREAM = Path(__file__).parent / "deepspeed_upstream"


def pytest_ignore_collect(collection_path, config):
    """DeepSpeed's vendored unit tests are collected only with ``-m deepspeed_upstream``."""
    path = Path(collection_path)
    if path == UPSTREAM or UPSTREAM in path.parents:
        return None if "deepspeed_upstream" in (config.getoption("markexpr", "") or "") else True
    return None


@pytest.fixture
def one_thread():
    """torch on one thread during the test (tiny tensors; the CI machine has two shared cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
