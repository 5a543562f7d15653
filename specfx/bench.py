"""Side-by-side benchmark: every method on the same prompts, same output length, warmed up.

How it measures (printed with every table):
- each method is built (for specfx, compiled: reported apart as `compile_s`) and runs `warmup`
  prompts untimed before the next method is built;
- then `repeats` passes over all prompts, in which each prompt runs every method in a new order
  (seeded): methods interleave, so a drift in the machine's speed (a shared virtual machine's
  phases) reaches each alike, and no method always follows the same other one. One method after
  another, two rows could differ by up to a fifth by the phase each ran in;
- per prompt the median wall time over repeats is kept;
- tokens/s = all new tokens / sum of per-prompt median times (prefill included, end to end);
- TTFT = median over prompts of the time from the call to the first new token on the host;
- TPOT = time per output token after the first: the sum over prompts of the median time after
  the first token over the sum of the tokens after the first (tokens/s with the prefill left
  out: a drafter's own speed, where tokens/s also holds the prefill that all methods share);
- exact_match = fraction of prompts whose new tokens equal `hf-greedy`'s, token for token
  (greedy only; with `sampling` the baseline is `hf-sample` and exact match is not defined);
- draft ms, verify ms = `SpeculativeModel.profile()`'s parts (each graph compiled alone), every
  specfx method's timed together in shuffled rounds after the passes, a draft graph's calls of
  one step in a row (the first reads its weights cold, as after a verify pass);
- peak memory = over a method's warm-up, the CUDA allocator peak, or on CPU the process's peak
  RSS (kernel high-water mark), which includes the methods built before it;
- the machine's speed during the passes (the CPU, float32 weights: `MachineSpeed`): before each
  prompt's round of methods and after the last, a read of the model's weight bytes by the
  header's hand-written stream and its register-only FMA loop, so that a table says which phase
  it ran in (the floor of a step over few rows is its bytes at the first, of one over many rows
  its multiply-adds at the second), the ridge between the two in query rows, and the round trip
  of a cache line between the kernels' first two threads (where they sit: on one last-level
  cache, or on two, which on a 2-core EPYC streamed faster and handed values over slower).
"""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from specfx.runtime.memory import PeakMemory

HF_METHODS = ("hf-greedy", "hf-early-exit", "hf-sample", "hf-static-compile")
SPECFX_PREFIX = "specfx:"


@dataclass
class MethodRun:
    """One method's figures over the prompt set."""

    name: str
    tokens_per_s: float
    ttft_s: float
    new_tokens: int
    tpot_s: float | None = None
    mean_accepted: float | None = None
    acceptance_by_position: list[float] | None = None
    draft_s: float | None = None
    verify_s: float | None = None
    peak_mem_mb: float = 0.0
    exact_match: float | None = None
    speedup_vs_hf_greedy: float | None = None
    compile_s: float | None = None
    config: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class BenchResult:
    model: str
    device: str
    settings: dict
    runs: list[MethodRun] = field(default_factory=list)
    machine: dict | None = None         # `MachineSpeed.summary()`, where it was measured

    def to_dict(self) -> dict:
        return {"model": self.model, "device": self.device, "settings": self.settings,
                "runs": [r.to_dict() for r in self.runs], "machine": self.machine}


PROBE_READS = 3


def _fastest(call) -> float:
    """The fewest seconds of `PROBE_READS` calls of `call`."""
    best = float("inf")
    for _ in range(PROBE_READS):
        t = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t)
    return best


def fastest_handoff(trip) -> float | None:
    """The fewest nanoseconds of `PROBE_READS` calls of `trip` (a `tiled_linear.handoff()`
    call); None where none timed a round trip (one thread)."""
    trips = [ns for ns in (trip() for _ in range(PROBE_READS)) if ns is not None]
    return min(trips) if trips else None


# The most bytes `MachineSpeed` streams: a model's weight bytes up to this (many times a
# last-level cache), so that probing a large model does not hold a second copy of it.
PROBE_MAX_BYTES = 256 * 2**20


class MachineSpeed:
    """The CPU's speed while the methods run, sampled between them: the GB/s at which the
    header's `stream_sum` reads a buffer of the model's weight bytes (at most
    `PROBE_MAX_BYTES`, in 2 MB pages as a compiled step's weights are: `huge_pages`), and the
    GFLOP/s of its `fma_peak` (register-only multiply-adds), both on Inductor's thread count.

    On a shared virtual machine both can drift between phases (a 2-core AMD EPYC's stream read a
    median of 54.1 GB/s in one bench run and 34.7 in the next: the README's "Draft trees"): a
    step over few rows is held by the bytes it reads, one over many rows by its multiply-adds,
    so which phase a table ran in decides how the two compare.
    Which of those phases a run is in can be where the threads sit, so `sample()` also times
    the round trip of a cache line between the kernels' first two threads (`handoff`): on a
    2-core AMD EPYC, `benchmarks/stream_phases.py --split-ns 150` found two placements, 53 ns
    at a median stream of 33.9 GB/s and 328 ns at 53.9 (as where two cores sit on different
    chiplets, each with its own last-level cache and link to memory; README, "Draft trees").
    `sample()` costs three reads of the buffer, about 1 ms of multiply-adds and three calls of
    `handoff`'s 2000 round trips.
    None of this on a GPU, without the compiled header, or for weights other than float32."""

    def __init__(self, model):
        from specfx.kernels import tiled_linear
        from specfx.roofline import linear_weights
        from specfx.runtime.memory import huge_pages

        weights = linear_weights(model)
        self.stream_gbps, self.fma_gflops, self.handoff_ns = [], [], []
        self.enabled = (bool(weights) and weights[0].device.type == "cpu" and weights[0].dtype == torch.float32
                        and tiled_linear.available()[0])
        if not self.enabled:
            return
        self.nbytes = min(sum(w.numel() * w.element_size() for w in weights), PROBE_MAX_BYTES) // 64 * 64
        self.buffer = torch.ones(self.nbytes // 4)
        huge_pages([self.buffer])
        self.stream = tiled_linear.stream_sum()
        self.fma, self.flops = tiled_linear.fma_peak()
        self.handoff = tiled_linear.handoff()

    def sample(self) -> None:
        """One sample of each: the fastest of `PROBE_READS` calls (a read that an interrupt or
        the threads' wake-up slowed says nothing about the phase); no round trip on one thread."""
        if not self.enabled:
            return
        self.stream_gbps.append(self.nbytes / _fastest(lambda: self.stream(self.buffer)) / 1e9)
        self.fma_gflops.append(self.flops / _fastest(self.fma) / 1e9)
        ns = fastest_handoff(self.handoff)
        if ns is not None:
            self.handoff_ns.append(ns)

    def summary(self) -> dict | None:
        """{"samples", "stream_gbps", "fma_gflops" and "ridge_rows" as [lowest, median, highest],
        "stream_mb"}. A sample's ridge is the query rows at which a pass over float32 weights
        (two FLOPs a row for every four bytes read) needs as long for its multiply-adds at the
        FMA peak as for its bytes at the stream's speed, 2 x GFLOP/s / GB/s: a pass over fewer
        rows is held by the stream, one over more by the multiply-adds. "handoff_ns": the round
        trip's [lowest, median, highest] (None on one thread)."""
        if not self.stream_gbps:
            return None
        spread = lambda v: [min(v), statistics.median(v), max(v)]  # noqa: E731
        ridge = [2 * f / s for s, f in zip(self.stream_gbps, self.fma_gflops)]
        trips = self.handoff_ns
        return {"samples": len(self.stream_gbps), "stream_mb": self.nbytes / 1e6,
                "stream_gbps": spread(self.stream_gbps), "fma_gflops": spread(self.fma_gflops),
                "ridge_rows": spread(ridge), "handoff_ns": spread(trips) if trips else None}


class _FirstTokenClock:
    """A streamer that notes when the first new token reaches the host."""

    def __init__(self):
        self.calls, self.first = 0, None

    def put(self, value):
        self.calls += 1
        if self.calls == 2 and self.first is None:
            self.first = time.perf_counter()

    def end(self):
        pass


def _hf_generate(model, ids, max_new_tokens, pad_id, sampling=None, **kw):
    clock = _FirstTokenClock()
    sample_kw = dict(do_sample=False) if sampling is None else dict(
        do_sample=True, temperature=sampling["temperature"], top_k=sampling["top_k"], top_p=sampling["top_p"])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             pad_token_id=pad_id, streamer=clock, **sample_kw, **kw)
    t1 = time.perf_counter()
    return out[0, ids.shape[1]:].tolist(), t1 - t0, (clock.first or t1) - t0, None


def _specfx_generate(fast, ids, max_new_tokens, pad_id, sampling=None):
    kw = {} if sampling is None else dict(do_sample=True, temperature=sampling["temperature"],
                                          top_k=sampling["top_k"], top_p=sampling["top_p"])
    t0 = time.perf_counter()
    out = fast.generate(ids, max_new_tokens=max_new_tokens, pad_token_id=pad_id, **kw)
    t1 = time.perf_counter()
    return out[0, ids.shape[1]:].tolist(), t1 - t0, fast.last_stats.ttft_s, fast.last_stats


# method -> (what its argument means, the default argument); None: takes no argument.
METHODS = {
    "hf-greedy": None, "hf-sample": None, "hf-static-compile": None,
    "hf-early-exit": "exit layer (default: the model's)",
    "hf-assisted": "draft checkpoint (default: pycoder-draft)",
    "hf-prompt-lookup": "prompt_lookup_num_tokens (default: k)",
    "specfx:none": None,
    "specfx:early-exit": "exit layer (default: the model's), then :tree=3x2x2 and :weights=int8|bfloat16|target if wanted",
    "specfx:draft-model": "draft checkpoint (default: pycoder-draft)",
    "specfx:ngram": "n-gram size (default: 3)",
    "specfx:mtp": "head checkpoint (default: the model's, e.g. pycoder-mtp)",
}
DEFAULT_DRAFT = "pycoder-draft"


def cache_length(encoded: list, max_new_tokens: int) -> int:
    """The static cache length a benchmark compiles for: the longest prompt (token ids [1, P])
    plus the new tokens, rounded up to a multiple of 64: one cache serves every prompt."""
    return -(-(max(e.shape[-1] for e in encoded) + max_new_tokens) // 64) * 64


def parse_method(method: str, default_exit: int, k: int) -> tuple[str, str | None]:
    """(base, argument) with defaults filled: "specfx:ngram" -> ("specfx:ngram", "3")."""
    prefix = SPECFX_PREFIX if method.startswith(SPECFX_PREFIX) else ""
    name, _, arg = method[len(prefix):].partition(":")
    base = prefix + name
    if base not in METHODS or (arg and METHODS[base] is None):
        raise ValueError(f"unknown method {method!r}; expected one of: "
                         + ", ".join(m + (f"[:{METHODS[m].split(' (')[0].replace(' ', '_')}]" if METHODS[m] else "")
                                     for m in METHODS))
    if base == "specfx:early-exit" and arg.startswith(("tree=", "weights=")):   # specfx:early-exit:tree=3x2x2
        arg = f"{default_exit}:{arg}"
    if not arg and METHODS[base]:
        arg = {"hf-early-exit": str(default_exit), "specfx:early-exit": str(default_exit),
               "hf-assisted": DEFAULT_DRAFT, "specfx:draft-model": DEFAULT_DRAFT,
               "hf-prompt-lookup": str(k), "specfx:ngram": "3", "specfx:mtp": ""}[base]
    number = arg.partition(":")[0] if base == "specfx:early-exit" else arg
    if base in ("hf-early-exit", "specfx:early-exit", "hf-prompt-lookup", "specfx:ngram") and not number.isdigit():
        raise ValueError(f"method {method!r}: expected a number after ':'")
    return base, arg or None


def _hf_kwargs(base: str, arg: str | None, model, max_seq_len: int) -> dict:
    """generate() arguments of a transformers baseline."""
    if base == "hf-static-compile":
        return hf_static_compile_kwargs(max_seq_len)
    if base == "hf-early-exit":
        return {"assistant_early_exit": int(arg)}
    if base == "hf-prompt-lookup":
        return {"prompt_lookup_num_tokens": int(arg)}
    if base == "hf-assisted":
        from transformers import AutoModelForCausalLM

        from specfx import zoo

        param = next(model.parameters())
        assistant = AutoModelForCausalLM.from_pretrained(str(zoo.resolve(arg)), dtype=param.dtype)
        return {"assistant_model": assistant.to(param.device).eval()}
    return {}


def hf_static_compile_kwargs(max_seq_len: int) -> dict:
    """transformers' own fast path: a static cache of one fixed length (so no prompt recompiles
    it) and the decoding forward compiled by `generate` itself, on any device."""
    from transformers import CompileConfig

    compile_config = CompileConfig(fullgraph=True, mode="default")
    compile_config._compile_all_devices = True            # transformers compiles on CUDA only by default
    return {"cache_implementation": "static", "max_cache_len": max_seq_len, "compile_config": compile_config}


def run_bench(model, tokenizer, prompts: list[str], methods: list[str], *, model_name: str,
              max_new_tokens: int = 128, repeats: int = 3, warmup: int = 2, k: int | None = None,
              backend: str = "inductor", sampling: dict | None = None, log=print) -> BenchResult:
    """Run `methods` side by side over `prompts`; see the module docstring for how.

    `sampling` = dict(temperature, top_k, top_p) switches every method to sampling.
    """
    from specfx.drafters import default_exit_layer

    device = next(model.parameters()).device
    encoded = [tokenizer(p, return_tensors="pt").input_ids.to(device) for p in prompts]
    max_seq_len = cache_length(encoded, max_new_tokens)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    default_exit = default_exit_layer(model)
    # `k` (None: each drafter's default, see `default_num_speculative_tokens`); the model's k
    # for the transformers baselines that take one.
    model_k = k or getattr(model.config, "specfx_num_speculative_tokens", None)
    settings = dict(prompts=len(prompts), max_new_tokens=max_new_tokens, repeats=repeats, warmup=warmup,
                    greedy=sampling is None, sampling=sampling, backend=backend, max_seq_len=max_seq_len,
                    threads=torch.get_num_threads(), dtype=str(next(model.parameters()).dtype).removeprefix("torch."))
    result = BenchResult(model_name, _device_name(device), settings)
    baseline = "hf-greedy" if sampling is None else "hf-sample"
    reference = None
    if sampling is None and "hf-greedy" in methods:
        methods = ["hf-greedy"] + [m for m in methods if m != "hf-greedy"]  # its tokens are the reference
    elif sampling is None:
        log(f"[bench] reference: hf-greedy on {len(prompts)} prompts")
        reference = [_hf_generate(model, ids, max_new_tokens, pad_id)[0] for ids in encoded]

    built = []
    for method in methods:          # each built, then warmed up (its peak memory) before the next
        m = _build(model, method, default_exit, model_k, k, max_seq_len, max_new_tokens, pad_id, sampling,
                   backend, log)
        log(f"[bench] {m.name}: warm-up")
        with PeakMemory(device) as mem:
            for ids in encoded[:warmup]:
                m.gen(ids)
        m.peak_bytes = mem.peak_bytes
        built.append(m)
    log(f"[bench] {repeats} x {len(prompts)} prompts, the {len(built)} methods in a new order for each")
    times = [[[] for _ in encoded] for _ in built]
    ttfts = [[[] for _ in encoded] for _ in built]
    outputs = [[None] * len(encoded) for _ in built]
    hist = [[] for _ in built]
    speed = MachineSpeed(model)
    for n, (i, j) in enumerate(interleave(len(encoded), len(built), repeats)):
        if n % len(built) == 0:                                   # before each prompt's round
            speed.sample()
        toks, dt, ttft, stats = built[j].gen(encoded[i])
        times[j][i].append(dt)
        ttfts[j][i].append(ttft)
        outputs[j][i] = toks
        if stats is not None:
            hist[j].append(stats)
    if reference is None and sampling is None:
        reference = outputs[next(j for j, m in enumerate(built) if m.name == "hf-greedy")]
    speed.sample()
    result.machine = speed.summary()
    parts = _profile_together(built)
    for j, m in enumerate(built):
        result.runs.append(_figures(m, times[j], ttfts[j], outputs[j], hist[j], reference, parts.get(j)))
    base_tps = next((r.tokens_per_s for r in result.runs if r.name == baseline), None)
    if base_tps is None:
        log(f"[bench] {baseline} not among the methods: speedups are left empty")
    for r in result.runs:
        r.speedup_vs_hf_greedy = r.tokens_per_s / base_tps if base_tps else None
    return result


@dataclass
class _Method:
    """A method ready to run: `gen(ids) -> (new tokens, seconds, TTFT seconds, stats or None)`."""

    name: str
    base: str
    gen: object
    fast: object = None             # the specfx model, for its acceptance and `profile()`
    compile_s: float | None = None
    config: str = ""
    peak_bytes: int = 0


def _build(model, method, default_exit, model_k, k, max_seq_len, max_new_tokens, pad_id, sampling, backend,
           log) -> _Method:
    """`method` compiled (specfx) or set up (transformers) for the bench's prompts."""
    import specfx
    from specfx.drafters import parse_draft
    from specfx.pipeline import resolve_drafter

    base, arg = parse_method(method, default_exit, model_k or 4)
    name = f"{base}:{arg}" if arg is not None else base
    if not base.startswith(SPECFX_PREFIX):
        if base in ("hf-greedy", "hf-sample") and (base == "hf-sample") != (sampling is not None):
            raise ValueError("hf-sample is the sampling baseline: use it with --sample (and hf-greedy without)")
        kw = _hf_kwargs(base, arg, model, max_seq_len)
        return _Method(name, base, lambda ids: _hf_generate(model, ids, max_new_tokens, pad_id, sampling, **kw))
    draft = name[len(SPECFX_PREFIX):]
    log(f"[bench] {name}: compiling ({backend})")
    tree = getattr(resolve_drafter(model, parse_draft(draft), k), "tree", None)   # a tree sets its own depth
    fast = specfx.compile(model, draft=draft, num_speculative_tokens=None if tree else k,
                          max_seq_len=max_seq_len, backend=backend)
    config = "" if draft == "none" else f"{fast.graphs.tree.size} nodes" if tree else f"k={fast.num_speculative_tokens}"
    return _Method(name, base, lambda ids: _specfx_generate(fast, ids, max_new_tokens, pad_id, sampling), fast,
                   fast.capture_s + fast.compile_s, config)


# Rounds of the draft and verify columns' timing. At 20, the same 4-row verify graph of two
# drafters printed 1.14x and 1.25x the decode graph in one run (build 7bc539b); a round of the
# six specfx methods of pycoder's greedy table costs about 14 ms (their draft and verify columns).
PROFILE_ROUNDS = 100


def _profile_together(built: list[_Method]) -> dict[int, tuple[float, float]]:
    """method index -> (draft, verify) seconds a step of every specfx method (`profile_models`)."""
    specfx_methods = {j: m.fast for j, m in enumerate(built) if m.fast is not None}
    return dict(zip(specfx_methods, profile_models(list(specfx_methods.values()))))


def profile_models(models: list) -> list[tuple[float, float]]:
    """(draft, verify) seconds a step of each `SpeculativeModel`, their parts timed together in
    `PROFILE_ROUNDS` shuffled rounds (`runtime.generate.profile_together`), each model's state
    held meanwhile."""
    from specfx.runtime.generate import profile_together

    with contextlib.ExitStack() as locks:
        for fast in models:
            locks.enter_context(fast.runtime.state.lock)
        return profile_together([fast.runtime for fast in models], PROFILE_ROUNDS)


def interleave(prompts: int, methods: int, repeats: int, seed: int = 0):
    """(prompt, method) indices in the order a side-by-side run calls them: `repeats` passes over
    the prompts, each prompt running every method in a new seeded order, so that a drift in the
    machine's speed reaches each method alike and none always follows the same other one."""
    order, shuffle = list(range(methods)), random.Random(seed).shuffle
    for _ in range(repeats):
        for i in range(prompts):
            shuffle(order)
            for j in order:
                yield i, j


def _figures(m: _Method, times, ttfts, outputs, hist, reference, parts) -> MethodRun:
    """One method's row: per-prompt medians over the repeats, acceptance, `profile()`'s parts."""
    med = [statistics.median(t) for t in times]
    new_tokens = sum(len(o) for o in outputs)
    later = sum(len(o) - 1 for o in outputs if o)                  # the tokens after each first one
    after_first = sum(statistics.median(t - f for t, f in zip(ts, fs)) for ts, fs in zip(times, ttfts))
    run = MethodRun(
        name=m.name, tokens_per_s=new_tokens / sum(med),
        ttft_s=statistics.median(statistics.median(t) for t in ttfts), new_tokens=new_tokens,
        tpot_s=after_first / later if later > 0 else None,
        peak_mem_mb=m.peak_bytes / 2**20, compile_s=m.compile_s, config=m.config,
        exact_match=None if reference is None else sum(o == r for o, r in zip(outputs, reference)) / len(reference),
    )
    fast = m.fast
    if fast is not None:
        calls = sum(s.target_calls for s in hist)
        run.mean_accepted = sum(s.mean_accepted * s.target_calls for s in hist) / max(calls, 1)
        if fast.num_speculative_tokens and m.base != "specfx:none":
            run.acceptance_by_position = [
                sum(s.acceptance_by_position[j] * s.target_calls for s in hist) / max(calls, 1)
                for j in range(fast.num_speculative_tokens)]
        run.draft_s, run.verify_s = parts
    return run


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def machine_caption(machine: dict | None) -> str | None:
    """The machine's speed during the passes (`MachineSpeed.summary()`), in a line."""
    if not machine:
        return None
    (s0, s1, s2), (f0, f1, f2) = machine["stream_gbps"], machine["fma_gflops"]
    r0, r1, r2 = machine["ridge_rows"]
    trips = ""
    if machine.get("handoff_ns"):
        h0, h1, h2 = machine["handoff_ns"]
        trips = f"; a cache line between the first two threads and back in {h1:.0f} ns ({h0:.0f}-{h2:.0f})"
    return (f"machine between the prompts' rounds ({machine['samples']} samples, median and range): "
            f"{machine['stream_mb']:.1f} MB streamed at {s1:.1f} GB/s ({s0:.1f}-{s2:.1f}), "
            f"FMA peak {f1:.1f} GFLOP/s ({f0:.1f}-{f2:.1f}); ridge {r1:.1f} rows ({r0:.1f}-{r2:.1f}): "
            f"a pass over the weights with fewer query rows is held by the stream, with more by the multiply-adds"
            + trips)


def render(result: BenchResult):
    """A rich Table of the runs."""
    from rich.table import Table

    s = result.settings
    mode = "greedy" if s.get("greedy", True) else "sampling " + ", ".join(f"{k}={v}" for k, v in s["sampling"].items())
    t = Table(title=f"{result.model} on {result.device}: {s['prompts']} prompts x {s['max_new_tokens']} "
                    f"new tokens, {mode}, median of {s['repeats']} interleaved after {s['warmup']} warm-up",
              caption=machine_caption(result.machine))
    base = "hf-greedy" if s.get("greedy", True) else "hf-sample"
    for col in ("method", "tok/s", f"vs {base}", "TTFT ms", "TPOT ms", "accepted/call", "acceptance by position",
                "draft ms", "verify ms", "peak MiB", "exact", "compile s"):
        t.add_column(col, justify="left" if col in ("method", "acceptance by position") else "right")
    f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    for r in result.runs:
        acc = " ".join(f"{a:.2f}" for a in r.acceptance_by_position) if r.acceptance_by_position else "-"
        t.add_row(
            f"{r.name} {r.config}".strip(), f"{r.tokens_per_s:.1f}", f(r.speedup_vs_hf_greedy, ".2f") + "x",
            f"{r.ttft_s * 1e3:.1f}", f(r.tpot_s and r.tpot_s * 1e3, ".3f"), f(r.mean_accepted, ".2f"), acc,
            f(r.draft_s and r.draft_s * 1e3, ".2f"), f(r.verify_s and r.verify_s * 1e3, ".2f"),
            f"{r.peak_mem_mb:.0f}", f(r.exact_match, ".2f"), f(r.compile_s, ".1f"),
        )
    return t
