"""expose_hidden: the target's hidden states that an MTP head drafts from become graph outputs."""

from __future__ import annotations

from torch import fx

from specfx.passes.graph_utils import finish, node_named, output_node, set_outputs
from specfx.passes.infra import Pass, PassResult, structure_of


class ExposeHidden(Pass):
    """Add the residual outputs of the layers a head taps (by default the last layer's: h,
    before the final norm) as outputs, after the graph's first output.

    The head itself (`specfx.mtp.StaticHead`, which shares the model's embedding and lm_head)
    is captured as its own graph over its own KV buffer: the step calls it k times to draft and
    once more over the verified positions, and `inline_graph_calls` inlines every call. This
    pass checks the head reads hidden states of this graph's size: the verify graph returns
    `(logits, hidden, ...)`, a prefill graph (head dropped) `(last layer's hidden, hidden, ...)`,
    one hidden per tap.
    """

    def __init__(self, *, head_hidden_size: int, taps: tuple[int, ...] | None = None):
        self.head_hidden_size, self.taps = head_hidden_size, None if taps is None else tuple(taps)

    def requires(self, gm: fx.GraphModule) -> None:
        s = structure_of(gm)
        if self.head_hidden_size != s.hidden_size:
            raise ValueError(f"MTP head does not fit this model: it reads hidden states of size "
                             f"{self.head_hidden_size}, the model's are {s.hidden_size}")
        bad = [i for i in self._taps(gm) if not 0 <= i < s.num_layers]
        if bad:
            raise ValueError(f"MTP head taps layers {bad}; the model has layers 0..{s.num_layers - 1}")

    def _taps(self, gm: fx.GraphModule) -> tuple[int, ...]:
        return self.taps if self.taps is not None else (structure_of(gm).num_layers - 1,)

    def call(self, gm: fx.GraphModule) -> PassResult:
        if gm.meta.get("mtp_hidden"):
            return PassResult(gm, False, f"the head's hidden states are already outputs ({gm.meta['mtp_hidden']})")
        taps = self._taps(gm)
        hidden = [node_named(gm, structure_of(gm).layer_outputs[i]) for i in taps]
        outs = list(output_node(gm).args[0])
        set_outputs(gm, outs[:1] + hidden)
        gm.meta["mtp_hidden"] = ", ".join(h.name for h in hidden)
        first = (gm.meta.get("outputs") or ["logits"])[:1]
        gm.meta["outputs"] = first + (["hidden"] if len(hidden) == 1 else [f"hidden_{i}" for i in taps])
        return PassResult(finish(gm), True, info={"hidden": gm.meta["mtp_hidden"], "taps": list(taps)})
