"""check_no_host_sync: find ops in a graph that would make the host wait for the device."""

from __future__ import annotations

import torch
from torch import fx

from specfx.passes.infra import Pass, PassOrderError, PassResult

aten = torch.ops.aten
# Ops that read a device value on the host, or whose output shape depends on data.
SYNC_OPS = {
    aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default,
    aten.equal.default, aten.allclose.default, aten.nonzero.default, aten.masked_select.default,
    aten.unique_consecutive.default, aten._unique2.default, aten.unique_dim.default,
    aten.one_hot.default,  # checks min/max of its input on the host
    aten.repeat_interleave.Tensor, aten.multinomial.default,
}
SYNC_FUNCTIONS = {torch.nonzero, torch.masked_select, torch.unique, torch.multinomial,
                  torch.nn.functional.one_hot, torch.repeat_interleave, torch.equal, torch.allclose}
SYNC_METHODS = {"item", "tolist", "nonzero", "numpy", "cpu", "masked_select", "unique", "__bool__"}


class CheckNoHostSync(Pass):
    """Analysis: list ops that sync the host (.item, nonzero, bool-mask indexing, ...)."""

    kind = "analysis"

    def requires(self, gm: fx.GraphModule) -> None:
        from specfx.passes.inline_graph_calls import graph_calls

        if graph_calls(gm):     # their ops are not in this graph: a sync inside them would go unseen
            raise PassOrderError(f"the graph still calls captured graphs {[n.target for n in graph_calls(gm)]}: "
                                 "run inline_graph_calls first")

    def call(self, gm: fx.GraphModule) -> PassResult:
        bad = find_host_syncs(gm)
        reason = "no host-sync ops" if not bad else "host-sync ops: " + ", ".join(bad)
        return PassResult(gm, False, reason, info={"host_syncs": bad})


def find_host_syncs(gm: fx.GraphModule) -> list[str]:
    """`node_name: op` for every node that would sync or has a data-dependent shape."""
    bad = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and (n.target in SYNC_OPS or n.target in SYNC_FUNCTIONS
                                        or _bool_mask_index(n)):
            bad.append(f"{n.name}: {n.target}")
        elif n.op == "call_method" and n.target in SYNC_METHODS:
            bad.append(f"{n.name}: Tensor.{n.target}")
    return bad


def _bool_mask_index(n: fx.Node) -> bool:
    """aten.index / index_put with a boolean index tensor (data-dependent shape)."""
    if n.target not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return False
    indices = n.args[1] if len(n.args) > 1 else []
    for idx in indices or []:
        val = idx.meta.get("val") if isinstance(idx, fx.Node) else None
        if val is not None and val.dtype == torch.bool:
            return True
    return False
