"""Bad arguments to `generate` get a clear error naming the argument, before anything runs."""

from __future__ import annotations

import pytest
import torch

import specfx
from helpers import assert_greedy_equal, hf_greedy, tiny_model, unpadded

V = 96


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, vocab=V, seed=5)


@pytest.fixture(scope="module")
def fast(model):
    return specfx.compile(model, draft="early-exit:1", num_speculative_tokens=2, max_seq_len=32, batch_size=2,
                          backend="eager")


IDS = torch.tensor([[5, 17, 9, 33]])


@pytest.mark.parametrize("ids, error, message", [
    (torch.tensor([[5, 17, V, 33]]), ValueError, rf"input_ids\[0, 2\] = {V} is outside the vocabulary \[0, {V}\)"),
    (torch.tensor([[5, -1, 9, 33]]), ValueError, r"input_ids\[0, 1\] = -1 is outside the vocabulary"),
    (IDS.float(), TypeError, "input_ids must hold integer token ids, got dtype torch.float32"),
    (IDS.bool(), TypeError, "input_ids must hold integer token ids, got dtype torch.bool"),
    (IDS[0], ValueError, r"input_ids must be 2-D \[batch, prompt_len\].*got shape \(4,\).*input_ids\[None\]"),
    (IDS[None], ValueError, r"input_ids must be 2-D.*got shape \(1, 1, 4\)"),
    (IDS[:0], ValueError, r"at least one row.*got shape \(0, 4\)"),
    (IDS[:, :0], ValueError, "row 0 has none"),
    (IDS.tolist(), TypeError, "input_ids must be a torch.Tensor of token ids, got list"),
    (IDS.to("meta"), ValueError, r"input_ids is on meta, the model on cpu; move it there: input_ids.to\('cpu'\)"),
])
def test_bad_input_ids(fast, ids, error, message):
    with pytest.raises(error, match=message):
        fast.generate(ids, max_new_tokens=4)


@pytest.mark.parametrize("mask, error, message", [
    (torch.ones(1, 3, dtype=torch.long), ValueError, r"attention_mask has shape \(1, 3\), input_ids \(1, 4\)"),
    (torch.tensor([[0, 1, 2, 1]]), ValueError, "attention_mask must hold only 0 .* and 1 .*, found 2"),
    (torch.tensor([[0.0, 0.5, 1.0, 1.0]]), ValueError, "attention_mask must hold only 0 .* found 0.5"),
    (torch.zeros(1, 4, dtype=torch.long), ValueError, "row 0 has none .*attention_mask is all 0"),
    ([[1, 1, 1, 1]], TypeError, "attention_mask must be a torch.Tensor or None, got list"),
    (torch.ones(1, 4, dtype=torch.long, device="meta"), ValueError, "attention_mask is on meta, input_ids on cpu"),
])
def test_bad_attention_mask(fast, mask, error, message):
    with pytest.raises(error, match=message):
        fast.generate(IDS, mask, max_new_tokens=4)


def test_ids_under_padding_are_not_checked(model, fast):
    """Padding is dropped whatever its id (some tokenizers pad with -100 or an id past the vocab)."""
    ids = torch.tensor([[-100, V + 5, 9, 33], [5, 17, 9, 33]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    out = fast.generate(ids, mask, max_new_tokens=6, eos_token_id=[])
    assert_greedy_equal(model, unpadded(out, ids, mask, 0), hf_greedy(model, ids[:1, 2:], 6), 2)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(eos_token_id=V), ValueError, f"eos_token_id {V} is outside the vocabulary"),
    (dict(eos_token_id=[2, -3]), ValueError, "eos_token_id -3 is outside the vocabulary"),
    (dict(eos_token_id=2.0), TypeError, "eos_token_id must be an int or a list of ints, got 2.0"),
    (dict(pad_token_id=V + 1), ValueError, f"pad_token_id {V + 1} is outside the vocabulary"),
    (dict(pad_token_id=-1), ValueError, "pad_token_id -1 is outside the vocabulary"),
    (dict(max_new_tokens=2.5), TypeError, "max_new_tokens must be an int, got 2.5"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
])
def test_bad_generation_arguments(fast, kwargs, error, message):
    with pytest.raises(error, match=message):
        fast.generate(IDS, **{"max_new_tokens": 4, **kwargs})


def test_configured_ids_outside_the_vocabulary_say_where_they_came_from():
    model = tiny_model("llama", layers=2, vocab=V, seed=5, eos_token_id=V + 3)
    model.generation_config.eos_token_id = V + 3
    fast = specfx.compile(model, draft="none", max_seq_len=32, backend="eager")
    with pytest.raises(ValueError, match=f"eos_token_id {V + 3} is outside .* configured value; pass it explicitly"):
        fast.generate(IDS, max_new_tokens=4)
    fast.generate(IDS, max_new_tokens=4, eos_token_id=2)           # explicit ids are used instead


def test_right_padding_is_handled_exactly(model, fast):
    """A right-padded row generates what its unpadded prompt does; as in model.generate, the new
    tokens follow the row's padding."""
    ids = torch.tensor([[5, 17, 9, 33, 41, 7], [8, 3, 12, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    out = fast.generate(ids, mask, max_new_tokens=8, eos_token_id=[])
    assert torch.equal(out[:, :6], ids)
    for b, n in ((0, 6), (1, 3)):
        assert_greedy_equal(model, unpadded(out, ids, mask, b), hf_greedy(model, ids[b : b + 1, :n], 8), n)


def test_checks_run_before_the_state_is_touched(fast):
    """A refused call leaves the previous call's tokens in the state: nothing ran."""
    fast.generate(IDS, max_new_tokens=4, eos_token_id=[])
    before = fast.graphs.state.tokens.clone()
    with pytest.raises(ValueError):
        fast.generate(torch.tensor([[1, 2, V]]), max_new_tokens=4)
    assert torch.equal(fast.graphs.state.tokens, before)
