"""PeakMemory on CPU: the process's peak RSS over a region, nested regions included."""

from __future__ import annotations

import torch

from specfx.runtime.memory import PeakMemory

MB = 2**20


def test_peak_covers_a_freed_allocation_and_nested_regions():
    with PeakMemory("cpu") as outer:
        x = torch.ones(300 * MB // 4)
        x.add_(1)
        del x
        with PeakMemory("cpu") as inner:
            y = torch.ones(100 * MB // 4)
            y.add_(1)
            del y
    assert outer.peak_bytes - inner.peak_bytes > 150 * MB     # the outer region saw the 300 MB
    assert inner.peak_bytes > 100 * MB
