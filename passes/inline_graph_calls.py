"""inline_graph_calls: inline every captured-graph call of a traced step into one flat graph."""

from __future__ import annotations

import operator

from torch import fx

from specfx.passes.graph_utils import finish
from specfx.passes.infra import Pass, PassOrderError, PassResult


class InlineGraphCalls(Pass):
    """Inline the step's calls into captured graphs (drafts, verify, refill) so the step is one graph."""

    def call(self, gm: fx.GraphModule) -> PassResult:
        calls = graph_calls(gm)
        if not calls:
            return PassResult(gm, False, "no captured-graph calls left to inline")
        for call in calls:
            _inline(gm, call)
        return PassResult(finish(gm), True, info={"inlined_calls": len(calls)})

    def ensures(self, gm: fx.GraphModule) -> None:
        if graph_calls(gm):
            raise PassOrderError(f"graph calls left after inlining: {[n.target for n in graph_calls(gm)]}")


def graph_calls(gm: fx.GraphModule) -> list[fx.Node]:
    """The `call_module` nodes of `gm` that call a captured graph."""
    return [n for n in gm.graph.nodes if n.op == "call_module" and isinstance(gm.get_submodule(n.target), fx.GraphModule)]


def _inline(gm: fx.GraphModule, call: fx.Node) -> None:
    sub: fx.GraphModule = gm.get_submodule(call.target)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(call.args) != len(placeholders) or call.kwargs:
        raise ValueError(f"{call.target}: called with {len(call.args)} args, graph takes {len(placeholders)}")
    env: dict[fx.Node, fx.Node] = dict(zip(placeholders, call.args))
    result = None
    with gm.graph.inserting_before(call):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                result = n.args[0]
                break
            if n.op == "get_attr":
                new = gm.graph.get_attr(f"{call.target}.{n.target}")
                new.meta = dict(n.meta)
            else:
                new = gm.graph.node_copy(n, lambda x: env[x])
                if n.op == "call_module":
                    new.target = f"{call.target}.{n.target}"
            env[n] = new
    outs = fx.node.map_arg(result, lambda x: env[x])
    for user in list(call.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(outs[user.args[1]])
            gm.graph.erase_node(user)
    if call.users:
        raise ValueError(f"{call.target}: result used other than by indexing ({list(call.users)})")
    gm.graph.erase_node(call)
