"""The near-tie rule of `helpers.assert_greedy_equal`: its gap is measured after the prompt."""

from __future__ import annotations

import pytest
import torch

from helpers import assert_greedy_equal, hf_greedy, tiny_model

PROMPT = [7, 3]


class _PromptSensitive(torch.nn.Module):
    """Logits with a wide gap (token 5 first) after PROMPT, an exact tie anywhere else."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, ids):
        logits = torch.zeros(1, ids.shape[1], 8)
        if ids[0, :2].tolist() == PROMPT:
            logits[..., 5] = 10.0
        return type("Out", (), {"logits": logits})()


def test_a_divergence_where_the_reference_is_sure_fails():
    model = _PromptSensitive()
    ref = torch.tensor([PROMPT + [5, 5, 5]])
    ours = torch.tensor([PROMPT + [5, 2, 5]])
    # Measured without the prompt the gap would be 0 (a tie): the divergence must fail here.
    with pytest.raises(AssertionError, match=r"divergence at 1 is not a near-tie \(top-2 gap 1.00e\+01\)"):
        assert_greedy_equal(model, ours, ref, len(PROMPT))
    # Suffixes (the new tokens alone) are refused: the gap would be measured without the prompt.
    with pytest.raises(AssertionError, match="pass whole sequences"):
        assert_greedy_equal(model, ours[:, 2:], ref[:, 2:], 0)


def test_equal_sequences_pass_and_a_real_model_divergence_fails():
    model = tiny_model("llama", layers=2, seed=1)
    ids = torch.randint(3, 96, (1, 6), generator=torch.Generator().manual_seed(0))
    ref = hf_greedy(model, ids, 8)
    assert_greedy_equal(model, ref.clone(), ref, 6)
    wrong = ref.clone()
    wrong[0, 9] = (ref[0, 9] + 1) % 96
    with pytest.raises(AssertionError, match="divergence at 3 is not a near-tie"):
        assert_greedy_equal(model, wrong, ref, 6)
    with pytest.raises(AssertionError, match="the prompts differ"):
        assert_greedy_equal(model, torch.cat([ref[:, :1] + 1, ref[:, 1:]], 1), ref, 6)
