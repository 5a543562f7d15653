"""Attention over the host-chosen span: masks, windows, both forms, and the runtime's choice of span."""

from __future__ import annotations

import pytest
import torch

import specfx
from helpers import assert_greedy_equal, hf_greedy, span, tiny_model
from specfx.attention import attend, visibility
from specfx.capture import capture


def test_visibility_masks_later_slots_and_slots_outside_the_window():
    pos = torch.tensor([[2, 5]])
    assert visibility(pos, 7, 0)[0, 0].int().tolist() == [[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 0]]
    assert visibility(pos, 7, 3)[0, 0].int().tolist() == [[1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 0]]


@pytest.mark.parametrize("softcap", [0.0, 5.0])
@pytest.mark.parametrize("tiled", [False, True])
def test_reduce_forms_equal_sdpa_form_with_grouped_heads(softcap, tiled):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 3, 16, generator=g), torch.randn(2, 2, 10, 16, generator=g),
               torch.randn(2, 2, 10, 16, generator=g))
    visible = visibility(torch.tensor([[4, 5, 6], [7, 8, 9]]), 10, 4)
    a = attend(q, k, v, visible, 0.3, softcap, reduce=True, tiled=tiled)
    b = attend(q, k, v, visible, 0.3, softcap, reduce=False)
    assert a.shape == (2, 3, 4, 16)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_span_reads_only_its_slots():
    """Within the span, outputs equal those over the whole cache; a span that leaves out a
    visible slot changes them (so the runtime's choice of span matters)."""
    model = tiny_model("llama", layers=2)
    cg = capture(model, width=2, max_seq_len=64)
    with torch.no_grad():
        cg.gm(torch.randint(3, 96, (1, 2)), torch.tensor([[0, 1]]), span(64))
        for name, buf in cg.gm.named_buffers():                      # stale entries past position 3
            if name.startswith("kv_"):
                buf[:, 4:].normal_()
        ids, pos = torch.randint(3, 96, (1, 2)), torch.tensor([[2, 3]])
        full = cg.gm(ids, pos, span(64))[0]
        live = cg.gm(ids, pos, span(4))[0]
        short = cg.gm(ids, pos, span(3))[0]
    torch.testing.assert_close(live, full, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(short[0, 1], full[0, 1], atol=1e-3)


def test_cpu_forms_read_each_query_once():
    """On the CPU every layer's scores read its query once: the tiled form hands the queries to
    `tiled_attend` (scores, softmax and weighted values in one kernel); the reduction form reads them
    from a materialized buffer (else Inductor recomputes the query's rotary inside the loop over
    cache slots). The SDPA form has neither. The tiled kernels' layers read one mask, built once."""
    from specfx.capture import StaticDecoder
    from specfx.passes.skinny_matmul import MATERIALIZE

    ops = torch.ops.specfx
    model = tiny_model("llama", layers=3)
    for reduce, tiled in ((True, True), (True, False), (False, False)):
        decoder = StaticDecoder(model, 1, 32, reduce_attention=reduce)
        assert decoder.tiled_attention == reduce                     # float32 on the CPU: tiled
        decoder.tiled_attention = tiled
        gm = capture(model, width=4, max_seq_len=32, decoder=decoder).gm
        count = lambda target: sum(n.op == "call_function" and n.target is target for n in gm.graph.nodes)  # noqa
        assert count(ops.tiled_attend.default) == (3 if tiled else 0)
        assert count(torch.ops.aten.where.Scalar) == (1 if tiled else 0)     # one mask for every layer
        assert count(ops.tiled_linear.default) == count(ops.tiled_mix.default) == 0
        hints = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is MATERIALIZE]
        assert len(hints) == (3 if reduce and not tiled else 0)
        for n in hints:                                            # feeds the q * k product
            assert any(u.target is torch.ops.aten.unsqueeze.default and
                       any(m.target is torch.ops.aten.mul.Tensor for m in u.users) for u in n.users)


def test_cpu_prefill_attention_takes_the_tiled_kernel(monkeypatch):
    """A prefill graph (symbolic width) on the CPU runs every layer's attention through
    `tiled_attend`, over one mask; with `TILED_PREFILL` off, through SDPA. Both give the model's
    logits."""
    from specfx import attention
    from specfx.capture import StaticDecoder

    model = tiny_model("llama", layers=2)
    ids = torch.randint(0, model.config.vocab_size, (1, 9))
    want = model(ids).logits
    for tiled in (True, False):
        monkeypatch.setattr(attention, "TILED_PREFILL", tiled)       # the capture is remembered per form
        decoder = StaticDecoder(model, 1, 32, reduce_attention=True)
        gm = capture(model, width=16, max_seq_len=32, decoder=decoder, dynamic_width=True).gm
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert targets.count(torch.ops.specfx.tiled_attend.default) == (2 if tiled else 0)
        assert sum("scaled_dot_product" in str(t) for t in targets) == (0 if tiled else 2)
        if tiled:
            assert targets.count(torch.ops.aten.where.Scalar) == 1                # one mask for every layer
        pos = torch.arange(9)[None]
        span = torch.empty(16)
        got = gm(ids, pos, span)[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("draft", ["none", "early-exit:1", "mtp", "mtp-tree", "self", "self-tree"])
def test_runtime_spans_cover_every_position(draft, tmp_path):
    """The live span the runtime picks before each step gives the tokens and the cache that the
    whole cache gives, over prompts that span several prefill chunks and generations that cross
    span blocks; a tree's step writes N+1 slots ahead. The model drafting for itself accepts
    every draft of its spine, so that every row's attention reaches the step's last slot (a
    random model's tokens barely depend on attention: its second layer's keys and values do)."""
    from specfx.runtime.generate import SPAN_ALIGN

    model = tiny_model("qwen2", layers=2, seed=4)
    if draft.startswith("self"):
        draft = specfx.DraftModel(model, tree=(2, 2, 1) if draft == "self-tree" else None)
    elif draft.startswith("mtp"):
        from specfx.mtp import new_head, save_head

        tree = (2, 2, 1) if draft == "mtp-tree" else None
        draft = specfx.MTPHead(save_head(new_head(model), tmp_path / "head", model), tree=tree)
    k = None if getattr(draft, "tree", None) else 3
    fast = specfx.compile(model, draft=draft, num_speculative_tokens=k, max_seq_len=200, backend="eager",
                          prefill_chunk=32)
    assert fast.runtime.live_span
    ids = torch.randint(3, 96, (1, 73), generator=torch.Generator().manual_seed(1))
    st = fast.graphs.state
    for length in (70, 71, 72, 73):         # a step's last slot meets a span's end at one of them
        fast.runtime.live_span = True
        live = fast.generate(ids[:, :length], max_new_tokens=40, eos_token_id=[])
        spans, written = st.span.shape[0], int(st.lengths.max()) - 1
        kv = [t[:, :, :written].clone() for t in st.kv]
        fast.runtime.live_span = False                              # the whole cache every step
        whole = fast.generate(ids[:, :length], max_new_tokens=40, eos_token_id=[])
        assert spans < st.seq_len and spans % SPAN_ALIGN == 0
        assert torch.equal(live, whole), length
        for a, b in zip(kv, st.kv):
            torch.testing.assert_close(a, b[:, :, :written], atol=1e-4, rtol=1e-4)


def test_sliding_window_stays_exact_past_the_window():
    model = tiny_model("mistral", layers=2, sliding_window=8, seed=6)
    fast = specfx.compile(model, draft="early-exit:1", num_speculative_tokens=3, max_seq_len=96, backend="eager")
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(2))
    ours = fast.generate(ids, max_new_tokens=40, eos_token_id=[])
    assert_greedy_equal(model, ours, hf_greedy(model, ids, 40), 12)
