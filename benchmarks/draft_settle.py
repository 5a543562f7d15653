"""What settling a draft's one-row kernel in its own pass changes (`MatmulPlan.settle` for a draft's
weight set): each drafter's fused step on pycoder, compiled with the measured plan as it is and
with the draft's one-row kernel left to its chains (the settle turned off), in one process,
timed round-robin (median of `--rounds`), repeated `--repeats` times. Prints which kernel each
build's draft pass reads its weights with.

    python benchmarks/draft_settle.py [--drafts mtp:pycoder-mtp:tree=1x1x1,mtp,early-exit] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from specfx import matmul_choice, pipeline, zoo
from specfx.matmul_choice import machine
from timing import at_span, round_args, timed_rounds

WAYS = ("settled", "chains")


def draft_kernels(gm) -> str:
    """How many tiled kernels the draft pass calls (none: its linears are the reduction's)."""
    ops = torch.ops.specfx
    tiled = sum(n.target in (ops.tiled_linear.default, ops.tiled_linears.default) for n in gm.graph.nodes)
    return f"{tiled} tiled kernels"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", default="mtp:pycoder-mtp:tree=1x1x1,mtp,early-exit")
    ap.add_argument("--span", type=int, default=192, help="cache slots a step reads")
    round_args(ap)
    args = ap.parse_args()
    os.environ.pop(matmul_choice.ENV, None)             # the measured plan
    model, tok = zoo.load("pycoder")
    settle, calls, kernels = pipeline._settle_draft, {}, {}
    for way in WAYS:
        pipeline._settle_draft = settle if way == "settled" else (lambda *a, **k: None)
        for spec in args.drafts.split(","):
            fast = at_span(model, tok, spec, args.span)
            calls[(spec, way)] = fast.runtime._step
            kernels[(spec, way)] = draft_kernels(fast.graphs.parts["draft"])
    pipeline._settle_draft = settle
    print(f"{machine()}; fused steps at a {args.span}-slot span, ms, median of {args.rounds} rounds, "
          "each repeat on its own line")
    for (spec, way), what in kernels.items():
        print(f"  {spec} {way}: draft pass on {what}")
    runs = timed_rounds(calls, args.rounds, args.repeats, lambda key: f"{key[0]} {key[1]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine(), span=args.span, rounds=args.rounds,
                           draft_pass={f"{s} {w}": k for (s, w), k in kernels.items()},
                           runs=[[dict(draft=s, plan=w, ms=t) for (s, w), t in ms.items()] for ms in runs]),
                      f, indent=1)


if __name__ == "__main__":
    main()
