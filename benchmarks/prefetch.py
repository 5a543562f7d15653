"""Where the tiled kernel's weight stream should prefetch, L1 or L2 (`SPECFX_AHEAD_LOCALITY` in
`specfx/kernels/tiled_linear.h`, chosen by `tiled_linear.ahead_locality`): pycoder's 85 weight
matrices (49 kernels, each input waiting on the kernel before, as `grouped_linears.py` times
them), and with `--steps` each drafter's fused step, compiled both ways in one process and timed
round-robin (median of `--rounds`), repeated `--repeats` times.

    python benchmarks/prefetch.py [--rows 1,4,8] [--steps none,mtp:pycoder-mtp:tree=1x1x1,mtp] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from torch._inductor import config

from grouped_linears import chain, weight_groups
from specfx import zoo
from specfx.kernels import tiled_linear
from specfx.matmul_choice import machine
from specfx.runtime.compile import compile_graph
from timing import at_span, round_args, timed_rounds

LOCALITY = {"l1": 3, "l2": 2}
LEVELS = tuple(LOCALITY)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8")
    ap.add_argument("--steps", default="", help="drafter specs whose fused steps to time too (comma-separated)")
    ap.add_argument("--span", type=int, default=192, help="cache slots a step reads (--steps)")
    round_args(ap)
    args = ap.parse_args()
    model, tok = zoo.load("pycoder")
    _, grouped = weight_groups(model)
    calls = {}
    default = tiled_linear.AHEAD_LOCALITY
    # Each level's graphs compiled anew (Inductor's FX graph cache would return the first level's
    # code: its key is the graph, whose VERSION argument is fixed at import).
    with torch.no_grad(), config.patch({"fx_graph_cache": False}):
        for level in LEVELS:
            tiled_linear.AHEAD_LOCALITY = LOCALITY[level]
            for M in (int(r) for r in args.rows.split(",")):
                xs = [torch.randn(M, K) for K in sorted({ws[0].shape[1] for ws in grouped})]
                fn = compile_graph(chain(grouped), "inductor")
                flat = [w for ws in grouped for w in ws] + xs
                fn(*flat)                                  # compiled here, at this level
                calls[(f"{M} rows", level)] = lambda fn=fn, flat=flat: fn(*flat)
            for spec in filter(None, args.steps.split(",")):
                calls[(f"step {spec}", level)] = at_span(model, tok, spec, args.span).runtime._step
    tiled_linear.AHEAD_LOCALITY = default
    print(f"{machine()}; L1 data cache {tiled_linear.l1_data_cache()} bytes a core (default: "
          f"{'l1' if default == 3 else 'l2'}); ms, median of {args.rounds} rounds, "
          "each repeat on its own line")
    runs = timed_rounds(calls, args.rounds, args.repeats, lambda key: f"{key[0]} {key[1]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine(), l1_data_cache=tiled_linear.l1_data_cache(), rounds=args.rounds,
                           runs=[[dict(what=w, prefetch=lv, ms=t) for (w, lv), t in ms.items()] for ms in runs]),
                      f, indent=1)


if __name__ == "__main__":
    main()
