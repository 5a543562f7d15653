"""Peak memory of a region: CUDA allocator peak on GPU, sampled resident set size on CPU."""

from __future__ import annotations

import os
import threading

import torch

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


class PeakMemory:
    """Context manager: `.peak_bytes` is the CUDA peak allocation, or the process RSS peak
    sampled every `interval` seconds on CPU (RSS includes weights and the Python heap)."""

    def __init__(self, device: torch.device, interval: float = 0.005):
        self.device, self.interval, self.peak_bytes = torch.device(device), interval, 0
        self._stop = threading.Event()

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.peak_bytes = rss_bytes()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(self.interval):
            self.peak_bytes = max(self.peak_bytes, rss_bytes())

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            self._stop.set()
            self._thread.join()
            self.peak_bytes = max(self.peak_bytes, rss_bytes())
        return False
