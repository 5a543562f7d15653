"""skinny_matmul: graph before -> pass -> graph after -> numerics; and how the choice is measured."""

from __future__ import annotations

import json

import pytest
import torch

import specfx
from helpers import assert_greedy_equal, hf_greedy, span, tiny_model
from specfx import matmul_choice
from specfx.capture import capture
from specfx.passes import Choice, SkinnyMatmul
from specfx.passes.skinny_matmul import GATED_FROM_ROWS, MATERIALIZE, MAX_ROWS, strip_materialize

aten = torch.ops.aten
ALWAYS = lambda M, N, K, dtype: Choice("reduce", f"M={M}: test")      # noqa: E731
TILED = lambda M, N, K, dtype: Choice("tiled", f"M={M}: test tiles")   # noqa: E731
NEVER = lambda M, N, K, dtype: Choice("blas", f"M={M}: test says BLAS")  # noqa: E731


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
    assert res.modified and res.info == {"rewritten": linears, "kept": 0, "grouped": 0, "gated": 0}
    assert _count(res.graph_module, aten.linear.default) == 0
    assert _count(res.graph_module, aten.sum.dim_IntList) == sums + linears * width   # one reduction per row
    assert _count(res.graph_module, MATERIALIZE) == queries + linears
    torch.testing.assert_close(_run(res.graph_module, ids, pos), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_run(strip_materialize(res.graph_module), ids, pos), ref, atol=1e-4, rtol=1e-4)
    assert _count(strip_materialize(res.graph_module), MATERIALIZE) == 0


def _tiled_weights(gm) -> list:
    """The 2-D weights the tiled kernels read, a lone linear's, a group's or a gated MLP's, in
    graph order."""
    ops, out = torch.ops.specfx, []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (ops.tiled_linear.default, ops.tiled_linears.default):
            ws = n.args[1] if n.target is ops.tiled_linears.default else [n.args[1]]
            out += [w for w in ws if w.meta["val"].dim() == 2]
        elif n.op == "call_function" and n.target is ops.tiled_glu.default:
            out += n.args[1:3]
    return out


@pytest.mark.parametrize("width", [1, 5])
def test_tiled_rewrite_reads_each_weight_once_and_groups_a_shared_input(width):
    """Every linear reaches the tiled kernel; those of one input (a layer's q, k and v; its gate
    and up) as one `tiled_linears` call, whose columns are sliced back into theirs."""
    from specfx.kernels import tiled_linear

    cg = capture(tiny_model("llama", layers=2), width=width, max_seq_len=32)
    ids, pos = torch.randint(3, 96, (1, width)), torch.arange(width)[None]
    ref = _run(cg.gm, ids, pos)
    sums = _count(cg.gm, aten.sum.dim_IntList)
    tiled, group = torch.ops.specfx.tiled_linear.default, torch.ops.specfx.tiled_linears.default
    attention = _count(cg.gm, tiled)                                              # scores, one per layer
    res = SkinnyMatmul(TILED)(cg.gm)
    glu, gated = torch.ops.specfx.tiled_glu.default, width >= GATED_FROM_ROWS     # one row: apart
    assert res.modified and res.info == {"rewritten": 15, "kept": 0, "grouped": 10, "gated": 2 * gated}
    assert "rewrote 15: M=" in res.reason and "grouped 10 tiled linears of a shared input into 4 kernels" in res.reason
    assert ("fused 2 gated MLPs' silu(gate) * up into their kernels" in res.reason) == gated
    calls = [n for n in res.graph_module.graph.nodes if n.target in (tiled, group, glu)]
    assert _count(res.graph_module, tiled) == attention + 5   # o, down, lm_head
    assert [len(n.args[1]) if n.target is group else "glu" for n in calls if n.target is not tiled] == \
           [3, "glu" if gated else 2] * 2
    assert _count(res.graph_module, aten.silu.default) == 2 * (not gated)      # fused: the kernel's
    weights = _tiled_weights(res.graph_module)
    assert len(weights) == len(set(weights)) == 15 and _count(res.graph_module, aten.linear.default) == 0
    assert _count(res.graph_module, aten.sum.dim_IntList) == sums                 # no reductions added
    assert all(n.args[-1] == tiled_linear.VERSION for n in calls)
    torch.testing.assert_close(_run(res.graph_module, ids, pos), ref, atol=1e-4, rtol=1e-4)
    stripped = strip_materialize(res.graph_module)                                # what export sees
    assert _count(stripped, tiled) == _count(stripped, group) == _count(stripped, glu) == 0
    assert _count(stripped, torch.ops.specfx.tiled_mix.default) == 0
    assert _count(res.graph_module, torch.ops.specfx.tiled_attend.default) == 2    # attention, one per layer
    assert _count(stripped, torch.ops.specfx.tiled_attend.default) == 0
    assert _count(stripped, aten.linear.default) == 0                             # products and sums
    torch.testing.assert_close(_run(stripped, ids, pos), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_a_weight_stored_in_another_dtype_reaches_the_tiled_kernel_as_stored(dtype):
    """A draft's linears keep bfloat16 or int8 weights and widen them where they are read
    (`mtp.store_weights`): the pass hands the kernel the stored weight, not the widened copy,
    and export's form widens it again. Against int8 the kernel quantizes its rows as well
    (`tiled_linear.quantized_reference`): the logits then move by the rows' rounding."""
    from specfx.mtp import store_weights

    model = tiny_model("llama", layers=2)
    store_weights(model.model.layers, dtype)
    cg = capture(model, width=4, max_seq_len=32)
    ids, pos = torch.randint(3, 96, (1, 4)), torch.arange(4)[None]
    ref = _run(cg.gm, ids, pos)
    res = SkinnyMatmul(TILED)(cg.gm)
    stored = _tiled_weights(res.graph_module)
    weights = [w.meta["val"] for w in stored]
    assert [w.dtype for w in weights].count(dtype) == 2 * 7 and len(weights) == 15   # the lm_head: float32
    assert all(w.op == "get_attr" for w in stored if w.meta["val"].dtype == dtype)
    tol = dict(atol=3e-2 * ref.abs().max().item(), rtol=0) if dtype == torch.int8 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_run(res.graph_module, ids, pos), ref, **tol)
    torch.testing.assert_close(_run(strip_materialize(res.graph_module), ids, pos), ref, **tol)


def test_tiled_choice_falls_back_where_the_kernel_does_not_apply():
    model = tiny_model("llama", layers=1).to(torch.bfloat16)
    cg = capture(model, width=2, max_seq_len=32)
    res = SkinnyMatmul(TILED)(cg.gm)
    assert _count(res.graph_module, torch.ops.specfx.tiled_linear.default) == 0
    assert "not the tiled kernel's case (float32 rows, float32, bfloat16 or int8 contiguous weights, rows of at most " \
           "one size not static, " \
           "a compiler for it): reduce" in res.reason


def test_tiled_choice_falls_back_where_the_kernel_does_not_compile(monkeypatch):
    from specfx import attention
    from specfx.kernels import tiled_linear as kernels

    for module in (kernels, attention):                            # attention asks too, at capture
        monkeypatch.setattr(module, "available", lambda: (False, "no compiler"))
    cg = capture(tiny_model("llama", layers=1), width=2, max_seq_len=32)
    res = SkinnyMatmul(TILED)(cg.gm)
    assert _count(res.graph_module, torch.ops.specfx.tiled_linear.default) == 0
    assert "a compiler for it): reduce" in res.reason


def test_keeps_what_the_choice_refuses_and_says_why():
    cg = capture(tiny_model("llama", layers=2), width=2, max_seq_len=32)
    res = SkinnyMatmul(NEVER)(cg.gm)
    assert not res.modified and res.info == {"rewritten": 0, "kept": 15, "grouped": 0, "gated": 0}
    assert "kept 15: M=2: test says BLAS" in res.reason
    wide = capture(tiny_model("llama", layers=1), width=MAX_ROWS + 1, max_seq_len=32)
    res = SkinnyMatmul(ALWAYS)(wide.gm)
    assert not res.modified and f"more rows than the rewrite unrolls ({MAX_ROWS})" in res.reason


def test_plan_chooses_the_faster_kernel_and_remembers_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECFX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(matmul_choice, "_memory", {})
    timings = {1: {"linears": 2, "tiled_ms": 1.5, "reduce_ms": 1.0, "blas_ms": 2.0},
               4: {"linears": 2, "tiled_ms": 1.0, "reduce_ms": 3.0, "blas_ms": 2.0},
               8: {"linears": 2, "reduce_ms": 3.0, "blas_ms": 2.0}}               # no tiled kernel here
    measured = []
    monkeypatch.setattr(matmul_choice, "measure", lambda ws, M, rows: measured.append(M) or timings[M])
    weights = [torch.randn(8, 4), torch.randn(4, 8)]
    plan = matmul_choice.MatmulPlan(weights)
    assert plan(1, 8, 4).kernel == "reduce"
    assert "tiled 1.50 ms, reduce 1.00 ms, BLAS 2.00 ms: reduce" in plan(1, 8, 4).reason
    assert plan(4, 4, 8).kernel == "tiled" and plan(8, 4, 8).kernel == "blas"
    assert plan(1, 3, 3).kernel == "blas" and "not a weight" in plan(1, 3, 3).reason
    assert measured == [1, 4, 8]                                   # once per row count
    assert len(json.loads((tmp_path / "matmul.json").read_text())) == 3
    # A new process (empty memory) reads the file instead of measuring again.
    monkeypatch.setattr(matmul_choice, "_memory", {})
    monkeypatch.setattr(matmul_choice, "measure", lambda ws, M, rows: pytest.fail("measured again"))
    assert matmul_choice.MatmulPlan(weights)(1, 8, 4).kernel == "reduce"


def test_plan_chooses_by_the_stored_dtype_where_a_draft_shares_its_targets_shapes(tmp_path, monkeypatch):
    """An int8 draft layer has its target layer's shape: its kernel comes from its own set's timing."""
    monkeypatch.setenv("SPECFX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(matmul_choice, "_memory", {})
    timings = {torch.float32: {"linears": 2, "tiled_ms": 1.1, "reduce_ms": 1.0},
               torch.int8: {"linears": 2, "tiled_ms": 0.3, "reduce_ms": 1.0}}
    monkeypatch.setattr(matmul_choice, "measure", lambda ws, M, rows: timings[ws[0].dtype])
    weights = [torch.randn(8, 4), torch.randn(4, 8)]
    plan = matmul_choice.MatmulPlan(weights)
    plan.include([w.to(torch.int8) for w in weights], rows=torch.float32)
    assert plan(1, 8, 4, torch.float32).kernel == "reduce"
    assert plan(1, 8, 4, torch.int8).kernel == "tiled"
    assert plan(1, 8, 4).kernel == "reduce"                        # no dtype: the first set that holds the shape


def test_the_verify_graph_settles_the_kernel_the_chains_cannot(tmp_path, monkeypatch):
    """Over several rows the chains leave the reduction out; the model's verify graph, timed under
    each kernel, decides for the model's own weights, once per machine, and for no other set."""
    monkeypatch.setenv("SPECFX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(matmul_choice, "_memory", {})
    monkeypatch.setattr(matmul_choice, "measure", lambda ws, M, rows: {"linears": 2, "tiled_ms": 1.0, "blas_ms": 2.0})
    graph_ms = {"tiled": 3.0, "reduce": 2.0}
    clock = iter(range(100_000))
    monkeypatch.setattr(matmul_choice.time, "perf_counter", lambda: next(clock))
    built = []

    def verify(kernel):                              # a call that takes graph_ms[kernel] ticks
        built.append(kernel)
        return lambda: [next(clock) for _ in range(int(graph_ms[kernel]) - 1)]

    weights = [torch.randn(8, 4), torch.randn(4, 8)]
    plan = matmul_choice.MatmulPlan(weights)
    plan.include([w.to(torch.int8) for w in weights], rows=torch.float32)
    assert plan(4, 8, 4, torch.float32).kernel == "tiled"           # the chains' choice, before
    plan.settle(4, verify)
    assert sorted(built) == ["reduce", "tiled"]
    assert plan(4, 8, 4, torch.float32).kernel == "reduce"
    assert "the model's verify at these rows took tiled 3000.00 ms, reduce 2000.00 ms: reduce" in plan(4, 8, 4).reason
    assert plan(4, 8, 4, torch.int8).kernel == "tiled"              # another weight set: its chains decide
    assert plan(2, 8, 4).kernel == "tiled"                          # another row count: not settled
    plan.settle(1, verify)                                          # one row: the chains time the reduction
    plan.settle(MAX_ROWS + 1, verify)                               # more than the reduction unrolls
    assert len(built) == 2
    # Remembered: a new process reads the graphs' timing instead of compiling them again.
    monkeypatch.setattr(matmul_choice, "_memory", {})
    again = matmul_choice.MatmulPlan(weights)
    again.settle(4, lambda kernel: pytest.fail("timed again"))
    assert again(4, 8, 4).kernel == "reduce"
    # A near tie keeps the tiled kernel (SETTLE_MARGIN): timed alone, the order flips with drift.
    graph_ms.update(tiled=100.0, reduce=97.0)
    plan.settle(6, verify)
    assert plan(6, 8, 4).kernel == "tiled" and ("reduce 97000.00 ms (the reduction's under 95% of the tiled "
                                                "kernel's in 0 of 5 blocks): tiled") in plan(6, 8, 4).reason
    # So does a reduction faster in some blocks of rounds but not in all: one moment decides nothing.
    blocks, round_robin = iter([2.0, 2.0, 2.0, 2.0, 4.0]), matmul_choice.round_robin

    def drifting(calls, repeats, before=None):
        graph_ms.update(tiled=3.0, reduce=next(blocks))
        return round_robin(calls, repeats, before)

    monkeypatch.setattr(matmul_choice, "round_robin", drifting)
    plan.settle(7, verify)
    assert plan(7, 8, 4).kernel == "tiled"
    assert "reduce 2000.00 ms (the reduction's under 95% of the tiled kernel's in 4 of 5 blocks): tiled" in plan(7, 8, 4).reason
    monkeypatch.setattr(matmul_choice, "round_robin", round_robin)
    # A verify graph that does not compile or run leaves the chains' choice, with a warning.
    def broken(kernel):
        raise RuntimeError("no compiler")

    with pytest.warns(UserWarning, match="could not be timed"):
        plan.settle(2, lambda kernel: broken(kernel) if kernel == "reduce" else verify(kernel))
    with pytest.warns(UserWarning, match="could not be timed"):
        plan.settle(3, broken)
    assert plan(2, 8, 4).kernel == "tiled" and plan(3, 8, 4).kernel == "tiled"
    # Where the chains already prefer another kernel, nothing is compiled.
    monkeypatch.setattr(matmul_choice, "measure", lambda ws, M, rows: {"linears": 2, "tiled_ms": 3.0, "blas_ms": 2.0})
    matmul_choice.MatmulPlan(weights).settle(5, lambda kernel: pytest.fail("no question to settle"))


def test_a_drafts_one_row_kernel_is_settled_in_its_draft_pass(tmp_path, monkeypatch):
    """A draft's set at one row, where its chains chose the tiled kernel: its pass decides, timed
    `calls` times in a row after the model's weights (untimed), once per machine and count; with
    `warm`, after one more pass (untimed)."""
    monkeypatch.setenv("SPECFX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(matmul_choice, "_memory", {})
    monkeypatch.setattr(matmul_choice, "measure", lambda ws, M, rows: {"linears": 2, "tiled_ms": 1.0,
                                                                       "reduce_ms": 2.0, "blas_ms": 3.0})
    graph_ms = {"tiled": 3.0, "reduce": 2.0}
    clock = iter(range(100_000))
    monkeypatch.setattr(matmul_choice.time, "perf_counter", lambda: next(clock))
    calls, streamed = [], []

    def draft(kernel):                               # a pass of graph_ms[kernel] ticks (three, and the timing's own)
        return lambda: calls.append(kernel) or [next(clock) for _ in range(int(graph_ms[kernel]))]

    weights = [torch.randn(8, 4), torch.randn(4, 8)]
    plan = matmul_choice.MatmulPlan(weights)
    head = plan.include([w.to(torch.int8) for w in weights], rows=torch.float32)
    assert head == 1 and plan.include([torch.randn(3)]) is None     # a set without a matrix: nothing to settle
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "sum", lambda self, *a, **k: streamed.append(self.shape))
        plan.settle(1, draft, head, calls=3)
    assert plan(1, 8, 4, torch.int8).kernel == "reduce"
    reason = plan(1, 8, 4, torch.int8).reason
    assert "the draft's pass at these rows took tiled 10000.00 ms, reduce 7000.00 ms: reduce" in reason
    rounds = matmul_choice.SETTLE_BLOCKS * (matmul_choice.GRAPH_REPEATS + 1)       # each block's warm-up round too
    assert calls.count("tiled") == calls.count("reduce") == 3 * rounds            # three passes a timing
    assert len(streamed) == 2 * len(weights) * rounds                             # the model's weights before each
    assert plan(1, 8, 4, torch.float32).kernel == "tiled"         # the model's own set: not settled at one row
    plan.settle(1, lambda kernel: pytest.fail("the model's one row is not settled"))

    # Warm (an MTP head's drafts, after its refill): one more pass before each timing, untimed,
    # remembered apart from the cold timing.
    warm = matmul_choice.MatmulPlan(weights)
    head = warm.include([w.to(torch.int8) for w in weights], rows=torch.float32)
    calls.clear()
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "sum", lambda self, *a, **k: streamed.append(self.shape))
        warm.settle(1, draft, head, calls=3, warm=True)
    assert calls.count("tiled") == calls.count("reduce") == 4 * rounds
    assert "the draft's pass at these rows took tiled 10000.00 ms, reduce 7000.00 ms" in warm(1, 8, 4, torch.int8).reason
    assert len({k for k in matmul_choice._load() if "draft graph x3" in k}) == 2


def test_build_settles_the_verify_width_on_the_verify_graph(tmp_path, monkeypatch):
    """`build` asks a measured plan to settle the verify's width, and the verify it hands over
    runs under the kernel asked for; the step's verify then takes the kernel the plan chose."""
    from specfx import pipeline
    from specfx.kernels import tiled_linear

    if not tiled_linear.available()[0]:
        pytest.skip(tiled_linear.available()[1])
    monkeypatch.setenv("SPECFX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(matmul_choice.ENV, raising=False)
    monkeypatch.setattr(matmul_choice, "_memory", {})
    monkeypatch.setattr(matmul_choice, "measure", lambda ws, M, rows: {"linears": len(ws), "tiled_ms": 1.0,
                                                                       "reduce_ms": 2.0, "blas_ms": 2.0})
    monkeypatch.setattr(pipeline, "SETTLE_BACKEND", "eager")
    ran = {}

    def timed(calls, repeats, before=None):
        for kernel, call in calls.items():
            out = call()
            ran[kernel] = out[0].shape
        return {"tiled": 2e-3, "reduce": 1e-3}

    monkeypatch.setattr(matmul_choice, "round_robin", timed)
    model = tiny_model("llama", layers=2, seed=5)
    fast = specfx.compile(model, draft="ngram:2", num_speculative_tokens=3, max_seq_len=32, backend="eager",
                          skinny_matmul=True, warmup=False)
    assert set(ran) == {"tiled", "reduce"} and all(shape[:2] == (1, 4) for shape in ran.values())
    verify = fast.graphs.parts["verify"]
    assert _count(verify, torch.ops.specfx.tiled_linear.default) == 0
    prompt = torch.randint(3, 96, (1, 9))
    assert_greedy_equal(model, fast.generate(prompt, max_new_tokens=12), hf_greedy(model, prompt, 12), 9)


def test_a_fixed_plan_names_the_kernels_without_measuring(monkeypatch):
    monkeypatch.setattr(matmul_choice, "measure", lambda ws, M, rows: pytest.fail("measured"))
    weights = [torch.randn(8, 4)]
    fixed = matmul_choice.plan(weights, "1:reduce, 4:blas, tiled")
    assert [fixed(M, 8, 4).kernel for M in (1, 2, 4, 64)] == ["reduce", "tiled", "blas", "tiled"]
    assert fixed(1, 8, 4).reason == "M=1: reduce, as the plan '1:reduce, 4:blas, tiled' says"
    monkeypatch.setenv(matmul_choice.ENV, "blas")                 # every compile's, unless one names its own
    assert matmul_choice.plan(weights)(1, 8, 4).kernel == "blas"
    assert matmul_choice.plan(weights, "reduce")(1, 8, 4).kernel == "reduce"
    monkeypatch.delenv(matmul_choice.ENV)
    assert isinstance(matmul_choice.plan(weights), matmul_choice.MatmulPlan)
    for spec, words in [("fast", "got 'fast'"), ("x:tiled,blas", "got 'x:tiled'"), ("1:reduce", "every other row count")]:
        with pytest.raises(ValueError, match=words):
            matmul_choice.plan(weights, spec)


@pytest.mark.parametrize("draft", ["early-exit:2", "mtp"])
def test_int8_drafts_take_the_kernel_timed_on_their_own_weights(draft, tmp_path, monkeypatch):
    """Early exit's stored layers and an MTP head's stored lm_head have the target's shapes: where
    the float32 model's linears time fastest as the reduction and the int8 copies' as the tiled
    kernel, the draft graph reads every int8 weight through the tiled kernel (the plan once took
    the first set of the shape, the target's, and drafted from int8 rows 4x slower). The draft's
    one-row pass, timed under both kernels after the model's weights, has the last word: where
    the reduction's runs faster, every int8 weight goes to the reduction."""
    from specfx import pipeline
    from specfx.kernels import tiled_linear
    from specfx.mtp import new_head, save_head

    if not tiled_linear.available()[0]:
        pytest.skip(tiled_linear.available()[1])
    monkeypatch.delenv(matmul_choice.ENV, raising=False)            # measured (as the lambda below says)
    monkeypatch.setattr(matmul_choice, "measure", lambda ws, M, rows: (
        {"linears": len(ws), "tiled_ms": 0.3, "reduce_ms": 1.0} if ws[0].dtype == torch.int8
        else {"linears": len(ws), "tiled_ms": 1.1, "reduce_ms": 1.0, "blas_ms": 2.0}))
    monkeypatch.setattr(pipeline, "SETTLE_BACKEND", "eager")
    settled = []
    model = tiny_model("llama", layers=4, seed=3)
    if draft == "mtp":
        draft = specfx.MTPHead(save_head(new_head(model), tmp_path / "head", model))
    for faster in ("tiled", "reduce"):
        def timed(calls, repeats, before=None):
            outs = [call() for call in calls.values()]          # each kernel's draft pass runs
            settled.append((before is not None, len(outs)))
            return {"tiled": 2e-3, "reduce": 2e-3, faster: 1e-3}

        monkeypatch.setattr(matmul_choice, "round_robin", timed)
        monkeypatch.setenv("SPECFX_CACHE_DIR", str(tmp_path / faster))
        monkeypatch.setattr(matmul_choice, "_memory", {})
        fast = specfx.compile(model, draft=draft, num_speculative_tokens=3, max_seq_len=32, backend="eager",
                              skinny_matmul=True, warmup=False)
        assert settled == [(True, 2)] * matmul_choice.SETTLE_BLOCKS     # the draft's pass, after the model's weights
        settled.clear()
        gm = fast.graphs.parts["draft"]
        vals = {n: n.meta.get("val") for n in gm.graph.nodes}
        int8 = lambda n: isinstance(n, torch.fx.Node) and vals[n] is not None and vals[n].dtype == torch.int8  # noqa: E731
        tiled = [w for w in _tiled_weights(gm) if int8(w)]
        widened = [n.args[0] for n in gm.graph.nodes if n.target is aten.to.dtype and int8(n.args[0])]
        on = tiled if faster == "tiled" else widened
        assert on and not (widened if faster == "tiled" else tiled)   # every int8 weight on one kernel
        if str(draft).startswith("early-exit"):
            assert len(on) == 2 * 7 + 1             # the layers before the exit, the lm_head
        else:
            assert any(vals[w].shape == model.lm_head.weight.shape for w in on)   # the stored lm_head


def test_a_draft_models_one_row_kernel_is_settled_in_its_draft_pass(tmp_path, monkeypatch):
    """A draft model's float32 linears at one row, where their chains chose the tiled kernel: its
    one-row pass, timed after the target's weights, decides."""
    from specfx import pipeline
    from specfx.kernels import tiled_linear

    if not tiled_linear.available()[0]:
        pytest.skip(tiled_linear.available()[1])
    monkeypatch.setenv("SPECFX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(matmul_choice.ENV, raising=False)
    monkeypatch.setattr(matmul_choice, "_memory", {})
    model, draft = tiny_model("llama", layers=4, seed=3), tiny_model("llama", layers=1, seed=4)
    draft_linears = sum(p.dim() == 2 for p in draft.parameters())
    monkeypatch.setattr(matmul_choice, "measure", lambda ws, M, rows: (
        {"linears": len(ws), "tiled_ms": 0.3, "reduce_ms": 1.0, "blas_ms": 2.0} if len(ws) == draft_linears
        else {"linears": len(ws), "tiled_ms": 1.1, "reduce_ms": 1.0, "blas_ms": 2.0}))
    monkeypatch.setattr(pipeline, "SETTLE_BACKEND", "eager")
    settled = []

    def timed(calls, repeats, before=None):
        for call in calls.values():
            call()
        settled.append("draft" if before is not None else "verify")
        return {"tiled": 2e-3, "reduce": 1e-3}

    monkeypatch.setattr(matmul_choice, "round_robin", timed)
    fast = specfx.compile(model, draft=specfx.DraftModel(draft), num_speculative_tokens=2, max_seq_len=32,
                          backend="eager", skinny_matmul=True, warmup=False)
    assert settled == ["draft"] * matmul_choice.SETTLE_BLOCKS    # (the model's chains chose the reduction: no verify to settle)
    gm = fast.graphs.parts["draft"]
    assert _count(gm, torch.ops.specfx.tiled_linear.default) == 0 and _tiled_weights(gm) == []
    prompt = torch.randint(3, 96, (1, 9))
    assert_greedy_equal(model, fast.generate(prompt, max_new_tokens=12), hf_greedy(model, prompt, 12), 9)


@pytest.mark.slow
def test_measure_times_every_kernel_on_the_models_weights():
    weights = [torch.randn(64, 32), torch.randn(32, 64)]
    t = matmul_choice.measure(weights, 1)
    assert t["linears"] == 2 and t["tiled_ms"] > 0 and t["reduce_ms"] > 0 and t["blas_ms"] > 0
    assert matmul_choice.forms([w.bfloat16() for w in weights], 2) == ["reduce", "blas"]        # a bfloat16 model
    stored = [w.bfloat16() for w in weights]                        # a draft's weights stored in bfloat16
    assert matmul_choice.forms(stored, 2, rows=torch.float32) == ["tiled", "blas"]
    assert matmul_choice.measure(stored, 2, rows=torch.float32)["tiled_ms"] > 0
    # Over several rows the reduction does not compete with the tiled kernel (see `forms`).
    assert matmul_choice.forms(weights, 2) == ["tiled", "blas"]
    assert matmul_choice.forms(weights, MAX_ROWS + 1) == ["tiled", "blas"]      # past what the rewrite unrolls


def test_round_robin_calls_each_once_a_round_in_shuffled_orders_and_drops_the_warm_up_round(monkeypatch):
    order, clock = [], iter(range(1000))
    monkeypatch.setattr(matmul_choice.time, "perf_counter", lambda: next(clock))
    calls = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c", "d")}
    times = matmul_choice.round_robin(calls, 7)
    rounds = [order[i:i + 4] for i in range(0, len(order), 4)]
    assert len(rounds) == 8 and all(sorted(r) == ["a", "b", "c", "d"] for r in rounds)   # interleaved
    assert len({tuple(r) for r in rounds}) > 1                     # no fixed order: no fixed predecessor
    assert {r[0] for r in rounds} != {"a"}
    assert times == {"a": 1, "b": 1, "c": 1, "d": 1}               # each call spans one tick of the clock
    assert matmul_choice.round_robin(calls, 7) and order[32:] == order[:32]    # seeded: a run repeats
