"""share_kv_buffers: KV buffers become graph inputs, so every graph uses the runtime's tensors."""

from __future__ import annotations

from torch import fx

from specfx.passes.graph_utils import finish
from specfx.passes.infra import Pass, PassOrderError, PassResult, structure_of


class ShareKVBuffers(Pass):
    """Replace the KV-buffer attributes by inputs (after the others), in layer order (key, value).

    The buffers are the graph's StructureMap's (`kv_buffers`, the buffers each layer writes in
    place), or `buffers`, named, for a graph that is not a decoder (an MTP head)."""

    def __init__(self, buffers: list[str] | None = None):
        self.buffers = buffers

    def _names(self, gm: fx.GraphModule) -> list[str]:
        if self.buffers is not None:
            return list(self.buffers)
        return [name for pair in structure_of(gm).kv_buffers for name in pair]

    def requires(self, gm: fx.GraphModule) -> None:
        self._names(gm)

    def ensures(self, gm: fx.GraphModule) -> None:
        left = [n.target for n in gm.graph.nodes if n.op == "get_attr" and n.target in self._names(gm)]
        if left:
            raise PassOrderError(f"KV buffers still read as attributes: {left}")

    def call(self, gm: fx.GraphModule) -> PassResult:
        by_name = {n.target: n for n in gm.graph.nodes if n.op == "get_attr"}
        attrs = [by_name[name] for name in self._names(gm) if name in by_name]
        if not attrs:
            return PassResult(gm, False, "no KV buffers held as graph attributes")
        last_ph = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
        names = []
        cursor = last_ph
        for n in attrs:
            with gm.graph.inserting_after(cursor):
                ph = gm.graph.placeholder(n.target)
            ph.meta["val"] = n.meta.get("val")
            n.replace_all_uses_with(ph)
            target = n.target
            gm.graph.erase_node(n)
            if hasattr(gm, target):
                delattr(gm, target)
            names.append(target)
            cursor = ph
        gm.meta["kv_inputs"] = names
        return PassResult(finish(gm), True, info={"kv_inputs": names})
