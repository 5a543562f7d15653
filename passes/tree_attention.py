"""tree_attention: a verify graph over a static draft tree computes its own positions, KV slots and mask.

A verify graph is captured with explicit inputs for where each row sits (`positions`), which KV
slot it writes (`slots`) and which cache slots it sees (`visible`, [B, 1, N+1, S] bool). For a
tree fixed at compile time all three follow from one number per sequence, the pending token's
position `last` [B] (see `specfx.runtime.tree.Tree`): a row's position is `last` plus its
depth, its slot `last` plus its row, and it sees the committed cache, its ancestors and itself.
This pass replaces the three inputs with `last` and builds them inside the graph from the tree's
constants, so the graph is "the target over this tree" and the step hands it one index. The mask
covers the slots that attention reads, the graph's span (its `span` input), not the whole cache.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from specfx.passes.graph_utils import copy_nodes, finish, output_node
from specfx.passes.infra import Pass, PassOrderError, PassResult
from specfx.passes.skinny_matmul import MATERIALIZE
from specfx.runtime.tree import Tree

INPUTS = ("positions", "slots", "visible")


class TreeAttention(Pass):
    """Replace the positions, KV slots and mask inputs with `last`; the graph builds them from the tree."""

    def __init__(self, tree: Tree, max_pos: int):
        self.tree, self.max_pos = tree, max_pos

    def requires(self, gm: fx.GraphModule) -> None:
        names = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
        if "last" in names:
            raise PassOrderError("the graph already takes `last`: tree_attention ran on it")
        if not set(INPUTS) <= names:
            raise PassOrderError(f"tree_attention needs a graph captured with explicit_mask=True "
                                 f"(inputs {', '.join(INPUTS)}), got {sorted(names)}")

    def ensures(self, gm: fx.GraphModule) -> None:
        names = {n.name for n in gm.graph.nodes if n.op == "placeholder"}
        assert "last" in names and not names & set(INPUTS), names

    def call(self, gm: fx.GraphModule) -> PassResult:
        placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
        pos_val = placeholders["positions"].meta["val"]
        B, width = pos_val.shape
        if width != self.tree.size + 1:
            raise ValueError(f"the verify graph reads {width} rows; the tree ({self.tree}) has "
                             f"{self.tree.size} nodes and the pending token")
        inputs = fx.symbolic_trace(_TreeInputs(self.tree, self.max_pos))
        with gm.graph.inserting_before(placeholders["positions"]):
            last = gm.graph.placeholder("last")
        last.meta["val"] = pos_val[:, 0].clone()
        arg_last, arg_span = [n for n in inputs.graph.nodes if n.op == "placeholder"]
        body = [n for n in inputs.graph.nodes if n.op not in ("placeholder", "output")]
        after = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
        env = copy_nodes(gm, body, {arg_last: last, arg_span: placeholders["span"]}, after=after)
        built = fx.node.map_arg(output_node(inputs).args[0], lambda x: env[x])
        span_len = placeholders["span"].meta["val"].shape[0]
        for name, node in zip(INPUTS, built):
            val = placeholders[name].meta["val"]
            if name == "visible":                   # over the span's slots, not the cache's
                val = val.new_empty((*val.shape[:-1], span_len))
            node.meta["val"] = val
            placeholders[name].replace_all_uses_with(node)
            gm.graph.erase_node(placeholders[name])
        if "inputs" in gm.meta:
            gm.meta["inputs"] = ["last" if name == "positions" else name for name in gm.meta["inputs"]]
        return PassResult(finish(gm), True, info={"rows": width, "tree": str(self.tree)})


class _TreeInputs(nn.Module):
    """(last [B], span [L]) -> (positions [B, N+1], slots [B, N+1], visible [B, 1, N+1, L]) of
    the tree: the mask over the span's L slots, which is all that attention reads (built over
    the whole cache, the kernel that computes it took 52.0 us a step in pycoder's 2x2x2x1 MTP step
    at 2048 slots; over the span, 8.3, layer 0's rotary and KV write included)."""

    def __init__(self, tree: Tree, max_pos: int):
        super().__init__()
        self.tree, self.max_pos = tree, max_pos

    def forward(self, last: torch.Tensor, span: torch.Tensor):
        t, S = self.tree, span.shape[0]
        visible = t.visibility(last, S)
        if not t.is_chain:
            # Computed once into a buffer: else Inductor inlines the ancestor table's gather
            # into every layer's softmax, per head, cache slot and pass over the scores.
            rows = t.size + 1
            visible = MATERIALIZE(visible, [rows * S, rows * S, S, 1])
        return t.positions(last).clamp(max=self.max_pos), t.slots(last).clamp(max=self.max_pos), visible
