"""Scale: random-init models with the shapes of Llama-3.2-1B and Qwen2.5-0.5B, in bfloat16.

    python benchmarks/scale.py                               # both shapes, eager backend
    python benchmarks/scale.py --shapes qwen2.5-0.5b --backend inductor --json out.json

How it measures, per shape and per drafter (early exit at half depth, n-gram lookup):
- capture time: `specfx.compile` up to a runnable step (export, passes, fusion: `capture_s`);
  compile time: the backend's warm-up compilation (`compile_s`; 0 with the eager backend, which
  runs the captured graphs as they are);
- memory: the process's resident set size (RSS, /proc) before the model exists is the baseline,
  taken after a tiny model of the same family went through the same steps (so that the code
  which export and the passes load is in the baseline, not counted as the model's);
  the peak RSS above it over model build, compile and a 32-token generation, against the bytes
  of the weights plus the KV buffers the compiled state holds. Goal: <= 1.25x, i.e. no copy of
  the weights anywhere in capture, passes or compile;
- exactness: 32 greedy tokens from a 16-token prompt equal `model.generate(do_sample=False)`
  in bfloat16, under the near-tie rule scaled to the dtype (`specfx.exactness`).
The weights are random (the shapes are what is measured), so acceptance rates mean nothing here.
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import specfx
from specfx.exactness import greedy_mismatch
from specfx.runtime.memory import PeakMemory, rss_bytes

SHAPES = {
    "llama-3.2-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                                   tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072)),
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                   tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=32768)),
}
PROMPT, NEW, MAX_SEQ_LEN = 16, 32, 64


def build(shape: str, dtype: torch.dtype):
    family, kw = SHAPES[shape]
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **kw)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors}.values())


def run_drafter(model, draft: str, ids: torch.Tensor, ref: torch.Tensor, backend: str, base_rss: int,
                weight_bytes: int) -> dict:
    with PeakMemory("cpu") as mem:
        fast = specfx.compile(model, draft=draft, num_speculative_tokens=4, max_seq_len=MAX_SEQ_LEN,
                              backend=backend)
        t0 = time.perf_counter()
        out = fast.generate(ids, max_new_tokens=NEW, eos_token_id=[])
        gen_s = time.perf_counter() - t0
    kv_bytes = tensor_bytes(fast.graphs.state.kv)
    why = greedy_mismatch(model, out[0].tolist(), ref[0].tolist(), PROMPT)
    peak = mem.peak_bytes - base_rss
    row = dict(draft=draft, backend=backend, capture_s=round(fast.capture_s, 2), compile_s=round(fast.compile_s, 2),
               generate_s=round(gen_s, 2), mean_accepted=round(fast.last_stats.mean_accepted, 3),
               kv_mb=round(kv_bytes / 2**20, 1), peak_above_baseline_mb=round(peak / 2**20, 1),
               peak_vs_weights_kv=round(peak / (weight_bytes + kv_bytes), 3),
               exact=why is None, mismatch=why)
    del fast
    gc.collect()
    return row


def warm_up(shape: str, dtype: torch.dtype, backend: str, drafts: list[str]) -> None:
    """The same steps on a tiny model of the family: load the code they need."""
    family, _ = SHAPES[shape]
    config = AutoConfig.for_model(family, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    tiny = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    ids = torch.randint(3, 128, (1, PROMPT))
    with torch.no_grad():
        tiny.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
    for draft in drafts:
        draft = "early-exit:1" if draft.startswith("early-exit") else draft
        specfx.compile(tiny, draft=draft, num_speculative_tokens=4, max_seq_len=MAX_SEQ_LEN,
                       backend=backend).generate(ids, max_new_tokens=4, eos_token_id=[])


def run_shape(shape: str, dtype: torch.dtype, backend: str, drafts: list[str], log) -> dict:
    warm_up(shape, dtype, backend, drafts)
    gc.collect()
    base_rss = rss_bytes()
    t0 = time.perf_counter()
    model = build(shape, dtype)
    build_s = time.perf_counter() - t0
    params = list(model.parameters())
    weight_bytes = tensor_bytes(params)
    log(f"[scale] {shape}: {sum(p.numel() for p in params) / 1e9:.2f}B parameters, "
        f"{weight_bytes / 2**30:.2f} GiB in {dtype}, built in {build_s:.0f}s")
    ids = torch.randint(3, 1000, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0, eos_token_id=None)
    ref_s = time.perf_counter() - t0
    rows = []
    for draft in drafts:
        rows.append(run_drafter(model, draft, ids, ref, backend, base_rss, weight_bytes))
        log(f"[scale] {shape} {draft}: {rows[-1]}")
    result = dict(shape=shape, dtype=str(dtype).removeprefix("torch."),
                  parameters=sum(p.numel() for p in params), weights_mb=round(weight_bytes / 2**20, 1),
                  hf_generate_s=round(ref_s, 2), runs=rows)
    del model, params
    gc.collect()
    return result


def render(results: list[dict]) -> str:
    lines = ["| shape | dtype | drafter | capture s | compile s | weights MB | KV MB | peak above baseline MB "
             "| peak / (weights + KV) | 32 tokens exact |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for run in r["runs"]:
            lines.append(f"| {r['shape']} | {r['dtype']} | {run['draft']} ({run['backend']}) | {run['capture_s']} "
                         f"| {run['compile_s']} | {r['weights_mb']} | {run['kv_mb']} | {run['peak_above_baseline_mb']} "
                         f"| {run['peak_vs_weights_kv']} | {'yes' if run['exact'] else 'NO'} |")
    return "\n".join(lines)


def _in_subprocess(shape: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        subprocess.run([sys.executable, __file__, "--shapes", shape, "--drafts", args.drafts, "--dtype", args.dtype,
                        "--backend", args.backend, "--json", str(out)], check=False)
        return json.loads(out.read_text())["results"][0]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--drafts", default="early-exit,ngram:3", help="drafters (early-exit: exit at half depth)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--backend", default="eager", help="eager (default: Inductor on a 1B model takes long on one core)")
    p.add_argument("--json", dest="json_out", default=None, help="write the results here")
    args = p.parse_args(argv)
    shapes = args.shapes.split(",")
    if len(shapes) > 1:   # one process per shape: memory one model freed stays in the next one's baseline
        results = [_in_subprocess(shape, args) for shape in shapes]
    else:
        layers = SHAPES[shapes[0]][1]["num_hidden_layers"]
        drafts = [f"early-exit:{layers // 2}" if d == "early-exit" else d for d in args.drafts.split(",")]
        results = [run_shape(shapes[0], getattr(torch, args.dtype), args.backend, drafts, print)]
    print(render(results))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "results": results}, f, indent=1)
    return 0 if all(run["exact"] for r in results for run in r["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
