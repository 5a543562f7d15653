"""Small helpers the passes share: outputs, erasing scopes, copying subgraphs."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import fx
from torch._guards import detect_fake_mode


def output_node(gm: fx.GraphModule) -> fx.Node:
    return next(n for n in reversed(gm.graph.nodes) if n.op == "output")


def node_named(gm: fx.GraphModule, name: str) -> fx.Node:
    for n in gm.graph.nodes:
        if n.name == name:
            return n
    raise KeyError(f"node {name!r} not in graph")


def set_outputs(gm: fx.GraphModule, values: Iterable[fx.Node]) -> None:
    """Make the graph return exactly `values` (a tuple)."""
    output_node(gm).args = (tuple(values),)


def erase_nodes(gm: fx.GraphModule, nodes: Iterable[fx.Node]) -> int:
    """Erase `nodes` (users first); each must be used only by nodes also being erased."""
    doomed = set(nodes)
    count = 0
    for n in reversed(list(gm.graph.nodes)):
        if n in doomed:
            outside = [u for u in n.users if u not in doomed]
            if outside:
                raise RuntimeError(f"cannot erase {n.name}: still used by {[u.name for u in outside]}")
            gm.graph.erase_node(n)
            count += 1
    return count


def copy_nodes(gm: fx.GraphModule, nodes: list[fx.Node], env: dict[fx.Node, fx.Node],
               *, after: fx.Node, rename: Callable[[str], str] | None = None) -> dict[fx.Node, fx.Node]:
    """Copy `nodes` (in order) after `after`; `env` maps inputs to replacements. Returns env."""
    cursor = after
    for n in nodes:
        with gm.graph.inserting_after(cursor):
            new = gm.graph.node_copy(n, lambda x: env.get(x, x))
        if rename:
            new.name = gm.graph._graph_namespace.create_name(rename(n.name), None)
        env[n] = new
        cursor = new
    return env


def layer_nodes(gm: fx.GraphModule, stack_path: str, keep: Callable[[int], bool]) -> list[fx.Node]:
    """Nodes inside decoder layers whose index satisfies `keep`."""
    from specfx.passes.find_structure import layer_index

    out = []
    for n in gm.graph.nodes:
        i = layer_index(n, stack_path)
        if i is not None and keep(i):
            out.append(n)
    return out


def is_impure(node: fx.Node) -> bool:
    """FX's notion, plus in-place Tensor methods (`x.add_(...)`), which FX deems pure."""
    if node.op == "call_method" and isinstance(node.target, str):
        return node.target.endswith("_") and not node.target.startswith("__")
    return node.is_impure()


def finish(gm: fx.GraphModule) -> fx.GraphModule:
    """Dead-code elimination (keeping in-place writes), lint and recompile after a rewrite."""
    gm.graph.eliminate_dead_code(is_impure_node=is_impure)
    gm.graph.lint()
    gm.recompile()
    return gm


def insert_call(gm: fx.GraphModule, target, args: tuple) -> fx.Node:
    """A new `call_function` node at the graph's insertion point, with `meta["val"]` computed
    from its inputs' values (under their fake mode), as the other nodes carry."""
    node = gm.graph.call_function(target, args)
    vals = fx.node.map_arg(args, lambda n: n.meta.get("val"))
    mode = detect_fake_mode(_tensors(vals))
    if mode is not None:
        with mode:
            node.meta["val"] = target(*vals)
    return node


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
