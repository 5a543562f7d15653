"""A fused step's kernels with specfx's barriers against Inductor's.

Inductor runs a C++ kernel's serial loop nests inside the kernel's parallel region as `omp
single` blocks, each ending in a barrier, and ends every `omp for` with one; specfx's compile
runs serial nests after the region and leaves out the barrier of a region's one top-level `omp
for` (`runtime.compile._fewer_barriers`). This compiles each drafter's fused step graph both ways
("inductor's", "specfx's"), on one model and one state, and calls the two (and the runtime's
own step, built the second way) round-robin in shuffled orders, so that the machine's drift
reaches all alike, each drafter's calls among themselves: a step called right after another
drafter's finds less of its state in the cache.

    python benchmarks/barriers.py [--drafts none,mtp,mtp:pycoder-mtp:tree=2x2x2x1] [--rounds 30]
                                  [--repeats 3] [--max-seq-len 512]
"""

from __future__ import annotations

import argparse
import contextlib

import specfx
from specfx import zoo
from specfx.matmul_choice import round_robin
from specfx.runtime import compile as rc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", default="none,mtp,mtp:pycoder-mtp:tree=2x2x2x1")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-seq-len", type=int, default=512)
    args = ap.parse_args()
    model, tok = zoo.load("pycoder")
    ids = tok(zoo.prompts()[0], return_tensors="pt").input_ids
    for spec in args.drafts.split(","):
        calls = {}
        fast = specfx.compile(model, draft=spec, max_seq_len=args.max_seq_len)
        fast.generate(ids, max_new_tokens=2)
        rt = fast.runtime
        rt.cover(steps=args.rounds * args.repeats * 3 + 10)
        ours = rc.compile_graph(rt.graphs.step, "inductor")
        rule = rc._fewer_barriers
        rc._fewer_barriers = contextlib.nullcontext
        try:
            theirs = rc.compile_graph(rt.graphs.step, "inductor")
        finally:
            rc._fewer_barriers = rule
        for fn in (ours, theirs):
            fn(*rt.state.step_args())
        calls[f"{spec}: inductor's"] = lambda fn=theirs, rt=rt: fn(*rt.state.step_args())
        calls[f"{spec}: specfx's"] = lambda fn=ours, rt=rt: fn(*rt.state.step_args())
        calls[f"{spec}: runtime's"] = rt._step
        for _ in range(args.repeats):
            ms = round_robin(calls, args.rounds)
            print("  ".join(f"{name} {t * 1e3:.3f}" for name, t in ms.items()), flush=True)


if __name__ == "__main__":
    main()
