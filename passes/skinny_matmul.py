"""skinny_matmul: linears over few rows become a product and a sum that Inductor generates itself.

`aten.linear(x [.., K], W [N, K])` with M = x.numel() / K rows (M <= MAX_ROWS) becomes

    stack([sum(W * x[m], -1) for m in range(M)])          -> [M, N]

M reductions over the same weight, which Inductor fuses into one loop that loads each weight
vector once and multiplies it into M accumulators: the weights stream at close to the
machine's speed, where a BLAS call at M = 1..k+1 streams them several times slower (DESIGN.md,
"Kernels"). x is materialized first, so the pointwise ops that produce it (a norm) run once,
not once per weight row. Which (M, N, K) to rewrite is an input: `choose(M, N, K) -> Choice`,
decided by measurement (`specfx.matmul_choice`), never by rule.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx
from torch._inductor import inductor_prims

from specfx.passes.graph_utils import finish, insert_call
from specfx.passes.infra import Pass, PassResult

aten = torch.ops.aten
MAX_ROWS = 16            # the rewrite unrolls one reduction per row; wider matmuls stay BLAS calls
# Inductor computes its input into a buffer of this layout (identity in eager and export, see
# `strip_materialize`).
MATERIALIZE = inductor_prims.force_stride_order


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
            if not isinstance(shape[0], int):
                choice = Choice(False, "rows not static (a prefill of any width): BLAS")
            elif shape[0] > MAX_ROWS:
                choice = Choice(False, f"M={shape[0]}: more rows than the rewrite unrolls ({MAX_ROWS}): BLAS")
            else:
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
    """(M, N, K) of `aten.linear(x, W[N, K])`, M a SymInt where x's rows are symbolic; None for
    any other node (or a weight not 2-D)."""
    if node.op != "call_function" or node.target is not aten.linear.default:
        return None
    x, w = node.args[0].meta.get("val"), node.args[1].meta.get("val")
    if x is None or w is None or w.dim() != 2:
        return None
    N, K = w.shape
    return math.prod(x.shape[:-1]), N, K


def _rewrite(gm: fx.GraphModule, node: fx.Node, M: int, N: int, K: int) -> None:
    x, w = node.args[0], node.args[1]
    bias = node.args[2] if len(node.args) > 2 else None
    lead = list(x.meta["val"].shape[:-1])
    with gm.graph.inserting_before(node):
        rows = insert_call(gm, aten.reshape.default, (x, [M, K]))
        rows = insert_call(gm, MATERIALIZE, (rows, [K, 1]))
        sums = [insert_call(gm, aten.sum.dim_IntList,
                            (insert_call(gm, aten.mul.Tensor, (w, insert_call(gm, aten.select.int, (rows, 0, m)))), [-1]))
                for m in range(M)]                                                          # M x [N]
        out = insert_call(gm, aten.stack.default, (sums, 0))                                # [M, N]
        if bias is not None:
            out = insert_call(gm, aten.add.Tensor, (out, bias))
        out = insert_call(gm, aten.reshape.default, (out, [*lead, N]))
    out.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)


def strip_materialize(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` without the rewrite's materialization hints (for torch.export / ONNX,
    which do not know Inductor's prims); values are unchanged."""
    import copy

    out = fx.GraphModule(gm, copy.deepcopy(gm.graph), gm.__class__.__name__)
    for node in list(out.graph.nodes):
        if node.op == "call_function" and node.target is MATERIALIZE:
            node.replace_all_uses_with(node.args[0])
            out.graph.erase_node(node)
    out.recompile()
    return out
