"""truncate_at_exit: the draft graph, keeping only layers < E and the exit head."""

from __future__ import annotations

from torch import fx

from specfx.passes.find_structure import StructureMap
from specfx.passes.graph_utils import erase_nodes, finish, layer_nodes, node_named, set_outputs
from specfx.passes.infra import Pass, PassResult


class TruncateAtExit(Pass):
    """Drop layers >= E and the final head: outputs (exit_logits, exit_hidden)."""

    def __init__(self, structure: StructureMap, exit_layer: int, *, keep_head: bool = True):
        self.structure, self.exit_layer, self.keep_head = structure, exit_layer, keep_head

    def call(self, gm: fx.GraphModule) -> PassResult:
        s, E = self.structure, self.exit_layer
        exit_hidden = node_named(gm, s.layer_outputs[E - 1])
        if self.keep_head:
            if not gm.meta.get("exit_logits"):
                return PassResult(gm, False, "no early exit attached: run attach_early_exit first")
            set_outputs(gm, [node_named(gm, gm.meta["exit_logits"]), exit_hidden])
        else:
            set_outputs(gm, [exit_hidden])
        late = layer_nodes(gm, s.stack_path, lambda i: i >= E)
        head = [node_named(gm, name) for name in s.head_nodes]
        # Later layers hold in-place KV writes, which DCE keeps: erase them explicitly.
        erase_nodes(gm, late + head)
        gm.meta["outputs"] = ["exit_logits", "exit_hidden"] if self.keep_head else ["hidden"]
        return PassResult(finish(gm), True, info={"erased_layers": s.num_layers - E})
