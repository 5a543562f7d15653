"""attach_mtp_head: expose the target hidden states an MTP head drafts from."""

from __future__ import annotations

from torch import fx

from specfx.passes.find_structure import StructureMap
from specfx.passes.graph_utils import finish, node_named, output_node, set_outputs
from specfx.passes.infra import Pass, PassResult


class AttachMTPHead(Pass):
    """Add the residual outputs of the layers the head taps (by default the last layer's: h,
    before the final norm) as outputs for the head.

    The head itself (`specfx.mtp.StaticHead`, which shares the model's embedding and lm_head)
    is captured as its own graph over its own KV buffer: the step calls it k times to draft and
    once more over the verified positions, and `fuse_spec_step` inlines every call. This pass
    checks the head reads hidden states of this graph's width and appends the tapped layers'
    outputs to the graph's first output: the verify graph returns `(logits, hidden, ...)`, a
    prefill graph (head dropped) `(last layer's hidden, hidden, ...)`, one hidden per tap.
    """

    def __init__(self, structure: StructureMap, *, head_hidden_size: int, taps: tuple[int, ...] | None = None):
        if head_hidden_size != structure.hidden_size:
            raise ValueError(f"MTP head does not fit this model: it reads hidden states of size "
                             f"{head_hidden_size}, the model's are {structure.hidden_size}")
        self.taps = tuple(taps) if taps is not None else (structure.num_layers - 1,)
        bad = [i for i in self.taps if not 0 <= i < structure.num_layers]
        if bad:
            raise ValueError(f"MTP head taps layers {bad}; the model has layers 0..{structure.num_layers - 1}")
        self.structure = structure

    def call(self, gm: fx.GraphModule) -> PassResult:
        if gm.meta.get("mtp_hidden"):
            return PassResult(gm, False, f"the head's hidden states are already outputs ({gm.meta['mtp_hidden']})")
        hidden = [node_named(gm, self.structure.layer_outputs[i]) for i in self.taps]
        outs = list(output_node(gm).args[0])
        set_outputs(gm, outs[:1] + hidden)
        gm.meta["mtp_hidden"] = ", ".join(h.name for h in hidden)
        first = (gm.meta.get("outputs") or ["logits"])[:1]
        gm.meta["outputs"] = first + (["hidden"] if len(hidden) == 1 else [f"hidden_{i}" for i in self.taps])
        return PassResult(finish(gm), True, info={"hidden": gm.meta["mtp_hidden"], "taps": list(self.taps)})
