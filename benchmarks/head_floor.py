"""An MTP head's one-row pass on the CPU against its floor: how long its int8 weights take to read.

A head pass drafting one token reads the head's linears and its copy of the target's lm_head,
a byte a weight (int8). This times, in rounds: a read of the model's float32 weights by the
header's `stream_sum` (each thread streaming its share, the fastest read specfx has); right after
it, a read of the head's bytes (as the first pass after a verify finds them: evicted) and the
same read again (as the passes after it find them); then, after another read of the model's
weights, `--passes` calls in a row of the head's draft graph (one pass, compiled as
`SpeculativeModel.profile` compiles it, after 64 generated tokens). Medians over `--rounds`.

    python benchmarks/head_floor.py [--head pycoder-mtp] [--rounds 200] [--passes 6]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import specfx
from specfx import zoo
from specfx.kernels import tiled_linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="pycoder")
    ap.add_argument("--head", default="pycoder-mtp")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--passes", type=int, default=6, help="head passes in a row after the model's weights")
    args = ap.parse_args()
    model, tok = zoo.load(args.model)
    head = specfx.MTPHead(args.head).load(model)
    head_bytes = sum(m.weight.numel() for m in head.modules() if isinstance(m, torch.nn.Linear))
    head_bytes += model.get_output_embeddings().weight.numel()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    read = tiled_linear.stream_sum()
    small, big = torch.randn(head_bytes // 4), torch.randn(model_bytes // 4)
    fast = specfx.compile(model, draft=f"mtp:{args.head}:tree=1x1")
    fast.generate(tok(zoo.prompts()[0], return_tensors="pt").input_ids, max_new_tokens=64)
    draft = fast.runtime.profile_calls()["draft"][0]

    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    stream, reads, passes = [], [[], []], [[] for _ in range(args.passes)]
    with torch.no_grad():
        for _ in range(20):
            read(big), draft(), read(small)
        for _ in range(args.rounds):
            stream.append(timed(lambda: read(big)))
            for ts in reads:
                ts.append(timed(lambda: read(small)))
            read(big)
            for ts in passes:
                ts.append(timed(draft))
    us = lambda ts: statistics.median(ts) * 1e6  # noqa: E731
    print(f"model weights: {model_bytes / 1e6:.2f} MB read in {us(stream):.1f} us "
          f"({model_bytes / us(stream) / 1e3:.1f} GB/s)")
    print(f"head weights: {head_bytes / 1e6:.2f} MB read right after them in {us(reads[0]):.1f} us "
          f"({head_bytes / us(reads[0]) / 1e3:.1f} GB/s), again in {us(reads[1]):.1f} us "
          f"({head_bytes / us(reads[1]) / 1e3:.1f} GB/s)")
    print("head passes right after the model's weights, one after another, us: "
          + " ".join(f"{us(ts):.1f}" for ts in passes))


if __name__ == "__main__":
    main()
