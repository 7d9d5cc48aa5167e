"""Fixtures for the planner tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """torch on one thread during the test (tiny tensors; the CI machine has two shared cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
