"""The GPU check's CPU dry run (scripts/gpu_check.sh --dry-run), so the check cannot rot without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specfx import gpu_bench

ROOT = Path(__file__).resolve().parents[1]


def _read(out: Path) -> dict:
    return json.loads((out / "gpu_bench.json").read_text())


@pytest.mark.slow
def test_dry_run_of_the_script_records_every_section_with_a_status(tmp_path):  # the embedded model's drafters
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(tmp_path)], cwd=ROOT,
                       env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    result = _read(tmp_path)
    assert list(result["sections"]) == list(gpu_bench.SECTIONS)          # every section, in order
    assert result["summary"] == {name: e["status"] for name, e in result["sections"].items()}
    tests = result["sections"]["cuda_tests"]
    assert tests["status"] == "skipped" and "CUDA tests collected" in tests["reason"]
    assert all(e["status"] == "ok" for name, e in result["sections"].items() if name != "cuda_tests")
    steps = result["sections"]["step_graphed_vs_ungraphed"]
    assert steps["ungraphed_step_ms"] > 0 and steps["graphed_step_ms"] is None
    drafters = result["sections"]["pycoder_drafters"]["drafters"]
    assert list(drafters) == list(gpu_bench.DRY.drafters)
    assert all(d["status"] == "ok" and d["tokens_per_s"] > 0 for d in drafters.values())
    assert result["ok"] is True and result["meta"]["dry_run"] is True
    assert "gpu_bench exit status 0" in (tmp_path / "gpu_check.log").read_text()


def test_the_script_exits_with_the_benchmark_status(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_TIMEOUT_S": "1"}   # killed by the hard timeout
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(tmp_path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 124 and "hard timeout" in r.stdout


def test_a_failing_cuda_test_fails_the_check(tmp_path, monkeypatch):
    failing = [sys.executable, "-c", "print('tests/test_cudagraph.py::test_x'); raise SystemExit(1)"]
    monkeypatch.setattr(gpu_bench, "pytest_command", lambda junit, collect_only: failing)
    assert gpu_bench.main(["--dry-run", "--out", str(tmp_path), "--only", "cuda_tests"]) == 1
    result = _read(tmp_path)
    assert result["sections"]["cuda_tests"]["status"] == "failed" and result["failed_sections"] == ["cuda_tests"]


def test_errors_and_the_deadline_are_recorded_section_by_section(tmp_path, monkeypatch):
    def broken(check):
        raise ValueError("boom")

    monkeypatch.setitem(gpu_bench.SECTIONS, "step_wall_vs_kernels", broken)
    monkeypatch.setitem(gpu_bench.SECTIONS, "specfx_none_vs_hf", lambda check: time.sleep(30))
    assert gpu_bench.main(["--dry-run", "--out", str(tmp_path), "--deadline-s", "1",
                           "--only", "step_wall_vs_kernels,specfx_none_vs_hf,pycoder_drafters"]) == 1
    sections = _read(tmp_path)["sections"]
    assert sections["step_wall_vs_kernels"]["status"] == "error" and "boom" in sections["step_wall_vs_kernels"]["error"]
    assert sections["specfx_none_vs_hf"]["status"] == "timeout"          # stopped at the deadline
    assert sections["pycoder_drafters"]["status"] == "skipped"           # not started after it
