"""Bad input gets a clear error, never a wrong answer."""

from __future__ import annotations

import pytest
import torch

import specfx
from helpers import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=4)


@pytest.mark.parametrize("E", [0, 4, 9])
def test_exit_layer_out_of_range(model, E):
    with pytest.raises(ValueError, match=r"exit layer|must be an int >= 1"):
        specfx.compile(model, draft=specfx.EarlyExit(layer=E) if E else "early-exit:0", backend="eager")


@pytest.mark.parametrize("k", [0, -2])
def test_k_below_one(model, k):
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        specfx.compile(model, draft="early-exit:2", num_speculative_tokens=k, backend="eager")


def test_prompt_plus_new_tokens_beyond_max_seq_len(model):
    fast = specfx.compile(model, draft="early-exit:2", num_speculative_tokens=2, max_seq_len=32, backend="eager")
    with pytest.raises(ValueError, match="exceeds max_seq_len=32"):
        fast.generate(torch.ones(1, 20, dtype=torch.long), max_new_tokens=13)
    fast.generate(torch.ones(1, 20, dtype=torch.long), max_new_tokens=12)  # exactly fits


def test_batch_larger_than_compiled(model):
    fast = specfx.compile(model, draft="none", max_seq_len=32, batch_size=2, backend="eager")
    with pytest.raises(ValueError, match="larger than the compiled batch_size=2"):
        fast.generate(torch.ones(3, 4, dtype=torch.long), max_new_tokens=4)


@pytest.mark.parametrize("spec", ["early-exit:x", "medusa", "none:3", "ngram:x"])
def test_unknown_draft_spec(model, spec):
    with pytest.raises(ValueError, match="draft spec"):
        specfx.compile(model, draft=spec, backend="eager")


def test_non_layerskip_model_runs_and_reports_low_acceptance(model):
    # A random model was never trained for early exit: allowed, exact, and the stats say so.
    fast = specfx.compile(model, draft="early-exit:1", num_speculative_tokens=4, max_seq_len=64, backend="eager")
    fast.generate(torch.randint(3, 96, (1, 8)), max_new_tokens=24, eos_token_id=[])
    s = fast.last_stats
    assert s.acceptance_by_position[-1] < 0.5
    assert s.mean_accepted < 3


@pytest.mark.parametrize("spec", ["ngram:0", "ngram:-1"])
def test_ngram_below_one(model, spec):
    with pytest.raises(ValueError, match="ngram must be an int >= 1"):
        specfx.compile(model, draft=spec, backend="eager")
