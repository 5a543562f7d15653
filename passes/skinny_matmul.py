"""skinny_matmul: linears over few rows run on the kernel that is fastest for their shape.

`aten.linear(x [.., K], W [N, K])` with M = x.numel() / K rows is rewritten, where
`choose(M, N, K, dtype) -> Choice` says so (dtype: the weight's as stored), into one of:

- "tiled": `specfx.tiled_linear(x [M, K], W)` (`specfx.kernels.tiled_linear`), a register-tiled
  C++ kernel that Inductor compiles into the graph: each weight row is read once for all M rows
  and a tile's sums are reduced across lanes together; M may be symbolic (a prefill graph
  serves every width up to its chunk, and is chosen for at the chunk);
- "reduce" (M <= MAX_ROWS): `stack([sum(W * x[m], -1) for m in range(M)])`, M reductions over
  the same weight, which Inductor fuses into one loop that loads each weight vector once and
  multiplies it into M accumulators (one horizontal sum per output);
- "blas": the linear is kept, for the BLAS library.

Tiled linears of one input and one weight dtype (a layer's q, k and v projections; its gate and
up) then run as one kernel, `specfx.tiled_linears`, sliced back into their outputs (the same to
the bit): one parallel region and one weight stream instead of one each. A gated MLP's
silu(gate) * up over such a group of float32 or bfloat16 weights becomes one `specfx.tiled_glu`
kernel, whose threads gate the columns they computed.

At M = 1..k+1 a BLAS call streams the weights several times slower than the machine can
(DESIGN.md, "Kernels"); at a prefill's width, MKL repacks every weight at each call on this
kind of machine. x is materialized first, so the pointwise ops that produce it (a norm) run
once, not once per weight row. The choice is an input, decided by measurement
(`specfx.matmul_choice`), never by rule.
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
# The fewest static rows whose gated MLP runs as one `tiled_glu` (rows not static, a prefill's,
# always do). pycoder's fused steps, both ways in one process, round-robin, three repeats
# (`benchmarks/gated_mlp.py`, a 2-core AMD EPYC, `benchmarks/cpu/gated_mlp_epyc_zen4.txt`): the
# chain of 7's 8-row verify step 3.37-3.43 ms against 3.63-3.65 apart, the chain of 3's 4-row one
# 3.10-3.17 against 3.14-3.21, the first token of a 115-token prompt 23.31-23.43 against
# 23.34-23.55. At one row Inductor's pointwise kernel reads 864 floats, and the fused decode step
# (an earlier run of the script: 1.86-2.18 ms against 1.82-2.14) differed from the other as two
# builds of one decode graph do here (2.14-2.21 against 2.11-2.18).
GATED_FROM_ROWS = 4
# Inductor computes its input into a buffer of this layout (identity in eager and export, see
# `strip_materialize`).
MATERIALIZE = inductor_prims.force_stride_order


KERNELS = ("tiled", "reduce", "blas")
SHOWN = {"tiled": "tiled", "reduce": "reduce", "blas": "BLAS"}      # each kernel as a reason names it


@dataclass(frozen=True)
class Choice:
    """The kernel for one matmul shape ("tiled", "reduce" or "blas"), and why."""

    kernel: str
    reason: str

    def __post_init__(self):
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")

    @property
    def rewrite(self) -> bool:
        return self.kernel != "blas"


class SkinnyMatmul(Pass):
    """Rewrite few-row linears into the kernel `choose` says is fastest for their shape."""

    def __init__(self, choose: Callable[[int, int, int, torch.dtype], Choice]):
        self.choose = choose

    def call(self, gm: fx.GraphModule) -> PassResult:
        rewrote, kept = Counter(), Counter()
        for node in list(gm.graph.nodes):
            shape = _linear_shape(node)
            if shape is None:
                continue
            choice = self._choose(node, *shape)
            (rewrote if choice.rewrite else kept)[choice.reason] += 1
            if choice.kernel == "tiled":
                _rewrite_tiled(gm, node, *shape)
            elif choice.kernel == "reduce":
                _rewrite(gm, node, *shape)
        if not rewrote and not kept:
            return PassResult(gm, False, "no linear with a 2-D weight")
        grouped, kernels = _group_tiled(gm)
        gated = _fuse_gated(gm)
        summary = "; ".join([f"rewrote {n}: {r}" for r, n in rewrote.items()] +
                            [f"kept {n}: {r}" for r, n in kept.items()] +
                            ([f"grouped {grouped} tiled linears of a shared input into {kernels} kernels"] if grouped else []) +
                            ([f"fused {gated} gated MLPs' silu(gate) * up into their kernels"] if gated else []))
        info = {"rewritten": sum(rewrote.values()), "kept": sum(kept.values()), "grouped": grouped, "gated": gated}
        if not rewrote:
            return PassResult(gm, False, summary, info)
        return PassResult(finish(gm), True, summary, info)

    def _choose(self, node: fx.Node, M, N: int, K: int) -> Choice:
        """The kernel for this linear. Rows that are not static (a prefill of any width) are
        chosen for at the width the graph was captured with, its widest; only the tiled
        kernel or BLAS takes them, or more than MAX_ROWS static rows."""
        rows = M if isinstance(M, int) else _hint(M)
        if rows is None:
            return Choice("blas", f"M={M}: rows not static, and no width to measure at: BLAS")
        choice = self.choose(rows, N, K, _stored_weight(node).meta["val"].dtype)
        if choice.kernel == "tiled" and not _tiled_fits(node):
            fallback = "reduce" if isinstance(M, int) and M <= MAX_ROWS else "blas"
            return Choice(fallback, f"M={M}: not the tiled kernel's case (float32 rows, float32, bfloat16 or int8 contiguous weights, "
                                    f"rows of at most one size not static, a compiler for it): {SHOWN[fallback]}")
        if choice.kernel == "reduce" and not (isinstance(M, int) and M <= MAX_ROWS):
            return Choice("blas", f"M={M}: more rows than the rewrite unrolls ({MAX_ROWS}): BLAS")
        if not isinstance(M, int):
            return Choice(choice.kernel, f"any width up to {rows} (a prefill), measured at {choice.reason}")
        return choice


def _hint(M) -> int | None:
    """The example value of a symbolic row count: the width its graph was captured with."""
    try:
        return int(M.node.hint)
    except (AttributeError, TypeError):
        return None


def _linear_shape(node: fx.Node) -> tuple[int, int, int] | None:
    """(M, N, K) of `aten.linear(x, W[N, K])`, M a SymInt where x's rows are symbolic; None for
    any other node (or a weight not 2-D)."""
    if node.op != "call_function" or node.target is not aten.linear.default:
        return None
    x, w = node.args[0].meta.get("val"), node.args[1].meta.get("val")
    if x is None or w is None or w.dim() != 2:
        return None
    N, K = (int(d) for d in w.shape)           # a weight's sizes are static (a SymInt here is one of a value)
    return math.prod(x.shape[:-1]), N, K


def _tiled_fits(node: fx.Node) -> bool:
    """The tiled kernel's case: float32 on the CPU, a contiguous weight, rows whose leading
    dimensions hold at most one symbolic size, and an Inductor here that compiles the kernel (a
    cached or user-supplied choice may name it where it does not)."""
    from specfx.kernels.tiled_linear import WEIGHT_DTYPES, available

    x, w = node.args[0].meta["val"], _stored_weight(node).meta["val"]
    return (x.dtype == torch.float32 and w.dtype in WEIGHT_DTYPES and x.device.type == w.device.type == "cpu"
            and w.is_contiguous() and len(_lead(node)) == x.dim() - 1 and available()[0])


def _stored_weight(node: fx.Node) -> fx.Node:
    """The linear's weight as stored: a bfloat16 or int8 weight widened to float32 where the graph
    reads it (`w.to(float32)`, a draft's weights kept at half or a quarter of the bytes) is the
    stored one, which the tiled kernel reads as stored; any other weight is itself."""
    w = node.args[1]
    widen = w.op == "call_function" and w.target in (aten.to.dtype, aten._to_copy.default)
    if widen and w.args[0].meta.get("val") is not None and w.args[0].meta["val"].dtype in (torch.bfloat16, torch.int8):
        return w.args[0]
    return w


def _lead(node: fx.Node) -> list:
    """x's leading sizes, its one symbolic size (if any) as -1 (what a reshape takes); shorter
    than x's leading dimensions where more than one is symbolic."""
    lead = [d if isinstance(d, int) else -1 for d in node.args[0].meta["val"].shape[:-1]]
    return lead if lead.count(-1) <= 1 else []


def _rewrite_tiled(gm: fx.GraphModule, node: fx.Node, M, N: int, K: int) -> None:
    from specfx.kernels import tiled_linear

    x, w = node.args[0], _stored_weight(node)
    bias = node.args[2] if len(node.args) > 2 else None
    lead = _lead(node)
    with gm.graph.inserting_before(node):
        rows = insert_call(gm, aten.reshape.default, (x, [-1, K]))                          # [M, K]
        out = insert_call(gm, torch.ops.specfx.tiled_linear.default, (rows, w, tiled_linear.VERSION))   # [M, N]
        if bias is not None:
            out = insert_call(gm, aten.add.Tensor, (out, bias))
        out = insert_call(gm, aten.reshape.default, (out, [*lead, N]))
    _replace(gm, node, out)


def _group_tiled(gm: fx.GraphModule) -> tuple[int, int]:
    """Tiled linears that read one input with weights of one dtype (a layer's q, k and v; its gate
    and up) become one `tiled_linears` kernel whose output columns are sliced back into theirs
    (each the same to the bit): one parallel region and one weight stream instead of one each
    (see `linears` in the kernels' header). Returns (linears grouped, kernels they became)."""
    from specfx.kernels import tiled_linear

    one = torch.ops.specfx.tiled_linear.default
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups: dict[tuple, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not one or node.args[1].meta["val"].dim() != 2:
            continue
        rows = node.args[0]                      # reshape(x, [-1, K]), one per rewritten linear
        x = rows.args[0] if rows.op == "call_function" and rows.target is aten.reshape.default else rows
        groups.setdefault((x, node.args[1].meta["val"].dtype), []).append(node)
    grouped = kernels = 0
    for nodes in groups.values():
        first = nodes[0]                          # the kernel goes where it is; the weights must be there
        for n in nodes[1:]:
            if order[n.args[1]] > order[first] and n.args[1].op == "get_attr":
                first.prepend(n.args[1])              # a parameter read where it is used: read it earlier
                order[n.args[1]] = order[first] - 0.5
        nodes = [first, *[n for n in nodes[1:] if order[n.args[1]] < order[first]]]
        if len(nodes) < 2:
            continue
        with gm.graph.inserting_before(first):
            out = insert_call(gm, torch.ops.specfx.tiled_linears.default,
                              (first.args[0], [n.args[1] for n in nodes], tiled_linear.VERSION))
        col = 0
        for n in nodes:
            N = int(n.args[1].meta["val"].shape[0])
            with gm.graph.inserting_before(n):
                piece = insert_call(gm, aten.slice.Tensor, (out, 1, col, col + N))
            col += N
            _replace(gm, n, piece)
        grouped, kernels = grouped + len(nodes), kernels + 1
    return grouped, kernels


def _only_user(node: fx.Node, target) -> fx.Node | None:
    """`node`'s one user, where it has exactly one and it calls `target`."""
    users = list(node.users)
    ok = len(users) == 1 and users[0].op == "call_function" and users[0].target is target
    return users[0] if ok else None


def _fuse_gated(gm: fx.GraphModule) -> int:
    """`mul(silu(gate), up)` where gate and up are the two columns of one `tiled_linears` of two
    float32 or bfloat16 weights of one shape (a gated MLP: Llama's, Qwen's), over at least
    `GATED_FROM_ROWS` rows or rows not static, becomes
    `tiled_glu(x, w_gate, w_up)`: each thread then gates the columns it computed, where
    Inductor's one-thread pointwise kernel read the other thread's half from its core's cache
    (see `glu` in the kernels' header). Returns how many it fused."""
    from specfx.kernels import tiled_linear

    fused = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.specfx.tiled_linears.default or len(node.args[1]) != 2:
            continue
        rows = node.args[0].meta["val"].shape[0]
        if isinstance(rows, int) and rows < GATED_FROM_ROWS:
            continue
        w_gate, w_up = node.args[1]
        g, u = w_gate.meta["val"], w_up.meta["val"]
        if g.dtype not in (torch.float32, torch.bfloat16) or g.dtype != u.dtype or g.shape != u.shape:
            continue
        N = int(g.shape[0])
        cols = {}                                        # first column -> (slice, its reshape)
        for piece in node.users:
            view = _only_user(piece, aten.reshape.default)
            if piece.target is aten.slice.Tensor and view is not None and tuple(piece.args[1:]) in ((1, 0, N), (1, N, 2 * N)):
                cols[piece.args[2]] = (piece, view)
        if len(cols) != 2 or len(node.users) != 2:
            continue
        (gate, gate_view), (up, up_view) = cols[0], cols[N]
        silu = _only_user(gate_view, aten.silu.default)
        mul = silu and _only_user(silu, aten.mul.Tensor)
        if mul is None or set(mul.args) != {silu, up_view} or _only_user(up_view, aten.mul.Tensor) is not mul:
            continue
        with gm.graph.inserting_before(mul):
            out = insert_call(gm, torch.ops.specfx.tiled_glu.default, (node.args[0], w_gate, w_up, tiled_linear.VERSION))
            out = insert_call(gm, aten.reshape.default, (out, gate_view.args[1]))
        _replace(gm, mul, out)
        for dead in (silu, up_view, gate_view, up, gate, node):
            gm.graph.erase_node(dead)
        fused += 1
    return fused


def _replace(gm: fx.GraphModule, node: fx.Node, out: fx.Node) -> None:
    out.meta.update({k: v for k, v in node.meta.items() if k != "val"})
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)


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
    _replace(gm, node, out)


def strip_materialize(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of `gm` without what only Inductor compiles (for torch.export / ONNX): no
    materialization hints, and the tiled kernels' calls as the products and sums they compute
    (which Inductor, compiling an exported program, fuses as it fuses the rewrite's reductions)."""
    import copy

    from specfx.kernels import tiled_linear  # noqa: F401 - defines torch.ops.specfx.tiled_*

    out = fx.GraphModule(gm, copy.deepcopy(gm.graph), gm.__class__.__name__)
    tiled = {torch.ops.specfx.tiled_linear.default: _linear_sums, torch.ops.specfx.tiled_mix.default: _mix_sums,
             torch.ops.specfx.tiled_attend.default: _attend_sums, torch.ops.specfx.tiled_linears.default: _linears_sums,
             torch.ops.specfx.tiled_glu.default: _glu_sums}
    for node in list(out.graph.nodes):
        if node.op == "call_function" and node.target is MATERIALIZE:
            node.replace_all_uses_with(node.args[0])
            out.graph.erase_node(node)
        elif node.op == "call_function" and node.target in tiled:
            with out.graph.inserting_before(node):
                value = tiled[node.target](out, *node.args[:-1])
            _replace(out, node, value)
    out.recompile()
    return out


def _attend_sums(gm: fx.GraphModule, q: fx.Node, k: fx.Node, v: fx.Node, bias: fx.Node, scale: float) -> fx.Node:
    """`tiled_attend` as products and sums: the scores, plus each query row's bias, their softmax,
    the weighted values (see `specfx.kernels.tiled_linear.attend_reference`)."""
    heads, R, _ = q.meta["val"].shape
    B, W = bias.meta["val"].shape[:2]
    bias = insert_call(gm, aten.unsqueeze.default, (insert_call(gm, aten.unsqueeze.default, (bias, 1)), 2))
    bias = insert_call(gm, aten.expand.default, (bias, [-1, heads // B, R // W, -1, -1]))     # [B, Hkv, G, W, L]
    bias = insert_call(gm, aten.reshape.default, (bias, [heads, R, -1]))
    scores = insert_call(gm, aten.mul.Tensor, (_linear_sums(gm, q, k), scale))
    probs = insert_call(gm, aten._softmax.default, (insert_call(gm, aten.add.Tensor, (scores, bias)), -1, False))
    return _mix_sums(gm, probs, v)


def _linear_sums(gm: fx.GraphModule, x: fx.Node, w: fx.Node) -> fx.Node:
    """x @ w.T as products and sums: one reduction per row of a [M, K] x (as `_rewrite`
    writes it), or over a batch of [B, M, K] x and [B, N, K] w; a linear for more rows (or
    rows not static: a prefill)."""
    M = x.meta["val"].shape[0]
    if w.meta["val"].dim() == 2 and not (isinstance(M, int) and M <= MAX_ROWS):
        if w.meta["val"].dtype != x.meta["val"].dtype:                  # a bfloat16 or int8 weight
            w = insert_call(gm, aten.to.dtype, (w, x.meta["val"].dtype))
        return insert_call(gm, aten.linear.default, (x, w))
    if w.meta["val"].dim() == 2:
        rows = [insert_call(gm, aten.sum.dim_IntList,
                            (insert_call(gm, aten.mul.Tensor, (w, insert_call(gm, aten.select.int, (x, 0, m)))), [-1]))
                for m in range(x.meta["val"].shape[0])]
        return insert_call(gm, aten.stack.default, (rows, 0))
    prod = insert_call(gm, aten.mul.Tensor, (insert_call(gm, aten.unsqueeze.default, (x, 2)),
                                             insert_call(gm, aten.unsqueeze.default, (w, 1))))  # [B, M, N, K]
    return insert_call(gm, aten.sum.dim_IntList, (prod, [-1]))


def _linears_sums(gm: fx.GraphModule, x: fx.Node, ws: list[fx.Node]) -> fx.Node:
    """`tiled_linears` as each weight's `_linear_sums`, side by side."""
    return insert_call(gm, aten.cat.default, ([_linear_sums(gm, x, w) for w in ws], -1))


def _glu_sums(gm: fx.GraphModule, x: fx.Node, w_gate: fx.Node, w_up: fx.Node) -> fx.Node:
    """`tiled_glu` as silu of the gate's `_linear_sums` times the up projection's."""
    gate = insert_call(gm, aten.silu.default, (_linear_sums(gm, x, w_gate),))
    return insert_call(gm, aten.mul.Tensor, (gate, _linear_sums(gm, x, w_up)))


def _mix_sums(gm: fx.GraphModule, p: fx.Node, v: fx.Node) -> fx.Node:
    """p [B, M, L] @ v [B, L, D] as products and a sum over L."""
    prod = insert_call(gm, aten.mul.Tensor, (insert_call(gm, aten.unsqueeze.default, (p, -1)),
                                             insert_call(gm, aten.unsqueeze.default, (v, 1))))  # [B, M, L, D]
    return insert_call(gm, aten.sum.dim_IntList, (prod, [-2]))
