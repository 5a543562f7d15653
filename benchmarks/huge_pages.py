"""Each drafter's fused step with the model's weights in 2 MB pages against 4 KB pages.

A compiled CPU graph backs the memory it reads with huge pages on its first call
(`runtime.memory.huge_pages`). This compiles each drafter on pycoder (its weights collapsed so),
keeps a copy of the weights in 4 KB pages (memory marked MADV_NOHUGEPAGE), and times the steps
round-robin in one process, the model's parameters pointed at the originals or at the copy
before each call (untimed), at a `--span`-slot span.

    python benchmarks/huge_pages.py [--drafts none,mtp:pycoder-mtp:tree=1x1x1,mtp] [--span 192]
                                    [--rounds 30] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

from specfx import zoo
from specfx.matmul_choice import machine, round_robin
from specfx.runtime.memory import small_pages
from timing import at_span, round_args


def small_pages_copy(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors`, one after another in memory kept in 4 KB pages."""
    sizes = [(t.numel() * t.element_size() + 63) // 64 * 64 for t in tensors]
    flat = small_pages(sum(sizes))
    copies, offset = [], 0
    for t, size in zip(tensors, sizes):
        c = flat[offset:offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        c.copy_(t.detach())
        copies.append(c)
        offset += size
    return copies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", default="none,mtp:pycoder-mtp:tree=1x1x1,mtp")
    ap.add_argument("--span", type=int, default=192)
    round_args(ap)
    args = ap.parse_args()
    model, tok = zoo.load("pycoder")
    drafts = args.drafts.split(",")
    steps = {d: at_span(model, tok, d, args.span).runtime._step for d in drafts}   # compiled: weights collapsed
    params = list(model.parameters())
    pages = {"2 MB": [p.data for p in params]}
    pages["4 KB"] = small_pages_copy(pages["2 MB"])
    calls = {(d, size): steps[d] for d in drafts for size in pages}

    def before(key) -> None:
        for p, t in zip(params, pages[key[1]]):
            p.data = t

    print(f"{machine()}; fused steps at a {args.span}-slot span, ms, median of {args.rounds} rounds, "
          "each repeat on its own line")
    runs = []
    for _ in range(args.repeats):
        ms = {key: s * 1e3 for key, s in round_robin(calls, args.rounds, before=before).items()}
        runs.append(ms)
        print("  ".join(f"{d} {size}: {t:.3f}" for (d, size), t in ms.items()), flush=True)
    before((drafts[0], "2 MB"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "span": args.span,
                       "runs": [{f"{d} {s}": ms for (d, s), ms in run.items()} for run in runs]}, f, indent=1)


if __name__ == "__main__":
    main()
