"""attach_early_exit: copy the model's head (final norm, lm_head, ...) onto layer E's output."""

from __future__ import annotations

from torch import fx

from specfx.passes.find_structure import StructureMap
from specfx.passes.graph_utils import copy_nodes, finish, node_named, output_node, set_outputs
from specfx.passes.infra import Pass, PassOrderError, PassResult, structure_of


class AttachEarlyExit(Pass):
    """Copy the final norm and lm_head onto the residual output of layer E (exit logits)."""

    def __init__(self, exit_layer: int):
        self.exit_layer = exit_layer

    def requires(self, gm: fx.GraphModule) -> None:
        check_exit_layer(structure_of(gm), self.exit_layer)

    def ensures(self, gm: fx.GraphModule) -> None:
        if not gm.meta.get("exit_logits"):
            raise PassOrderError("no exit logits after attach_early_exit")

    def call(self, gm: fx.GraphModule) -> PassResult:
        s = structure_of(gm)
        if gm.meta.get("exit_logits"):
            return PassResult(gm, False, f"an early exit is already attached ({gm.meta['exit_logits']})")
        last = node_named(gm, s.layer_outputs[-1])
        exit_hidden = node_named(gm, s.layer_outputs[self.exit_layer - 1])
        head = [node_named(gm, name) for name in s.head_nodes]
        # The copy reads the exit layer's output wherever the original read the last layer's.
        env = copy_nodes(gm, head, {last: exit_hidden}, after=_last_of(gm, head),
                         rename=lambda name: f"exit{self.exit_layer}_{name}")
        exit_logits = env[head[-1]]
        outs = list(output_node(gm).args[0])
        set_outputs(gm, outs + [exit_logits, exit_hidden])
        gm.meta["exit_logits"], gm.meta["exit_hidden"] = exit_logits.name, exit_hidden.name
        gm.meta["exit_layer"] = self.exit_layer
        return PassResult(finish(gm), True, info={"copied": len(head)})


def check_exit_layer(structure: StructureMap, exit_layer: int) -> None:
    """Exit after E layers: 1 <= E < num_layers (E = num_layers would be the model itself)."""
    if not isinstance(exit_layer, int) or not 1 <= exit_layer < structure.num_layers:
        raise ValueError(
            f"exit layer {exit_layer} out of range: the model has {structure.num_layers} layers, "
            f"so the exit layer must be in 1..{structure.num_layers - 1}"
        )


def _last_of(gm: fx.GraphModule, nodes: list[fx.Node]) -> fx.Node:
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return max(nodes, key=order.get)
