"""Training of the embedded models: the LayerSkip target and the small draft model.

- `TARGET_CONFIG` / `DRAFT_CONFIG`: the Llama shapes of `pycoder` and `pycoder-draft`.
- `layerskip_loss(...)`: one forward with layer dropout rising exponentially with depth and
  early-exit losses through the shared final norm and lm_head, on a rotational curriculum
  (LayerSkip, Elhoushi et al. 2024).
- `distill_loss(...)`: the draft's cross-entropy, plus a KL term towards a teacher's logits.
- `train(cfg)`: the seeded loop with a rich progress bar and a JSON log of the loss curve.

Layer dropout is applied per batch (a dropped layer is skipped for the whole batch), which
saves its compute on CPU; LayerSkip drops per sample, which has the same expectation.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

TARGET_CONFIG = dict(
    hidden_size=320, intermediate_size=864, num_hidden_layers=12,
    num_attention_heads=5, num_key_value_heads=5, max_position_embeddings=2048,
    tie_word_embeddings=True,
)
DRAFT_CONFIG = dict(
    hidden_size=160, intermediate_size=448, num_hidden_layers=3,
    num_attention_heads=5, num_key_value_heads=5, max_position_embeddings=2048,
    tie_word_embeddings=True,
)


@dataclass
class TrainConfig:
    """What `specfx train` runs; defaults reproduce the shipped models."""

    kind: str = "layerskip"          # "layerskip" (target) or "draft"
    steps: int = 3000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    seed: int = 0
    p_max: float = 0.1               # layer dropout of the last layer (LayerSkip)
    exit_every: int = 4              # rotational curriculum: every R-th layer gets an exit loss
    exit_scale: float = 1.0          # weight of the early-exit losses relative to the last layer
    teacher: str | None = None       # draft only: path of a target to distill from
    distill_weight: float = 0.5
    bf16: bool = True                # CPU autocast: about 2x throughput with AVX512-BF16
    model_overrides: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.kind not in ("layerskip", "draft"):
            raise ValueError(f"kind must be 'layerskip' or 'draft', got {self.kind!r}")
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 2:
            raise ValueError("steps, batch_size must be >= 1 and seq_len >= 2")
        if not 0.0 <= self.p_max < 1.0:
            raise ValueError(f"p_max must be in [0, 1), got {self.p_max}")


def build_model(kind: str, tokenizer, **overrides) -> LlamaForCausalLM:
    """A fresh float32 Llama of the `kind`'s shape for this tokenizer."""
    shape = dict(TARGET_CONFIG if kind == "layerskip" else DRAFT_CONFIG, **overrides)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **shape,
    )
    return LlamaForCausalLM(config)


def layer_drop_probs(num_layers: int, p_max: float) -> list[float]:
    """LayerSkip's schedule: p_l = p_max * (exp(l ln2 / (L-1)) - 1), 0 at layer 0, p_max last."""
    if num_layers == 1:
        return [0.0]
    return [p_max * (math.exp(l * math.log(2) / (num_layers - 1)) - 1) for l in range(num_layers)]


def exit_layers(step: int, num_layers: int, every: int) -> list[int]:
    """Layers (0-based) whose early-exit loss is on at `step`; the last layer always is."""
    on = [l for l in range(num_layers - 1) if (l - step) % every == 0] if every > 0 else []
    return on + [num_layers - 1]


def hidden_states_by_layer(model, input_ids, *, keep, drop=None, generator=None):
    """Run the decoder stack and return {layer: residual output} for layers in `keep`."""
    m = model.model
    h = m.embed_tokens(input_ids)
    pos = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
    pe = m.rotary_emb(h, pos)
    out = {}
    for i, layer in enumerate(m.layers):
        dropped = drop is not None and torch.rand((), generator=generator).item() < drop[i]
        if not dropped:
            h = layer(h, attention_mask=None, position_ids=pos, position_embeddings=pe)
        if i in keep:
            out[i] = h
    return out


def exit_logits(model, h):
    """Logits of a residual-stream state through the shared final norm and lm_head."""
    return model.lm_head(model.model.norm(h))


def layerskip_loss(model, input_ids, step, cfg: TrainConfig, generator):
    """Weighted early-exit losses (curriculum) with layer dropout; returns (loss, last-layer CE)."""
    L = model.config.num_hidden_layers
    exits = exit_layers(step, L, cfg.exit_every)
    hs = hidden_states_by_layer(
        model, input_ids[:, :-1], keep=set(exits),
        drop=layer_drop_probs(L, cfg.p_max), generator=generator,
    )
    labels = input_ids[:, 1:].reshape(-1)
    total, weight_sum, last = 0.0, 0.0, None
    for l in exits:
        ce = F.cross_entropy(exit_logits(model, hs[l]).flatten(0, 1), labels)
        # Deeper exits weigh more (LayerSkip scales the loss by the layer's depth).
        w = 1.0 if l == L - 1 else cfg.exit_scale * (l + 1) / L
        total, weight_sum = total + w * ce, weight_sum + w
        if l == L - 1:
            last = ce
    return total / weight_sum, last


def distill_loss(model, input_ids, cfg: TrainConfig, teacher=None):
    """Cross-entropy on the data, plus KL(teacher || draft) when a teacher is given."""
    logits = model(input_ids[:, :-1]).logits.flatten(0, 1)
    ce = F.cross_entropy(logits, input_ids[:, 1:].reshape(-1))
    if teacher is None:
        return ce, ce
    with torch.no_grad():
        t_logits = teacher(input_ids[:, :-1]).logits.flatten(0, 1)
    kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(t_logits, -1),
                  log_target=True, reduction="batchmean")
    return (1 - cfg.distill_weight) * ce + cfg.distill_weight * kl, ce


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up then cosine decay to `min_lr_ratio * lr`."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def batches(stream: torch.Tensor, cfg: TrainConfig, generator):
    """Endless random windows [B, seq_len+1] of the token stream."""
    n = stream.numel() - cfg.seq_len - 1
    while True:
        starts = torch.randint(0, n, (cfg.batch_size,), generator=generator)
        yield torch.stack([stream[s : s + cfg.seq_len + 1] for s in starts.tolist()])


def train(model, stream: torch.Tensor, cfg: TrainConfig, *, log_path: Path | None = None,
          teacher=None, progress=True) -> list[dict]:
    """Train `model` in place for `cfg.steps`; returns (and writes) the loss curve."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )
    model.train()
    curve: list[dict] = []
    data = batches(stream, cfg, gen)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    bar = _progress(cfg.steps) if progress else None
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        x = next(data)
        # Autocast per step: its cast cache lives as long as the context, so a context around
        # the whole loop would keep using the bf16 copies of the initial weights.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
            if cfg.kind == "layerskip":
                loss, ce = layerskip_loss(model, x, step, cfg, gen)
            else:
                loss, ce = distill_loss(model, x, cfg, teacher)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        elapsed = time.perf_counter() - t0
        row = {"step": step + 1, "loss": round(loss.item(), 4), "ce": round(ce.item(), 4),
               "lr": round(opt.param_groups[0]["lr"], 6), "elapsed_s": round(elapsed, 1),
               "tokens_per_s": round(tokens_per_step * (step + 1) / elapsed, 1)}
        curve.append(row)
        if bar is not None:
            bar.update(row)
        if log_path is not None and ((step + 1) % 50 == 0 or step + 1 == cfg.steps):
            log_path.write_text(json.dumps({"config": asdict(cfg), "curve": curve}, indent=1))
    if bar is not None:
        bar.close()
    model.eval()
    return curve


class _progress:
    """rich progress bar showing loss, tokens/s and ETA."""

    def __init__(self, total: int):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        self._p = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.3f}"), TextColumn("{task.fields[tps]:.0f} tok/s"),
            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
        )
        self._task = self._p.add_task("train", total=total, loss=float("nan"), tps=0.0)
        self._p.start()

    def update(self, row: dict):
        self._p.update(self._task, advance=1, loss=row["loss"], tps=row["tokens_per_s"])

    def close(self):
        self._p.stop()
