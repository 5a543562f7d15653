"""Where the fused steps' time goes, kernel by kernel: each drafter's step on pycoder, side by
side in one process.

Compiles each drafter spec with Inductor's kernel profiling on (every generated kernel, and
each call of specfx's tiled kernels, records a profiler event), sets every state to a
`--span`-slot span after 64 generated tokens, times the steps round-robin (shuffled rounds),
then profiles `--steps` steps of each, three times over in turn, and prints each kernel's
calls a step, its median microseconds a call and its microseconds a step, per drafter.

    python benchmarks/step_kernels.py [--drafts none,mtp:pycoder-mtp:tree=1x1x1,mtp] [--span 192] [--top 30]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

from specfx import zoo
from specfx.matmul_choice import round_robin
from timing import at_span


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", default="none,mtp:pycoder-mtp:tree=1x1x1,mtp")
    ap.add_argument("--span", type=int, default=192)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    inductor_config.cpp.enable_kernel_profile = True
    model, tok = zoo.load("pycoder")
    drafts = args.drafts.split(",")
    runtimes = {d: at_span(model, tok, d, args.span).runtime for d in drafts}
    steps = round_robin({d: rt._step for d, rt in runtimes.items()}, 100)
    print("fused step, us (round-robin, median of 100): " + "  ".join(f"{d} {s * 1e6:.0f}" for d, s in steps.items()))
    events: dict[tuple[str, str], list[float]] = {}
    for _ in range(3):
        for d, rt in runtimes.items():
            with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    rt._step()
            for e in prof.events():
                if not e.name.startswith(("aten::", "ProfilerStep")):
                    events.setdefault((d, e.name[:70]), []).append(e.cpu_time_total)
    n = 3 * args.steps
    print("kernel events a step, us: " + "  ".join(
        f"{d} {sum(sum(v) for (dd, _), v in events.items() if dd == d) / n:.0f}" for d in drafts))
    names = sorted({name for _, name in events}, key=lambda k: -max(sum(events.get((d, k), [0])) for d in drafts))
    print(f"{'kernel':<70} " + "  ".join(f"{d[:28]:>28}" for d in drafts))
    print(f"{'':<70} " + "  ".join(f"{'calls  us/call  us/step':>28}" for _ in drafts))
    for name in names[: args.top]:
        cells = []
        for d in drafts:
            ts = events.get((d, name), [])
            cells.append(f"{len(ts) / n:5.1f} {statistics.median(ts) if ts else 0:8.1f} {sum(ts) / n:9.1f}".rjust(28))
        print(f"{name:<70} " + "  ".join(cells))


if __name__ == "__main__":
    main()
