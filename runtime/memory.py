"""Peak memory of a region: CUDA allocator peak on GPU, peak resident set size on CPU; and the
CPU memory a step reads backed by 2 MB pages (`huge_pages`)."""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import re
import sys

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


HUGE_PAGE = 2 << 20
HUGE_PAGES_ENV = "SPECFX_HUGE_PAGES"        # "0": leave the pages as they are
MADV_HUGEPAGE, MADV_NOHUGEPAGE, MADV_COLLAPSE = 14, 15, 25     # Linux; MADV_COLLAPSE since 6.1


def huge_pages(tensors) -> int:
    """Back the CPU memory of `tensors` (their whole storages) with 2 MB pages, in place: each
    2 MB range they touch is marked for transparent huge pages and collapsed into one now
    (`madvise` MADV_HUGEPAGE, then MADV_COLLAPSE). Contents, addresses and the tensors stay what
    they were; a range the kernel will not collapse (one that crosses into another mapping, a
    file's pages, a kernel before 6.1) is left as it is. Returns how many ranges are collapsed;
    0 off Linux, or with `$SPECFX_HUGE_PAGES=0`.

    A step streams the model's weights once, and with 4 KB pages it leaves speed on the table:
    every 4 KB a new page to translate, and the hardware prefetchers stop at page edges. On a
    2-core AMD EPYC with AVX-512, `python benchmarks/huge_pages.py` (pycoder's fused steps
    round-robin in one process, the weights switched between calls from their collapsed pages
    to a copy in 4 KB pages) timed the decode step at 1.860-2.460 ms against 2.049-2.573, the
    MTP chain's at 3.015-3.333 against 3.085-3.339 and the 2x2x1x1x1 tree's at 3.441-3.660
    against 3.575-3.796."""
    if not sys.platform.startswith("linux") or os.environ.get(HUGE_PAGES_ENV) == "0":
        return 0
    ranges = set()
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            continue
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            continue
        start = storage.data_ptr()
        ranges.update(range(start // HUGE_PAGE * HUGE_PAGE, start + storage.nbytes(), HUGE_PAGE))
    return sum(madvise(r, HUGE_PAGE, MADV_HUGEPAGE) and madvise(r, HUGE_PAGE, MADV_COLLAPSE) for r in sorted(ranges))


def small_pages(nbytes: int) -> torch.Tensor:
    """`nbytes` of zeros (uint8) in an anonymous mapping of their own marked for 4 KB pages
    (MADV_NOHUGEPAGE), which the tensor keeps alive: memory to compare huge pages against."""
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if not madvise(ctypes.addressof(ctypes.c_char.from_buffer(area)), nbytes, MADV_NOHUGEPAGE):
        raise OSError(ctypes.get_errno(), "madvise(MADV_NOHUGEPAGE) failed")
    return torch.frombuffer(area, dtype=torch.uint8)


def madvise(address: int, length: int, advice: int) -> bool:
    """Linux `madvise(address, length, advice)`; whether it succeeded."""
    return _libc().madvise(address, length, advice) == 0


@functools.cache
def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc
