"""Peak memory of a region: CUDA allocator peak on GPU, peak resident set size on CPU."""

from __future__ import annotations

import os
import re

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


def _reset_rss_peak() -> bool:
    """Reset the kernel's high-water mark of this process's RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _rss_peak_bytes() -> int:
    """The kernel's high-water mark of this process's RSS (VmHWM), 0 where unavailable."""
    try:
        with open("/proc/self/status") as f:
            m = re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.MULTILINE)
        return int(m.group(1)) * 1024 if m else 0
    except OSError:
        return 0


class PeakMemory:
    """Context manager: `.peak_bytes` is the CUDA peak allocation, or on CPU the process's peak
    RSS over the region (the kernel's high-water mark, reset on entry; RSS includes weights and
    the Python heap). No sampling thread: a thread waking every few ms would take the GIL from
    the loop it measures. Where the mark cannot be reset, the larger RSS of entry and exit."""

    def __init__(self, device: torch.device):
        self.device, self.peak_bytes = torch.device(device), 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _fold_peak_into_open_regions()          # an enclosing region keeps what came before
            self._tracked = _reset_rss_peak()
            self.peak_bytes = rss_bytes()
            _OPEN.append(self)
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            _fold_peak_into_open_regions()
            _OPEN.remove(self)
        return False


_OPEN: list[PeakMemory] = []      # CPU regions entered and not yet left (they may nest)


def _fold_peak_into_open_regions() -> None:
    rss, peak = rss_bytes(), _rss_peak_bytes()
    for region in _OPEN:
        region.peak_bytes = max(region.peak_bytes, rss, peak if region._tracked else 0)
