"""What `SpeculativeModel.profile()` reports for each drafter's verify graph against the decode
graph of plain decoding: the ratio the CPU goal states (a 4-row verify at most 1.15x a decode).

`profile()` times each graph compiled alone, as `specfx bench` does for its draft and verify
columns. This compiles each drafter on pycoder, generates 64 tokens, then times every
drafter's parts together in shuffled rounds (`runtime.generate.profile_together`, as the bench
does), `--repeats` times over, and prints each verify's medians and its ratio to the first
drafter's.

    python benchmarks/verify_cost.py [--drafts none,mtp:pycoder-mtp:tree=1x1x1,mtp] [--rounds 60] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics

import specfx
from specfx import zoo
from specfx.runtime.generate import profile_together


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", default="none,mtp:pycoder-mtp:tree=1x1x1,mtp",
                    help="the first is the reference (pycoder's `mtp` drafts its default tree; tree=1x1x1 is the chain)")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model, tok = zoo.load("pycoder")
    ids = tok(zoo.prompts()[0], return_tensors="pt").input_ids
    drafts = args.drafts.split(",")
    fast = {d: specfx.compile(model, draft=d, max_seq_len=256) for d in drafts}
    for f in fast.values():
        f.generate(ids, max_new_tokens=64)
    verify = {d: [] for d in drafts}
    for _ in range(args.repeats):
        for d, (_, verify_s) in zip(drafts, profile_together([f.runtime for f in fast.values()], args.rounds)):
            verify[d].append(verify_s * 1e3)
    first = statistics.median(verify[drafts[0]])
    for d, ms in verify.items():
        m = statistics.median(ms)
        rows = fast[d].graphs.tree.size + 1
        print(f"{d}: {rows} rows, verify {m:.3f} ms ({m / first:.3f}x), by repeat {' '.join(f'{x:.3f}' for x in ms)}")


if __name__ == "__main__":
    main()
