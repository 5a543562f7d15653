"""Soak: many mixed `generate` calls on one compiled tiny model, checking that nothing drifts.

    python benchmarks/soak.py                      # 2000 calls, Inductor
    python benchmarks/soak.py --calls 100 --backend eager

How it measures:
- A pool of distinct calls (batch fill 1..B rows of different lengths, greedy or sampling with
  a seed, EOS ids, max_new_tokens up to the cache limit) on a tiny random Llama compiled with
  early exit. Warm-up runs every call of the pool once; then `--calls` calls are drawn from the
  pool at random (seeded) and run one after another.
- Memory: the process's resident set size (RSS, /proc) after warm-up and after the last call,
  each after a garbage collection. Goal: flat within 5%.
- Compilations after warm-up. Goal: 0. Counted three ways, so that the count holds however
  the step gets compiled: Dynamo's graphs (`torch._dynamo.utils.counters["stats"]
  ["unique_graphs"]`, which a recompilation adds to), Inductor's graph compilations (its FX
  graph cache's hits, misses and bypasses: every `compile_fx` call counts once, with Dynamo or
  without), and the calls of specfx's own `compile_graph`. With `--backend eager` nothing is
  compiled, so all three are 0 by construction.
- Exactness: every greedy row equals `model.generate`'s greedy tokens (the near-tie rule of
  `specfx.exactness`), and every sampled output equals the same call's output on a second
  model, compiled alike, that ran each call of the pool once, in order, before the soak.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from dataclasses import asdict, dataclass

import torch

B, K, MAX_SEQ_LEN = 2, 3, 96


@dataclass
class SoakResult:
    calls: int
    backend: str
    rss_start_mb: float
    rss_end_mb: float
    dynamo_graphs: int
    inductor_compiles: int
    specfx_compiles: int
    greedy_rows: int
    sampled_calls: int
    mismatches: list[str]
    seconds: float

    @property
    def rss_change(self) -> float:
        return self.rss_end_mb / self.rss_start_mb - 1

    @property
    def ok(self) -> bool:
        compiles = self.dynamo_graphs + self.inductor_compiles + self.specfx_compiles
        return abs(self.rss_change) <= 0.05 and compiles == 0 and not self.mismatches

    def __str__(self) -> str:
        return "\n".join([
            f"soak: {self.calls} calls after warm-up, backend={self.backend}, {self.seconds:.0f} s",
            f"  RSS after warm-up {self.rss_start_mb:.1f} MiB, at the end {self.rss_end_mb:.1f} MiB "
            f"({self.rss_change:+.2%}; goal within 5%)",
            f"  compilations after warm-up (goal 0): Dynamo graphs {self.dynamo_graphs}, Inductor graphs "
            f"{self.inductor_compiles}, specfx compile_graph calls {self.specfx_compiles}",
            f"  exact: {self.greedy_rows - len(self.mismatches)}/{self.greedy_rows} greedy rows equal model.generate, "
            f"sampled calls {self.sampled_calls} (each equal to a fresh model's), mismatches {len(self.mismatches)}",
            *(f"    {m}" for m in self.mismatches[:10]),
            f"  {'OK' if self.ok else 'FAILED'}",
        ])


def pool(size: int, vocab: int, eos: int, rng: random.Random) -> list[dict]:
    """`size` distinct calls: rows, prompt lengths, greedy or sampled, EOS, max_new_tokens."""
    calls = []
    for i in range(size):
        lengths = [rng.randint(1, 70) for _ in range(rng.randint(1, B))]
        ids = torch.randint(3, vocab, (len(lengths), max(lengths)), generator=torch.Generator().manual_seed(i))
        mask = torch.zeros_like(ids)
        for b, n in enumerate(lengths):
            mask[b, max(lengths) - n:] = 1
        sample = dict(do_sample=True, seed=rng.randint(0, 2**16), temperature=rng.choice([0.7, 1.0])) \
            if rng.random() < 0.4 else {}
        calls.append(dict(ids=ids * mask, mask=mask, lengths=lengths, sample=sample,
                          eos_token_id=rng.choice([[], [eos], [rng.randint(3, vocab - 1)]]),
                          max_new_tokens=rng.randint(1, MAX_SEQ_LEN - max(lengths))))
    return calls


def run(fast, c: dict) -> torch.Tensor:
    return fast.generate(c["ids"], c["mask"], max_new_tokens=c["max_new_tokens"], eos_token_id=c["eos_token_id"],
                         **c["sample"])


def greedy_rows(model, c: dict) -> list[list[int]]:
    """model.generate's greedy tokens (prompt + new) for each row of call `c`, alone."""
    rows = []
    for b, n in enumerate(c["lengths"]):
        prompt = c["ids"][b, -n:][None]
        with torch.no_grad():
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                 max_new_tokens=c["max_new_tokens"], eos_token_id=c["eos_token_id"] or None,
                                 pad_token_id=0)
        rows.append(_until_eos(out[0].tolist(), n, c))
    return rows


def _until_eos(row: list[int], prompt_len: int, c: dict) -> list[int]:
    """The prompt and the new tokens up to the first EOS (kept) or max_new_tokens."""
    new = row[prompt_len : prompt_len + c["max_new_tokens"]]
    cut = next((i + 1 for i, t in enumerate(new) if t in c["eos_token_id"]), len(new))
    return row[:prompt_len] + new[:cut]


def soak(calls: int = 2000, backend: str = "inductor", pool_size: int = 48, seed: int = 0, log=print) -> SoakResult:
    import specfx
    from specfx.exactness import greedy_mismatch
    from specfx.runtime import generate as runtime_generate
    from specfx.runtime.memory import rss_bytes
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    model.generation_config.eos_token_id = None      # EOS ids come with each call
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)                           # spread the logits (fewer near-ties)
    rng = random.Random(seed)
    specs = pool(pool_size, 96, 2, rng)
    compile_graph, compiled = runtime_generate.compile_graph, []

    def counted(gm, backend, **kwargs):
        compiled.append(gm)
        return compile_graph(gm, backend, **kwargs)

    runtime_generate.compile_graph = counted
    try:
        make = lambda: specfx.compile(model, draft="early-exit:1", num_speculative_tokens=K,  # noqa: E731
                                      max_seq_len=MAX_SEQ_LEN, batch_size=B, backend=backend)
        t0 = time.perf_counter()
        twin, fast = make(), make()
        references = [run(twin, c) if c["sample"] else greedy_rows(model, c) for c in specs]
        for c in specs:                               # warm-up: every call once (compiles what runs)
            run(fast, c)
        log(f"built, references and warm-up in {time.perf_counter() - t0:.0f} s; soaking {calls} calls ...")
        gc.collect()
        rss0, counters0, compiled0 = rss_bytes(), _compile_counts(), len(compiled)
        mismatches, rows, sampled = [], 0, 0
        t1 = time.perf_counter()
        for i in range(calls):
            if i and i % 500 == 0:
                log(f"  {i} calls, RSS {rss_bytes() / 2**20:.1f} MiB")
            j = rng.randrange(len(specs))
            c, ref, out = specs[j], references[j], run(fast, specs[j])
            if c["sample"]:
                sampled += 1
                if not torch.equal(out, ref):
                    mismatches.append(f"call {i} (pool {j}, sampled): differs from the fresh model's")
                continue
            width = c["ids"].shape[1]
            for b, n in enumerate(c["lengths"]):
                rows += 1
                ours = _until_eos(c["ids"][b, -n:].tolist() + out[b, width:].tolist(), n, c)
                why = greedy_mismatch(model, ours, ref[b], n)
                if why:
                    mismatches.append(f"call {i} (pool {j}) row {b}: {why}")
        seconds = time.perf_counter() - t1
        gc.collect()
        rss1, counters1 = rss_bytes(), _compile_counts()
    finally:
        runtime_generate.compile_graph = compile_graph
    return SoakResult(calls, backend, rss0 / 2**20, rss1 / 2**20, counters1[0] - counters0[0],
                      counters1[1] - counters0[1], len(compiled) - compiled0, rows, sampled, mismatches, seconds)


def _compile_counts() -> tuple[int, int]:
    """(Dynamo graphs compiled, Inductor graphs compiled) so far in this process."""
    from torch._dynamo.utils import counters

    inductor = sum(counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"))
    return counters["stats"]["unique_graphs"], inductor


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="calls after warm-up (default 2000)")
    parser.add_argument("--backend", default="inductor", help="inductor (default) or eager")
    parser.add_argument("--pool", type=int, default=48, help="distinct calls the soak draws from")
    parser.add_argument("--seed", type=int, default=0, help="model, pool and order seed")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    result = soak(args.calls, args.backend, args.pool, args.seed)
    print(result)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({**asdict(result), "rss_change": result.rss_change, "ok": result.ok}, f, indent=1)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
