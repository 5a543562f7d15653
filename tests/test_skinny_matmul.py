"""skinny_matmul: graph before -> pass -> graph after -> numerics; and how the choice is measured."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import span, tiny_model
from specfx import matmul_choice
from specfx.capture import capture
from specfx.passes import Choice, SkinnyMatmul
from specfx.passes.skinny_matmul import MATERIALIZE, MAX_ROWS, strip_materialize

aten = torch.ops.aten
ALWAYS = lambda M, N, K: Choice(True, f"M={M}: test")         # noqa: E731
NEVER = lambda M, N, K: Choice(False, f"M={M}: test says BLAS")  # noqa: E731


def _count(gm, target) -> int:
    return sum(n.op == "call_function" and n.target is target for n in gm.graph.nodes)


def _run(gm, ids, pos):
    with torch.no_grad():
        return gm(ids, pos, span(32))[0]


@pytest.mark.parametrize("width", [1, 4])
def test_rewrites_every_linear_and_keeps_numerics(width):
    model = tiny_model("llama", layers=2)
    cg = capture(model, width=width, max_seq_len=32)
    ids, pos = torch.randint(3, 96, (1, width)), torch.arange(width)[None]
    linears = _count(cg.gm, aten.linear.default)
    assert linears == 2 * 7 + 1                                    # q k v o gate up down per layer, lm_head
    ref = _run(cg.gm, ids, pos)
    sums = _count(cg.gm, aten.sum.dim_IntList)                     # attention's own
    queries = _count(cg.gm, MATERIALIZE)                           # attention's queries (CPU)
    res = SkinnyMatmul(ALWAYS)(cg.gm)
    assert res.modified and res.info == {"rewritten": linears, "kept": 0}
    assert _count(res.graph_module, aten.linear.default) == 0
    assert _count(res.graph_module, aten.sum.dim_IntList) == sums + linears * width   # one reduction per row
    assert _count(res.graph_module, MATERIALIZE) == queries + linears
    torch.testing.assert_close(_run(res.graph_module, ids, pos), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_run(strip_materialize(res.graph_module), ids, pos), ref, atol=1e-4, rtol=1e-4)
    assert _count(strip_materialize(res.graph_module), MATERIALIZE) == 0


def test_keeps_what_the_choice_refuses_and_says_why():
    cg = capture(tiny_model("llama", layers=2), width=2, max_seq_len=32)
    res = SkinnyMatmul(NEVER)(cg.gm)
    assert not res.modified and res.info == {"rewritten": 0, "kept": 15}
    assert "kept 15: M=2: test says BLAS" in res.reason
    wide = capture(tiny_model("llama", layers=1), width=MAX_ROWS + 1, max_seq_len=32)
    res = SkinnyMatmul(ALWAYS)(wide.gm)
    assert not res.modified and f"more rows than the rewrite unrolls ({MAX_ROWS})" in res.reason


def test_plan_chooses_the_faster_kernel_and_remembers_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(matmul_choice, "_memory", {})
    timings = {1: {"linears": 2, "reduce_ms": 1.0, "blas_ms": 2.0}, 4: {"linears": 2, "reduce_ms": 3.0, "blas_ms": 2.0}}
    measured = []
    monkeypatch.setattr(matmul_choice, "measure", lambda ws, M: measured.append(M) or timings[M])
    weights = [torch.randn(8, 4), torch.randn(4, 8)]
    plan = matmul_choice.MatmulPlan(weights)
    assert plan(1, 8, 4).reduce and "reduce 1.00 ms, BLAS 2.00 ms: reduce" in plan(1, 8, 4).reason
    assert not plan(4, 4, 8).reduce
    assert not plan(1, 3, 3).reduce and "not a weight" in plan(1, 3, 3).reason
    assert measured == [1, 4]                                      # once per row count
    assert len(json.loads((tmp_path / "matmul.json").read_text())) == 2
    # A new process (empty memory) reads the file instead of measuring again.
    monkeypatch.setattr(matmul_choice, "_memory", {})
    monkeypatch.setattr(matmul_choice, "measure", lambda ws, M: pytest.fail("measured again"))
    assert matmul_choice.MatmulPlan(weights)(1, 8, 4).reduce


@pytest.mark.slow
def test_measure_times_both_kernels_on_the_models_weights():
    weights = [torch.randn(64, 32), torch.randn(32, 64)]
    t = matmul_choice.measure(weights, 2)
    assert t["linears"] == 2 and t["reduce_ms"] > 0 and t["blas_ms"] > 0
