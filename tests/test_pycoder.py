"""The embedded models: exactness of every drafter over the evaluation prompts, quality floors."""

from __future__ import annotations

import pytest
import torch

import specfx
from helpers import assert_greedy_equal
from specfx import zoo

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def references(pycoder):
    """(prompt ids, model.generate greedy output) for every evaluation prompt, 32 new tokens."""
    model, tok = pycoder
    out = []
    for text in zoo.prompts("completion"):
        ids = tok(text, return_tensors="pt").input_ids
        with torch.no_grad():
            out.append((ids, model.generate(ids, max_new_tokens=32, do_sample=False, pad_token_id=tok.pad_token_id)))
    return out


def test_early_exit_is_exact_on_every_evaluation_prompt(pycoder, references):
    model, _ = pycoder
    fast = specfx.compile(model, draft="early-exit", max_seq_len=320, backend="eager")
    assert fast.drafter.layer == model.config.specfx_exit_layer
    accepted = []
    for ids, ref in references:
        assert_greedy_equal(model, fast.generate(ids, max_new_tokens=32), ref, ids.shape[1])
        accepted.append(fast.last_stats.mean_accepted)
    # LayerSkip training makes even the first layer's exit a useful draft: drafts are accepted
    # (one token per call would mean none ever is).
    assert sum(accepted) / len(accepted) > 1.3


@pytest.mark.parametrize("draft", ["mtp", "draft-model:pycoder-draft", "ngram:3"])
def test_other_drafters_are_exact_on_every_evaluation_prompt(pycoder, references, draft):
    model, _ = pycoder
    fast = specfx.compile(model, draft=draft, max_seq_len=320, backend="eager")
    calls = accepted = 0
    for ids, ref in references:
        assert_greedy_equal(model, fast.generate(ids, max_new_tokens=32), ref, ids.shape[1])
        calls += fast.last_stats.target_calls
        accepted += fast.last_stats.mean_accepted * fast.last_stats.target_calls
    if draft == "mtp":   # the shipped head drafts well for the model it was trained for
        assert accepted / calls > 2.0


def test_zoo_quality_floor():
    target, draft = zoo.info("pycoder")["heldout"], zoo.info("pycoder-draft")["heldout"]
    assert target["top1"] >= 0.45
    assert draft["greedy_agreement_with_target"] >= 0.55
    # Early exit is useful: accuracy rises with depth and the middle of the stack already predicts.
    by_exit = target["top1_by_exit"]
    assert by_exit[-1] == max(by_exit)
    assert by_exit[len(by_exit) // 4] > 0.3
    head = zoo.info("pycoder-mtp")
    assert head["heldout"]["top1_agreement"] >= 0.6 and head["acceptance"]["mean_accepted"] >= 2.0
