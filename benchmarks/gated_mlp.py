"""What fusing a gated MLP's silu(gate) * up into its kernel (`tiled_glu`, the skinny-matmul
pass's `_fuse_gated`) changes: each drafter's fused step on pycoder, compiled with the fusion
and without it (the gate and up columns from `tiled_linears`, gated by Inductor's pointwise
kernel), in one process, timed round-robin (median of `--rounds`), repeated `--repeats` times;
with them, the first drafter's prefill of the first evaluation prompt and its first token
(`generate(max_new_tokens=1)`), each way.

    python benchmarks/gated_mlp.py [--drafts none,mtp:pycoder-mtp:tree=1x1x1,mtp] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

from specfx import zoo
from specfx.matmul_choice import machine
from specfx.passes import skinny_matmul
from timing import at_span, round_args, timed_rounds

WAYS = ("fused", "apart")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", default="none,mtp:pycoder-mtp:tree=1x1x1,mtp")
    ap.add_argument("--span", type=int, default=192, help="cache slots a step reads")
    round_args(ap)
    args = ap.parse_args()
    model, tok = zoo.load("pycoder")
    fuse, calls = skinny_matmul._fuse_gated, {}
    for way in WAYS:
        skinny_matmul._fuse_gated = fuse if way == "fused" else (lambda gm: 0)
        for i, spec in enumerate(args.drafts.split(",")):
            fast = at_span(model, tok, spec, args.span)
            calls[(spec, way)] = fast.runtime._step
            if i == 0:
                ids = tok(zoo.prompts()[0], return_tensors="pt").input_ids
                calls[(f"prefill {ids.shape[1]} tokens", way)] = lambda fast=fast, ids=ids: fast.generate(ids, max_new_tokens=1)
    skinny_matmul._fuse_gated = fuse
    print(f"{machine()}; fused steps at a {args.span}-slot span, ms, median of {args.rounds} rounds, "
          "each repeat on its own line")
    runs = timed_rounds(calls, args.rounds, args.repeats, lambda key: f"{key[0]} {key[1]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine(), span=args.span, rounds=args.rounds,
                           runs=[[dict(draft=s, mlp=w, ms=t) for (s, w), t in ms.items()] for ms in runs]), f, indent=1)


if __name__ == "__main__":
    main()
