"""drop_head: a prefill graph, which only fills the KV cache, returns the last layer's output."""

from __future__ import annotations

from torch import fx

from specfx.passes.graph_utils import erase_nodes, finish, node_named, set_outputs
from specfx.passes.infra import Pass, PassResult, structure_of


class DropHead(Pass):
    """Drop the final norm and lm_head: the graph returns the last layer's residual output."""

    def requires(self, gm: fx.GraphModule) -> None:
        structure_of(gm)

    def call(self, gm: fx.GraphModule) -> PassResult:
        s = structure_of(gm)
        if gm.meta.get("outputs") == ["hidden"]:
            return PassResult(gm, False, "the head is already dropped")
        set_outputs(gm, [node_named(gm, s.layer_outputs[-1])])
        erase_nodes(gm, [node_named(gm, name) for name in s.head_nodes])
        gm.meta["outputs"] = ["hidden"]
        return PassResult(finish(gm), True, info={"erased": len(s.head_nodes)})
