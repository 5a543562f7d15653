"""Build the embedded models end to end: tokenizer, training, held-out evaluation, model card.

`build(kind, out, ...)` is what `specfx train layerskip|draft` runs. It is seeded, so the same
interpreter (same standard library) and the same arguments give the same model.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from specfx.zoo import corpus
from specfx.zoo.tokenizer import train_tokenizer
from specfx.zoo.train import TrainConfig, build_model, exit_logits, hidden_states_by_layer, train

VOCAB_SIZE = 4096
EVAL_WINDOW = 512


def load_or_train_tokenizer(path: str | Path | None, train_files: list[str]):
    """The tokenizer at `path`, or a new one trained on the training files."""
    if path is not None:
        return AutoTokenizer.from_pretrained(str(path))
    return train_tokenizer((corpus.read(f) for f in train_files), VOCAB_SIZE)


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, *, max_tokens: int = 65536, teacher=None) -> dict:
    """Held-out loss and top-1 accuracy at every exit layer (and agreement with `teacher`)."""
    model.eval()
    L = model.config.num_hidden_layers
    n = min(stream.numel() - 1, max_tokens) // EVAL_WINDOW * EVAL_WINDOW
    x = stream[:n].view(-1, EVAL_WINDOW)
    y = stream[1 : n + 1].view(-1, EVAL_WINDOW)
    correct = torch.zeros(L)
    loss = torch.zeros(L)
    agree = 0
    for i in range(x.shape[0]):
        hs = hidden_states_by_layer(model, x[i : i + 1], keep=set(range(L)))
        for l in range(L):
            logits = exit_logits(model, hs[l])[0]
            loss[l] += F.cross_entropy(logits, y[i], reduction="sum")
            correct[l] += (logits.argmax(-1) == y[i]).sum()
        if teacher is not None:  # `logits` is the last layer's here
            agree += (teacher(x[i : i + 1]).logits[0].argmax(-1) == logits.argmax(-1)).sum().item()
    result = {
        "tokens": n,
        "loss": round(loss[-1].item() / n, 4),
        "top1": round(correct[-1].item() / n, 4),
        "loss_by_exit": [round(v / n, 4) for v in loss.tolist()],
        "top1_by_exit": [round(v / n, 4) for v in correct.tolist()],
    }
    if teacher is not None:
        result["greedy_agreement_with_target"] = round(agree / n, 4)
    return result


def save(model, tokenizer, out: Path, info: dict) -> None:
    """Write an HF checkpoint stored as fp16 that loads as float32, plus tokenizer and info."""
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(out)
    model.to(torch.float32)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["dtype"] = "float32"  # stored as fp16 to halve the repo size; computed in float32
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    tokenizer.save_pretrained(out)
    (out / "specfx_train.json").write_text(json.dumps(info, indent=1) + "\n")


def build(kind: str, out: str | Path, *, tokenizer: str | Path | None = None,
          teacher: str | Path | None = None, threads: int | None = None,
          progress: bool = True, **train_kwargs) -> dict:
    """Train one embedded model (`kind` = layerskip | draft) into `out`; returns its info."""
    if threads:
        torch.set_num_threads(threads)
    out = Path(out)
    train_files, heldout_files = corpus.split(corpus.list_files())
    tok = load_or_train_tokenizer(tokenizer, train_files)
    stream = corpus.token_stream(tok, train_files)
    heldout = corpus.token_stream(tok, heldout_files)
    cfg = TrainConfig(kind=kind, teacher=str(teacher) if teacher else None, **train_kwargs)
    model = build_model(kind, tok, **cfg.model_overrides)
    teacher_model = _load_fp32(teacher) if teacher else None
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(out)  # early, so a draft can be trained on it while this one runs
    t0 = time.perf_counter()
    curve = train(model, stream, cfg, log_path=out / "train_log.json",
                  teacher=teacher_model, progress=progress)
    train_s = time.perf_counter() - t0
    if kind == "draft" and teacher_model is None and tokenizer is not None:
        try:
            teacher_model = _load_fp32(tokenizer)
        except (OSError, ValueError):
            teacher_model = None
    metrics = evaluate(model, heldout, teacher=teacher_model)
    info = {
        "kind": kind,
        "config": asdict(cfg),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens": stream.numel(),
        "train_seconds": round(train_s, 1),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "heldout": metrics,
        "final_train_loss": curve[-1]["loss"],
    }
    save(model, tok, out, info)
    (out / "train_log.json").write_text(json.dumps({"config": asdict(cfg), "curve": curve}, indent=1))
    finish_checkpoint(out)
    return info


def reevaluate(out: str | Path, teacher: str | Path | None = None) -> dict:
    """Recompute a checkpoint's held-out figures (and agreement with `teacher`); rewrite its card."""
    out = Path(out)
    model = _load_fp32(out)
    tok = AutoTokenizer.from_pretrained(str(out))
    _, heldout_files = corpus.split(corpus.list_files())
    info = json.loads((out / "specfx_train.json").read_text())
    info["heldout"] = evaluate(model, corpus.token_stream(tok, heldout_files),
                               teacher=_load_fp32(teacher) if teacher else None)
    (out / "specfx_train.json").write_text(json.dumps(info, indent=1) + "\n")
    finish_checkpoint(out)
    return info


def finish_checkpoint(out: str | Path) -> None:
    """Write the corpus manifest and the model card next to a trained checkpoint."""
    out = Path(out)
    (out / "corpus_manifest.json").write_text(json.dumps(corpus.manifest(), indent=0) + "\n")
    (out / "README.md").write_text(model_card(out.name, json.loads((out / "specfx_train.json").read_text())))


def model_card(name: str, info: dict) -> str:
    """A model card from the training record: shape, data, held-out loss and accuracy."""
    ho = info["heldout"]
    cfg = info["config"]
    rows = "\n".join(f"| {i + 1} | {loss:.3f} | {acc:.3f} |" for i, (loss, acc) in
                     enumerate(zip(ho["loss_by_exit"], ho["top1_by_exit"])))
    agree = ho.get("greedy_agreement_with_target")
    agree_line = f"- greedy token agrees with `pycoder`'s greedy token: {agree:.3f}\n" if agree is not None else ""
    recipe = (f"LayerSkip: layer dropout rising exponentially to p_max={cfg['p_max']}, early-exit loss on "
              f"every {cfg['exit_every']}th layer in rotation (plus the last), shared final norm and lm_head"
              if info["kind"] == "layerskip" else
              "next-token cross-entropy" + (f", distilled from {cfg['teacher']}" if cfg.get("teacher") else ""))
    return f"""# {name}

A `LlamaForCausalLM` trained by `specfx train {info['kind']}` on the Python standard library of
Python {info['python']} (whole files held out for evaluation; `corpus_manifest.json` lists them).
Weights are stored as float16 and load as float32.

- parameters: {info['parameters']:,}
- training: {cfg['steps']} steps x {cfg['batch_size']} x {cfg['seq_len']} tokens, seed {cfg['seed']},
  {info['train_seconds'] / 60:.0f} min on {info['threads']} CPU threads (torch {info['torch']})
- recipe: {recipe}

## Held-out evaluation ({ho['tokens']:,} tokens of held-out files)

- loss {ho['loss']:.3f}, top-1 next-token accuracy {ho['top1']:.3f}
{agree_line}
| exit after layer | loss | top-1 |
|---:|---:|---:|
{rows}

Measured by `specfx train` at the end of training (`specfx_train.json` holds the same figures).
"""


def _load_fp32(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def build_mtp(target: str | Path, out: str | Path, *, threads: int | None = None, progress: bool = True,
              num_prompts: int = 16, k: int = 3, **train_kwargs) -> dict:
    """Train an MTP head for the zoo model or checkpoint `target` into `out`; returns its info.

    The head trains on windows of the target's training corpus and is evaluated on held-out
    files (agreement with the target's greedy token) and on the evaluation prompts: greedy
    generation with the head as drafter, acceptance per draft position at k.
    """
    from specfx import zoo
    from specfx.mtp import save_head
    from specfx.mtp_train import MTPTrainConfig, evaluate_head, sample_windows, train_head

    if threads:
        torch.set_num_threads(threads)
    out = Path(out)
    target_dir = zoo.resolve(str(target))
    model = _load_fp32(target_dir)
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    train_files, heldout_files = corpus.split(corpus.list_files())
    cfg = MTPTrainConfig(**train_kwargs)
    stream = corpus.token_stream(tok, train_files)
    t0 = time.perf_counter()
    windows = sample_windows(stream, cfg.windows, cfg.seq_len, cfg.seed)
    if cfg.generated:
        prefixes = sample_windows(stream, cfg.generated, cfg.seq_len // 4, cfg.seed + 2)
        windows = torch.cat([windows, _generate_windows(model, prefixes, cfg.seq_len, progress)])
    out.mkdir(parents=True, exist_ok=True)
    head, curve = train_head(model, windows, cfg, log_path=out / "train_log.json", progress=progress)
    train_s = time.perf_counter() - t0
    heldout = sample_windows(corpus.token_stream(tok, heldout_files), 64, cfg.seq_len, cfg.seed + 1)
    info = {
        "kind": "mtp",
        "target": str(target),
        "config": asdict(cfg),
        "parameters": sum(p.numel() for p in head.parameters()),
        "train_seconds": round(train_s, 1),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "heldout": evaluate_head(head, model, heldout),
        "final_train_loss": curve[-1]["loss"],
    }
    save_head(head, out, model, info)
    info["acceptance"] = measure_acceptance(model, out, zoo.prompts()[:num_prompts], tok, k=k)
    save_head(head, out, model, info)
    (out / "train_log.json").write_text(json.dumps({"config": asdict(cfg), "curve": curve}, indent=1))
    (out / "README.md").write_text(mtp_card(out.name, info))
    return info


def _generate_windows(model, prefixes: torch.Tensor, seq_len: int, progress: bool) -> torch.Tensor:
    """`greedy_windows`, with a progress bar when `progress`."""
    from rich.progress import Progress

    from specfx.mtp_train import greedy_windows

    if not progress:
        return greedy_windows(model, prefixes, seq_len)
    with Progress() as bar:
        task = bar.add_task("greedy windows", total=prefixes.shape[0])
        return greedy_windows(model, prefixes, seq_len, progress=lambda n: bar.update(task, completed=n))


def measure_acceptance(model, head_dir: Path, prompts: list[str], tok, *, k: int,
                       max_new_tokens: int = 128) -> dict:
    """Greedy generation with the head as drafter (eager graphs): acceptance over the prompts."""
    import specfx
    from specfx.runtime.stats import acceptance_stats

    fast = specfx.compile(model, draft=specfx.MTPHead(str(head_dir)), num_speculative_tokens=k,
                          backend="eager", max_seq_len=1024)
    hist = [0] * (k + 1)
    for text in prompts:
        fast.generate(tok(text, return_tensors="pt").input_ids, max_new_tokens=max_new_tokens)
        hist = [a + b for a, b in zip(hist, fast.runtime.state.accept_hist.tolist())]
    calls, mean, by_pos = acceptance_stats(hist)
    return {"k": k, "prompts": len(prompts), "max_new_tokens": max_new_tokens, "target_calls": calls,
            "mean_accepted": round(mean, 3), "acceptance_by_position": [round(a, 3) for a in by_pos]}


def mtp_card(name: str, info: dict) -> str:
    """A model card for an MTP head: what it drafts for, how it was trained, what it accepts."""
    cfg, ho, acc = info["config"], info["heldout"], info["acceptance"]
    by_pos = " | ".join(f"{a:.3f}" for a in acc["acceptance_by_position"])
    arch, target = cfg.get("arch", "specfx"), info["target"]
    vocab = (f"the {cfg['draft_vocab']} tokens most frequent in its training windows" if cfg.get("draft_vocab")
             else "the target's whole vocabulary")
    shape = {
        "specfx": f"""`W·[RMSNorm(emb(t_(i+1))); RMSNorm(h_i)]` -> one `{target}` decoder layer -> RMSNorm -> the
target's own lm_head (the embedding and lm_head are the target's and are not stored here).""",
        "eagle": """EAGLE-1: `fc[emb(t_(i+1)); norm(h_i)]` -> one Llama decoder layer (no input norm) -> the target's
own lm_head (the embedding, final norm and lm_head are the target's and are not stored here).""",
        "eagle3": f"""EAGLE-3: h_i = `fc` over the outputs of three target layers -> a midlayer attending over
`[RMSNorm(emb(t_(i+1))); RMSNorm(h_i)]` -> RMSNorm -> its own lm_head over a draft vocabulary
({vocab}, mapped to the target's ids by `d2t`).""",
        "deepseek-mtp": f"""DeepSeek-V3 MTP: `eh_proj[RMSNorm(emb(t_(i+1))); RMSNorm(norm(h_i))]` -> one `{target}`
decoder layer -> RMSNorm -> the target's own lm_head (the embedding and lm_head are the target's).""",
    }[arch]
    arch_flag = ("" if arch == "specfx" else f" --arch {arch}") + f" --steps {cfg['steps']} --windows {cfg['windows']}"
    if cfg.get("init"):
        arch_flag += f" --init {cfg['init']} --lr {cfg['lr']}"
    if cfg.get("generated"):
        arch_flag += f" --generated {cfg['generated']}"
    if cfg.get("chain_weight"):
        arch_flag += f" --chain-weight {cfg['chain_weight']}"
    generated = (f" ({cfg['generated']} of them the target's own greedy continuations of {cfg['seq_len'] // 4}-token"
                 f"\n  corpus prefixes, generated within the time below)" if cfg.get("generated") else "")
    chain = (f" + {cfg['chain_weight']} x the cross-entropy of a second draft reading the head's own output"
             if cfg.get("chain_weight") else "")
    return f"""# {name}

An MTP/EAGLE-style draft head for `{target}`, trained by `specfx train mtp --target {target}{arch_flag}`:
{shape}
`config.json` records the target it fits (sizes and a signature of its weights).

- parameters: {info['parameters']:,} (float32 safetensors)
- training: {cfg['steps']} steps x {cfg['batch_size']} x {cfg['seq_len']} tokens over {cfg['windows'] + cfg.get('generated', 0)} precomputed
  windows of the target's hidden states{generated}, seed {cfg['seed']}, {info['train_seconds'] / 60:.0f} min on
  {info['threads']} CPU threads (torch {info['torch']}); loss: cross-entropy against the target's
  next-token distribution + {cfg['regression_weight']} x feature regression{chain}

## Measured

- held-out files ({ho['tokens']:,} positions): greedy agreement with the target at draft 1 {ho['top1_agreement']:.3f}
- greedy generation on {acc['prompts']} evaluation prompts x {acc['max_new_tokens']} tokens at k = {acc['k']}:
  {acc['mean_accepted']:.2f} tokens per target call

| draft position | {' | '.join(str(i + 1) for i in range(acc['k']))} |
|---|{'---:|' * acc['k']}
| acceptance | {by_pos} |

Measured by `specfx train mtp` at the end of training (`config.json` holds the same figures).
"""
