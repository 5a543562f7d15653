"""What a fused step costs against its parts: each drafter's step, its draft and verify graphs
timed alone, and the same graphs called one after another as the step calls them.

`SpeculativeModel.profile()` times each graph alone, repeated: a draft graph then finds its
weights in the cache. In a step it follows the verify pass, which streams the target's weights
through the cache, and the fused step also accepts, commits and moves the drafter's state.
This times, round-robin over everything (so the machine's drift reaches each figure alike):

- `step`: one fused step, as the generate loop runs it;
- `alone`: the sum over the parts of (calls per step x the part's time timed alone);
- `sequence`: the parts called once each in a step's order (draft graphs, verify, refill).

    python benchmarks/step_cost.py [--drafts none,mtp,draft-model:pycoder-draft,ngram:3,early-exit] [--rounds 40]
                                   [--json benchmarks/cpu/step_cost.json]
"""

from __future__ import annotations

import argparse
import json

import torch

import specfx
from specfx import zoo
from specfx.matmul_choice import round_robin


def parts_in_order(rt) -> list[tuple[str, int]]:
    """(part, calls) in a step's order: the drafts, the verify pass, then the refill."""
    calls = dict(rt.graphs.draft_calls)
    refill = calls.pop("refill", 0)
    return [*calls.items(), (rt.verify_part, 1), *([("refill", refill)] if refill else [])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", default="none,mtp,draft-model:pycoder-draft,ngram:3,early-exit")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--json")
    args = ap.parse_args()
    model, tok = zoo.load("pycoder")
    ids = tok(zoo.prompts()[0], return_tensors="pt").input_ids
    calls, plan = {}, {}
    for spec in args.drafts.split(","):
        fast = specfx.compile(model, draft=spec, max_seq_len=1024)
        fast.generate(ids, max_new_tokens=2)
        rt = fast.runtime
        rt.cover(steps=args.rounds + 2)
        exit_hidden, order = None, parts_in_order(rt)
        for name, _ in order:
            call = calls[f"{spec} {name}"] = rt.part_call(name, exit_hidden)
            if name == "draft":
                exit_hidden = call()[-1]              # early exit's verify reads it (as `profile` passes it)
        seq = [(calls[f"{spec} {name}"], n) for name, n in order]
        calls[f"{spec} sequence"] = lambda seq=seq: [fn() for fn, n in seq for _ in range(n)]
        calls[f"{spec} step"] = rt._step
        plan[spec] = order
    times = round_robin(calls, args.rounds)               # under no_grad
    ms = {name: s * 1e3 for name, s in times.items()}
    rows = []
    print(f"{'drafter':<14}{'step ms':>9}{'sequence':>10}{'alone':>8}   parts alone (ms x calls)")
    for spec, order in plan.items():
        alone = sum(ms[f"{spec} {name}"] * n for name, n in order)
        parts = {name: dict(ms=ms[f"{spec} {name}"], calls=n) for name, n in order}
        rows.append(dict(draft=spec, step_ms=ms[f"{spec} step"], sequence_ms=ms[f"{spec} sequence"],
                         alone_ms=alone, parts=parts))
        shown = ", ".join(f"{name} {p['ms']:.3f} x{p['calls']}" for name, p in parts.items())
        print(f"{spec:<14}{rows[-1]['step_ms']:>9.3f}{rows[-1]['sequence_ms']:>10.3f}{alone:>8.3f}   {shown}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(rounds=args.rounds, threads=torch.get_num_threads(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
