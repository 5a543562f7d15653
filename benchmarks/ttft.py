"""Time to first token, transformers' `generate` against each specfx drafter, side by side.

`specfx bench` times one method after another, and on a machine whose speed drifts a TTFT of
one row can come from a slower phase than another's. This takes, for every prompt and round,
the first-token time of each method in turn (alternating the order from round to round):
hf-greedy through a streamer that notes when the first new token reaches the host, as
`specfx bench` does, and each specfx drafter as its `GenerationStats.ttft_s`. It prints the
median over prompts and rounds of each, and each against hf-greedy's in the same round.

    python benchmarks/ttft.py [--task editing] [--num-prompts 16] [--rounds 3]
                              [--drafts none,mtp,draft-model:pycoder-draft,ngram:3,early-exit]
                              [--json benchmarks/cpu/ttft_editing.json]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import specfx
from specfx import zoo
from specfx.bench import _hf_generate, cache_length


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="completion")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--drafts", default="none,mtp,draft-model:pycoder-draft,ngram:3,early-exit")
    ap.add_argument("--json")
    args = ap.parse_args()
    model, tok = zoo.load("pycoder")
    prompts = [tok(p, return_tensors="pt").input_ids for p in zoo.prompts(args.task)[: args.num_prompts]]
    max_seq_len = cache_length(prompts, 2)
    methods = {"hf-greedy": lambda ids: _hf_generate(model, ids, 2, tok.pad_token_id)[2]}
    for spec in args.drafts.split(","):
        fast = specfx.compile(model, draft=spec, max_seq_len=max_seq_len)
        methods[spec] = lambda ids, fast=fast: (fast.generate(ids, max_new_tokens=2), fast.last_stats.ttft_s)[1]
    for fn in methods.values():                                   # warm-up
        fn(prompts[0])
    ttft = {m: [] for m in methods}
    ratio = {m: [] for m in methods}
    with torch.no_grad():
        for r in range(args.rounds):
            names = list(methods) if r % 2 == 0 else list(methods)[::-1]
            for ids in prompts:
                got = {m: methods[m](ids) for m in names}
                for m in methods:
                    ttft[m].append(got[m])
                    ratio[m].append(got[m] / got["hf-greedy"])
    rows = [dict(method=m, median_ttft_ms=statistics.median(ttft[m]) * 1e3,
                 median_vs_hf_greedy=statistics.median(ratio[m])) for m in methods]
    print(f"TTFT, {args.task} prompts ({len(prompts)}), {args.rounds} rounds:")
    for row in rows:
        print(f"  {row['method']:<28} {row['median_ttft_ms']:7.1f} ms   {row['median_vs_hf_greedy']:.2f}x hf-greedy")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(task=args.task, prompts=len(prompts), rounds=args.rounds, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
