"""What the benchmarks that time kernels and fused steps side by side share: repeated round-robin
timings printed a repeat a line (`timed_rounds`, its options `round_args`), and a drafter's
compiled pycoder with its state at a fixed attention span (`at_span`)."""

from __future__ import annotations

import specfx
from specfx import zoo
from specfx.matmul_choice import round_robin


def round_args(ap) -> None:
    """The options `timed_rounds` takes (`--rounds`, `--repeats`), and `--json` for its runs."""
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json")


def timed_rounds(calls: dict, rounds: int, repeats: int, label) -> list[dict]:
    """`repeats` timings of `calls` round-robin (key -> ms, the median of `rounds`), each printed
    on a line of its own, a call named `label(key)`."""
    runs = []
    for _ in range(repeats):
        ms = {key: s * 1e3 for key, s in round_robin(calls, rounds).items()}
        runs.append(ms)
        print("  ".join(f"{label(key)}: {t:.3f}" for key, t in ms.items()), flush=True)
    return runs


def at_span(model, tok, spec: str, span: int):
    """`model` compiled with drafter `spec`, 64 tokens generated from the first evaluation prompt
    (everything compiled, the drafter's state filled), then its state set to read `span` cache
    slots: `._step` / `.runtime._step` is one fused step there."""
    ids = tok(zoo.prompts()[0], return_tensors="pt").input_ids
    return to_span(specfx.compile(model, draft=spec, max_seq_len=max(256, span + 64)), ids, span)


def to_span(fast, ids, span: int):
    """`fast` (a compiled model) after 64 tokens generated from `ids`, its state then set to
    read `span` cache slots: the state `at_span` leaves."""
    fast.generate(ids, max_new_tokens=64)
    fast.runtime.state.set_span(span)
    return fast
