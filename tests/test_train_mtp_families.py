"""`specfx train mtp --target DIR` on a non-Llama family: the head holds that family's own
decoder layer, and the head it writes drafts exactly in a compiled step."""

from __future__ import annotations

import json

import torch
from transformers import AutoTokenizer

import specfx
from helpers import assert_greedy_equal, family_model, hf_greedy
from specfx import zoo
from specfx.cli.main import main


def test_train_mtp_for_a_gpt_neox_target(tmp_path):
    tok = AutoTokenizer.from_pretrained(str(zoo.path("pycoder-draft")))
    model = family_model("gpt_neox", layers=2, vocab=len(tok), seed=2)
    model.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    head_dir = tmp_path / "head"
    rc = main(["train", "mtp", "--target", str(tmp_path / "target"), "--out", str(head_dir), "--steps", "3",
               "--windows", "8", "--seq-len", "32", "--batch-size", "2", "--eval-prompts", "1", "--threads", "1"])
    assert rc == 0
    config = json.loads((head_dir / "config.json").read_text())
    assert config["target"]["model_type"] == "gpt_neox"
    assert config["target"]["layer_type"] == "GPTNeoXLayer"
    assert config["train"]["acceptance"]["target_calls"] > 0
    fast = specfx.compile(model, draft=specfx.MTPHead(str(head_dir)), num_speculative_tokens=2, max_seq_len=48,
                          backend="eager")
    assert type(fast.graphs.drafter.load(model).layers[0]).__name__ == "GPTNeoXLayer"
    ids = torch.randint(3, len(tok), (1, 8), generator=torch.Generator().manual_seed(0))
    assert_greedy_equal(model, fast.generate(ids, max_new_tokens=16, eos_token_id=[]),
                        hf_greedy(model, ids, 16, eos_token_id=None), 8)
