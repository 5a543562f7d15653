"""skinny_matmul: linears over few rows become a product and a sum that Inductor generates itself.

`aten.linear(x [.., K], W [N, K])` with M = x.numel() / K rows becomes

    sum(W[:, None, :] * x[None, :, :], -1)  -> [N, M], read as [M, N]

which Inductor lowers to one reduction that loads each weight row once and reuses it for all M
rows, at close to the machine's streaming speed, where a BLAS call at M = 1..k+1 streams the
weights several times slower (DESIGN.md, "Kernels"). Which (M, N, K) to rewrite is an input:
`choose(M, N, K) -> Choice`, decided by measurement (`specfx.matmul_choice`), never by rule.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx

from specfx.passes.graph_utils import finish, insert_call
from specfx.passes.infra import Pass, PassResult

aten = torch.ops.aten


@dataclass(frozen=True)
class Choice:
    """Whether to rewrite one matmul shape, and why."""

    reduce: bool
    reason: str


class SkinnyMatmul(Pass):
    """Rewrite few-row linears as a weight-row-reusing reduction, where `choose` says it is faster."""

    def __init__(self, choose: Callable[[int, int, int], Choice]):
        self.choose = choose

    def call(self, gm: fx.GraphModule) -> PassResult:
        rewrote, kept = Counter(), Counter()
        for node in list(gm.graph.nodes):
            shape = _linear_shape(node)
            if shape is None:
                continue
            choice = self.choose(*shape)
            (rewrote if choice.reduce else kept)[choice.reason] += 1
            if choice.reduce:
                _rewrite(gm, node, *shape)
        if not rewrote and not kept:
            return PassResult(gm, False, "no linear with a 2-D weight")
        summary = "; ".join([f"rewrote {n}: {r}" for r, n in rewrote.items()] +
                            [f"kept {n}: {r}" for r, n in kept.items()])
        info = {"rewritten": sum(rewrote.values()), "kept": sum(kept.values())}
        if not rewrote:
            return PassResult(gm, False, summary, info)
        return PassResult(finish(gm), True, summary, info)


def _linear_shape(node: fx.Node) -> tuple[int, int, int] | None:
    """(M, N, K) of `aten.linear(x, W[N, K])` with static shapes, else None."""
    if node.op != "call_function" or node.target is not aten.linear.default:
        return None
    x, w = node.args[0].meta.get("val"), node.args[1].meta.get("val")
    if x is None or w is None or w.dim() != 2 or not all(isinstance(d, int) for d in x.shape):
        return None
    N, K = w.shape
    return math.prod(x.shape[:-1]), N, K


def _rewrite(gm: fx.GraphModule, node: fx.Node, M: int, N: int, K: int) -> None:
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    lead = list(x.meta["val"].shape[:-1])
    with gm.graph.inserting_before(node):
        rows = insert_call(gm, aten.reshape.default, (x, [M, K]))
        rows = insert_call(gm, torch.ops.prims.inductor_force_stride_order.default, (rows, [K, 1]))
        prod = insert_call(gm, aten.mul.Tensor, (insert_call(gm, aten.unsqueeze.default, (w, 1)),
                                                 insert_call(gm, aten.unsqueeze.default, (rows, 0))))  # [N, M, K]
        out = insert_call(gm, aten.permute.default, (insert_call(gm, aten.sum.dim_IntList, (prod, [-1])), [1, 0]))
        if bias is not None:
            out = insert_call(gm, aten.add.Tensor, (out, bias))
        out = insert_call(gm, aten.reshape.default, (out, [*lead, N]))
    out.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)
