"""The runtime's graphs under Inductor, called without Dynamo, over symbolic spans and widths."""

from __future__ import annotations

import pytest
import torch

import specfx
from helpers import assert_greedy_equal, hf_greedy, tiny_model
from specfx.runtime.compile import InductorGraph


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
    """The CPU kernels fuse multiply-add (Inductor's default is off; see CPU_INDUCTOR) and run
    loops of a few rows on one thread (min_chunk_size); the
    wrapper is C++ and keeps buffers on the stack (CPU_WRAPPER): Inductor's stack-allocating
    wrapper is registered for the CPU during the compile only, with the budget STACK_ELEMENTS."""
    import torch._inductor.compile_fx as cfx
    from torch import fx
    from torch._inductor import config
    from torch._inductor.codegen import common
    from torch._inductor.codegen import cpp_wrapper_cpu_array_ref as arrayref

    from specfx.runtime.compile import STACK_ELEMENTS, compile_graph

    common.init_backend_registration()
    registered = common.device_codegens["cpu"].cpp_wrapper_codegen, arrayref.MAX_STACK_ALLOCATION_SIZE
    seen = []
    monkeypatch.setattr(cfx, "compile_fx", lambda gm, args, **kwargs: seen.append(
        (config.cpp.enable_floating_point_contract_flag, config.cpp.min_chunk_size, config.cpp_wrapper,
         config.memory_planning,
         config.aot_inductor.allow_stack_allocation, common.device_codegens["cpu"].cpp_wrapper_codegen,
         arrayref.MAX_STACK_ALLOCATION_SIZE)) or gm)
    fn = compile_graph(fx.symbolic_trace(lambda x: x * 2 + 1), "inductor")
    x = torch.ones(3)
    torch.testing.assert_close(fn(x), x * 2 + 1)
    assert seen == [("fast", 4096, True, False, True, arrayref.CppWrapperCpuArrayRef, STACK_ELEMENTS)]
    assert (common.device_codegens["cpu"].cpp_wrapper_codegen, arrayref.MAX_STACK_ALLOCATION_SIZE) == registered


def test_cpu_graph_is_called_past_aot_wrappers_where_they_have_nothing_to_do():
    """After the first call a CPU graph runs its compiled code directly, its parameters first (as
    AOTAutograd orders them), with its input mutations done inside it; a graph whose output
    aliases an input keeps AOTAutograd's wrappers (they hand back the view)."""
    from torch import fx

    from specfx.runtime.compile import compile_graph

    class Scale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(8.0), requires_grad=False)
            self.register_buffer("b", torch.full((8,), 0.5))

        def forward(self, x, count):
            count.add_(1)                                   # a state input, mutated in place
            return (x * self.w + self.b + count,)

    fn = compile_graph(fx.symbolic_trace(Scale()), "inductor")
    x, count = torch.randn(8), torch.zeros(1)
    with torch.no_grad():
        first = fn(x, count)[0].clone()                      # (the next call writes its output's buffer)
        assert fn.direct is not None
        second = fn(x, count)[0]
    want = lambda n: x * torch.arange(8.0) + 0.5 + n        # noqa: E731
    torch.testing.assert_close(first, want(1.0))
    torch.testing.assert_close(second, want(2.0))
    assert count.item() == 2.0

    view = compile_graph(fx.symbolic_trace(lambda x: (x.view(2, 4),)), "inductor")
    y = torch.randn(8)
    assert view(y)[0].data_ptr() == y.data_ptr() and view.direct is None
    assert view(y)[0].data_ptr() == y.data_ptr()


@pytest.mark.slow
@pytest.mark.parametrize("draft, kernel", [("early-exit:1", "reduce"), ("ngram:2", "tiled")])
def test_cpu_step_keeps_its_buffers_on_the_stack(monkeypatch, draft, kernel):
    """With every linear rewritten (as Inductor's reduction or the tiled kernel, which the
    wrapper calls as it calls Inductor's own), a greedy step calls no library kernel, so its
    C++ wrapper holds the intermediate buffers as stack arrays (CPU_WRAPPER). One library call
    anywhere in the step (a scan in the acceptance, a BLAS linear) would take them all to the heap."""
    import re

    from torch._inductor.utils import run_and_get_code

    model = tiny_model("llama", layers=2, seed=9)
    fast, codes = run_and_get_code(lambda: specfx.compile(model, draft=draft, num_speculative_tokens=3,
                                                          max_seq_len=200, skinny_matmul=kernel))
    step = max(codes, key=len)                      # prefill, first token, step: the step is the largest
    assert "ArrayRefTensor" in step
    assert not re.findall(r"aoti_torch_cpu_\w+|aoti_torch_call_dispatcher", step)
    assert "specfx_tiled::" in step                         # attention's scores and values, in any case
    skinny = [r for r in fast.graphs.records if r.name == "skinny_matmul" and r.modified]
    assert skinny and all(f"as the plan '{kernel}' says" in r.reason for r in skinny)
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(1))
    assert_greedy_equal(model, fast.generate(ids, max_new_tokens=20, eos_token_id=[]), hf_greedy(model, ids, 20), 9)
