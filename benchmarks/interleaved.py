"""Drafters side by side, interleaved prompt by prompt: which is faster, with the machine's drift shared.

On a machine whose speed drifts (a shared virtual machine) two methods timed one after another
can differ by the phase they ran in. This compiles every drafter spec given, then runs rounds
over the same prompts (128 new tokens each), each prompt running every method in a new seeded
order, and prints each method's tokens per second per round, its ratio to the first method in
the same round, and the medians; then where a call's time goes: time to first token, and the
steps (milliseconds per step in the generate loop, tokens per step), each against the first
method's. With `--span S`, each drafter's fused step is then timed at an S-slot span two ways,
repeated `--repeats` times: in a run of consecutive steps of its own (as the generate loop calls
it) and round-robin with the other drafters' steps (as `specfx bench` times its parts), so that
what a step gains from the cache its previous step left shows.

    python benchmarks/interleaved.py [--drafts mtp,mtp@4,mtp:pycoder-mtp:tree=2x2x2x1] [--rounds 5]
                                     [--num-prompts 8] [--span 192] [--json benchmarks/cpu/interleaved.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import specfx
from specfx import zoo
from specfx.bench import cache_length, interleave
from specfx.matmul_choice import round_robin
from timing import to_span


def compiled(model, spec: str, max_seq_len: int):
    """specfx.compile for a spec `DRAFT` or `DRAFT@K` (K drafts a step; default the drafter's)."""
    draft, _, k = spec.partition("@")
    return specfx.compile(model, draft=draft, num_speculative_tokens=int(k) if k else None, max_seq_len=max_seq_len)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafts", default="mtp:pycoder-mtp:tree=1x1x1,mtp,mtp:pycoder-mtp:tree=4x2x2x1,none",
                    help="drafter specs, comma-separated, each DRAFT or DRAFT@K (K drafts a step); "
                         "the first is the reference")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--span", type=int, help="also time each fused step at this span, alone and round-robin")
    ap.add_argument("--repeats", type=int, default=3, help="repeats of the --span timings")
    ap.add_argument("--json")
    args = ap.parse_args()
    model, tok = zoo.load("pycoder")
    prompts = [tok(p, return_tensors="pt").input_ids for p in zoo.prompts()[: args.num_prompts]]
    specs = args.drafts.split(",")
    max_seq_len = cache_length(prompts, args.max_new_tokens)
    fast = {s: compiled(model, s, max_seq_len) for s in specs}
    for f in fast.values():                                      # warm-up
        for ids in prompts[:2]:
            f.generate(ids, max_new_tokens=args.max_new_tokens)
    rates = {s: [] for s in specs}
    accepted = {s: [] for s in specs}
    ttft = {s: [] for s in specs}
    loop = {s: [0.0, 0, 0] for s in specs}                       # seconds after the first token, steps, tokens
    calls = interleave(len(prompts), len(specs), args.rounds)
    for r in range(args.rounds):
        spent, made = dict.fromkeys(specs, 0.0), dict.fromkeys(specs, 0)
        for _ in range(len(prompts) * len(specs)):           # this round's calls
            p, j = next(calls)
            s, ids = specs[j], prompts[p]
            t = time.perf_counter()
            out = fast[s].generate(ids, max_new_tokens=args.max_new_tokens)
            spent[s] += time.perf_counter() - t
            made[s] += out.shape[1] - ids.shape[1]
            st = fast[s].last_stats
            accepted[s].append(st.mean_accepted)
            ttft[s].append(st.ttft_s)
            loop[s][0] += st.total_s - st.ttft_s
            loop[s][1] += st.steps
            loop[s][2] += st.new_tokens - 1
        for s in specs:
            rates[s].append(made[s] / spent[s])
        print(f"round {r}: " + "  ".join(f"{s} {rates[s][-1]:.1f} tok/s" for s in specs), flush=True)
    rows = []
    step_ms = {s: loop[s][0] / max(loop[s][1], 1) * 1e3 for s in specs}
    for s in specs:
        ratios = [a / b for a, b in zip(rates[s], rates[specs[0]])]
        rows.append(dict(draft=s, tokens_per_s=rates[s], median_tokens_per_s=statistics.median(rates[s]),
                         vs_first=ratios, median_vs_first=statistics.median(ratios),
                         accepted_per_call=statistics.mean(accepted[s]), median_ttft_ms=statistics.median(ttft[s]) * 1e3,
                         loop_ms_per_step=step_ms[s], tokens_per_step=loop[s][2] / max(loop[s][1], 1)))
        print(f"{s}: median {rows[-1]['median_tokens_per_s']:.1f} tok/s, accepted/call "
              f"{rows[-1]['accepted_per_call']:.2f}, vs {specs[0]} by round "
              f"{' '.join(f'{x:.2f}' for x in ratios)}, median {rows[-1]['median_vs_first']:.2f}x")
    print("where the time goes: TTFT ms, then ms per step in the generate loop and tokens per step")
    for row in rows:
        s = row["draft"]
        print(f"{s}: TTFT {row['median_ttft_ms']:.1f} ms; step {step_ms[s]:.3f} ms "
              f"({step_ms[s] / step_ms[specs[0]]:.2f}x {specs[0]}'s), {row['tokens_per_step']:.2f} tokens/step, "
              f"steps alone {row['tokens_per_step'] / rows[0]['tokens_per_step'] * step_ms[specs[0]] / step_ms[s]:.2f}x")
    steps = span_steps(fast, prompts[0], args.span, args.repeats) if args.span else None
    if args.json:
        settings = dict(prompts=len(prompts), max_new_tokens=args.max_new_tokens, rounds=args.rounds,
                        max_seq_len=max_seq_len, span=args.span)
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "rows": rows, "span_steps": steps}, f, indent=1)


STEPS_IN_A_RUN = 40


def span_steps(fast: dict, ids, span: int, repeats: int) -> list[dict]:
    """Each repeat: drafter -> (ms a step in a run of its own consecutive steps, ms a step
    round-robin with the others' steps), medians, each state at a `span`-slot span after 64
    tokens generated from `ids` (`timing.to_span`), printed a repeat a line."""
    steps = {s: to_span(f, ids, span).runtime._step for s, f in fast.items()}
    runs = []
    for _ in range(repeats):
        alone = {}
        for s, step in steps.items():
            times = []
            for _ in range(STEPS_IN_A_RUN + 1):
                t = time.perf_counter()
                step()
                times.append(time.perf_counter() - t)
            alone[s] = statistics.median(times[1:]) * 1e3        # the first finds the others' data cached
        shared = {s: t * 1e3 for s, t in round_robin(steps, STEPS_IN_A_RUN).items()}
        runs.append({s: dict(alone_ms=alone[s], round_robin_ms=shared[s]) for s in steps})
        print(f"steps at a {span}-slot span, ms, alone / round-robin: " + "  ".join(
            f"{s} {alone[s]:.3f} / {shared[s]:.3f}" for s in steps), flush=True)
    return runs


if __name__ == "__main__":
    main()
