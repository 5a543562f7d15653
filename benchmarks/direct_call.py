"""A fused step called through AOTAutograd's runtime wrappers against the direct call.

On the CPU, `runtime.compile` calls a compiled graph's code directly after its first call where
AOTAutograd's wrappers have nothing to do (`runtime.compile._direct`). This times each
drafter's step both ways on one model and state, round-robin in shuffled orders, each drafter's
calls among themselves.

    python benchmarks/direct_call.py [--drafts none,mtp,mtp:pycoder-mtp:tree=2x2x2x1] [--rounds 60]
                                     [--repeats 3]
"""

from __future__ import annotations

import argparse

import specfx
from specfx import zoo
from specfx.matmul_choice import round_robin
from specfx.runtime.compile import _flatten


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", default="none,mtp,mtp:pycoder-mtp:tree=2x2x2x1")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model, tok = zoo.load("pycoder")
    ids = tok(zoo.prompts()[0], return_tensors="pt").input_ids
    for spec in args.drafts.split(","):
        fast = specfx.compile(model, draft=spec, max_seq_len=256)
        fast.generate(ids, max_new_tokens=2)
        rt = fast.runtime
        rt.state.set_span(192)
        step = rt.step_fn
        if step.direct is None:
            print(f"{spec}: no direct call here (not the CPU, or a graph its wrappers work on)")
            continue
        calls = {"wrapped": lambda step=step, rt=rt: step.fn(*_flatten(rt.state.step_args())), "direct": rt._step}
        for _ in range(args.repeats):
            ms = {name: s * 1e3 for name, s in round_robin(calls, args.rounds).items()}
            print(f"{spec}: wrapped {ms['wrapped']:.3f} ms, direct {ms['direct']:.3f} ms "
                  f"({(1 - ms['direct'] / ms['wrapped']) * 100:.1f}% less)", flush=True)


if __name__ == "__main__":
    main()
