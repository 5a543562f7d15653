"""The fused step under torch.compile: no graph break, no host sync, same tokens."""

from __future__ import annotations

import pytest
import torch

import specfx
from helpers import assert_greedy_equal, hf_greedy, tiny_model
from specfx.passes import find_host_syncs

pytestmark = pytest.mark.slow


def test_fused_step_compiles_fullgraph_with_inductor_and_stays_exact():
    # The model, drafter and sizes of tests/test_compile_path.py and test_sampling.py: the same
    # kernels, compiled once per machine (Inductor's code cache keys them by source, not weights).
    model = tiny_model("llama", layers=2, seed=11)
    fast = specfx.compile(model, draft="early-exit:1", num_speculative_tokens=3, max_seq_len=200,
                          backend="inductor")
    step = fast.graphs.step
    assert find_host_syncs(step) == []
    explain = torch._dynamo.explain(step)(*fast.graphs.state.step_args())
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    ids = torch.randint(3, 96, (1, 9))
    ours = fast.generate(ids, max_new_tokens=20, eos_token_id=[])
    assert_greedy_equal(model, ours, hf_greedy(model, ids, 20), 9)
    assert fast.compile_s > 0
