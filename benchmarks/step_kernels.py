"""Where the fused steps' time goes, kernel by kernel: each drafter's step on pycoder, side by
side in one process.

Compiles each drafter spec with Inductor's kernel profiling on (every generated kernel, and
each call of specfx's tiled kernels, records a profiler event), sets every state to a
`--span`-slot span after 64 generated tokens, times the steps round-robin (shuffled rounds),
then profiles `--steps` steps of each, three times over in turn, and prints each kernel's
calls a step, its median microseconds a call and its microseconds a step, per drafter.

With `--split GBPS`, each round of profiles first samples the machine as `specfx bench` does
(`bench.MachineSpeed`: the model's weight bytes read by the header's `stream_sum`, the fastest
of three reads) and goes to the slow or the fast phase by the stream's speed; rounds go on for
up to `--seconds` until each phase has three (a phase that has them skips its rounds), and each
phase gets its own table. With `--split-ns NS` instead, the round trip of a cache line between
the kernels' first two threads (`tiled_linear.handoff`, the fastest of three) decides: below NS
the "near" placement (one last-level cache), at or above it the "far" one.

    python benchmarks/step_kernels.py [--drafts none,mtp:pycoder-mtp:tree=1x1x1,mtp] [--span 192] [--top 30]
                                      [--split 42 | --split-ns 150] [--seconds 600]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._inductor.config as inductor_config
from torch.profiler import ProfilerActivity, profile

from specfx import zoo
from specfx.bench import MachineSpeed, fastest_handoff
from specfx.kernels import tiled_linear
from specfx.matmul_choice import round_robin
from timing import at_span


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", default="none,mtp:pycoder-mtp:tree=1x1x1,mtp")
    ap.add_argument("--span", type=int, default=192)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--split", type=float, help="GB/s between the slow and the fast phase (default: no phases)")
    ap.add_argument("--split-ns", type=float,
                    help="ns of the threads' round trip between the near and the far placement")
    ap.add_argument("--seconds", type=float, default=600,
                    help="with --split or --split-ns: the most time its rounds take")
    args = ap.parse_args()
    inductor_config.cpp.enable_kernel_profile = True
    model, tok = zoo.load("pycoder")
    drafts = args.drafts.split(",")
    runtimes = {d: at_span(model, tok, d, args.span).runtime for d in drafts}
    steps = round_robin({d: rt._step for d, rt in runtimes.items()}, 100)
    print("fused step, us (round-robin, median of 100): " + "  ".join(f"{d} {s * 1e6:.0f}" for d, s in steps.items()))
    speed = MachineSpeed(model) if args.split else None
    trip = tiled_linear.handoff() if args.split_ns else None
    if trip is not None and trip() is None:
        ap.error("--split-ns times a round trip between two threads: run on two or more")
    phases: dict[str, dict[tuple[str, str], list[float]]] = {}
    rounds: dict[str, int] = {}
    end = time.time() + args.seconds

    def more() -> bool:         # three rounds; with phases, three of each, or the time is up
        if speed is None and trip is None:
            return sum(rounds.values()) < 3
        return time.time() < end and (len(rounds) < 2 or min(rounds.values()) < 3)

    while more():
        if speed is not None:
            speed.sample()
            phase = "slow" if speed.stream_gbps[-1] < args.split else "fast"
        elif trip is not None:
            phase = "near" if (fastest_handoff(trip) or float("inf")) < args.split_ns else "far"
        else:
            phase = "all"
        if rounds.get(phase, 0) >= 3:
            continue
        rounds[phase] = rounds.get(phase, 0) + 1
        events = phases.setdefault(phase, {})
        for d, rt in runtimes.items():
            with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.steps):
                    rt._step()
            for e in prof.events():
                if not e.name.startswith(("aten::", "ProfilerStep")):
                    events.setdefault((d, e.name[:70]), []).append(e.cpu_time_total)
    for phase, events in phases.items():
        if phase in ("slow", "fast"):
            print(f"{phase} phase (the stream {'below' if phase == 'slow' else 'at or above'} {args.split:g} GB/s): "
                  f"{rounds[phase]} rounds")
        elif phase != "all":
            print(f"{phase} placement (the threads' round trip {'below' if phase == 'near' else 'at or above'} "
                  f"{args.split_ns:g} ns): {rounds[phase]} rounds")
        table(events, drafts, rounds[phase] * args.steps, args.top)


def table(events: dict, drafts: list[str], n: int, top: int) -> None:
    """Each kernel's calls a step, median us a call and us a step, per drafter, over `n` steps each."""
    print("kernel events a step, us: " + "  ".join(
        f"{d} {sum(sum(v) for (dd, _), v in events.items() if dd == d) / n:.0f}" for d in drafts))
    names = sorted({name for _, name in events}, key=lambda k: -max(sum(events.get((d, k), [0])) for d in drafts))
    print(f"{'kernel':<70} " + "  ".join(f"{d[:28]:>28}" for d in drafts))
    print(f"{'':<70} " + "  ".join(f"{'calls  us/call  us/step':>28}" for _ in drafts))
    for name in names[:top]:
        cells = []
        for d in drafts:
            ts = events.get((d, name), [])
            cells.append(f"{len(ts) / n:5.1f} {statistics.median(ts) if ts else 0:8.1f} {sum(ts) / n:9.1f}".rjust(28))
        print(f"{name:<70} " + "  ".join(cells))


if __name__ == "__main__":
    main()
