"""The runtime's graphs under Inductor, called without Dynamo, over symbolic spans and widths."""

from __future__ import annotations

import pytest
import torch

import specfx
from helpers import assert_greedy_equal, hf_greedy, tiny_model
from specfx.runtime.compile import RECURSION_LIMIT, InductorGraph


@pytest.mark.slow
def test_steps_run_without_guard_checks_or_recompiles():
    model = tiny_model("llama", layers=2, seed=9)
    fast = specfx.compile(model, draft="early-exit:1", num_speculative_tokens=3, max_seq_len=200)
    rt = fast.runtime
    assert isinstance(rt.step_fn, InductorGraph) and rt.step_fn.fn is not None     # compiled at warm-up
    compiled = (rt.step_fn.fn, [fn.fn for fn, _ in rt.prefill_fns])
    # Prompts across several prefill widths and spans; each output exact.
    for n in (3, 40, 70, 130):
        ids = torch.randint(3, 96, (1, n), generator=torch.Generator().manual_seed(n))
        assert_greedy_equal(model, fast.generate(ids, max_new_tokens=30, eos_token_id=[]),
                            hf_greedy(model, ids, 30), n)
    assert (rt.step_fn.fn, [fn.fn for fn, _ in rt.prefill_fns]) == compiled        # nothing recompiled
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(20):
            rt.step()
    names = {e.key for e in prof.key_averages()}
    assert not any("TorchDynamo" in name or "Torch-Compiled Region" in name for name in names), names


def test_cpu_kernels_are_compiled_with_fma_contraction(monkeypatch):
    """The CPU kernels fuse multiply-add (Inductor's default is off; see CPU_INDUCTOR); the
    wrapper is C++ and plans its buffers into one pool (CPU_WRAPPER), under a recursion limit
    the planner's allocation tree fits in (pycoder's MTP step goes past Python's default)."""
    import sys

    import torch._inductor.compile_fx as cfx
    from torch import fx
    from torch._inductor import config

    from specfx.runtime.compile import compile_graph

    seen = []
    monkeypatch.setattr(cfx, "compile_fx", lambda gm, args: seen.append(
        (config.cpp.enable_floating_point_contract_flag, config.cpp_wrapper, config.memory_planning,
         sys.getrecursionlimit())) or gm)
    before = sys.getrecursionlimit()
    fn = compile_graph(fx.symbolic_trace(lambda x: x * 2 + 1), "inductor")
    x = torch.ones(3)
    torch.testing.assert_close(fn(x), x * 2 + 1)
    assert seen == [("fast", True, True, max(before, RECURSION_LIMIT))] and sys.getrecursionlimit() == before
