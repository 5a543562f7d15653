"""CUDA-graph capture of the step: bookkeeping on CPU, capture, replay and sync checks on CUDA.

The CUDA tests share one tiny model compiled once (prefill, greedy and sampling steps), so that
`scripts/gpu_check.sh` runs them in little time: the runtime replays the captured step when
`cudagraphs` is on and calls the compiled step directly when it is off.
"""

from __future__ import annotations

from contextlib import contextmanager

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
    prompt = torch.randint(3, 96, (5,))
    fast.generate(prompt[None], max_new_tokens=4, eos_token_id=[])
    reg.check()                                            # generate writes in place only
    # A row that cannot be done during the next step: no EOS, room for 32 more tokens.
    st.load_prompts([prompt], max_new_tokens=32, eos_ids=[])
    fast.runtime.prefill(prompt.numel())
    snap = reg.snapshot()
    lengths, tokens = st.lengths.clone(), st.tokens.clone()
    fast.runtime.step()
    assert not st.done.any() and bool((st.lengths > lengths).all())
    assert not torch.equal(st.tokens, tokens)
    reg.restore(snap)
    assert torch.equal(st.lengths, lengths) and torch.equal(st.tokens, tokens)
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


@pytest.fixture(scope="module")
def on_cuda():
    """(model, compiled runtime with CUDA graphs) on CUDA, Inductor, compiled once for the module."""
    return _fast("cuda", backend="inductor", cudagraphs=True)


@contextmanager
def no_sync_allowed():
    """Any synchronizing CUDA call in the block raises (explicit `torch.cuda.synchronize()` aside)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _graphed(fast, sample: bool):
    """The captured step for greedy or sampling (the runtime keys captures by (sample, filters))."""
    steps = [step for (drawn, _), step in fast.runtime._graphed.items() if drawn == sample]
    assert len(steps) == 1, list(fast.runtime._graphed)
    return steps[0]


def _generate(fast, ids, graphed: bool, sample: bool):
    fast.runtime.cudagraphs = graphed     # the same compiled step, replayed as a graph or called directly
    kw = dict(do_sample=True, seed=5) if sample else {}
    return fast.generate(ids, max_new_tokens=24, eos_token_id=[], **kw)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("sample", [False, True])
def test_replay_equals_the_unreplayed_compiled_step(on_cuda, sample):
    model, fast = on_cuda
    ids = torch.randint(3, 96, (1, 7), device="cuda")
    graphed = _generate(fast, ids, True, sample)          # captures on first use
    plain = _generate(fast, ids, False, sample)
    assert torch.equal(graphed, plain)
    step = _graphed(fast, sample)
    assert step.warmup_runs == step.warmup
    step.buffers.check()
    if not sample:
        assert_greedy_equal(model, graphed.cpu(), hf_greedy(model, ids, 24).cpu(), 7)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("sample", [False, True])
def test_compiled_step_and_generate_loop_do_not_sync(on_cuda, sample):
    _, fast = on_cuda
    rt = fast.runtime
    ids = torch.randint(3, 96, (1, 7))                    # host prompts: generate's own copies only
    expected = _generate(fast, ids, True, sample)         # compiles and captures outside the check
    _generate(fast, ids, False, sample)
    rt.state.load_prompts([ids[0]], max_new_tokens=24, eos_ids=[])
    with no_sync_allowed():
        for _ in range(3):                                # the compiled step itself, not a replay
            rt.sample_step() if sample else rt.step()
        graphed = _generate(fast, ids, True, sample)      # the whole loop, the step replayed
        plain = _generate(fast, ids, False, sample)       # the whole loop, the step called
    assert torch.equal(graphed, expected) and torch.equal(plain, expected)
    _graphed(fast, sample).buffers.check()


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_greedy_matches_model_generate_in_the_same_dtype(dtype):
    model = tiny_model("qwen2", layers=3, seed=8).to("cuda", dtype)
    fast = specfx.compile(model, draft="early-exit:1", num_speculative_tokens=3, max_seq_len=64)
    ids = torch.randint(3, 96, (1, 9), device="cuda")
    ours = fast.generate(ids, max_new_tokens=24, eos_token_id=[])
    assert_greedy_equal(model, ours.cpu(), hf_greedy(model, ids, 24).cpu(), 9)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("sample", [False, True])
def test_a_tree_step_replays_as_it_runs_and_keeps_greedy_exact(tmp_path, sample):
    """A draft tree's step (an MTP head's spine tree, pycoder's default kind) captured as a CUDA
    graph: replayed, it makes what the compiled step makes, and greedy stays the model's."""
    from specfx.mtp import new_head, save_head

    model = tiny_model("llama", layers=2, seed=3).cuda()
    head = save_head(new_head(model), tmp_path / "head", model)
    fast = specfx.compile(model, draft=specfx.MTPHead(head, tree=(2, 2, 1)), max_seq_len=64, backend="inductor",
                          cudagraphs=True)
    ids = torch.randint(3, 96, (1, 7), device="cuda")
    graphed = _generate(fast, ids, True, sample)
    plain = _generate(fast, ids, False, sample)
    assert torch.equal(graphed, plain)
    _graphed(fast, sample).buffers.check()
    if not sample:
        assert_greedy_equal(model, graphed.cpu(), hf_greedy(model, ids, 24).cpu(), 7)
