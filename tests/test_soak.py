"""The soak benchmark (benchmarks/soak.py), 100 calls: memory flat, nothing compiled after
warm-up, every output exact. CI runs it with the eager backend (Inductor's cold compile of the
steps alone would take about a minute on a 2-core machine), so its compile counts are specfx's
own `compile_graph` calls; README has the 2000-call Inductor run."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def test_soak_100_calls():
    path = Path(__file__).parents[1] / "benchmarks" / "soak.py"
    spec = importlib.util.spec_from_file_location("soak", path)
    soak = sys.modules["soak"] = importlib.util.module_from_spec(spec)    # dataclasses look it up there
    spec.loader.exec_module(soak)
    result = soak.soak(calls=100, backend="eager", pool_size=12, log=lambda m: None)
    assert result.greedy_rows > 20 and result.sampled_calls > 20
    assert result.ok, str(result)
