"""What the passes did to a model: structure, pass pipeline, and the fused step's health.

`inspect_model(model, draft, k=...)` builds the graphs (no compilation) and returns an
`InspectReport`; `specfx inspect` renders it and can write it as JSON.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

import torch
from torch import fx

import specfx
from specfx.passes import find_host_syncs


@dataclass
class StepReport:
    nodes: int
    ops: dict[str, int]
    host_syncs: list[str]
    graph_breaks: int
    static_shapes: bool


@dataclass
class InspectReport:
    model: str
    drafter: str
    k: int
    tree: list[int]                 # the proposal's parents (runtime.tree.Tree): a chain of k, or the drafter's tree
    structure: dict
    passes: list[dict]
    step: StepReport
    graphs: dict[str, str] = field(default_factory=dict)  # name -> readable code

    def to_dict(self) -> dict:
        return {"model": self.model, "drafter": self.drafter, "k": self.k, "tree": self.tree, "structure": self.structure,
                "passes": self.passes, "step": asdict(self.step)}


def op_histogram(gm: fx.GraphModule) -> Counter:
    """Count of call_function / call_method targets, by readable name."""
    ops = Counter()
    for n in gm.graph.nodes:
        if n.op == "call_function":
            ops[getattr(n.target, "__name__", str(n.target)) if not isinstance(n.target, torch._ops.OpOverload)
                else str(n.target)] += 1
        elif n.op == "call_method":
            ops[f"Tensor.{n.target}"] += 1
    return ops


def graph_breaks(gm: fx.GraphModule, args) -> int:
    """Graph breaks when dynamo traces `gm` (0 means `fullgraph=True` compiles it)."""
    torch._dynamo.reset()
    explain = torch._dynamo.explain(gm)(*args)
    torch._dynamo.reset()
    return explain.graph_break_count


def _static(gm: fx.GraphModule) -> bool:
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if isinstance(val, torch.Tensor) and any(not isinstance(s, int) for s in val.shape):
            return False
    return True


def inspect_model(model, draft, *, name: str = "model", k: int | None = None,
                  max_seq_len: int = 256, skinny_matmul: bool | None = None) -> InspectReport:
    """The graphs `specfx.compile` builds (by default with the passes its Inductor backend runs,
    the skinny-matmul rewrite included on CPU), not compiled."""
    if skinny_matmul is None:
        skinny_matmul = next(model.parameters()).device.type == "cpu"
    from specfx.pipeline import resolve_drafter

    if getattr(resolve_drafter(model, specfx.parse_draft(draft), k), "tree", None) is not None:
        k = None                    # a tree sets the drafts per step (a k asks for a chain: no default tree)
    fast = specfx.compile(model, draft=draft, num_speculative_tokens=k, max_seq_len=max_seq_len,
                          backend="eager", warmup=False, skinny_matmul=skinny_matmul)
    g = fast.graphs
    # A state with one short prompt, so dynamo traces the step over real values.
    g.state.load_prompts([torch.zeros(2, dtype=torch.long)], 1, [])
    step = StepReport(
        nodes=len(g.step.graph.nodes), ops=dict(op_histogram(g.step).most_common()),
        host_syncs=find_host_syncs(g.step), graph_breaks=graph_breaks(g.step, g.state.step_args()),
        static_shapes=_static(g.step),
    )
    graphs = {"prefill": g.prefill.code, "step": g.step.code}
    graphs.update({name_: gm.code for name_, gm in g.parts.items()})
    return InspectReport(model=name, drafter=str(g.drafter), k=g.k, tree=list(g.tree.parents),
                         structure=g.structure.to_dict(),
                         passes=[r.to_dict() for r in g.records], step=step, graphs=graphs)
