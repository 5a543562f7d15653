"""share_kv_buffers: KV buffers become graph inputs, so every graph uses the runtime's tensors."""

from __future__ import annotations

import re

from torch import fx

from specfx.passes.graph_utils import finish
from specfx.passes.infra import Pass, PassResult

_KV = re.compile(r"^kv_([kv])_(\d+)$")


class ShareKVBuffers(Pass):
    """Replace KV-buffer attributes by inputs (after the others), in layer order."""

    def call(self, gm: fx.GraphModule) -> PassResult:
        attrs = [n for n in gm.graph.nodes if n.op == "get_attr" and _KV.match(n.target)]
        if not attrs:
            return PassResult(gm, False, "no KV buffers held as graph attributes")
        attrs.sort(key=lambda n: (int(_KV.match(n.target).group(2)), _KV.match(n.target).group(1)))
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
