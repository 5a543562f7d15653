"""A report measured section by section under a deadline (the runner of `specfx.gpu_bench`).

- `Report(path, deadline_s, meta)`: `result` = {"ok", "failed_sections", "summary", "meta",
  "sections"}, rewritten to `path` after every section (atomically), so a run stopped at any
  point keeps what it measured.
- `Report.run(name, fn, min_s)`: runs `fn()` in try/except unless fewer than `min_s` seconds are
  left before the deadline, and stops it (SIGALRM, main thread only) if it runs past it. The
  section's entry is `{"status": ok | failed | error | timeout | skipped, ...}` with its seconds
  and the graphs torch.compile compiled meanwhile; `fn` may set its own status ("failed",
  "skipped") or record partial results with `Report.record` before it ends.
- `Report.finish(must_pass)`: "ok" is false when a section failed or raised, or a section in
  `must_pass` did not pass.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path


class SectionTimeout(BaseException):
    """A section ran past the report's deadline (a BaseException, like KeyboardInterrupt, so that
    no `except Exception` inside the section, in its code or in torch's, swallows it)."""


class Report:
    """The result of one run and its deadline; see the module docstring."""

    def __init__(self, path: Path, deadline_s: float, meta: dict):
        self.path, self.deadline = path, time.monotonic() + deadline_s
        self.result = {"ok": None, "failed_sections": [], "summary": {}, "meta": meta, "sections": {}}

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def save(self) -> None:
        """Rewrite the JSON through a temporary file: a run killed mid-write keeps the previous one."""
        tmp = self.path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)

    def record(self, name: str, entry: dict) -> None:
        self.result["sections"][name] = entry
        self.result["summary"][name] = entry["status"]
        self.save()

    def run(self, name: str, fn, min_s: float = 0) -> dict:
        """Run `fn()` as section `name` unless the deadline is too near; record and return its entry."""
        left = self.time_left()
        if left <= 0 or left < min_s:
            entry = {"status": "skipped", "reason": f"{max(left, 0):.0f} s left before the deadline, needs ~{min_s:.0f} s"}
        else:
            t0, graphs0 = time.monotonic(), compiled_graphs()
            try:
                with _alarm(left):
                    entry = {"status": "ok", **fn()}
            except SectionTimeout as e:
                entry = {**self.result["sections"].get(name, {}), "status": "timeout", "error": str(e)}
            except Exception as e:  # noqa: BLE001 - recorded; the next section still runs
                entry = {**self.result["sections"].get(name, {}), "status": "error", **error_entry(e)}
            entry["seconds"] = round(time.monotonic() - t0, 1)
            entry["graphs_compiled"] = compiled_graphs() - graphs0
        self.record(name, entry)
        print(f"[{name}] {json.dumps({k: v for k, v in entry.items() if k != 'traceback'}, default=str)}", flush=True)
        return entry

    def finish(self, must_pass: tuple[str, ...] = ()) -> bool:
        sections = self.result["sections"]
        bad = [n for n, e in sections.items() if e["status"] in ("failed", "error")
               or (n in must_pass and e["status"] != "ok")]
        self.result["ok"], self.result["failed_sections"] = not bad, bad
        self.save()
        return not bad


def error_entry(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=-6)}


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@contextmanager
def _alarm(seconds: float):
    """Raise SectionTimeout in the main thread after `seconds`; in another thread, no alarm."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum, frame):
        raise SectionTimeout(f"stopped at the deadline, after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
