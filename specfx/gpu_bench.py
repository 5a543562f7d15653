"""GPU check: per-step costs and tokens/s of the CUDA-graph step (run by scripts/gpu_check.sh).

    python -m specfx.gpu_bench --out benchmarks/gpu/DATE-GPU

Two parts, each written to `OUT/gpu_bench.json` and printed:
1. A random-init Llama of about 1B parameters in bf16 (acceptance is meaningless with random
   weights, so this part reports costs): plain decode step, one draft pass, verify of k+1
   tokens, the fused step replayed as a CUDA graph, the sum of its kernel times (profiler) and
   the launch overhead (wall minus kernels); tokens/s of HF `generate` with a static cache
   and `torch.compile(mode="reduce-overhead")`, specfx:none with a CUDA graph, and
   specfx:early-exit with and without one.
2. `pycoder` (bf16) with every drafter (early exit, its MTP head, pycoder-draft, n-gram):
   mean accepted tokens per call and tokens/s.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def _time(fn, iters: int = 50) -> float:
    """Median seconds of `fn()` with the device synchronized around each call."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def kernel_seconds(fn, iters: int = 10) -> float:
    """Sum of CUDA kernel times of one `fn()` call (profiler), averaged over `iters` calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    total_us = sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA"
                   and not e.key.startswith("cudaGraph"))
    return total_us / iters / 1e6


def _tokens_per_s(gen, prompts, max_new_tokens) -> float:
    gen(prompts[0])
    torch.cuda.synchronize()
    t = time.perf_counter()
    new = 0
    for ids in prompts:
        out = gen(ids)
        new += out.shape[1] - ids.shape[1]
    torch.cuda.synchronize()
    return new / (time.perf_counter() - t)


def random_1b(device="cuda", dtype=torch.bfloat16):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                      num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096)
    return LlamaForCausalLM(cfg).to(device, dtype).eval()


def step_costs(model, *, exit_layer: int, k: int, max_seq_len: int) -> dict:
    """Per-step costs in ms of the graphs and of the fused step as a CUDA graph."""
    import specfx

    ids = torch.randint(3, 1000, (1, 64), device="cuda")
    none = specfx.compile(model, draft="none", max_seq_len=max_seq_len)
    ee = specfx.compile(model, draft=f"early-exit:{exit_layer}", num_speculative_tokens=k, max_seq_len=max_seq_len)
    for m in (none, ee):
        m.generate(ids, max_new_tokens=8, eos_token_id=[])
    _, decode_s = none.profile(repeats=50)
    draft_s, verify_s = ee.profile(repeats=50)
    graphed = ee.runtime.step_callable(False)
    fused_s = _time(graphed)
    kernels = kernel_seconds(graphed)
    return {"decode_step_ms": decode_s * 1e3, "draft_pass_ms": draft_s / (k + 1) * 1e3,
            "draft_step_ms": draft_s * 1e3, "verify_step_ms": verify_s * 1e3,
            "fused_step_ms": fused_s * 1e3, "fused_kernels_ms": kernels * 1e3,
            "launch_overhead_ms": (fused_s - kernels) * 1e3, "wall_over_kernels": fused_s / max(kernels, 1e-12)}


def throughput(model, prompts, *, exit_layer: int, k: int, max_new_tokens: int, max_seq_len: int) -> dict:
    """tokens/s: HF static cache + compile, specfx:none (graph), specfx:early-exit with/without graph."""
    import specfx

    out = {}
    model.generation_config.cache_implementation = "static"
    model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    hf = lambda ids: model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,  # noqa: E731
                                    eos_token_id=None, pad_token_id=0)
    try:
        with torch.no_grad():
            out["hf_static_compile"] = _tokens_per_s(hf, prompts, max_new_tokens)
    finally:
        del model.forward                      # back to the class's own forward
        model.generation_config.cache_implementation = None
    for name, draft, graphs in [("specfx_none_cudagraph", "none", True),
                                ("specfx_early_exit_cudagraph", f"early-exit:{exit_layer}", True),
                                ("specfx_early_exit_no_cudagraph", f"early-exit:{exit_layer}", False)]:
        fast = specfx.compile(model, draft=draft, num_speculative_tokens=k, max_seq_len=max_seq_len,
                              cudagraphs=graphs)
        out[name] = _tokens_per_s(lambda ids: fast.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=[]),
                                  prompts, max_new_tokens)
        if draft != "none":
            out[name + "_mean_accepted"] = fast.last_stats.mean_accepted
    return out


def pycoder_acceptance(max_new_tokens: int, num_prompts: int) -> dict:
    import specfx
    from specfx import zoo

    model, tok = zoo.load("pycoder", dtype=torch.bfloat16)
    model = model.cuda()
    prompts = [tok(p, return_tensors="pt").input_ids.cuda() for p in zoo.prompts()[:num_prompts]]
    out = {}
    for draft in ("none", "early-exit", "mtp", "draft-model:pycoder-draft", "ngram:3"):
        fast = specfx.compile(model, draft=draft, max_seq_len=512)
        acc, calls, new, t = 0.0, 0, 0, 0.0
        for ids in prompts:
            t0 = time.perf_counter()
            o = fast.generate(ids, max_new_tokens=max_new_tokens)
            t += time.perf_counter() - t0
            s = fast.last_stats
            acc += s.mean_accepted * s.target_calls
            calls += s.target_calls
            new += o.shape[1] - ids.shape[1]
        out[draft] = {"tokens_per_s": new / t, "mean_accepted": acc / max(calls, 1),
                      "drafter": str(fast.drafter), "k": fast.num_speculative_tokens}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for gpu_bench.json")
    ap.add_argument("--exit-layer", type=int, default=4, help="exit layer for the 1B model")
    ap.add_argument("-k", type=int, default=4, help="draft tokens per step")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=8)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "settings": vars(args)}
    model = random_1b()
    result["params"] = sum(p.numel() for p in model.parameters())
    result["random_1b_costs"] = step_costs(model, exit_layer=args.exit_layer, k=args.k, max_seq_len=1024)
    print(json.dumps(result["random_1b_costs"], indent=1), flush=True)
    prompts = [torch.randint(3, 32000, (1, 128), device="cuda") for _ in range(args.num_prompts)]
    result["random_1b_tokens_per_s"] = throughput(model, prompts, exit_layer=args.exit_layer, k=args.k,
                                                  max_new_tokens=args.max_new_tokens, max_seq_len=1024)
    print(json.dumps(result["random_1b_tokens_per_s"], indent=1), flush=True)
    del model
    torch.cuda.empty_cache()
    result["pycoder"] = pycoder_acceptance(args.max_new_tokens, args.num_prompts)
    print(json.dumps(result["pycoder"], indent=1), flush=True)
    (out / "gpu_bench.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
