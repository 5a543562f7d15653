"""PeakMemory on CPU: the process's peak RSS over a region, nested regions included; huge pages
for the memory a compiled step reads."""

from __future__ import annotations

import platform
import re
import sys

import pytest
import torch

from specfx.runtime import memory
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


def _huge_bytes(t: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds t's first byte (/proc/self/smaps)."""
    inside, total = False, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= t.data_ptr() < int(m.group(2), 16)
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1]) * 1024
    return total


@pytest.mark.skipif(not sys.platform.startswith("linux") or
                    tuple(map(int, re.findall(r"\d+", platform.release())[:2])) < (6, 1),
                    reason="MADV_COLLAPSE needs Linux 6.1 or later")
def test_huge_pages_back_a_tensor_with_2mb_pages_in_place(monkeypatch):
    """`huge_pages` collapses the 2 MB ranges a tensor's storage covers, leaving its address and
    values; `$SPECFX_HUGE_PAGES=0` leaves them alone."""
    t = memory.small_pages(12 << 20).view(torch.float32)                            # a mapping of its own
    t.copy_(torch.arange(3 << 20, dtype=torch.float32))
    ptr, before = t.data_ptr(), _huge_bytes(t)
    assert before == 0
    monkeypatch.setenv(memory.HUGE_PAGES_ENV, "0")
    assert memory.huge_pages([t]) == 0 and _huge_bytes(t) == before
    monkeypatch.delenv(memory.HUGE_PAGES_ENV)
    collapsed = memory.huge_pages([t, torch.zeros(0), "not a tensor"])
    assert collapsed >= 5 and _huge_bytes(t) >= 10 << 20
    assert t.data_ptr() == ptr and torch.equal(t, torch.arange(3 << 20, dtype=torch.float32))


def test_a_compiled_cpu_graph_backs_its_weights_with_huge_pages(monkeypatch):
    """An Inductor graph on the CPU hands its parameters, buffers and inputs to `huge_pages` when
    it is first called (and not again)."""
    from specfx.runtime import compile as rc

    seen = []
    monkeypatch.setattr(rc, "huge_pages", lambda ts: seen.append([t for t in ts if isinstance(t, torch.Tensor)]))
    lin = torch.nn.Linear(8, 8)
    gm = torch.fx.symbolic_trace(lin)
    graph = rc.compile_graph(gm, "inductor")
    x = torch.randn(2, 8)
    torch.testing.assert_close(graph(x), lin(x))
    graph(x)
    assert len(seen) == 1 and {id(t) for t in seen[0]} >= {id(lin.weight), id(lin.bias), id(x)}


def test_the_roofline_reads_its_flat_probe_from_huge_pages(monkeypatch):
    """The roofline's flat buffer (the probes that read the weights' bytes as one stream) goes to
    `huge_pages` when it is made, before any probe reads it: the steps' weights are in 2 MB pages,
    and a first read in 4 KB pages would understate the machine's stream."""
    import specfx.matmul_choice as mc
    from specfx import roofline

    seen = []
    monkeypatch.setattr(memory, "huge_pages", lambda ts: seen.extend(ts))
    monkeypatch.setattr(mc, "chains", lambda weights, rows: {})               # no per-linear probes
    monkeypatch.setattr(torch._inductor, "compile", lambda gm, args: gm)     # the flat sum, eager
    weights = [torch.randn(256, 64), torch.randn(64, 256)]
    calls = roofline.probes(weights)
    assert "flat sum" in calls and len(seen) == 1
    assert seen[0].numel() == sum(w.numel() for w in weights) and seen[0].dtype == torch.float32
