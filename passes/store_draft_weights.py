"""store_draft_weights: the early-exit draft graph reads its weights at fewer bytes (drafting only)."""

from __future__ import annotations

import functools

import torch
from torch import fx
from torch._guards import detect_fake_mode

from specfx.passes.graph_utils import finish, insert_call
from specfx.passes.infra import Pass, PassOrderError, PassResult

aten = torch.ops.aten


PREFIX = "draft_weight_"     # the buffers the pass adds: PREFIX{i}_stored, PREFIX{i}_scale


def stored_weights(gm: fx.GraphModule) -> list[torch.Tensor]:
    """The stored weights (not their scales) that `StoreDraftWeights` added to `gm`."""
    return [b for name, b in gm.named_buffers() if name.startswith(PREFIX) and name.endswith("_stored")]


class StoreDraftWeights(Pass):
    """Draft graph: every linear (the layers before the exit and the head) reads its own copy of
    its weight in int8 or bfloat16."""

    def __init__(self, dtype: torch.dtype = torch.int8):
        self.dtype = dtype

    def requires(self, gm: fx.GraphModule) -> None:
        if gm.meta.get("outputs") != ["exit_logits", "exit_hidden"]:
            raise PassOrderError("not a draft graph: run attach_early_exit and truncate_at_exit first")

    def call(self, gm: fx.GraphModule) -> PassResult:
        """Each linear over a weight W of the model becomes linear(x, stored.to(W's dtype)) *
        scale (+ bias), stored and scale from `tiled_linear.store_rows`: the skinny-matmul pass
        hands `stored` to the tiled kernel, which reads it as stored (and quantizes the rows it
        multiplies into int8 too: `tiled_linear.quantized_reference`). The drafts' KV and exit
        hidden states are then not the model's: the verify pass must run every layer over the
        drafts (`EarlyExit`, weights stored), writing the model's KV over the drafts'. Only the
        drafts can change."""
        from specfx.kernels.tiled_linear import store_rows

        linears = [n for n in gm.graph.nodes if n.op == "call_function"
                   and n.target is aten.linear.default and n.args[1].op == "get_attr"]
        if not linears:
            return PassResult(gm, False, "the draft graph has no linear over a weight of the model")
        for i, node in enumerate(linears):
            w = node.args[1]
            stored, scale = store_rows(functools.reduce(getattr, w.target.split("."), gm).detach(), self.dtype)
            with gm.graph.inserting_before(node):
                read = insert_call(gm, aten.to.dtype, (_constant(gm, f"{PREFIX}{i}_stored", stored, w),
                                                      w.meta["val"].dtype))
            bias = node.args[2] if len(node.args) > 2 else None
            node.args = (node.args[0], read)
            out = node
            users = list(node.users)
            with gm.graph.inserting_before(node.next):        # in order, after the linear
                if scale is not None:
                    out = insert_call(gm, aten.mul.Tensor, (out, _constant(gm, f"{PREFIX}{i}_scale", scale, w)))
                if bias is not None:
                    out = insert_call(gm, aten.add.Tensor, (out, bias))
            for user in users:
                user.replace_input_with(node, out)
        return PassResult(finish(gm), True, info={"stored": len(linears), "dtype": str(self.dtype).removeprefix("torch.")})


def _constant(gm: fx.GraphModule, name: str, value: torch.Tensor, like: fx.Node) -> fx.Node:
    """A buffer of `gm` read by a new get_attr node, its `meta["val"]` a fake tensor in the
    graph's fake mode (as `like`'s)."""
    gm.register_buffer(name, value)
    node = gm.graph.get_attr(name)
    mode = detect_fake_mode([like.meta["val"]])
    node.meta["val"] = mode.from_tensor(value) if mode is not None else value
    return node
