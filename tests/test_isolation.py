"""State isolation between calls, property-based: any sequence of calls on one compiled model
gives, call for call, what a freshly compiled model gives for that call alone.

Hypothesis draws sequences of calls (prompt lengths across a prefill chunk, fewer rows than the
compiled batch, left or right padding, EOS ids, max_new_tokens up to the cache limit, greedy
and sampling interleaved, seeds). The fresh model is a deep copy of a compiled model that never
ran: every tensor and Python attribute of a fresh compile, without compiling again. Bounded
(a few examples per architecture and drafter, derandomized) so the whole file takes about a
minute; raise MAX_EXAMPLES to search longer.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specfx
from helpers import tiny_model

B, MAX_SEQ_LEN, V, K = 3, 80, 32, 2          # 80: prompts may span more than one prefill chunk (64)
MAX_EXAMPLES = 8
CONFIGS = [("llama", "early-exit:1"), ("qwen2", "ngram:2"), ("mistral", "draft-model"), ("gemma", "mtp")]


@st.composite
def call(draw) -> dict:
    """One generate call: its batch, padding, lengths, EOS ids, length limit and sampling."""
    rows = draw(st.integers(1, B))
    lengths = draw(st.lists(st.integers(1, 70), min_size=rows, max_size=rows))
    return dict(lengths=lengths, right_pad=draw(st.booleans()), tokens_seed=draw(st.integers(0, 2**16)),
                max_new_tokens=draw(st.integers(1, MAX_SEQ_LEN - max(lengths))),
                eos_token_id=draw(st.lists(st.integers(3, V - 1), max_size=2)),
                sample=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
                temperature=draw(st.sampled_from([0.6, 1.0, 1.5])), top_k=draw(st.sampled_from([0, 4])))


def run(fast, c: dict) -> tuple[torch.Tensor, tuple]:
    """(tokens, acceptance stats) of call `c` on `fast`."""
    width = max(c["lengths"])
    g = torch.Generator().manual_seed(c["tokens_seed"])
    ids = torch.randint(3, V, (len(c["lengths"]), width), generator=g)
    mask = torch.zeros_like(ids)
    for b, n in enumerate(c["lengths"]):
        if c["right_pad"]:
            mask[b, :n] = 1
        else:
            mask[b, width - n:] = 1
    kwargs = dict(do_sample=True, seed=c["seed"], temperature=c["temperature"], top_k=c["top_k"]) \
        if c["sample"] else {}
    out = fast.generate(ids, mask, max_new_tokens=c["max_new_tokens"], eos_token_id=c["eos_token_id"], **kwargs)
    s = fast.last_stats
    return out, (s.new_tokens, s.steps, s.target_calls, s.mean_accepted, s.acceptance_by_position)


@pytest.fixture(scope="module", params=CONFIGS, ids=["/".join(c) for c in CONFIGS])
def models(request, tmp_path_factory):
    """(the model every call of an example sequence runs on, a compiled model that never runs)."""
    arch, draft = request.param
    model = tiny_model(arch, layers=2, vocab=V, seed=17)
    if draft == "draft-model":
        draft = specfx.DraftModel(tiny_model(arch, layers=1, vocab=V, seed=18))
    elif draft == "mtp":
        from specfx.mtp import new_head, save_head

        draft = specfx.MTPHead(save_head(new_head(model), tmp_path_factory.mktemp("head") / "head", model))
    pristine = specfx.compile(model, draft=draft, num_speculative_tokens=K, max_seq_len=MAX_SEQ_LEN,
                              batch_size=B, backend="eager", prefill_chunk=64)
    return copy.deepcopy(pristine), pristine


@settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None)
@given(calls=st.lists(call(), min_size=2, max_size=4))
def test_every_call_equals_a_fresh_models(models, calls):
    shared, pristine = models
    for c in calls:
        out, stats = run(shared, c)
        fresh_out, fresh_stats = run(copy.deepcopy(pristine), c)
        assert torch.equal(out, fresh_out), c
        assert stats == fresh_stats, c
