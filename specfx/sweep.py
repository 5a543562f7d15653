"""Sweeps: the (exit layer, k) sweet spot of a LayerSkip model, and the best draft tree.

For every exit layer E it measures, on real prompts, how often each draft position is
accepted (one run at the largest k: `a_i(E)` = P(the first i drafts are accepted)). For every
(E, k) it times the draft graph and the verify graph, each compiled alone (`profile()`), and
predicts tokens per second with the expected-tokens form of Leviathan et al.'s speedup:

    tokens per step  T(E, k) = 1 + sum_{i<=k} a_i(E)
    step time        t(E, k) = calls(k) * draft(E) + verify(E, k)
    speedup vs none          = T(E, k) * decode / t(E, k)

where `decode` is one plain decoding step and calls(k) the draft passes of a step (k + 1 on the
model's own weights, k on a stored copy: `EarlyExit`). Acceptance is measured with the drafts
the timed graphs make (on the CPU, from the int8 copy). The prediction adds parts timed alone,
which misranks neighbouring pairs, so the `check` pairs it predicts best then run for real,
compiled with `backend`, over the prompts in rounds of shuffled order against plain decoding
(`measured_speedup`); the fastest of them is the sweet spot.

`sweep_tree` does the same over draft-tree shapes of one drafter (an MTP head by default): the
measured tokens per target call of each shape (greedy, on the prompts), its draft and verify
times, and the predicted tokens per second, against the chain of k drafts; the chain and the
`check` shapes predicted fastest then run for real, and the fastest of them is the best. Each
shape's `verify_bound_vs_chain` is the most it can gain over the chain on this machine, its
tokens per call over its verify time against the chain's: where drafting cost nothing. A shape
whose bound sits near 1 loses its extra tokens to the verify pass over more rows alone.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specfx.bench import cache_length, interleave, profile_models

KS = (2, 3, 4, 6)


@dataclass
class SweepResult:
    rows: list[dict] = field(default_factory=list)
    decode_ms: float = 0.0
    best: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"settings": self.settings, "decode_ms": self.decode_ms, "best": self.best, "rows": self.rows}


def sweep_exit(model, tokenizer, prompts: list[str], *, max_new_tokens: int = 64, num_prompts: int = 8,
               ks=KS, layers=None, backend: str = "inductor", check: int = 5, rounds: int = 3,
               log=print) -> SweepResult:
    """The (E, k) sweep over exit layers `layers` (default: every layer below the last); the
    `check` best predicted pairs are then run for real, `rounds` rounds each (0: trust the
    prediction)."""
    encoded = [tokenizer(p, return_tensors="pt").input_ids for p in prompts[:num_prompts]]
    max_seq_len = cache_length(encoded, max_new_tokens)
    L = model.config.num_hidden_layers
    layers = list(range(1, L)) if layers is None else list(layers)
    if not layers or any(not 1 <= E < L for E in layers):
        raise ValueError(f"exit layers must be in 1..{L - 1}, got {layers}")
    result = SweepResult(settings=dict(prompts=len(encoded), max_new_tokens=max_new_tokens, ks=list(ks),
                                       exit_layers=layers, backend=backend, max_seq_len=max_seq_len,
                                       checked=check, rounds=rounds))
    base = _profiled(model, "none", 1, encoded[0], max_seq_len, backend)
    result.decode_ms = base.profile()[1] * 1e3
    log(f"[sweep] plain decode step: {result.decode_ms:.2f} ms")
    for E in layers:
        acc = _acceptance(model, E, max(ks), encoded, max_new_tokens, max_seq_len, backend)
        for k in ks:
            draft_s, verify_s = _profiled(model, f"early-exit:{E}", k, encoded[0], max_seq_len, backend).profile()
            tokens = 1 + sum(acc[:k])
            step_ms = (draft_s + verify_s) * 1e3
            row = dict(exit_layer=E, k=k, tokens_per_step=round(tokens, 3),
                       acceptance_by_position=[round(a, 3) for a in acc[:k]],
                       draft_ms=round(draft_s * 1e3, 3), verify_ms=round(verify_s * 1e3, 3),
                       step_ms=round(step_ms, 3),
                       predicted_speedup=round(tokens * result.decode_ms / step_ms, 3))
            result.rows.append(row)
            log(f"[sweep] E={E} k={k}: {tokens:.2f} tokens/step, step {step_ms:.2f} ms, "
                f"predicted {row['predicted_speedup']:.2f}x vs plain decoding")
    result.best = max(result.rows, key=lambda r: r["predicted_speedup"])
    top = sorted(result.rows, key=lambda r: -r["predicted_speedup"])[:check]
    if top:
        speedups = _run_side_by_side(model, [(f"early-exit:{r['exit_layer']}", r["k"]) for r in top], encoded,
                                     max_new_tokens, max_seq_len, backend, rounds)
        for r, x in zip(top, speedups, strict=True):
            r["measured_speedup"] = round(x, 3)
            log(f"[sweep] E={r['exit_layer']} k={r['k']}: measured {x:.2f}x vs plain decoding")
        result.best = max(top, key=lambda r: r["measured_speedup"])
    return result


def _run_side_by_side(model, drafters: list[tuple[str, int | None]], encoded, max_new_tokens: int,
                      max_seq_len: int, backend: str, rounds: int) -> list[float]:
    """Each (draft spec, k) of `drafters` against plain decoding: the median over `rounds`
    rounds of plain decoding's seconds over the prompts divided by the drafter's. Every method
    makes the same greedy tokens, so that is the ratio of their tokens per second. In a round
    each prompt runs every method, in a new seeded order, so that the machine's drift reaches
    each alike and none always follows the same other one (one method's whole pass after
    another's, pycoder's MTP chain measured 1.60-2.00x plain decoding from round to round)."""
    import specfx

    fast = []
    for draft, k in [("none", None), *drafters]:
        fast.append(specfx.compile(model, draft=draft, num_speculative_tokens=k, max_seq_len=max_seq_len,
                                   backend=backend))
        fast[-1].generate(encoded[0], max_new_tokens=max_new_tokens)          # compile and warm up
    seconds = [[0.0] * rounds for _ in fast]
    for call, (p, i) in enumerate(interleave(len(encoded), len(fast), rounds)):
        t = time.perf_counter()
        fast[i].generate(encoded[p], max_new_tokens=max_new_tokens)
        seconds[i][call // (len(encoded) * len(fast))] += time.perf_counter() - t
    base, *times = [statistics.median(s) for s in seconds]
    return [base / t for t in times]


TREES = ((2, 1, 1), (3, 2, 1), (2, 2, 2, 1), (2, 2, 2, 2), (4, 2, 2, 1))


def saved_tree(model, draft: str) -> tuple[int, ...] | None:
    """The tree `draft` takes by default on `model` where it is an MTP head: the one a sweep saved
    (`config.specfx_mtp_tree`, as `pipeline.resolve_drafter` reads it), or None."""
    import dataclasses

    from specfx.drafters import MTPHead, parse_draft
    from specfx.pipeline import resolve_drafter

    config = parse_draft(draft)
    return resolve_drafter(model, dataclasses.replace(config, tree=None)).tree if isinstance(config, MTPHead) else None


def tree_spec(draft: str, tree: tuple[int, ...]) -> str:
    """`draft` with a tree: "mtp" -> "mtp:tree=4x2x2x1" (its other options kept, in their place:
    "mtp:pycoder-mtp:weights=bfloat16" -> "mtp:pycoder-mtp:tree=4x2x2x1:weights=bfloat16")."""
    import dataclasses

    from specfx.drafters import parse_draft

    return str(dataclasses.replace(parse_draft(draft), tree=tree))


def sweep_tree(model, tokenizer, prompts: list[str], *, draft: str = "mtp", k: int = 3, trees=TREES,
               max_new_tokens: int = 64, num_prompts: int = 8, backend: str = "inductor", check: int = 3,
               rounds: int = 5, log=print) -> SweepResult:
    """Each tree shape of `draft`, after its chain of k and with the model's saved default tree
    (`saved_tree`) where `trees` leave it out: tokens per target call, draft and verify ms (every
    shape's graphs and the decode graph timed together in shuffled rounds), and predicted
    tokens per second relative to plain decoding and to the chain; then the chain, the `check`
    trees predicted fastest and the saved tree run for real, `rounds` rounds each against
    plain decoding (`measured_speedup`), and the fastest of them is the best (0: trust the
    prediction). The parts timed alone miss what the fused step adds (a drafter's weights
    read cold after the verify pass has streamed the model's), which can reorder close shapes."""
    import specfx

    encoded = [tokenizer(p, return_tensors="pt").input_ids for p in prompts[:num_prompts]]
    max_seq_len = cache_length(encoded, max_new_tokens)
    # The saved default tree is swept too (and run for real below), so that a sweep saving its
    # best replaces it only with a shape measured faster.
    saved, trees = saved_tree(model, draft), tuple(tuple(t) for t in trees)
    if saved and saved not in (*trees, (1,) * k):
        trees += (saved,)
    result = SweepResult(settings=dict(prompts=len(encoded), max_new_tokens=max_new_tokens, draft=draft, k=k,
                                       trees=[list(t) for t in trees], backend=backend, max_seq_len=max_seq_len,
                                       checked=check, rounds=rounds))
    plain = _profiled(model, "none", 1, encoded[0], max_seq_len, backend)
    specs, shapes = [], []
    for tree in ((1,) * k, *trees):           # the chain first, spelled as a tree (a saved default tree aside)
        spec = tree_spec(draft, tree)
        fast = specfx.compile(model, draft=spec, max_seq_len=max_seq_len, backend="eager")
        calls = accepted = 0
        for ids in encoded:
            fast.generate(ids, max_new_tokens=max_new_tokens)
            calls += fast.last_stats.target_calls
            accepted += fast.last_stats.mean_accepted * fast.last_stats.target_calls
        shapes.append((tree, fast.graphs.tree.size, accepted / max(calls, 1),
                       _profiled(model, spec, None, encoded[0], max_seq_len, backend)))
        specs.append(spec)
    # Every shape's parts and the decode graph timed together, so that the machine's drift
    # reaches each alike (timed one shape after another, the same 8-row verify graph of four
    # shapes printed 1.74 to 1.94 ms in one sweep).
    (_, decode_s), *parts = profile_models([plain, *(profiled for *_, profiled in shapes)])
    result.decode_ms = decode_s * 1e3
    log(f"[sweep] plain decode step: {result.decode_ms:.2f} ms")
    for spec, (tree, nodes, tokens, _), (draft_s, verify_s) in zip(specs, shapes, parts, strict=True):
        step_ms = (draft_s + verify_s) * 1e3
        row = dict(tree=None if tuple(tree) == (1,) * k else list(tree), nodes=nodes,
                   tokens_per_call=round(tokens, 3),
                   draft_ms=round(draft_s * 1e3, 3), verify_ms=round(verify_s * 1e3, 3), step_ms=round(step_ms, 3),
                   predicted_tokens_per_s=round(tokens / step_ms * 1e3, 1),
                   predicted_speedup=round(tokens * result.decode_ms / step_ms, 3))
        chain = result.rows[0] if result.rows else row
        row["vs_chain"] = round(row["predicted_speedup"] / chain["predicted_speedup"], 3)
        # The most a shape can gain over the chain here: its tokens per call over its verify
        # pass alone against the chain's, as if drafting (head passes, refill) cost nothing.
        row["verify_bound_vs_chain"] = round(tokens / verify_s / (chain["tokens_per_call"] / chain["verify_ms"] * 1e3), 3)
        result.rows.append(row)
        log(f"[sweep] {spec}: {tokens:.2f} tokens/call, step {step_ms:.2f} ms, predicted "
            f"{row['predicted_tokens_per_s']:.0f} tok/s, {row['vs_chain']:.2f}x the chain")
    result.best = max(result.rows, key=lambda r: r["predicted_speedup"])
    top = sorted(range(1, len(result.rows)), key=lambda i: -result.rows[i]["predicted_speedup"])[:check]
    if top and saved and saved in trees and trees.index(saved) + 1 not in top:
        top.append(trees.index(saved) + 1)
    if top:
        checked = [0, *top]                   # the chain, the reference of `measured_vs_chain`
        speedups = _run_side_by_side(model, [(specs[i], None) for i in checked], encoded, max_new_tokens,
                                     max_seq_len, backend, rounds)
        for i, x in zip(checked, speedups, strict=True):
            row = result.rows[i]
            row["measured_speedup"] = round(x, 3)
            row["measured_vs_chain"] = round(x / speedups[0], 3)
            log(f"[sweep] {specs[i]}: measured {x:.2f}x plain decoding, {row['measured_vs_chain']:.2f}x the chain")
        result.best = max((result.rows[i] for i in checked), key=lambda r: r["measured_speedup"])
    return result


def render_tree_sweep(result: SweepResult):
    from rich.table import Table

    t = Table(title=f"tree sweep of {result.settings['draft']} (plain decode step {result.decode_ms:.2f} ms; "
                    f"{result.settings['prompts']} prompts x {result.settings['max_new_tokens']} tokens)")
    for col in ("tree", "nodes", "tokens/call", "draft ms", "verify ms", "step ms", "predicted tok/s", "vs chain",
                "bound vs chain", "measured vs none", "measured vs chain"):
        t.add_column(col, justify="right")
    for r in result.rows:
        measured = "measured_speedup" in r
        t.add_row(_shape_name(r), str(r["nodes"]), f"{r['tokens_per_call']:.2f}", f"{r['draft_ms']:.2f}",
                  f"{r['verify_ms']:.2f}", f"{r['step_ms']:.2f}", f"{r['predicted_tokens_per_s']:.0f}",
                  f"{r['vs_chain']:.2f}x", f"{r['verify_bound_vs_chain']:.2f}x",
                  f"{r['measured_speedup']:.2f}x" if measured else "-",
                  f"{r['measured_vs_chain']:.2f}x" if measured else "-",
                  style="bold green" if r is result.best else None)
    t.caption = ("best: " + _shape_name(result.best) + (" (measured)" if "measured_speedup" in result.best else "")
                 + "; bound vs chain: tokens per call over the verify pass alone, as if drafting were free")
    return t


def _shape_name(row: dict) -> str:
    """A sweep row's shape: "chain of N" for a chain (the drafter's own, or a deeper one spelled
    1x1x...), else the tree's branching ("2x2x2x1")."""
    from specfx.drafters import tree_name

    return f"chain of {row['nodes']}" if not row["tree"] or set(row["tree"]) == {1} else tree_name(row["tree"])


def save_tree_default(checkpoint: str | Path, best: dict) -> None:
    """Record the best tree as the model's default MTP tree in config.json (`specfx_mtp_tree`,
    read by `specfx.MTPHead()`; a deeper chain as its branching, 1x1x...); the drafter's own chain
    winning removes it."""
    path = Path(checkpoint) / "config.json"
    cfg = json.loads(path.read_text())
    cfg.pop("specfx_mtp_tree", None)
    if best["tree"]:
        cfg["specfx_mtp_tree"] = best["tree"]
    path.write_text(json.dumps(cfg, indent=2) + "\n")


def _profiled(model, draft, k, prompt, max_seq_len, backend):
    """A model ready for `profile()`: built and run eagerly (the fused step is not compiled),
    with `backend` used for the draft and verify graphs that `profile()` compiles and times.
    Its graphs get the matmul rewrite `backend` gets (the build decides it, not the compile)."""
    import specfx
    from specfx.api import skinny_default

    fast = specfx.compile(model, draft=draft, num_speculative_tokens=k, max_seq_len=max_seq_len,
                          backend="eager", skinny_matmul=skinny_default(model, backend))
    fast.generate(prompt, max_new_tokens=4)
    fast.runtime.backend = backend
    return fast


def _acceptance(model, E, k, encoded, max_new_tokens, max_seq_len, backend) -> list[float]:
    """P(first i drafts accepted), i = 1..k, over the prompts (eager: same tokens, no compile;
    the drafts `backend`'s build makes, as `_profiled`'s)."""
    import specfx
    from specfx.api import skinny_default

    fast = specfx.compile(model, draft=f"early-exit:{E}", num_speculative_tokens=k, max_seq_len=max_seq_len,
                          backend="eager", skinny_matmul=skinny_default(model, backend))
    hist = torch.zeros(k + 1, dtype=torch.long)
    for ids in encoded:
        fast.generate(ids, max_new_tokens=max_new_tokens)
        hist += fast.graphs.state.accept_hist.cpu()
    calls = hist.sum().item()
    return [hist[i:].sum().item() / calls for i in range(1, k + 1)]


def render_sweep(result: SweepResult):
    from rich.table import Table

    t = Table(title=f"exit-layer sweep (plain decode step {result.decode_ms:.2f} ms; "
                    f"{result.settings['prompts']} prompts x {result.settings['max_new_tokens']} tokens)")
    for col in ("E", "k", "tokens/step", "draft ms", "verify ms", "step ms", "predicted speedup", "measured"):
        t.add_column(col, justify="right")
    for r in result.rows:
        style = "bold green" if r is result.best else None
        measured = f"{r['measured_speedup']:.2f}x" if "measured_speedup" in r else ""
        t.add_row(str(r["exit_layer"]), str(r["k"]), f"{r['tokens_per_step']:.2f}", f"{r['draft_ms']:.2f}",
                  f"{r['verify_ms']:.2f}", f"{r['step_ms']:.2f}", f"{r['predicted_speedup']:.2f}x", measured,
                  style=style)
    how = "measured" if "measured_speedup" in result.best else "predicted"
    t.caption = f"sweet spot ({how}): exit layer {result.best['exit_layer']}, k={result.best['k']}"
    return t


def save_default(checkpoint: str | Path, best: dict) -> None:
    """Record the sweet spot in config.json: the exit layer `specfx.EarlyExit()` takes, and
    early exit's k (the other drafters keep the model's `specfx_num_speculative_tokens`)."""
    path = Path(checkpoint) / "config.json"
    cfg = json.loads(path.read_text())
    cfg["specfx_exit_layer"] = best["exit_layer"]
    cfg["specfx_exit_num_speculative_tokens"] = best["k"]
    path.write_text(json.dumps(cfg, indent=2) + "\n")
