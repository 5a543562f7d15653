"""Analysis: find the decoder's structure in a captured graph, from module metadata alone.

Every node of an exported graph carries `meta["nn_module_stack"]`, the chain of modules that
produced it. From that chain alone, with no architecture-specific node names:

- the decoder stack is the module path `P` with the most children `P.0, P.1, ...`, among
  those not nested in another such list;
- layer i's residual output is the last node in `P.i` that a node outside `P.i` uses;
- the head is every node between the last layer's output and the logits (final norm, lm_head,
  and any logit soft-capping), so an early exit copies exactly what the model itself does;
- the KV buffers of layer i are the buffers mutated in place inside `P.i`.

A graph where a part cannot be found raises `StructureError` naming that part.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import fx

from specfx.passes.infra import Pass, PassResult

_INDEXED = re.compile(r"^(.*)\.(\d+)$")


class StructureError(ValueError):
    """The captured model lacks a part speculative decoding needs."""


@dataclass
class StructureMap:
    """Where the parts of a decoder sit in one captured graph (node names, module paths)."""

    stack_path: str
    layer_type: str
    num_layers: int
    layer_outputs: list[str]
    kv_buffers: list[tuple[str, str]]
    embedding: str
    final_norm: str
    lm_head: str
    head_nodes: list[str]
    input_ids: str
    positions: str
    hidden_size: int
    vocab_size: int
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}

    def __str__(self) -> str:
        return (f"StructureMap({self.stack_path}: {self.num_layers} x {self.layer_type}, "
                f"norm={self.final_norm}, lm_head={self.lm_head}, hidden={self.hidden_size}, "
                f"vocab={self.vocab_size})")


def module_paths(node: fx.Node) -> list[str]:
    """Module paths enclosing `node`, outermost first."""
    stack = node.meta.get("nn_module_stack") or {}
    return [v[0] if isinstance(v, tuple) else str(v) for v in stack.values()]


def layer_index(node: fx.Node, stack_path: str) -> int | None:
    """Index of the decoder layer that produced `node`, or None outside the stack."""
    prefix = stack_path + "."
    for p in module_paths(node):
        if p.startswith(prefix):
            rest = p[len(prefix):].split(".", 1)[0]
            if rest.isdigit():
                return int(rest)
    return None


def _find_stack(gm: fx.GraphModule) -> tuple[str, str]:
    children: dict[str, set[int]] = {}
    types: dict[str, str] = {}
    for node in gm.graph.nodes:
        for key, val in (node.meta.get("nn_module_stack") or {}).items():
            path, typ = (val if isinstance(val, tuple) else (str(val), ""))
            m = _INDEXED.match(path)
            if m:
                children.setdefault(m.group(1), set()).add(int(m.group(2)))
                types[m.group(1)] = str(typ).rsplit(".", 1)[-1]
    if not children:
        raise StructureError(
            "decoder stack not found: no module list of repeated layers (paths like "
            "'model.layers.0') appears in the graph's nn_module_stack metadata"
        )
    # A list inside a layer (StableLM's per-head QK norms) is not the stack, however long.
    outer = [p for p in children if not any(p.startswith(q + ".") for q in children if q != p)]
    stack = max(outer, key=lambda p: (len(children[p]), -len(p)))
    n = len(children[stack])
    if children[stack] != set(range(n)):
        raise StructureError(f"decoder stack {stack!r} has non-contiguous layers {sorted(children[stack])}")
    return stack, types[stack]


def find_structure(gm: fx.GraphModule) -> StructureMap:
    """Build the StructureMap of a captured decoder graph (raises StructureError)."""
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) < 2:
        raise StructureError("position input not found: expected placeholders (input_ids, positions)")
    input_ids, positions = placeholders[0], placeholders[1]
    stack, layer_type = _find_stack(gm)
    in_layer = {n: layer_index(n, stack) for n in nodes}
    num_layers = 1 + max(i for i in in_layer.values() if i is not None)

    layer_outputs, kv_buffers = [], []
    for i in range(num_layers):
        scope = [n for n in nodes if in_layer[n] == i]
        escaping = [n for n in scope if any(in_layer[u] != i for u in n.users)]
        if not escaping:
            raise StructureError(f"residual output of layer {i} not found in {stack}.{i}")
        layer_outputs.append(max(escaping, key=order.get))
        writes = [n for n in scope if _mutated_buffer(n) is not None]
        if len(writes) < 2:
            raise StructureError(
                f"KV buffers of layer {i} not found: {stack}.{i} writes no cache in place "
                "(does the attention call cache.update?)"
            )
        kv_buffers.append((_mutated_buffer(writes[0]), _mutated_buffer(writes[1])))

    ids = _views_of(input_ids)
    embedding = next((n for n in nodes if n.op == "call_function"
                      and n.target is torch.ops.aten.embedding.default and len(n.args) > 1 and n.args[1] in ids), None)
    if embedding is None:
        raise StructureError("embedding not found: no aten.embedding reads input_ids")

    output = next(n for n in nodes if n.op == "output")
    logits = output.args[0][0] if isinstance(output.args[0], (tuple, list)) else output.args[0]
    head = _between(nodes, layer_outputs[-1], logits)
    if not head:
        raise StructureError("head not found: the logits do not depend on the last layer's output")
    norm_path = _first_module(head, exclude=stack)
    lm_head = next((n for n in reversed(head) if n.target in (torch.ops.aten.linear.default,
                    torch.ops.aten.mm.default, torch.ops.aten.matmul.default)), None)
    if norm_path is None:
        raise StructureError("final norm not found after the decoder stack")
    if lm_head is None:
        raise StructureError("lm_head not found: no linear layer between the last layer and the logits")
    val = layer_outputs[-1].meta.get("val")
    lval = logits.meta.get("val")
    return StructureMap(
        stack_path=stack, layer_type=layer_type, num_layers=num_layers,
        layer_outputs=[n.name for n in layer_outputs], kv_buffers=kv_buffers,
        embedding=embedding.name, final_norm=norm_path, lm_head=module_paths(lm_head)[-1],
        head_nodes=[n.name for n in head], input_ids=input_ids.name, positions=positions.name,
        hidden_size=int(val.shape[-1]) if val is not None else -1,
        vocab_size=int(lval.shape[-1]) if lval is not None else -1,
    )


_VIEWS = {torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten.unsqueeze.default,
          torch.ops.aten.squeeze.dim, torch.ops.aten.flatten.using_ints, torch.ops.aten.contiguous.default}


def _views_of(node: fx.Node) -> set[fx.Node]:
    """`node` and the nodes that only reshape it (GPT-2 and OPT embed `input_ids.view(...)`)."""
    seen, stack = {node}, [node]
    while stack:
        for u in stack.pop().users:
            if u.op == "call_function" and u.target in _VIEWS and u.args[0] in seen and u not in seen:
                seen.add(u)
                stack.append(u)
    return seen


def _mutated_buffer(node: fx.Node) -> str | None:
    """Name of the get_attr buffer `node` mutates in place (first argument), if any."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    if not node.target._schema.is_mutable or not node.args:
        return None
    first = node.args[0]
    return first.target if isinstance(first, fx.Node) and first.op == "get_attr" else None


def _between(nodes, src: fx.Node, dst: fx.Node) -> list[fx.Node]:
    """Nodes on some path src -> dst (excluding src), in graph order."""
    ancestors, stack = set(), [dst]
    while stack:
        n = stack.pop()
        if n in ancestors:
            continue
        ancestors.add(n)
        stack.extend(n.all_input_nodes)
    seen, stack = set(), [src]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u not in seen and u in ancestors:
                seen.add(u)
                stack.append(u)
    return [n for n in nodes if n in seen]


def _first_module(head: list[fx.Node], exclude: str) -> str | None:
    for n in head:
        paths = [p for p in module_paths(n) if not p.startswith(exclude)]
        if len(paths) >= 2:
            return paths[-1]
    return None



class FindStructure(Pass):
    """Analysis: map decoder stack, residual outputs, norm, lm_head, embedding and KV buffers
    (kept in `gm.meta["structure"]`, where the structural passes read it)."""

    kind = "analysis"

    def call(self, gm: fx.GraphModule) -> PassResult:
        structure = find_structure(gm)
        gm.meta["structure"] = structure
        return PassResult(gm, False, "analysis", info={"structure": structure})
