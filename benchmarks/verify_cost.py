"""What `SpeculativeModel.profile()` reports for each drafter's verify graph against the decode
graph of plain decoding: the ratio the CPU goal states (a 4-row verify at most 1.15x a decode).

`profile()` times each graph alone, repeated, as `specfx bench` does for its draft and verify
columns. This compiles each drafter on pycoder, generates 64 tokens, then calls `profile()` on
each in alternating rounds (the order reversed every other round) and prints the medians.

    python benchmarks/verify_cost.py [--drafts none,mtp,mtp:pycoder-mtp:tree=2x2x2x1] [--rounds 7] [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics

import specfx
from specfx import zoo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", default="none,mtp,mtp:pycoder-mtp:tree=2x2x2x1", help="the first is the reference")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    model, tok = zoo.load("pycoder")
    ids = tok(zoo.prompts()[0], return_tensors="pt").input_ids
    fast = {d: specfx.compile(model, draft=d, max_seq_len=256) for d in args.drafts.split(",")}
    for f in fast.values():
        f.generate(ids, max_new_tokens=64)
    ms = {d: [] for d in fast}
    order = list(fast.items())
    for r in range(args.rounds):
        for d, f in (order if r % 2 == 0 else order[::-1]):
            ms[d].append(f.profile(repeats=args.repeats)[1] * 1e3)
    first = statistics.median(next(iter(ms.values())))
    for d, t in ms.items():
        m = statistics.median(t)
        print(f"{d}: verify {m:.3f} ms ({m / first:.3f}x), by round {' '.join(f'{x:.3f}' for x in t)}")


if __name__ == "__main__":
    main()
