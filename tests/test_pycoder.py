"""The embedded models: exactness of every drafter over the evaluation prompts, quality floors."""

from __future__ import annotations

import pytest
import torch

import specfx
from helpers import assert_greedy_equal
from specfx import zoo

pytestmark = pytest.mark.slow

FLOORS = {"mtp": 2.5, "mtp:pycoder-mtp:weights=int8": 2.5, "draft-model:pycoder-draft": 1.9, "ngram:3": 1.25,
          "early-exit:weights=int8": 1.9, "early-exit": 1.9}
BATCH = 8       # prompts per generate call: the eager step costs about the same for 1 row or 8


def exact_over_every_prompt(model, fast, references) -> float:
    """Assert every evaluation prompt's greedy output equals plain `generate`'s (batched, left
    padded: each row decodes on its own); return the tokens per target call over all rows."""
    calls = accepted = 0
    for i in range(0, len(references), BATCH):
        group = references[i:i + BATCH]
        width = max(ids.shape[1] for ids, _ in group)
        padded = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros_like(padded)
        for b, (ids, _) in enumerate(group):
            padded[b, width - ids.shape[1]:], mask[b, width - ids.shape[1]:] = ids[0], 1
        out = fast.generate(padded, attention_mask=mask, max_new_tokens=32)
        for b, (ids, ref) in enumerate(group):
            ours = torch.cat([ids[0], out[b, width:]])[None, :ref.shape[1]]
            assert_greedy_equal(model, ours, ref, ids.shape[1])
        calls += fast.last_stats.target_calls
        accepted += fast.last_stats.mean_accepted * fast.last_stats.target_calls
    return accepted / calls


def test_early_exit_is_exact_on_every_evaluation_prompt(pycoder, pycoder_references):
    model, _ = pycoder
    fast = specfx.compile(model, draft="early-exit", max_seq_len=320, batch_size=BATCH, backend="eager")
    assert fast.drafter.layer == model.config.specfx_exit_layer
    # LayerSkip training makes an early layer's exit a useful draft: drafts are accepted (one
    # token per call would mean none ever is; 2.26 at the default exit 3 with k=3 when written).
    tokens_per_call = exact_over_every_prompt(model, fast, pycoder_references)
    assert tokens_per_call > FLOORS["early-exit"], tokens_per_call


@pytest.mark.parametrize("draft", ["mtp", "mtp:pycoder-mtp:weights=int8", "draft-model:pycoder-draft", "ngram:3",
                                   "early-exit:weights=int8"])
def test_other_drafters_are_exact_on_every_evaluation_prompt(pycoder, pycoder_references, draft):
    model, _ = pycoder
    fast = specfx.compile(model, draft=draft, max_seq_len=320, batch_size=BATCH, backend="eager")
    # Exactness cannot catch a broken drafter (verification repairs every wrong draft); these
    # floors can: tokens per target call over the prompts, measured at 32 new tokens each
    # (2.69, 2.35 and 1.40 when written; the head's 2.70 is 2.98 since its retraining, 2.97 with int8
    # weights; early exit on an int8 copy of its layers 2.27).
    tokens_per_call = exact_over_every_prompt(model, fast, pycoder_references)
    assert tokens_per_call > FLOORS[draft], (draft, tokens_per_call)


def test_zoo_quality_floor(pycoder):
    """Measured here, on two held-out windows (not read from the figures recorded at training):
    the models predict held-out code, the early exits predict more with depth, and the draft
    model and the MTP head agree with pycoder."""
    from specfx.mtp import load_head
    from specfx.mtp_train import evaluate_head, sample_windows
    from specfx.zoo import corpus
    from specfx.zoo.build import EVAL_WINDOW, evaluate

    model, tok = pycoder
    _, heldout = corpus.split(corpus.list_files())
    windows = sample_windows(corpus.token_stream(tok, heldout[::4]), 2, EVAL_WINDOW + 1, seed=0)
    target = [evaluate(model, w) for w in windows]
    top1 = sum(r["top1"] for r in target) / 2
    by_exit = [sum(r["top1_by_exit"][i] for r in target) / 2 for i in range(len(target[0]["top1_by_exit"]))]
    # Measured when written: 0.35; exits 0.20 .. 0.35 (0.32 at a quarter depth); 0.51; 0.67.
    assert top1 > 0.3, top1
    assert by_exit[-1] >= max(by_exit) - 0.02 and by_exit[-1] > by_exit[0] + 0.1, by_exit
    assert by_exit[len(by_exit) // 4] > 0.25, by_exit
    draft, _ = zoo.load("pycoder-draft")
    agreement = sum(evaluate(draft, w, teacher=model)["greedy_agreement_with_target"] for w in windows) / 2
    assert agreement > 0.45, agreement
    head = evaluate_head(load_head(zoo.path("pycoder-mtp"), model), model, windows)["top1_agreement"]
    assert head > 0.6, head


def test_mtp_first_draft_is_the_head_at_the_pending_token(pycoder, pycoder_references):
    """An MTP step takes draft 1 from the previous step's refill, at the accepted row: after
    every step it must equal the head run afresh over the new pending token (the prime pass),
    whatever number of drafts was accepted."""
    model, _ = pycoder
    fast = specfx.compile(model, draft="mtp", num_speculative_tokens=3, max_seq_len=320, backend="eager")
    rt, st, layout = fast.runtime, fast.graphs.state, fast.graphs.kv_layout
    ahead, head_kv = st.kv[layout.slice("ahead")], st.kv[layout.slice("head")]
    ids, _ = pycoder_references[0]
    st.load_prompts([ids[0]], 40, [])
    rt.prefill(ids.shape[1])
    accepted = set()
    for _ in range(10):
        before = st.lengths.clone()
        rt.step()
        accepted.add(int(st.lengths - before) - 1)
        kept = [t.clone() for t in st.kv]
        rt.prime_fn(*st.step_args())                               # the head at the pending token, afresh
        # The same output, and the refill had written the same key and value at that position.
        for fresh, stored in zip(ahead + head_kv, kept[layout.slice("ahead")] + kept[layout.slice("head")]):
            torch.testing.assert_close(stored, fresh, rtol=1e-4, atol=1e-4)
        for t, k in zip(st.kv, kept):
            t.copy_(k)
    assert len(accepted) > 1 and max(accepted) > 0, accepted      # steps that accepted drafts, and others
