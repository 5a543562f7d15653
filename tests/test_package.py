"""Packaging: `passes/` and `runtime/` install as `specfx.passes` and `specfx.runtime`."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_editable_install_imports_subpackages():
    import specfx.passes
    import specfx.runtime

    assert Path(specfx.passes.__file__).parent == ROOT / "passes"
    assert Path(specfx.runtime.__file__).parent == ROOT / "runtime"


@pytest.mark.slow
def test_wheel_contains_subpackages_under_specfx(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(ROOT)],
        check=True,
    )
    (wheel,) = tmp_path.glob("specfx-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "specfx/passes/__init__.py" in names
    assert "specfx/runtime/__init__.py" in names
    assert "specfx/zoo/pycoder/model.safetensors" in names
    assert "specfx/zoo/prompts/pycode.jsonl" in names
    assert not any(n.startswith(("passes/", "runtime/")) for n in names)


def test_cli_lists_zoo_models(capsys):
    from specfx.cli.main import main

    assert main(["zoo"]) == 0
    out = capsys.readouterr().out
    assert "pycoder" in out and "pycoder-draft" in out and "top-1" in out
