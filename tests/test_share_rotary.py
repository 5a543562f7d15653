"""share_rotary: graph before -> pass -> graph after -> numerics, and what Inductor makes of it."""

from __future__ import annotations

import pytest
import torch

from helpers import FAMILIES, family_model, span
from specfx.capture import capture
from specfx.passes import ShareRotary
from specfx.passes.skinny_matmul import MATERIALIZE, strip_materialize

aten = torch.ops.aten
# Families whose tiny models read one rotary table in several layers (the others: no rotary, a
# table per layer of two, or positions looked up in a stored table).
SHARED = sorted(set(FAMILIES) - {"gpt2", "opt", "gptj", "cohere2", "gemma3_text", "smollm3"})


def _materialized(gm) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is MATERIALIZE]


def _run(gm, ids, pos):
    with torch.no_grad():
        return gm(ids, pos, span(32))[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_shares_the_table_that_several_layers_read_and_keeps_numerics(family):
    cg = capture(family_model(family, layers=2), width=4, max_seq_len=32)
    ids, pos = torch.randint(3, 96, (1, 4)), torch.arange(4)[None]
    ref, before = _run(cg.gm, ids, pos), len(_materialized(cg.gm))
    res = ShareRotary()(cg.gm)
    assert res.modified == (family in SHARED), res.reason
    added = _materialized(res.graph_module)[before:] if res.modified else []
    assert len(added) == res.info["shared"] == (2 if res.modified else 0)
    for node in added:                                     # cos and sin, each read by both layers
        assert len(node.users) == 2 and node.args[0].meta["val"].shape[-2] == 4
    torch.testing.assert_close(_run(res.graph_module, ids, pos), ref, rtol=0, atol=0)
    torch.testing.assert_close(_run(strip_materialize(res.graph_module), ids, pos), ref, rtol=1e-5, atol=1e-5)


def test_leaves_one_position_and_prefill_tables_inline():
    model = family_model("llama", layers=2)
    res = ShareRotary()(capture(model, width=1, max_seq_len=32).gm)
    assert not res.modified and "2 of one position" in res.reason
    res = ShareRotary()(capture(model, width=8, max_seq_len=32, dynamic_width=True).gm)
    assert not res.modified and "2 of shapes not static" in res.reason


def test_inductor_computes_the_table_once():
    from torch._inductor.utils import run_and_get_code

    cg = capture(family_model("llama", layers=3), width=4, max_seq_len=32)
    ids, pos = torch.randint(3, 96, (1, 4)), torch.arange(4)[None]
    ref = _run(cg.gm, ids, pos)
    gm = ShareRotary()(cg.gm).graph_module
    with torch.no_grad():
        out, (code,) = run_and_get_code(torch.compile(gm, backend="inductor", dynamic=False), ids, pos, span(32))
    # Without the pass, the layers' kernels compute each of them 4 times.
    assert code.count(".cos()") + code.count("std::cos(") == 1, code.count(".cos()")
    assert code.count(".sin()") + code.count("std::sin(") == 1
    torch.testing.assert_close(out[0], ref, atol=1e-5, rtol=1e-5)
