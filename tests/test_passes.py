"""Each pass: graph before -> run the pass -> graph after -> numerics against eager."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from helpers import span, tiny_model
from specfx.capture import capture, kv_shape
from specfx.passes import (REGISTRY, AttachEarlyExit, CheckNoHostSync, CutAtExit, DropHead, InlineGraphCalls,
                           PassError, PassManager, PassOrderError, ShareKVBuffers, TreeAttention, TruncateAtExit,
                           find_host_syncs)
from specfx.passes.find_structure import layer_index
from specfx.runtime.step import trace_step

L, W, S = 4, 3, 32


@pytest.fixture
def setup():
    model = tiny_model("llama", layers=L)
    ids = torch.randint(3, 96, (1, W))
    pos = torch.arange(W)[None]
    with torch.no_grad():
        hf = model(ids, output_hidden_states=True)
    return model, ids, pos, hf


def _layers(gm, stack):
    return {layer_index(n, stack) for n in gm.graph.nodes} - {None}


def _head(model, h):
    return model.lm_head(model.model.norm(h))


def _outputs(gm):
    return next(n for n in gm.graph.nodes if n.op == "output").args[0]


@pytest.mark.parametrize("E", [1, 2, 3])
def test_attach_early_exit(setup, E):
    model, ids, pos, hf = setup
    cg = capture(model, width=W, max_seq_len=S)
    assert len(_outputs(cg.gm)) == 1
    res = AttachEarlyExit(E)(cg.gm)
    assert res.modified and len(_outputs(res.graph_module)) == 3
    with torch.no_grad():
        logits, exit_logits, exit_hidden = res.graph_module(ids, pos, span(S))
        torch.testing.assert_close(logits, hf.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(exit_hidden, hf.hidden_states[E], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(exit_logits, _head(model, hf.hidden_states[E]), atol=1e-4, rtol=1e-4)
    again = AttachEarlyExit(E)(res.graph_module)
    assert not again.modified and "already attached" in again.reason


def test_attach_early_exit_rejects_out_of_range_layers(setup):
    cg = capture(setup[0], width=W, max_seq_len=S)
    for bad in (0, L, L + 3, -1):
        with pytest.raises(ValueError, match="out of range"):
            AttachEarlyExit(bad)(cg.gm)


def test_truncate_at_exit(setup):
    model, ids, pos, hf = setup
    E = 2
    cg = capture(model, width=W, max_seq_len=S)
    gm = AttachEarlyExit(E)(cg.gm).graph_module
    assert _layers(gm, cg.structure.stack_path) == set(range(L))
    res = TruncateAtExit(E)(gm)
    assert res.modified
    assert _layers(res.graph_module, cg.structure.stack_path) == set(range(E))
    with torch.no_grad():
        exit_logits, exit_hidden = res.graph_module(ids, pos, span(S))
    torch.testing.assert_close(exit_hidden, hf.hidden_states[E], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(exit_logits, _head(model, hf.hidden_states[E]), atol=1e-4, rtol=1e-4)
    # KV of layers < E written, layers >= E untouched.
    assert res.graph_module.kv_k_0.abs().sum() > 0
    assert res.graph_module.kv_k_1.abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16])
def test_store_draft_weights(setup, dtype):
    """Every linear of the draft graph (the layers before the exit and the lm_head's copy) reads
    its own int8 (or bfloat16) copy of its weight, widened where read (and scaled by row, for
    int8): the draft graph computes what the model computes with those weights, and no longer
    reads the model's own."""
    import copy

    from specfx.kernels.tiled_linear import store_rows
    from specfx.passes import StoreDraftWeights

    model, ids, pos, hf = setup
    E = 2
    with pytest.raises(PassOrderError, match="run attach_early_exit and truncate_at_exit first"):
        StoreDraftWeights(dtype)(AttachEarlyExit(E)(capture(model, width=W, max_seq_len=S).gm).graph_module)
    gm = TruncateAtExit(E)(AttachEarlyExit(E)(capture(model, width=W, max_seq_len=S).gm).graph_module).graph_module
    before = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)
               and (name == "lm_head" or int(name.split(".")[2]) < E)}
    res = StoreDraftWeights(dtype)(gm)
    assert res.modified and res.info["stored"] == len(linears) == 7 * E + 1
    g = res.graph_module
    read = {n.target for n in g.graph.nodes if n.op == "get_attr"}
    assert not {f"model.{name}.weight" for name in linears} & read                     # read by none
    stored = [n for n in g.graph.nodes if n.op == "get_attr" and n.target not in before]
    assert {str(n.meta["val"].dtype) for n in stored} == {str(dtype)} | ({"torch.float32"} if dtype == torch.int8 else set())
    like = copy.deepcopy(model)                              # the model with the stored weights, widened
    with torch.no_grad():
        for name in linears:
            lin = like.get_submodule(name)
            q, scale = store_rows(lin.weight, dtype)
            lin.weight.copy_(q.float() * (scale[:, None] if scale is not None else 1))
        want = like(ids, output_hidden_states=True).hidden_states[E]
        exit_logits, exit_hidden = g(ids, pos, span(S))
    torch.testing.assert_close(exit_hidden, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(exit_logits, _head(like, want), atol=1e-4, rtol=1e-4)
    assert not torch.equal(exit_hidden, hf.hidden_states[E])     # not the model's own


def test_pass_order_is_checked(setup):
    """A pass that needs an earlier one refuses a graph without it, naming the pass to run."""
    cg = capture(setup[0], width=W, max_seq_len=S)
    with pytest.raises(PassOrderError, match="run attach_early_exit first"):
        TruncateAtExit(2)(cg.gm)
    with pytest.raises(PassOrderError, match="at layer 3 attached"):           # another exit's
        TruncateAtExit(3)(AttachEarlyExit(2)(cg.gm).graph_module)
    bare = capture(setup[0], width=W, max_seq_len=S).gm
    del bare.meta["structure"]                                                  # a graph nobody mapped
    with pytest.raises(PassOrderError, match="run find_structure on it first"):
        CutAtExit(2)(bare)
    cut = CutAtExit(2)(capture(setup[0], width=W, max_seq_len=S).gm).graph_module
    with pytest.raises(PassOrderError, match="cut already"):
        CutAtExit(2)(cut)
    step = trace_step(torch.nn.Sequential(cut))                                 # a step calling a graph
    with pytest.raises(PassOrderError, match="run inline_graph_calls first"):
        CheckNoHostSync()(step)


def test_drop_head(setup):
    model, ids, pos, hf = setup
    cg = capture(model, width=W, max_seq_len=S)
    res = DropHead()(cg.gm)
    assert res.modified and not any(n.name in cg.structure.head_nodes for n in res.graph_module.graph.nodes)
    with torch.no_grad():
        (hidden,) = res.graph_module(ids, pos, span(S))
    # The residual stream before the final norm (transformers' last hidden state is after it).
    torch.testing.assert_close(model.model.norm(hidden), hf.hidden_states[L], atol=1e-4, rtol=1e-4)
    assert not DropHead()(res.graph_module).modified


@pytest.mark.parametrize("E", [1, 3])
def test_cut_at_exit(setup, E):
    model, ids, pos, hf = setup
    cg = capture(model, width=W, max_seq_len=S)
    res = CutAtExit(E)(cg.gm)
    gm = res.graph_module
    assert [n.name for n in gm.graph.nodes if n.op == "placeholder"] == ["exit_hidden", "positions", "span"]
    assert _layers(gm, cg.structure.stack_path) == set(range(E, L))
    assert not any(n.target is torch.ops.aten.embedding.default for n in gm.graph.nodes)
    with torch.no_grad():
        (logits,) = gm(hf.hidden_states[E], pos, span(S))
    torch.testing.assert_close(logits, hf.logits, atol=1e-4, rtol=1e-4)


def test_share_kv_buffers(setup):
    model, ids, pos, hf = setup
    cg = capture(model, width=W, max_seq_len=S)
    assert sum(n.op == "get_attr" and n.target.startswith("kv_") for n in cg.gm.graph.nodes) == 2 * L
    res = ShareKVBuffers()(cg.gm)
    gm = res.graph_module
    assert res.modified and gm.meta["kv_inputs"] == [f"kv_{t}_{i}" for i in range(L) for t in "kv"]
    assert not any(n.op == "get_attr" and n.target.startswith("kv_") for n in gm.graph.nodes)
    kv = [torch.zeros(kv_shape(model.config, 1, S + 1)) for _ in range(2 * L)]
    with torch.no_grad():
        (logits,) = gm(ids, pos, span(S), *kv)
    torch.testing.assert_close(logits, hf.logits, atol=1e-4, rtol=1e-4)
    assert all(t.abs().sum() > 0 for t in kv)  # the caller's tensors were written
    assert not ShareKVBuffers()(gm).modified


@pytest.mark.parametrize("parents", [(-1, -1, 0, 2), (-1, 0, 1)])
def test_tree_attention(setup, parents):
    """The verify graph over a tree takes `last` instead of positions, slots and the mask, builds
    them from the tree, and computes the logits and KV writes the explicit inputs give."""
    from specfx.capture import kv_slots
    from specfx.runtime.tree import Tree

    model, tree, B = setup[0], Tree(parents), 2
    width = tree.size + 1
    cap = lambda: capture(model, width=width, batch_size=B, max_seq_len=S, explicit_mask=True).gm  # noqa: E731
    before = ShareKVBuffers()(cap()).graph_module
    assert [n.name for n in before.graph.nodes if n.op == "placeholder"][:5] == \
        ["input_ids", "positions", "span", "slots", "visible"]
    res = TreeAttention(tree, S - 1)(cap())
    after = ShareKVBuffers()(res.graph_module).graph_module
    assert res.modified and res.info["rows"] == width
    assert [n.name for n in after.graph.nodes if n.op == "placeholder"][:3] == ["input_ids", "last", "span"]
    with pytest.raises(PassOrderError, match="already takes `last`"):
        TreeAttention(tree, S - 1)(res.graph_module)
    with pytest.raises(ValueError, match=f"reads {width} rows"):
        TreeAttention(Tree.chain(width), S - 1)(cap())
    ids, last = torch.randint(3, 96, (B, width)), torch.tensor([5, 11])
    kv_before = [torch.randn(kv_shape(model.config, B, kv_slots(S))) for _ in range(2 * L)]
    kv_after = [t.clone() for t in kv_before]
    explicit = (tree.positions(last), span(S), tree.slots(last), tree.visibility(last, kv_slots(S)))
    with torch.no_grad():
        (want,) = before(ids, *explicit, *kv_before)
        (got,) = after(ids, last, span(S), *kv_after)
    torch.testing.assert_close(got, want)
    assert all(torch.equal(x, y) for x, y in zip(kv_before, kv_after))

    # Over a shorter span the mask is built over the span's slots only, never the whole cache's.
    masks = []

    class Masks(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor) and out.dtype == torch.bool and out.dim() == 4:
                masks.append(out.shape[-1])
            return out

    with torch.no_grad():
        (want,) = before(ids, explicit[0], span(20), *explicit[2:], *kv_before)
        (got,) = Masks(after).run(ids, last, span(20), *kv_after)
    torch.testing.assert_close(got, want)
    assert masks and set(masks) == {20}, masks


@pytest.mark.parametrize("draft, calls", [("early-exit:2", ["drafter.draft"] * 4 + ["verify"]), ("ngram:2", ["verify"])])
def test_inline_graph_calls_inlines_calls_and_keeps_numerics(draft, calls):
    import specfx

    model = tiny_model("llama", layers=L)
    fast = specfx.compile(model, draft=draft, num_speculative_tokens=3, max_seq_len=S, backend="eager")
    unfused, fused = fast.graphs.unfused_step, fast.graphs.step
    assert [n.target for n in unfused.graph.nodes if n.op == "call_module"] == calls
    assert not any(n.op == "call_module" for n in fused.graph.nodes)
    # Same state in (an active row, its prompt's KV written), same state and KV out.
    st = fast.graphs.state
    ids = torch.randint(3, 96, (6,), generator=torch.Generator().manual_seed(1))
    st.load_prompts([ids], 12, [])
    fast.runtime.prefill(6)
    before = _state(st)
    with torch.no_grad():
        fused(*st.step_args())
    after_fused = _state(st)
    for t, s in zip(st.tensors().values(), before.values()):
        t.copy_(s)
    with torch.no_grad():
        unfused(*st.step_args())
    after_unfused = _state(st)
    assert after_fused["lengths"].item() > before["lengths"].item()      # the step wrote tokens ...
    assert not torch.equal(after_fused["kv_0"], before["kv_0"])          # ... and KV
    for name, t in after_fused.items():
        assert torch.equal(t, after_unfused[name]), name
    assert not InlineGraphCalls()(fused).modified


def _state(st) -> dict[str, torch.Tensor]:
    """A copy of every state tensor (KV included), by name."""
    return {name: t.clone() for name, t in st.tensors().items()}


def test_check_no_host_sync_flags_syncs_and_passes_the_step():
    class Bad(torch.nn.Module):
        def forward(self, x):
            n = x.sum().item()
            return x.nonzero(), x + n

    gm = fx.symbolic_trace(Bad())
    res = CheckNoHostSync()(gm)
    assert not res.modified
    assert any("item" in s for s in res.info["host_syncs"])
    assert any("nonzero" in s for s in res.info["host_syncs"])
    ep = torch.export.export(Bad(), (torch.ones(3),))
    aten_syncs = find_host_syncs(ep.module())
    assert any("_local_scalar_dense" in s or "item" in s for s in aten_syncs)
    assert any("nonzero" in s for s in aten_syncs)


def test_pass_manager_records_and_names_the_failing_pass(setup):
    cg = capture(setup[0], width=W, max_seq_len=S)
    pm = PassManager()
    gm = pm.run_all([AttachEarlyExit(2), TruncateAtExit(2)], cg.gm, graph="draft")
    names = [r.name for r in pm.records]
    assert names == ["attach_early_exit", "truncate_at_exit"]
    assert pm.records[0].nodes_added > 0 and pm.records[1].nodes_removed > 0
    assert all(r.kind == "rewrite" and r.modified for r in pm.records)

    class Broken(AttachEarlyExit):
        pass_name = "broken_pass"

        def call(self, gm):
            raise RuntimeError("boom")

    with pytest.raises(PassError, match=r"pass broken_pass failed on graph draft: boom \(passes run before it: "
                                        r"attach_early_exit, truncate_at_exit\)"):
        pm.run(Broken(2), gm, graph="draft")
    REGISTRY.pop("broken_pass")


def test_every_pass_is_registered_with_a_docstring():
    expected = {"find_structure", "attach_early_exit", "truncate_at_exit", "cut_at_exit", "drop_head",
                "expose_hidden", "share_kv_buffers", "inline_graph_calls", "check_no_host_sync", "skinny_matmul"}
    assert expected <= set(REGISTRY)
    for name in expected:
        assert REGISTRY[name].summary(), name
        assert REGISTRY[name].kind in ("analysis", "rewrite")


@pytest.mark.parametrize("draft", ["none", "early-exit:2", "ngram:2", "draft-model", "mtp"])
def test_every_drafters_step_is_one_graph_without_host_sync(tmp_path, draft):
    """check_no_host_sync on the fused greedy and sampling steps, and dynamo traces each with
    no graph break (what `torch.compile(fullgraph=True)` needs)."""
    import specfx
    from specfx.mtp import new_head, save_head

    model = tiny_model("llama", layers=L)
    if draft == "draft-model":
        draft = specfx.DraftModel(tiny_model("llama", layers=1, seed=3))
    elif draft == "mtp":
        draft = specfx.MTPHead(save_head(new_head(model), tmp_path / "head", model))
    fast = specfx.compile(model, draft=draft, num_speculative_tokens=2, max_seq_len=S, backend="eager")
    g = fast.graphs
    g.state.load_prompts([torch.ones(3, dtype=torch.long)], 4, [])
    for step in (g.step, g.fused_sample_step()):
        assert find_host_syncs(step) == []
        torch._dynamo.reset()
        explain = torch._dynamo.explain(step)(*g.state.step_args())
        assert explain.graph_break_count == 0 and explain.graph_count == 1
    torch._dynamo.reset()
