"""CUDA-graph capture of the step: bookkeeping on CPU, capture and replay on CUDA."""

from __future__ import annotations

import pytest
import torch

import specfx
from helpers import assert_greedy_equal, hf_greedy, tiny_model
from specfx.runtime.cudagraph import GraphedStep, StaticBuffers

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _fast(device="cpu", **kw):
    model = tiny_model("llama", layers=4, seed=3).to(device)
    return model, specfx.compile(model, draft="early-exit:2", num_speculative_tokens=3, max_seq_len=64,
                                 backend=kw.pop("backend", "eager"), **kw)


def test_static_buffer_registry_detects_moved_tensors_and_restores_snapshots():
    _, fast = _fast()
    st = fast.graphs.state
    reg = StaticBuffers(st)
    assert set(reg.addresses) >= {"tokens", "lengths", "done", "noise", "kv_0"}
    fast.generate(torch.randint(3, 96, (1, 5)), max_new_tokens=4, eos_token_id=[])
    reg.check()                                            # generate writes in place only
    snap = reg.snapshot()
    lengths = st.lengths.clone()
    fast.runtime.step()
    assert not torch.equal(st.lengths, lengths) or bool(st.done.all())
    reg.restore(snap)
    assert torch.equal(st.lengths, lengths)
    st.tokens = st.tokens.clone()                          # a moved buffer is caught
    with pytest.raises(RuntimeError, match="moved"):
        reg.check()


def test_capture_refuses_a_cpu_state_and_cpu_runtime_never_graphs():
    _, fast = _fast()
    assert fast.runtime.cudagraphs is False
    with pytest.raises(RuntimeError, match="CUDA device"):
        GraphedStep(fast.runtime.step, fast.graphs.state).capture()
    with pytest.raises(ValueError, match="CUDA device"):
        _fast(cudagraphs=True)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("sample", [False, True])
def test_replay_equals_the_uncaptured_step_without_syncs(sample):
    model, graphed = _fast("cuda", backend="inductor", cudagraphs=True)
    _, plain = _fast("cuda", backend="inductor", cudagraphs=False)
    ids = torch.randint(3, 96, (1, 7), device="cuda")
    kw = dict(do_sample=True, seed=5) if sample else {}
    a = graphed.generate(ids, max_new_tokens=24, eos_token_id=[], **kw)
    b = plain.generate(ids, max_new_tokens=24, eos_token_id=[], **kw)
    assert torch.equal(a, b)
    step = graphed.runtime._graphed[sample]
    assert step.warmup_runs == step.warmup
    step.buffers.check()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    step.buffers.check()
    if not sample:
        assert_greedy_equal(model, a.cpu(), hf_greedy(model, ids, 24).cpu(), 7)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_greedy_matches_model_generate_in_the_same_dtype(dtype):
    model = tiny_model("qwen2", layers=4, seed=8).to("cuda", dtype)
    fast = specfx.compile(model, draft="early-exit:2", num_speculative_tokens=3, max_seq_len=64)
    ids = torch.randint(3, 96, (1, 9), device="cuda")
    ours = fast.generate(ids, max_new_tokens=24, eos_token_id=[])
    assert_greedy_equal(model, ours.cpu(), hf_greedy(model, ids, 24).cpu(), 9)
