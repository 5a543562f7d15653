"""GPU check: what `scripts/gpu_check.sh` measures, most important first (README, "GPU check").

    python -m specfx.gpu_bench [--out DIR] [--deadline-s 320] [--dry-run]

Sections, in this order; `OUT/gpu_bench.json` is rewritten after each one (and after each
drafter), so a run stopped at any point keeps what it measured:

1. `cuda_tests`: `pytest -m cuda tests/test_cudagraph.py`: capture, replay equal to the
   unreplayed compiled step, no sync under `set_sync_debug_mode("error")` around the compiled
   step and the whole generate loop, half-precision exactness.
2. `step_graphed_vs_ungraphed`: one specfx:none decoding step of a random-init Llama (about 1B
   parameters, bf16, built on the GPU), called as compiled code and replayed as a CUDA graph.
3. `step_wall_vs_kernels`: that step's wall time against the sum of its kernel times
   (torch.profiler; the goal is wall <= 1.15x kernels).
4. `specfx_none_vs_hf`: tokens/s of specfx:none and of transformers' `generate` with a static
   cache, whose decoding forward transformers compiles itself, once (all prompts have one
   length, so the cache has one length).
5. `pycoder_drafters`: pycoder (bf16) with each drafter: tokens/s and mean accepted tokens per
   target call, as long as time allows.

Every section runs in try/except and records its error (`specfx.report`). A section is skipped
(and recorded so) when less time is left before the internal deadline than it needs, and stopped
if it runs past the deadline. The exit status is 1 when the CUDA tests did not pass or a section raised.
`--dry-run` runs the same code on the CPU with tiny shapes and the eager backend: the CUDA
tests are only collected, CUDA-graph figures are skipped, and the JSON has every section.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from specfx.report import Report, SectionTimeout, compiled_graphs, error_entry
from specfx.runtime.generate import _median_time, _sync

CUDA_TESTS = Path(__file__).resolve().parents[1] / "tests" / "test_cudagraph.py"


@dataclass(frozen=True)
class Workload:
    """Model sizes and what a run measures."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    vocab: int
    prompt_len: int
    max_new_tokens: int
    num_prompts: int
    iters: int
    drafters: tuple[str, ...]         # pycoder's, in this order


# 16 layers of a 1B Llama's shape (~1.0B parameters): one specfx:none step unrolls 16 layer
# instances, so its compile fits the check's time (an early-exit step would unroll ~2x that).
GPU = Workload(layers=16, hidden=2048, intermediate=5632, heads=16, vocab=32000, prompt_len=128,
               max_new_tokens=128, num_prompts=4, iters=50,
               drafters=("none", "early-exit", "mtp", "draft-model:pycoder-draft", "ngram:3"))
# One drafter keeps the dry run short (pycoder's capture takes seconds); the unit tests build every drafter.
DRY = Workload(layers=2, hidden=64, intermediate=128, heads=4, vocab=256, prompt_len=8, max_new_tokens=8,
               num_prompts=1, iters=3, drafters=("early-exit",))
# Seconds a section needs on a cold H200 to be worth starting (the dry run needs none).
MIN_SECONDS = {"cuda_tests": 60, "step_graphed_vs_ungraphed": 90, "step_wall_vs_kernels": 15,
               "specfx_none_vs_hf": 90, "pycoder_drafters": 40}
PER_DRAFTER_S = 40
CUDA_TESTS_MAX_S = 200


def kernel_seconds(fn, device: torch.device, iters: int = 10) -> float:
    """Per call of `fn`: the sum of its CUDA kernel times, or on CPU of its ops' self times (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    _sync(device)
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            fn()
        _sync(device)
    if cuda:
        total_us = sum(e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA")
    else:
        total_us = sum(e.self_cpu_time_total for e in prof.key_averages())
    return total_us / iters / 1e6


def _tokens_per_s(gen, prompts, device: torch.device, warmup: int = 1) -> float:
    """New tokens per second of `gen(ids)` over `prompts`, after `warmup` calls on the first."""
    for _ in range(warmup):
        gen(prompts[0])
    _sync(device)
    t, new = time.perf_counter(), 0
    for ids in prompts:
        new += gen(ids).shape[1] - ids.shape[1]
    _sync(device)
    return new / (time.perf_counter() - t)


def random_llama(w: Workload, device: torch.device, dtype: torch.dtype):
    """A random-init Llama built directly on `device`, seeded without touching the global RNG."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=w.vocab, hidden_size=w.hidden, intermediate_size=w.intermediate,
                      num_hidden_layers=w.layers, num_attention_heads=w.heads, num_key_value_heads=w.heads,
                      max_position_embeddings=4096,
                      bos_token_id=None, eos_token_id=None, pad_token_id=0)   # no EOS: every run is full length
    forked = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=forked), torch.device(device):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
    return model.to(dtype).eval()


class Check:
    """One run: its settings, the models its sections share, and its report."""

    def __init__(self, out: Path, *, dry_run: bool, deadline_s: float):
        self.dry_run, self.out = dry_run, out
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.dtype = torch.float32 if dry_run else torch.bfloat16
        self.backend = "eager" if dry_run else "inductor"
        self.work = DRY if dry_run else GPU
        self.report = Report(out / "gpu_bench.json", deadline_s, self._meta(deadline_s))
        self._model = self._none = None

    def _meta(self, deadline_s: float) -> dict:
        import platform

        import transformers

        versions = {"python": platform.python_version(), "torch": torch.__version__,
                    "transformers": transformers.__version__}
        for name in ("triton", "pytest"):
            try:
                versions[name] = __import__(name).__version__
            except ImportError:
                versions[name] = None
        device = "cpu (dry run)" if self.dry_run else torch.cuda.get_device_name()
        return {"device": device, "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "dry_run": self.dry_run,
                "deadline_s": deadline_s, "backend": self.backend, "dtype": str(self.dtype).removeprefix("torch."),
                "workload": asdict(self.work), "versions": versions}

    def random_model(self):
        if self._model is None:
            self._model = random_llama(self.work, self.device, self.dtype)
        return self._model

    def specfx_none(self):
        """specfx:none on the random model, compiled on first use (no warm-up generate)."""
        import specfx

        if self._none is None:
            s = self.work
            self._none = specfx.compile(self.random_model(), draft="none", max_seq_len=s.prompt_len + s.max_new_tokens,
                                        backend=self.backend, warmup=False)
        return self._none

    def random_prompts(self) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(1)
        s = self.work
        return [torch.randint(3, s.vocab, (1, s.prompt_len), generator=g).to(self.device) for _ in range(s.num_prompts)]

    def fresh_row(self) -> None:
        """Load one random prompt with room for max_new_tokens, so timed steps decode real positions."""
        st, s = self.specfx_none().graphs.state, self.work
        st.load_prompts([self.random_prompts()[0][0].cpu()], max_new_tokens=s.max_new_tokens, eos_ids=[])


def pytest_command(junit: Path, collect_only: bool) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", str(CUDA_TESTS),
           f"--junitxml={junit}"]
    return cmd + ["--collect-only"] if collect_only else cmd


def cuda_tests(check: Check) -> dict:
    """The CUDA tests in a pytest process (collected only in a dry run)."""
    try:
        import pytest  # noqa: F401
    except ImportError:
        raise RuntimeError("pytest is not installed, so the CUDA tests cannot run: pip install pytest "
                           "(the offline install uses --no-deps)") from None
    junit = check.out / "cuda_tests.xml"
    cmd = pytest_command(junit, collect_only=check.dry_run)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=min(check.report.time_left(), CUDA_TESTS_MAX_S))
    except subprocess.TimeoutExpired:
        raise SectionTimeout(f"the CUDA tests ran past {CUDA_TESTS_MAX_S} s or the deadline") from None
    finally:
        if proc.poll() is None:                       # timed out or interrupted: end pytest and its workers
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    entry = {"command": " ".join(cmd[1:]), "exit_code": proc.returncode, "output_tail": output[-3000:]}
    if check.dry_run:
        collected = sum(1 for line in output.splitlines() if "::" in line)
        if proc.returncode != 0 or collected == 0:
            return {**entry, "status": "failed", "reason": f"collecting the CUDA tests failed ({collected} collected)"}
        return {**entry, "status": "skipped", "reason": f"dry run: no CUDA; {collected} CUDA tests collected"}
    counts = _junit_counts(junit)
    passed = proc.returncode == 0 and counts.get("passed", 0) > 0 and counts.get("skipped", 0) == 0
    return {**entry, **counts, "status": "ok" if passed else "failed"}


def _junit_counts(path: Path) -> dict:
    """passed / failed / errors / skipped and the failing tests' first message lines, from a JUnit XML."""
    import xml.etree.ElementTree as ET

    if not path.is_file():
        return {}
    counts, failures = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}, []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), None)
        key = {"failure": "failed", "error": "errors", "skipped": "skipped", None: "passed"}[outcome]
        counts[key] += 1
        if outcome in ("failure", "error"):
            message = next(c for c in case if c.tag == outcome).get("message", "")
            failures.append(f"{case.get('name')}: {message.splitlines()[0] if message else outcome}")
    return {**counts, "failures": failures}


def step_graphed_vs_ungraphed(check: Check) -> dict:
    """Median ms of one decoding step, compiled and called, and replayed as a CUDA graph."""
    fast = check.specfx_none()
    rt, dev, iters = fast.runtime, check.device, check.work.iters
    model = check.random_model()
    check.fresh_row()
    out = {"model": "random-init Llama", "parameters": sum(p.numel() for p in model.parameters()),
           "layers": check.work.layers, "kv_len": fast.graphs.state.seq_len,
           "ungraphed_step_ms": _median_time(rt.step, iters, dev) * 1e3}
    if not rt.cudagraphs:
        return {**out, "graphed_step_ms": None, "skipped": ["graphed_step_ms: CUDA graphs need CUDA"]}
    graphed = rt.step_callable(False)                 # captures here
    check.fresh_row()
    out["graphed_step_ms"] = _median_time(graphed, iters, dev) * 1e3
    return {**out, "graph_speedup": out["ungraphed_step_ms"] / out["graphed_step_ms"]}


def step_wall_vs_kernels(check: Check) -> dict:
    """Wall time of the step as the loop runs it against the sum of its kernel times."""
    rt, dev = check.specfx_none().runtime, check.device
    step = rt.step_callable(False)                    # the CUDA graph, or the compiled step without CUDA
    check.fresh_row()
    wall = _median_time(step, check.work.iters, dev)
    # The compiled step launches the graph's kernels one by one; the profiler sees them all.
    kernels = kernel_seconds(rt.step, dev)
    out = {"timed": "cuda graph replay" if rt.cudagraphs else "compiled step", "wall_ms": wall * 1e3,
           "kernels_ms": kernels * 1e3, "wall_over_kernels": wall / max(kernels, 1e-12),
           "launch_overhead_ms": (wall - kernels) * 1e3, "goal": "wall_over_kernels <= 1.15"}
    if rt.cudagraphs:
        out["kernels_seen_in_replay_ms"] = kernel_seconds(step, dev) * 1e3
    return out


def specfx_none_vs_hf(check: Check) -> dict:
    """tokens/s: specfx:none against transformers' generate with a static cache, compiled by transformers."""
    model, fast, dev, s = check.random_model(), check.specfx_none(), check.device, check.work
    prompts = check.random_prompts()
    ours = _tokens_per_s(lambda ids: fast.generate(ids, max_new_tokens=s.max_new_tokens, eos_token_id=[]),
                         prompts, dev)

    def hf(ids):
        return model.generate(ids, max_new_tokens=s.max_new_tokens, do_sample=False, cache_implementation="static",
                              pad_token_id=0)

    graphs0 = compiled_graphs()
    with torch.no_grad():
        for _ in range(2):                             # compile, then record (reduce-overhead: CUDA graphs)
            hf(prompts[0])
        graphs1 = compiled_graphs()
        theirs = _tokens_per_s(hf, prompts, dev, warmup=0)
    return {"specfx_none_tokens_per_s": ours, "hf_static_compile_tokens_per_s": theirs,
            "specfx_over_hf": ours / theirs, "goal": "specfx_over_hf >= 1",
            "hf_graphs_compiled": graphs1 - graphs0, "hf_graphs_compiled_while_timed": compiled_graphs() - graphs1,
            "hf_static_cache_len": s.prompt_len + s.max_new_tokens, "new_tokens": s.max_new_tokens,
            "note": "transformers compiles the decoding forward itself (CUDA only); its prefill runs eagerly"}


def pycoder_drafters(check: Check) -> dict:
    """pycoder with each drafter, while time allows: tokens/s and mean accepted tokens per call."""
    import specfx
    from specfx import zoo
    from specfx.bench import cache_length

    model, tok = zoo.load("pycoder", dtype=check.dtype)
    model = model.to(check.device)
    s = check.work
    prompts = [tok(p, return_tensors="pt").input_ids.to(check.device) for p in zoo.prompts()[: s.num_prompts]]
    max_seq_len = cache_length(prompts, s.max_new_tokens)
    out = {}
    for draft in s.drafters:
        left = check.report.time_left()
        if not check.dry_run and left < PER_DRAFTER_S:
            out[draft] = {"status": "skipped", "reason": f"{left:.0f} s left before the deadline"}
            continue
        try:
            t0 = time.monotonic()
            fast = specfx.compile(model, draft=draft, max_seq_len=max_seq_len, backend=check.backend)
            ready_s = time.monotonic() - t0
            tps = _tokens_per_s(lambda ids: fast.generate(ids, max_new_tokens=s.max_new_tokens), prompts,
                                check.device, warmup=0)
            out[draft] = {"status": "ok", "tokens_per_s": tps, "mean_accepted": fast.last_stats.mean_accepted,
                          "drafter": str(fast.drafter), "k": fast.num_speculative_tokens, "ready_s": ready_s}
        except Exception as e:  # noqa: BLE001 - one drafter's failure leaves the others measured
            out[draft] = {"status": "error", **error_entry(e)}
        check.report.record("pycoder_drafters", {"status": "running", "drafters": out})
    failed = [d for d, r in out.items() if r["status"] == "error"]
    return {"status": "error" if failed else "ok", "drafters": out, "prompts": len(prompts),
            "new_tokens": s.max_new_tokens, **({"error": f"drafters failed: {', '.join(failed)}"} if failed else {})}


SECTIONS = {"cuda_tests": cuda_tests, "step_graphed_vs_ungraphed": step_graphed_vs_ungraphed,
            "step_wall_vs_kernels": step_wall_vs_kernels, "specfx_none_vs_hf": specfx_none_vs_hf,
            "pycoder_drafters": pycoder_drafters}


def default_out_dir(dry_run: bool) -> Path:
    """benchmarks/gpu/DATE-GPU (`scripts/gpu_check.sh` names it the same way)."""
    device = "cpu-dry-run" if dry_run else torch.cuda.get_device_name().replace(" ", "-")
    return Path("benchmarks/gpu") / f"{time.strftime('%Y-%m-%d')}-{device}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="output folder (default: $OUT, else benchmarks/gpu/DATE-GPU)")
    ap.add_argument("--deadline-s", type=float, default=320.0,
                    help="seconds from start after which no section starts and a running one is stopped")
    ap.add_argument("--dry-run", action="store_true",
                    help="on the CPU, tiny shapes, eager backend; CUDA-only parts recorded as skipped")
    ap.add_argument("--only", help="comma-separated sections to run (default: all, in order)")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        ap.error("no CUDA device: run on a GPU machine, or pass --dry-run")
    out = Path(args.out or os.environ.get("OUT") or default_out_dir(args.dry_run))
    out.mkdir(parents=True, exist_ok=True)
    only = args.only.split(",") if args.only else list(SECTIONS)
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown sections {unknown}; expected some of {list(SECTIONS)}")
    check = Check(out, dry_run=args.dry_run, deadline_s=args.deadline_s)
    print(f"[meta] {json.dumps(check.report.result['meta'])}", flush=True)
    for name in only:
        check.report.run(name, lambda: SECTIONS[name](check), min_s=0 if args.dry_run else MIN_SECONDS[name])
    ok = check.report.finish(must_pass=() if args.dry_run else ("cuda_tests",))
    bad = check.report.result["failed_sections"]
    print(f"wrote {out / 'gpu_bench.json'}" + (f"; failed: {', '.join(bad)}" if bad else ""), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
