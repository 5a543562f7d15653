"""truncate_at_exit: the draft graph, keeping only layers < E and the exit head."""

from __future__ import annotations

from torch import fx

from specfx.passes.graph_utils import erase_nodes, finish, layer_nodes, node_named, set_outputs
from specfx.passes.infra import Pass, PassOrderError, PassResult, structure_of


class TruncateAtExit(Pass):
    """Drop layers >= E and the final head: outputs (exit_logits, exit_hidden)."""

    def __init__(self, exit_layer: int):
        self.exit_layer = exit_layer

    def requires(self, gm: fx.GraphModule) -> None:
        if gm.meta.get("exit_layer") != self.exit_layer:
            raise PassOrderError(f"no early exit at layer {self.exit_layer} attached: run attach_early_exit first")

    def call(self, gm: fx.GraphModule) -> PassResult:
        s, E = structure_of(gm), self.exit_layer
        exit_hidden = node_named(gm, s.layer_outputs[E - 1])
        set_outputs(gm, [node_named(gm, gm.meta["exit_logits"]), exit_hidden])
        late = layer_nodes(gm, s.stack_path, lambda i: i >= E)
        head = [node_named(gm, name) for name in s.head_nodes]
        # Later layers hold in-place KV writes, which DCE keeps: erase them explicitly.
        erase_nodes(gm, late + head)
        gm.meta["outputs"] = ["exit_logits", "exit_hidden"]
        return PassResult(finish(gm), True, info={"erased_layers": s.num_layers - E})
