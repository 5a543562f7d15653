"""Time to first token with the prefill's attention through the tiled kernel against SDPA.

A prefill chunk's attention (a symbolic width) runs `tiled_attend` on the CPU
(`specfx.attention.TILED_PREFILL`); this captures pycoder twice, once each way, checks that
both give the same greedy tokens, and times the first token of the same prompts under both,
alternating the order from round to round (the machine's drift reaches both alike).

    python benchmarks/prefill_attention.py [--max-seq-len 256] [--num-prompts 8] [--rounds 6]
                                           [--long N]   # one prompt of N tokens instead
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch

import specfx
from specfx import attention, zoo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-seq-len", type=int, default=256)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--long", type=int, default=0, help="one prompt of this many tokens (the prompts joined)")
    args = ap.parse_args()
    runs = {}
    for tiled in (False, True):
        attention.TILED_PREFILL = tiled
        model, tok = zoo.load("pycoder")
        fast = specfx.compile(model, draft="none", max_seq_len=args.max_seq_len)
        fast.generate(tok("def f(x):", return_tensors="pt").input_ids, max_new_tokens=2)
        runs["tiled" if tiled else "sdpa"] = fast
    prompts = [tok(p, return_tensors="pt").input_ids for p in zoo.prompts()[:args.num_prompts]]
    if args.long:
        prompts = [torch.cat(prompts, 1)[:, :args.long]]
    out = {name: [fast.generate(p, max_new_tokens=8)[0].tolist() for p in prompts] for name, fast in runs.items()}
    print(f"same greedy tokens: {out['sdpa'] == out['tiled']}")
    ttft, names, shuffle = {name: [] for name in runs}, list(runs), random.Random(0).shuffle
    for _ in range(args.rounds):
        shuffle(names)
        for name in names:
            for p in prompts:
                runs[name].generate(p, max_new_tokens=1)
                ttft[name].append(runs[name].last_stats.ttft_s * 1e3)
    lengths = sorted({p.shape[1] for p in prompts})
    print(f"prompts of {lengths[0]}-{lengths[-1]} tokens, max_seq_len {args.max_seq_len}")
    for name, ms in ttft.items():
        print(f"{name}: median TTFT {statistics.median(ms):.2f} ms over {len(ms)}")


if __name__ == "__main__":
    main()
