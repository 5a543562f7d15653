"""`specfx train mtp --target DIR` on a non-Llama family: the head holds that family's own
decoder layer, and drafts in a compiled step (the acceptance `train mtp` measures; exactness of
MTP heads on this family is in tests/test_families.py)."""

from __future__ import annotations

import json

import specfx
from helpers import tiny_checkpoint
from specfx.cli.main import main


def test_train_mtp_for_a_gpt_neox_target(tmp_path):
    model = tiny_checkpoint(tmp_path / "target", "gpt_neox", layers=2, seed=2)
    head_dir = tmp_path / "head"
    rc = main(["train", "mtp", "--target", str(tmp_path / "target"), "--out", str(head_dir), "--steps", "3",
               "--windows", "8", "--generated", "2", "--seq-len", "32", "--batch-size", "2", "--eval-prompts", "1",
               "--threads", "1"])
    assert rc == 0
    config = json.loads((head_dir / "config.json").read_text())
    assert config["train"]["config"]["generated"] == 2
    assert "--generated 2" in (head_dir / "README.md").read_text()
    rc = main(["train", "mtp", "--target", str(tmp_path / "target"), "--out", str(tmp_path / "again"), "--init",
               str(head_dir), "--steps", "1", "--windows", "8", "--seq-len", "32", "--batch-size", "2",
               "--eval-prompts", "1", "--threads", "1"])
    assert rc == 0
    assert json.loads((tmp_path / "again" / "config.json").read_text())["train"]["config"]["init"] == str(head_dir)
    assert f"--init {head_dir}" in (tmp_path / "again" / "README.md").read_text()
    assert config["target"]["model_type"] == "gpt_neox"
    assert config["target"]["layer_type"] == "GPTNeoXLayer"
    assert config["train"]["acceptance"]["target_calls"] > 0
    head = specfx.MTPHead(str(head_dir)).load(model)       # refused were it not this target's
    assert type(head.layers[0]).__name__ == "GPTNeoXLayer"
