"""Drafters side by side in alternating rounds: which is faster, with the machine's drift shared.

`specfx bench` runs one method after another, so on a machine whose speed drifts (a shared
virtual machine) two rows can differ by the phase they ran in. This compiles every drafter
spec given, then runs rounds over the same prompts (128 new tokens each), alternating the
order of the methods from round to round, and prints each method's tokens per second per
round, its ratio to the first method in the same round, and the medians.

    python benchmarks/interleaved.py [--drafts mtp,mtp:pycoder-mtp:tree=4x2x2x1] [--rounds 5]
                                     [--num-prompts 8] [--json benchmarks/cpu/interleaved.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import specfx
from specfx import zoo
from specfx.bench import cache_length


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", default="mtp,mtp:pycoder-mtp:tree=2x1x1,mtp:pycoder-mtp:tree=4x2x2x1",
                    help="drafter specs, comma-separated; the first is the reference")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--json")
    args = ap.parse_args()
    model, tok = zoo.load("pycoder")
    prompts = [tok(p, return_tensors="pt").input_ids for p in zoo.prompts()[: args.num_prompts]]
    specs = args.drafts.split(",")
    max_seq_len = cache_length(prompts, args.max_new_tokens)
    fast = {s: specfx.compile(model, draft=s, max_seq_len=max_seq_len) for s in specs}
    for f in fast.values():                                      # warm-up
        for ids in prompts[:2]:
            f.generate(ids, max_new_tokens=args.max_new_tokens)
    rates = {s: [] for s in specs}
    accepted = {s: [] for s in specs}
    for r in range(args.rounds):
        for s in specs if r % 2 == 0 else specs[::-1]:
            t, n = time.perf_counter(), 0
            for ids in prompts:
                out = fast[s].generate(ids, max_new_tokens=args.max_new_tokens)
                n += out.shape[1] - ids.shape[1]
                accepted[s].append(fast[s].last_stats.mean_accepted)
            rates[s].append(n / (time.perf_counter() - t))
        print(f"round {r}: " + "  ".join(f"{s} {rates[s][-1]:.1f} tok/s" for s in specs), flush=True)
    rows = []
    for s in specs:
        ratios = [a / b for a, b in zip(rates[s], rates[specs[0]])]
        rows.append(dict(draft=s, tokens_per_s=rates[s], median_tokens_per_s=statistics.median(rates[s]),
                         vs_first=ratios, median_vs_first=statistics.median(ratios),
                         accepted_per_call=statistics.mean(accepted[s])))
        print(f"{s}: median {rows[-1]['median_tokens_per_s']:.1f} tok/s, accepted/call "
              f"{rows[-1]['accepted_per_call']:.2f}, vs {specs[0]} by round "
              f"{' '.join(f'{x:.2f}' for x in ratios)}, median {rows[-1]['median_vs_first']:.2f}x")
    if args.json:
        settings = dict(prompts=len(prompts), max_new_tokens=args.max_new_tokens, rounds=args.rounds,
                        max_seq_len=max_seq_len)
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
