"""Pass infrastructure: the pass contract, a registry, and a PassManager that records each run.

A pass is a callable class with a one-line docstring, a `kind` ("analysis" or "rewrite") and
`call(gm) -> PassResult`. A rewrite that did not fire returns `PassResult(gm, False, reason)`,
so `specfx inspect` can say why. Order between passes is checked, not described: a pass's
`requires(gm)` raises `PassOrderError` when the graph lacks what an earlier pass provides (its
StructureMap, an attached exit), and `ensures(gm)` checks what the pass promises after it ran
(as torch.fx's `PassBase` does). The PassManager times each pass, counts the nodes it added
and removed, and names the failing pass (and those that ran before it) when one raises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from torch import fx

REGISTRY: dict[str, type[Pass]] = {}


@dataclass
class PassResult:
    """What a pass returns: the (possibly new) graph, whether it changed, and why not."""

    graph_module: fx.GraphModule
    modified: bool
    reason: str = ""
    info: dict[str, Any] = field(default_factory=dict)


class Pass:
    """Base class: subclasses implement `call(gm)`; `kind` is "analysis" or "rewrite"."""

    kind = "rewrite"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        REGISTRY[cls.name()] = cls

    @classmethod
    def name(cls) -> str:
        return getattr(cls, "pass_name", None) or _snake(cls.__name__)

    @classmethod
    def summary(cls) -> str:
        return (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""

    def requires(self, gm: fx.GraphModule) -> None:
        """Raise `PassOrderError` (or `ValueError` for a bad argument) if `gm` cannot take this pass."""

    def ensures(self, gm: fx.GraphModule) -> None:
        """Raise `PassOrderError` if the result breaks what this pass promises."""

    def call(self, gm: fx.GraphModule) -> PassResult:
        raise NotImplementedError

    def __call__(self, gm: fx.GraphModule) -> PassResult:
        self.requires(gm)
        result = self.call(gm)
        self.ensures(result.graph_module)
        return result


class PassOrderError(RuntimeError):
    """A pass ran on a graph that lacks what an earlier pass provides, or broke its promise."""


def structure_of(gm: fx.GraphModule):
    """The graph's own StructureMap (`find_structure` puts it in `gm.meta`, and `capture` maps
    every graph it exports): passes look nodes up by the names of the graph they rewrite."""
    structure = gm.meta.get("structure")
    if structure is None:
        raise PassOrderError("the graph has no StructureMap: run find_structure on it first")
    return structure


@dataclass
class PassRecord:
    """One pass run as the PassManager saw it."""

    name: str
    kind: str
    modified: bool
    reason: str
    nodes_added: int
    nodes_removed: int
    ms: float
    graph: str = ""

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "modified": self.modified, "reason": self.reason,
                "graph": self.graph, "nodes_added": self.nodes_added,
                "nodes_removed": self.nodes_removed, "ms": round(self.ms, 3)}


class PassError(RuntimeError):
    """A pass raised; the message names it and the passes that ran before it."""


class PassManager:
    """Runs passes in order over a graph and keeps a `PassRecord` per pass."""

    def __init__(self, records: list[PassRecord] | None = None):
        self.records = records if records is not None else []

    def run(self, p: Pass, gm: fx.GraphModule, *, graph: str = "") -> PassResult:
        before = set(gm.graph.nodes)  # node objects, kept alive so ids are not reused
        t0 = time.perf_counter()
        try:
            result = p(gm)
        except Exception as e:
            ran = ", ".join(r.name for r in self.records) or "none"
            raise PassError(f"pass {p.name()} failed on graph {graph or '?'}: {e} "
                            f"(passes run before it: {ran})") from e
        ms = (time.perf_counter() - t0) * 1e3
        after = set(result.graph_module.graph.nodes)
        self.records.append(PassRecord(
            name=p.name(), kind=p.kind, modified=result.modified, reason=result.reason,
            nodes_added=len(after - before), nodes_removed=len(before - after), ms=ms, graph=graph,
        ))
        return result

    def run_all(self, passes: list[Pass], gm: fx.GraphModule, *, graph: str = "") -> fx.GraphModule:
        for p in passes:
            gm = self.run(p, gm, graph=graph).graph_module
        return gm


def _snake(name: str) -> str:
    out = []
    for i, ch in enumerate(name):
        nxt = name[i + 1] if i + 1 < len(name) else ""
        if ch.isupper() and i and (name[i - 1].islower() or nxt.islower()):
            out.append("_")
        out.append(ch.lower())
    return "".join(out)
