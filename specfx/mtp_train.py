"""Training an MTP head for a target: precompute the target's hidden states, then fit the head.

The target is frozen; only the head's parameters train. For each window of tokens the target's
final hidden states h (the residual stream after its last layer) are computed once and kept
in bfloat16 (`precompute`). The head at position i reads (t_{i+1}, h_i) and is trained
(`head_loss`) with

- cross-entropy against the target's own next-token distribution at i+1, softmax(lm_head(norm(h_{i+1})))
  (the target's predictions, not the data: acceptance is agreement with the target);
- plus `regression_weight` times a smooth-L1 between the RMS-normalised head output g_i and
  h_{i+1} (EAGLE's feature regression), since a second draft feeds g_i where h_{i+1} would be.

`train_head(target, windows, cfg)` returns the head and the loss curve; `evaluate_head` gives
held-out agreement with the target's greedy choice at the first draft position.
"""

from __future__ import annotations

import copy
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specfx.capture import position_mask
from specfx.mtp import DraftHead, final_hidden, new_head, target_parts


@dataclass
class MTPTrainConfig:
    """What `specfx train mtp` runs; the defaults reproduce the shipped `pycoder-mtp`."""

    steps: int = 1200
    batch_size: int = 8
    seq_len: int = 256
    windows: int = 2048              # windows of target hidden states precomputed and reused
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.0
    regression_weight: float = 0.5
    seed: int = 0
    bf16: bool = True                # CPU autocast for the head's forward/backward

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 3 or self.windows < 1:
            raise ValueError("steps, batch_size, windows must be >= 1 and seq_len >= 3")


def sample_windows(stream: torch.Tensor, count: int, seq_len: int, seed: int) -> torch.Tensor:
    """`count` random windows [count, seq_len] of a token stream (seeded)."""
    n = stream.numel() - seq_len
    if n < 1:
        raise ValueError(f"token stream of {stream.numel()} tokens is shorter than one window of {seq_len}")
    starts = torch.randint(0, n, (count,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


@torch.no_grad()
def precompute(target, windows: torch.Tensor, *, batch_size: int = 8, progress=None) -> torch.Tensor:
    """The target's final hidden states [N, T, H] for token windows [N, T], in bfloat16."""
    target.eval()
    device = next(target.parameters()).device
    out = []
    for i in range(0, windows.shape[0], batch_size):
        out.append(final_hidden(target, windows[i : i + batch_size].to(device)).to(torch.bfloat16))
        if progress is not None:
            progress(min(i + batch_size, windows.shape[0]))
    return torch.cat(out)


def head_loss(head: DraftHead, parts, ids: torch.Tensor, hidden: torch.Tensor, regression_weight: float):
    """(loss, ce, agreement) of the head on windows ids [B, T] with the target's h [B, T, H]."""
    T = ids.shape[1]
    embeds = parts.embed(ids[:, 1:])                                  # t_{i+1}, i = 0..T-2
    h = hidden[:, : T - 1].to(embeds.dtype)
    pos = torch.arange(T - 1, device=ids.device)[None].expand(ids.shape[0], -1)
    # An explicit causal mask: not every attention backend infers one when given none.
    g = head(embeds, h, position_ids=pos, position_embeddings=parts.position_embeddings(embeds, pos),
             attention_mask=position_mask(pos, T - 1, embeds.dtype))
    logits = parts.lm_head(head.norm(g)).float()
    with torch.no_grad():
        h_next = hidden[:, 1:].to(embeds.dtype)
        target_logits = parts.lm_head(parts.norm(h_next)).float()
    ce = -(target_logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
    reg = F.smooth_l1_loss(_rms_normalise(g.float()), _rms_normalise(h_next.float()))
    agree = (logits.argmax(-1) == target_logits.argmax(-1)).float().mean()
    return ce + regression_weight * reg, ce, agree


def _rms_normalise(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def lr_at(step: int, cfg: MTPTrainConfig) -> float:
    """Linear warm-up then cosine decay to `min_lr_ratio * lr`."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def train_head(target, windows: torch.Tensor, cfg: MTPTrainConfig, *, log_path: Path | None = None,
               progress: bool = True) -> tuple[DraftHead, list[dict]]:
    """Train a new head for the frozen `target` on token windows [N, T]; returns (head, curve)."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    parts = target_parts(target)
    frozen = [(p, p.requires_grad) for p in target.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    bar = _Progress(windows.shape[0] + cfg.steps) if progress else None
    device = next(target.parameters()).device
    hidden = precompute(target, windows, progress=bar.precomputed if bar else None)
    windows = windows.to(device)
    head = new_head(target).float().train()
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    curve: list[dict] = []
    t0 = time.perf_counter()
    try:
        for step in range(cfg.steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            idx = torch.randint(0, windows.shape[0], (cfg.batch_size,), generator=gen)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                loss, ce, agree = head_loss(head, parts, windows[idx], hidden[idx], cfg.regression_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            row = {"step": step + 1, "loss": round(loss.item(), 4), "ce": round(ce.item(), 4),
                   "agreement": round(agree.item(), 4), "lr": round(opt.param_groups[0]["lr"], 6),
                   "elapsed_s": round(time.perf_counter() - t0, 1)}
            curve.append(row)
            if bar is not None:
                bar.trained(row)
            if log_path is not None and ((step + 1) % 50 == 0 or step + 1 == cfg.steps):
                log_path.write_text(json.dumps({"config": asdict(cfg), "curve": curve}, indent=1))
    finally:
        for p, requires_grad in frozen:
            p.requires_grad_(requires_grad)
        if bar is not None:
            bar.close()
    return head.eval(), curve


@torch.no_grad()
def evaluate_head(head: DraftHead, target, windows: torch.Tensor, *, batch_size: int = 8) -> dict:
    """Held-out: the head's cross-entropy against the target and its greedy agreement (draft 1)."""
    parts = target_parts(target)
    param = next(target.parameters())
    head = copy.deepcopy(head).to(param.dtype)                      # the caller's head stays as it is
    ce_sum, agree_sum, n = 0.0, 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        ids = windows[i : i + batch_size].to(param.device)
        _, ce, agree = head_loss(head, parts, ids, final_hidden(target, ids), 0.0)
        m = ids.shape[0] * (ids.shape[1] - 1)
        ce_sum, agree_sum, n = ce_sum + ce.item() * m, agree_sum + agree.item() * m, n + m
    return {"tokens": n, "ce_vs_target": round(ce_sum / n, 4), "top1_agreement": round(agree_sum / n, 4)}


class _Progress:
    """rich progress: precomputing hidden states, then training steps (loss, agreement)."""

    def __init__(self, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._p = Progress(TextColumn("[bold]{task.fields[phase]}"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("loss {task.fields[loss]:.3f}  agree {task.fields[agree]:.3f}"),
                           TimeElapsedColumn())
        self._task = self._p.add_task("mtp", total=total, phase="hidden states", loss=float("nan"),
                                      agree=float("nan"))
        self._p.start()
        self._done = 0

    def precomputed(self, n: int):
        self._p.update(self._task, completed=n)
        self._done = n

    def trained(self, row: dict):
        self._p.update(self._task, completed=self._done + row["step"], phase="train head",
                       loss=row["loss"], agree=row["agreement"])

    def close(self):
        self._p.stop()
