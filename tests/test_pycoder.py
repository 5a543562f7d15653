"""The embedded model: exactness of early-exit speculation over the evaluation prompts."""

from __future__ import annotations

import pytest
import torch

import specfx
from helpers import assert_greedy_equal
from specfx import zoo

pytestmark = pytest.mark.slow


def test_early_exit_is_exact_on_every_evaluation_prompt(pycoder):
    model, tok = pycoder
    prompts = zoo.prompts("completion")
    fast = specfx.compile(model, draft="early-exit", max_seq_len=320, backend="eager")
    assert fast.drafter.layer == model.config.specfx_exit_layer
    accepted = []
    for text in prompts:
        ids = tok(text, return_tensors="pt").input_ids
        ours = fast.generate(ids, max_new_tokens=32)
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=tok.pad_token_id)
        assert_greedy_equal(model, ours, ref, ids.shape[1])
        accepted.append(fast.last_stats.mean_accepted)
    # LayerSkip training makes even the first layer's exit a useful draft: drafts are accepted
    # (one token per call would mean none ever is).
    assert sum(accepted) / len(accepted) > 1.3


def test_zoo_quality_floor():
    target, draft = zoo.info("pycoder")["heldout"], zoo.info("pycoder-draft")["heldout"]
    assert target["top1"] >= 0.45
    assert draft["greedy_agreement_with_target"] >= 0.55
    # Early exit is useful: accuracy rises with depth and the middle of the stack already predicts.
    by_exit = target["top1_by_exit"]
    assert by_exit[-1] == max(by_exit)
    assert by_exit[len(by_exit) // 4] > 0.3
