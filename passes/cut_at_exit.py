"""cut_at_exit: the verify remainder, layers >= E fed by the exit hidden states (KVQ reuse)."""

from __future__ import annotations

from torch import fx

from specfx.passes.find_structure import StructureError
from specfx.passes.graph_utils import erase_nodes, finish, layer_nodes, node_named
from specfx.passes.infra import Pass, PassOrderError, PassResult, structure_of


class CutAtExit(Pass):
    """Turn layer E's input into a graph input and drop layers < E and the embedding."""

    def __init__(self, exit_layer: int):
        self.exit_layer = exit_layer

    def requires(self, gm: fx.GraphModule) -> None:
        s = structure_of(gm)
        if not 1 <= self.exit_layer <= s.num_layers:
            raise ValueError(f"cut at layer {self.exit_layer}: the model has layers 0..{s.num_layers - 1}")
        if s.input_ids not in {n.name for n in gm.graph.nodes if n.op == "placeholder"}:
            raise PassOrderError("the graph no longer reads input_ids: it was cut already")

    def call(self, gm: fx.GraphModule) -> PassResult:
        s, E = structure_of(gm), self.exit_layer
        boundary = node_named(gm, s.layer_outputs[E - 1])
        input_ids = node_named(gm, s.input_ids)
        with gm.graph.inserting_before(input_ids):
            hidden = gm.graph.placeholder("exit_hidden")
        hidden.meta["val"] = boundary.meta.get("val")
        boundary.replace_all_uses_with(hidden)
        erase_nodes(gm, layer_nodes(gm, s.stack_path, lambda i: i < E))
        finish(gm)
        if input_ids.users:
            raise StructureError(
                f"layers >= {E} still read input_ids (through {[u.name for u in input_ids.users]}), "
                "so the verify graph cannot start from the exit hidden states; use another drafter")
        gm.graph.erase_node(input_ids)
        gm.meta["inputs"] = ["exit_hidden", "positions"]
        return PassResult(finish(gm), True, info={"erased_layers": E})
