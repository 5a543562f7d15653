"""Each drafter's fused step on pycoder against the machine's weight stream, phase by phase.

On a shared virtual machine the memory's speed moves between phases. This compiles each
drafter spec, sets its state to a `--span`-slot span after 64 generated tokens, and times, in
`--repeats` sets of `--rounds` round-robin rounds (median of each), every step together with a
read of the model's weight bytes by the header's `stream_sum` (in 2 MB pages, as the steps'
weights are). Each set prints the stream's GB/s beside the steps' ms; then the sets are grouped
by that speed (below and above `--split` GB/s) and each group's medians printed, with the median
over its sets of the last spec's step less the one before it.

With `--split-ns NS` each set also times the round trip of a cache line between the kernels'
first two threads (`tiled_linear.handoff`, the fastest of three, before the set) and the sets
are grouped by it instead: below NS the threads share a last-level cache ("near"), at or above
it they do not ("far").

    python benchmarks/stream_phases.py [--drafts none,mtp:pycoder-mtp:tree=1x1x1,mtp] [--repeats 40]
                                       [--split 42 | --split-ns 150]
"""

from __future__ import annotations

import argparse
import json
import statistics

from specfx import zoo
from specfx.bench import MachineSpeed, fastest_handoff
from specfx.kernels import tiled_linear
from specfx.matmul_choice import machine
from timing import at_span, round_args, timed_rounds

STREAM = "stream"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", default="none,mtp:pycoder-mtp:tree=1x1x1,mtp")
    ap.add_argument("--span", type=int, default=192, help="cache slots a step reads")
    ap.add_argument("--split", type=float, default=42.0, help="GB/s between the slow and the fast sets")
    ap.add_argument("--split-ns", type=float,
                    help="group by the threads' round trip instead: ns between the near and the far sets")
    round_args(ap)
    ap.set_defaults(repeats=40)
    args = ap.parse_args()
    model, tok = zoo.load("pycoder")
    speed = MachineSpeed(model)                 # its buffer of the weight bytes, in 2 MB pages
    nbytes = speed.nbytes
    drafts = args.drafts.split(",")
    calls = {STREAM: lambda: speed.stream(speed.buffer)}
    for spec in drafts:
        calls[spec] = at_span(model, tok, spec, args.span).runtime._step
    print(f"{machine()}; {nbytes / 1e6:.1f} MB streamed and fused steps at a {args.span}-slot span, ms, "
          f"median of {args.rounds} rounds a set")
    trip = tiled_linear.handoff() if args.split_ns else None
    if trip is not None and trip() is None:
        ap.error("--split-ns times a round trip between two threads: run on two or more")
    runs = []
    for _ in range(args.repeats):                  # a set at a time, each after its round trip
        ns = (fastest_handoff(trip) or float("inf")) if trip else None
        if ns is not None:
            print(f"round trip {ns:.0f} ns  ", end="")
        run = timed_rounds(calls, args.rounds, 1, str)[0]
        run["gbps"] = nbytes / run[STREAM] / 1e6
        if ns is not None:
            run["handoff_ns"] = ns
        runs.append(run)
    if args.split_ns:
        print(f"by the threads' round trip (below / at or above {args.split_ns:g} ns), medians over the sets:")
        groups = (("near", [r for r in runs if r["handoff_ns"] < args.split_ns]),
                  ("far", [r for r in runs if r["handoff_ns"] >= args.split_ns]))
    else:
        print(f"by the stream's speed (below / above {args.split:g} GB/s), medians over the sets:")
        groups = (("slow", [r for r in runs if r["gbps"] < args.split]),
                  ("fast", [r for r in runs if r["gbps"] >= args.split]))
    for name, group in groups:
        if not group:
            continue
        keys = ["gbps", *drafts] + (["handoff_ns"] if args.split_ns else [])
        med = {key: statistics.median(r[key] for r in group) for key in keys}
        diff = statistics.median(r[drafts[-1]] - r[drafts[-2]] for r in group) if len(drafts) > 1 else 0.0
        print(f"  {name}: {len(group)} sets, stream {med['gbps']:.1f} GB/s"
              + (f", round trip {med['handoff_ns']:.0f} ns" if args.split_ns else "") + "  "
              + "  ".join(f"{d} {med[d]:.3f}" for d in drafts) + f"  {drafts[-1]} less {drafts[-2]} {diff:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine(), span=args.span, rounds=args.rounds, stream_mb=nbytes / 1e6,
                           split_ns=args.split_ns, runs=runs), f, indent=1)


if __name__ == "__main__":
    main()
