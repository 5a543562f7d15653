"""share_rotary: a graph computes the rotary embedding's cos and sin once, not once per layer.

A decoder computes the rotary table (`cos(positions * inv_freq)` and its `sin`, scaled and cast)
once and hands it to every layer. Inductor fuses pointwise producers into their consumers, so
each layer's kernel recomputes the cos and sin, per head and per row. This pass follows each
`cos` and `sin` through the pointwise ops that have it as their only input (a scale, a cast) to
the value that several consumers read, and materializes that value (a hint that only Inductor
reads: `strip_materialize` drops it for eager and export).

Measured on pycoder (fp32, 2 threads, verify graphs at a 192-slot span, round-robin in one
process): the chain's 4-row verify 1471-1497 -> 1458-1471 us, the 2x2x1x1x1 tree's 8-row verify
1646-1656 -> 1622-1627; the one-row decode graph 1322-1343 -> 1343-1365, slower (its layer is one
kernel, which computes the table for one row in registers). So a table of one position is left
inline, as are tables whose shapes are not static (a prefill of any width).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import fx
from torch._prims_common import make_contiguous_strides_for

from specfx.passes.graph_utils import finish, insert_call
from specfx.passes.infra import Pass, PassResult
from specfx.passes.skinny_matmul import MATERIALIZE

aten, prims = torch.ops.aten, torch.ops.prims
TABLES = (aten.cos.default, aten.sin.default)
# Ops that carry the table on to its readers unchanged in shape: its scale and cast.
CARRY = (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar, aten.to.dtype, aten._to_copy.default,
         prims.convert_element_type.default)


class ShareRotary(Pass):
    """Materialize the rotary table that several layers read, so it is computed once per graph."""

    def call(self, gm: fx.GraphModule) -> PassResult:
        shared, skipped = [], []
        for node in list(gm.graph.nodes):
            if node.op != "call_function" or node.target not in TABLES:
                continue
            end = _shared_value(node)
            if end is None:
                continue
            val = end.meta.get("val")
            if not isinstance(val, torch.Tensor) or not all(isinstance(s, int) for s in val.shape):
                skipped.append("shapes not static")
                continue
            if val.dim() < 2 or val.shape[-2] == 1:
                skipped.append("one position")
                continue
            users = list(end.users)
            with gm.graph.inserting_after(end):
                table = insert_call(gm, MATERIALIZE, (end, make_contiguous_strides_for(val.shape)))
            for user in users:
                user.replace_input_with(end, table)
            shared.append(f"{end.name} ({len(users)} readers)")
        if not shared:
            why = ("rotary tables left inline: " + ", ".join(f"{n} of {r}" for r, n in Counter(skipped).items())
                   if skipped else "no cos or sin that several ops read")
            return PassResult(gm, False, why, {"shared": 0})
        return PassResult(finish(gm), True, "computed once: " + ", ".join(shared), {"shared": len(shared)})


def _shared_value(node: fx.Node) -> fx.Node | None:
    """The value that `node` reaches through single-reader shape-keeping pointwise ops, if more
    than one op reads it; else None (one layer, or no reader)."""
    while len(node.users) == 1:
        (user,) = node.users
        if user.op != "call_function" or user.target not in CARRY or _tensor_args(user) != [node]:
            return None
        if getattr(user.meta.get("val"), "shape", None) != node.meta["val"].shape:
            return None
        node = user
    if len(node.users) < 2 or any(u.op == "call_function" and u.target is MATERIALIZE for u in node.users):
        return None
    return node


def _tensor_args(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
