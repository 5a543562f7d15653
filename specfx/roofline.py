"""How far a compiled step runs from the machine's weight-streaming limit.

A decode step on a CPU (or a small batch on a GPU) reads every weight once: its floor is the
time the machine needs to stream those bytes. `roofline(model, ...)` measures

- the **probe**: the machine's GB/s on the model's own weight bytes, the fastest of
  every linear of the model at one row, one after another, through (a) specfx's tiled kernel,
  (b) the skinny-matmul reduction, (c) BLAS, each compiled as the runtime compiles its graphs;
  and a flat buffer of the same size read (d) by a sum that Inductor generates, (e) as one
  matrix through the tiled kernel at one row, (f) on the CPU, by a plain sum written by hand
  (`stream_sum` in `kernels/tiled_linear.h`: each thread streams its share into eight
  accumulators). (f) is the ceiling: Inductor's sums and the tiled kernel stay below it;
- the bytes one **decode** step (one row) and one **verify** step (k+1 rows, and any other
  `verify_rows`: what a draft tree of that many nodes, plus the pending token, costs to verify)
  read: every weight matrix, the embedding rows and the live KV cache of a `context`-token
  sequence;
- each step's time (its graph alone, as `SpeculativeModel.profile` times it) and achieved GB/s,
  and that as a fraction of the probe;
- on the CPU, the machine's float32 **FMA peak** (`fma_peak` in `kernels/tiled_linear.h`: both
  threads multiply-adding in registers, nothing read from memory) and each step's GFLOP/s
  against it (two per weight per row): whether a step over many rows (a verify pass over a
  draft tree) is held by the bytes it reads, by its multiply-adds, or by neither (pycoder's
  8-row verify ran at 57% of the streaming probe and 25% of the FMA peak).

Probes and steps are timed together, round-robin (`matmul_choice.round_robin`, median of
`REPEATS` rounds): on a shared or virtual machine the speed drifts by a third between phases,
and figures timed one after another would compare the phases, not the steps.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
from torch import fx

from specfx.kernels import tiled_linear
from specfx.matmul_choice import round_robin
from specfx.runtime.compile import CPU_INDUCTOR

REPEATS = 15
FLAT_K = 1024          # the flat probe's matrix: rows of this many elements


@dataclass
class StepRoof:
    name: str
    rows: int
    weight_bytes: int
    kv_bytes: int
    ms: float
    flops: int = 0                           # two per weight per row (a multiply-add)

    @property
    def gbps(self) -> float:
        return (self.weight_bytes + self.kv_bytes) / self.ms / 1e6

    @property
    def gflops(self) -> float:
        return self.flops / self.ms / 1e6


@dataclass
class Roofline:
    device: str
    threads: int
    context: int
    probes: dict[str, float]                 # probe -> GB/s
    steps: list[StepRoof] = field(default_factory=list)
    fma_gflops: float | None = None          # the FMA peak (CPU only)

    @property
    def probe_gbps(self) -> float:
        return max(self.probes.values())

    def to_dict(self) -> dict:
        peak = self.fma_gflops
        return {"device": self.device, "threads": self.threads, "context": self.context, "probes_gbps": self.probes,
                "probe_gbps": self.probe_gbps, "fma_peak_gflops": peak,
                "steps": [{**asdict(s), "gbps": s.gbps, "fraction_of_probe": s.gbps / self.probe_gbps,
                           "gflops": s.gflops, "fraction_of_fma_peak": s.gflops / peak if peak else None}
                          for s in self.steps]}


def linear_weights(model) -> list[torch.Tensor]:
    """The 2-D weights a step multiplies by (the embedding is read one row per token)."""
    embed = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    out, seen = [], set()
    for name, p in model.named_parameters():
        if p.dim() == 2 and p is not embed and id(p) not in seen:
            seen.add(id(p))
            out.append(p.detach())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and head.weight is embed:                 # tied: the head reads it all
        out.append(head.weight.detach())
    return out


def probes(weights: list[torch.Tensor]) -> dict:
    """probe name -> a call that reads these weights' bytes (see the module docstring)."""
    from specfx.matmul_choice import chains
    from specfx.runtime.compile import compile_graph
    from specfx.runtime.memory import huge_pages

    names = {"tiled": "tiled kernel", "reduce": "skinny reduction", "blas": "BLAS"}
    out = {f"linears, {names[kernel]}": call for kernel, call in chains(weights, 1).items()}
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flat = torch.empty(nbytes // weights[0].element_size(), dtype=weights[0].dtype,
                       device=weights[0].device).normal_()
    huge_pages([flat])      # in 2 MB pages from the first read, as a compiled step's weights are
    gm = fx.symbolic_trace(lambda x: x.sum())
    with torch.no_grad(), torch._inductor.config.patch(CPU_INDUCTOR):
        total = torch._inductor.compile(gm, [flat])
    out["flat sum"] = lambda: total(flat)
    if "linears, tiled kernel" in out:           # one matrix of the same bytes: a plain stream of reads
        matrix = flat[: flat.numel() // FLAT_K * FLAT_K].view(-1, FLAT_K)
        row = torch.randn(1, FLAT_K, dtype=flat.dtype, device=flat.device)
        gm = fx.symbolic_trace(lambda x, w: torch.ops.specfx.tiled_linear(x, w, tiled_linear.VERSION))
        read = compile_graph(gm, "inductor")
        out["flat matrix, tiled kernel"] = lambda: read(row, matrix)
    if flat.device.type == "cpu" and flat.dtype == torch.float32:
        stream = tiled_linear.stream_sum()
        out["flat, streamed by hand"] = lambda: stream(flat)
    return out


def kv_bytes(model, context: int) -> int:
    """Bytes of the KV cache of `context` tokens (all layers, keys and values)."""
    from specfx.capture import kv_shape, text_config

    config = text_config(model)
    B, H, _, D = kv_shape(config, 1, context)
    return 2 * config.num_hidden_layers * context * H * D * next(model.parameters()).element_size()


def roofline(model, *, context: int = 200, k: int = 3, max_seq_len: int = 1024,
             verify_rows: tuple[int, ...] = ()) -> Roofline:
    """Probe, then time the decode and verify graphs of `model` at a `context`-token sequence
    (the verify graph at k+1 rows and at each of `verify_rows`)."""
    import specfx

    weights = linear_weights(model)
    wbytes = sum(w.numel() * w.element_size() for w in weights)
    emb = model.get_input_embeddings().weight
    device = next(model.parameters()).device
    prompt = torch.randint(3, min(emb.shape[0], 1000), (1, context), device=device)
    if any(r < 2 for r in verify_rows):
        raise ValueError(f"verify rows must be >= 2 (the pending token and a draft), got {verify_rows}")
    widths = [("decode", "none", 1), ("verify", "ngram:3", k + 1)]
    widths += [("verify", "ngram:3", r) for r in sorted(set(verify_rows) - {k + 1})]
    calls = probes(weights)
    probe_names = list(calls)
    fma_flops = None
    if device.type == "cpu" and tiled_linear.available()[0]:
        calls["fma peak"], fma_flops = tiled_linear.fma_peak()
    steps = []                                                        # (key in calls, name, rows)
    for i, (name, draft, rows) in enumerate(widths):
        fast = specfx.compile(model, draft=draft, num_speculative_tokens=max(1, rows - 1), max_seq_len=max_seq_len)
        if i < 2:
            fast.generate(prompt, max_new_tokens=2, eos_token_id=[])
        else:        # only the verify graph is timed: the cache's length matters, not its values
            fast.graphs.state.load_prompts([prompt[0]], 2, [])
        rt = fast.runtime
        rt.cover(steps=1)
        steps.append((f"{name} {rows}", name, rows))
        calls[steps[-1][0]] = rt.part_call(rt.verify_part)
    times = round_robin(calls, REPEATS)
    result = Roofline(str(device), torch.get_num_threads(), context,
                      {name: wbytes / times[name] / 1e9 for name in probe_names},
                      fma_gflops=fma_flops / times["fma peak"] / 1e9 if fma_flops else None)
    for key, name, rows in steps:
        row_bytes = rows * emb.shape[1] * emb.element_size()
        result.steps.append(StepRoof(name, rows, wbytes + row_bytes, kv_bytes(model, context), times[key] * 1e3,
                                     flops=2 * rows * sum(w.numel() for w in weights)))
    return result


def render(r: Roofline):
    from rich.table import Table

    t = Table(title=f"roofline on {r.device} ({r.threads} threads), context {r.context} tokens")
    peak = r.fma_gflops
    cols = ("", "rows", "weights MB", "live KV MB", "ms", "GB/s", "of probe") + (("GFLOP/s", "of FMA peak") if peak else ())
    for col in cols:
        t.add_column(col, justify="left" if not col else "right")
    for name, gbps in r.probes.items():
        t.add_row(f"probe: {name}", "1", "", "", "", f"{gbps:.1f}", "best" if gbps == r.probe_gbps else "",
                  *(("", "") if peak else ()))
    if peak:
        t.add_row("probe: FMA peak", "", "", "", "", "", "", f"{peak:.1f}", "best")
    for s in r.steps:
        t.add_row(f"{s.name} step", str(s.rows), f"{s.weight_bytes / 1e6:.1f}", f"{s.kv_bytes / 1e6:.2f}",
                  f"{s.ms:.3f}", f"{s.gbps:.1f}", f"{s.gbps / r.probe_gbps:.0%}",
                  *((f"{s.gflops:.1f}", f"{s.gflops / peak:.0%}") if peak else ()))
    return t


