"""attach_mtp_head: expose the target's final hidden state, the input an MTP head drafts from."""

from __future__ import annotations

from torch import fx

from specfx.passes.find_structure import StructureMap
from specfx.passes.graph_utils import finish, node_named, output_node, set_outputs
from specfx.passes.infra import Pass, PassResult


class AttachMTPHead(Pass):
    """Add the last layer's residual output (h, before the final norm) as an output for the head.

    The head itself (`specfx.mtp.StaticHead`, which shares the model's embedding and lm_head)
    is captured as its own graph over its own KV buffer: the step calls it k times to draft and
    once more over the verified positions, and `fuse_spec_step` inlines every call. This pass
    checks the head reads hidden states of this graph's width and makes the verify graph
    return `(logits, hidden)`.
    """

    def __init__(self, structure: StructureMap, *, head_hidden_size: int):
        if head_hidden_size != structure.hidden_size:
            raise ValueError(f"MTP head does not fit this model: it reads hidden states of size "
                             f"{head_hidden_size}, the model's are {structure.hidden_size}")
        self.structure = structure

    def call(self, gm: fx.GraphModule) -> PassResult:
        if gm.meta.get("mtp_hidden"):
            return PassResult(gm, False, f"the final hidden state is already an output ({gm.meta['mtp_hidden']})")
        hidden = node_named(gm, self.structure.layer_outputs[-1])
        outs = list(output_node(gm).args[0])
        set_outputs(gm, outs[:1] + [hidden])
        gm.meta["mtp_hidden"] = hidden.name
        gm.meta["outputs"] = ["logits", "hidden"]
        return PassResult(finish(gm), True, info={"hidden": hidden.name})
