"""Does a step cost what the context costs, not what `max_seq_len` costs?

Compiles pycoder's plain decode step twice, with `max_seq_len` 256 and 4096, prefills the same
200-token prompt into each and times each decode graph alone (its attention reads the span the
runtime chose, a multiple of 64 slots covering the context), interleaved in one process:
25 rounds of 10 calls each, median. Also prints each compile time; for a fair comparison of
those run it with an empty Inductor cache (`TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)`), since the
second model may reuse kernels the first one compiled.

    python benchmarks/span.py [--context 200] [--json benchmarks/cpu/span.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import specfx
from specfx import zoo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--lengths", default="256,4096", help="max_seq_len values")
    ap.add_argument("--json")
    args = ap.parse_args()
    model, _ = zoo.load("pycoder")
    prompt = torch.randint(5, 4000, (1, args.context), generator=torch.Generator().manual_seed(0))
    calls, compile_s = {}, {}
    for S in (int(s) for s in args.lengths.split(",")):
        fast = specfx.compile(model, draft="none", max_seq_len=S)
        compile_s[S] = fast.compile_s
        fast.generate(prompt, max_new_tokens=2, eos_token_id=[])
        rt = fast.runtime
        rt.cover(steps=1)
        calls[S] = rt.part_call("decode")
    times = {S: [] for S in calls}
    for _ in range(25):
        for S, fn in calls.items():
            fn()
            t = time.perf_counter()
            for _ in range(10):
                fn()
            times[S].append((time.perf_counter() - t) / 10 * 1e3)
    ms = {S: statistics.median(v) for S, v in times.items()}
    base = min(ms)
    for S in ms:
        print(f"max_seq_len {S:5d}: decode step at a {args.context}-token context {ms[S]:.3f} ms "
              f"({ms[S] / ms[base]:.2f}x max_seq_len {base}), compile {compile_s[S]:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"context": args.context, "threads": torch.get_num_threads(),
                       "decode_ms": ms, "compile_s": compile_s}, f, indent=1)


if __name__ == "__main__":
    main()
