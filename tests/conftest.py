"""Shared fixtures: tiny random-init models of several architectures, the zoo model."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def pycoder():
    from specfx import zoo

    return zoo.load("pycoder")
