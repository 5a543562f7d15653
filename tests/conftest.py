"""Shared fixtures: tiny random-init models of several architectures, the zoo model."""

from __future__ import annotations

import os

import pytest
import torch

# Under pytest-xdist each worker has a core of its own; alone, the tests use up to two threads.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def pycoder():
    from specfx import zoo

    return zoo.load("pycoder")
