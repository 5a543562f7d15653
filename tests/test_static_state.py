"""The static state's layout and randomness: aligned KV length, the runtime's own generator."""

from __future__ import annotations

import torch

import specfx
from helpers import assert_greedy_equal, hf_greedy, tiny_model
from specfx.capture import kv_slots
from specfx.pipeline import KV_ALIGN


def test_kv_length_is_rounded_up_and_generation_stays_exact_up_to_max_seq_len():
    model = tiny_model("llama", layers=3, seed=21)
    fast = specfx.compile(model, draft="early-exit:1", num_speculative_tokens=3, max_seq_len=29, backend="eager")
    st = fast.graphs.state
    assert st.seq_len == 48 and st.seq_len % KV_ALIGN == 0                # 29 + k + 1 = 33 -> 48
    assert {t.shape[2] for t in st.kv} == {kv_slots(48)}                 # [B, H, S + 1, D]
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    ours = fast.generate(ids, max_new_tokens=20, eos_token_id=[])      # fills max_seq_len exactly
    assert_greedy_equal(model, ours, hf_greedy(model, ids, 20), 9)


def test_sampling_without_a_seed_leaves_the_global_rng_alone():
    model = tiny_model("llama", layers=2, seed=22)
    fast = specfx.compile(model, draft="none", max_seq_len=32, backend="eager")
    before = torch.get_rng_state()
    fast.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=True, eos_token_id=[])
    fast.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=True, seed=3, eos_token_id=[])
    assert torch.equal(torch.get_rng_state(), before)
