"""Acceptance floors: exactness alone cannot catch a broken drafter (verification repairs every
wrong draft), so these check that right drafts are proposed and accepted."""

from __future__ import annotations

import pytest
import torch

import specfx
from helpers import assert_greedy_equal, hf_greedy, tiny_model
from specfx.runtime.lookup import ngram_propose


def _identity_exit(E: int, layers: int = 4):
    """A model whose layers >= E add nothing to the residual stream: the exit at E predicts
    exactly what the whole model does."""
    model = tiny_model("llama", layers=layers, seed=13)
    with torch.no_grad():
        for layer in model.model.layers[E:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model


@pytest.mark.parametrize("E, k", [(1, 3), (2, 4)])
def test_identity_early_exit_accepts_every_draft(E, k):
    model = _identity_exit(E)
    fast = specfx.compile(model, draft=f"early-exit:{E}", num_speculative_tokens=k, max_seq_len=64,
                          backend="eager")
    g = torch.Generator().manual_seed(E)
    for n in (1, 9):
        ids = torch.randint(3, 96, (1, n), generator=g)
        out = fast.generate(ids, max_new_tokens=20, eos_token_id=[])
        assert_greedy_equal(model, out, hf_greedy(model, ids, 20), n)
        assert fast.last_stats.acceptance_by_position == [1.0] * k
        # Sampling: the draft's distribution is the target's, so p/q = 1 accepts every draft.
        fast.generate(ids, max_new_tokens=20, eos_token_id=[], do_sample=True, seed=n)
        assert fast.last_stats.acceptance_by_position == [1.0] * k


def _propose(rows: list[list[int]], lengths: list[int], ngram: int, k: int) -> list[list[int]]:
    S = max(len(r) for r in rows)
    tokens = torch.tensor([r + [0] * (S - len(r)) for r in rows])
    return ngram_propose(tokens, torch.tensor(lengths), ngram, k).tolist()


@pytest.mark.parametrize("row, length, ngram, k, drafts", [
    ([5, 6, 7, 8, 5, 6], 6, 2, 2, [7, 8]),                  # the tokens that followed the match
    ([5, 6, 7, 5, 6, 9, 5, 6], 8, 2, 1, [9]),               # the latest earlier occurrence wins
    ([1, 2, 3, 9, 2, 4, 1, 2], 8, 2, 1, [3]),               # a longer match wins over a later shorter one
    ([1, 2, 3, 9, 2, 4, 1, 2], 8, 1, 1, [4]),               # ngram=1: the latest single token
    ([1, 2, 3, 4], 4, 2, 3, [4, 4, 4]),                     # no match: the last token again
    ([7, 0, 0, 0], 1, 3, 2, [7, 7]),                        # a row shorter than n
    ([7, 8, 9, 7, 8, 5], 2, 2, 2, [8, 8]),                  # tokens past the length are not matched
    ([1, 2, 1, 2], 4, 2, 3, [1, 2, 2]),                     # a continuation clipped at the buffer's end
])
def test_ngram_propose(row, length, ngram, k, drafts):
    assert _propose([row], [length], ngram, k) == [drafts]


def test_ngram_propose_rows_are_independent():
    rows = [[5, 6, 7, 8, 5, 6, 0, 0], [1, 2, 3, 4, 1, 2, 3, 1]]
    assert _propose(rows, [6, 8], 3, 2) == [[7, 8], [2, 3]]
