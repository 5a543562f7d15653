"""Training a draft head for a target: precompute the target's features, then fit the head.

The head is of any layout in `specfx.heads` (`MTPTrainConfig.arch`: specfx's own `DraftHead`,
`eagle`, `eagle3`, `deepseek-mtp`) and trains through the interface they share. The target is
frozen; only the head's parameters train. The windows are the corpus's, and optionally the
target's own greedy continuations of corpus prefixes (`greedy_windows`: the kind of text a head
drafts at inference). For each window of tokens the outputs of the target layers the head taps,
and of its last layer, are computed once and kept in bfloat16 (`precompute`). The head's h_i is
its combiner over the tapped outputs at position i: the last layer's output itself (specfx), the
target's final norm of it (eagle, deepseek-mtp), or EAGLE-3's `fc` over three layers, which
trains and so is applied in the loss. The head at position i reads (t_{i+1}, h_i) and is
trained (`head_loss`) with

- cross-entropy against the target's own next-token distribution at i+1, softmax(lm_head(norm(h_{i+1})))
  with h the last layer's output (the target's predictions, not the data: acceptance is agreement
  with the target); a head with a reduced draft vocabulary (EAGLE-3, `draft_vocabulary`) is
  scored over that vocabulary, the target's distribution renormalised to it as EAGLE-3 does;
- plus `regression_weight` times a smooth-L1 between the RMS-normalised head output g_i and
  the RMS-normalised h_{i+1} the head reads (EAGLE's feature regression), since a second draft
  feeds g_i where h_{i+1} would be.

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
from torch import nn

from specfx.capture import position_mask
from specfx.heads import LAYOUTS, new_layout_head
from specfx.mtp import layer_outputs, new_head, target_parts


@dataclass
class MTPTrainConfig:
    """What `specfx train mtp` runs; the defaults reproduce the shipped `pycoder-mtp`."""

    steps: int = 5000
    batch_size: int = 8
    seq_len: int = 256
    windows: int = 12288             # corpus windows of target hidden states, precomputed and reused
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.0
    regression_weight: float = 0.5
    seed: int = 0
    bf16: bool = True                # CPU autocast for the head's forward/backward
    arch: str = "specfx"             # the head's layout, one of specfx.heads.LAYOUTS
    draft_vocab: int | None = None   # eagle3 only: draft vocabulary size (None: the target's)
    chain_weight: float = 0.5        # weight of the second draft's cross-entropy (`head_loss`)
    generated: int = 0               # more windows: the target's greedy continuations of corpus
                                     # prefixes of seq_len // 4 tokens (`greedy_windows`)
    init: str | None = None          # a head (folder or zoo name) to train on from (`initial_head`)

    def __post_init__(self):
        if self.steps < 1 or self.batch_size < 1 or self.seq_len < 3 or self.windows < 1:
            raise ValueError("steps, batch_size, windows must be >= 1 and seq_len >= 3")
        if self.generated < 0:
            raise ValueError(f"generated (windows of the target's greedy continuations) must be >= 0, "
                             f"got {self.generated}")
        if self.arch not in LAYOUTS:
            raise ValueError(f"arch must be one of {', '.join(LAYOUTS)}, got {self.arch!r}")
        if self.draft_vocab is not None and (self.arch != "eagle3" or self.draft_vocab < 1):
            raise ValueError(f"draft_vocab is the size of an eagle3 head's reduced vocabulary (>= 1); "
                             f"got {self.draft_vocab} for arch {self.arch!r}")


def sample_windows(stream: torch.Tensor, count: int, seq_len: int, seed: int) -> torch.Tensor:
    """`count` random windows [count, seq_len] of a token stream (seeded)."""
    n = stream.numel() - seq_len
    if n < 1:
        raise ValueError(f"token stream of {stream.numel()} tokens is shorter than one window of {seq_len}")
    starts = torch.randint(0, n, (count,), generator=torch.Generator().manual_seed(seed))
    return torch.stack([stream[s : s + seq_len] for s in starts.tolist()])


@dataclass
class Features:
    """What a head trains on at each position of token windows: the outputs of the target layers
    it taps, concatenated (`taps` [N, T, n H]; its combiner maps them to its h), and the last
    layer's output (`last` [N, T, H]; the target's logits are lm_head(norm(last)))."""

    taps: torch.Tensor
    last: torch.Tensor

    def __getitem__(self, idx) -> Features:
        return Features(self.taps[idx], self.last[idx])


def features(target, input_ids: torch.Tensor, taps: tuple[int, ...]) -> Features:
    """The Features of token windows input_ids [B, T] for a head tapping target layers `taps`."""
    outs = layer_outputs(target, input_ids, (*taps, len(target_parts(target).layers) - 1))
    return Features(torch.cat(outs[:-1], -1), outs[-1])


@torch.no_grad()
def precompute(target, windows: torch.Tensor, taps: tuple[int, ...], *, batch_size: int = 8,
               progress=None) -> Features:
    """The Features [N, T, ...] of token windows [N, T] for a head tapping `taps`, in bfloat16
    (`last` is a view of `taps` where the last tap is the last layer)."""
    target.eval()
    device = next(target.parameters()).device
    shared = taps[-1] == len(target_parts(target).layers) - 1
    tapped, last = [], []
    for i in range(0, windows.shape[0], batch_size):
        f = features(target, windows[i : i + batch_size].to(device), taps)
        tapped.append(f.taps.to(torch.bfloat16))
        if not shared:
            last.append(f.last.to(torch.bfloat16))
        if progress is not None:
            progress(min(i + batch_size, windows.shape[0]))
    tapped = torch.cat(tapped)
    return Features(tapped, tapped[..., -(tapped.shape[-1] // len(taps)):] if shared else torch.cat(last))


@torch.no_grad()
def greedy_windows(target, prefixes: torch.Tensor, seq_len: int, *, batch_size: int = 64,
                   progress=None) -> torch.Tensor:
    """Windows [N, seq_len]: each of `prefixes` [N, P] continued by the target's own greedy tokens
    (end of sequence suppressed, so every window is full). A head drafts the target's greedy
    text, which is not the corpus: it repeats itself far more (pycoder's continuations of
    64-token corpus prefixes hold a median of 22 distinct tokens in 192)."""
    device = next(target.parameters()).device
    pad = getattr(target.generation_config, "pad_token_id", None)
    out = []
    for i in range(0, prefixes.shape[0], batch_size):
        x = prefixes[i : i + batch_size].to(device)
        new = seq_len - x.shape[1]
        y = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                            do_sample=False, pad_token_id=pad)
        out.append(y[:, :seq_len].cpu())
        if progress is not None:
            progress(min(i + batch_size, prefixes.shape[0]))
    return torch.cat(out)


def draft_vocabulary(windows: torch.Tensor, size: int, vocab_size: int) -> torch.Tensor:
    """EAGLE-3's reduced draft vocabulary: the `size` most frequent tokens of `windows` (ties go
    to the lower id), as target ids in increasing order. A head over it has
    `d2t = ids - arange(size)`: target id = draft id + d2t[draft id]."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"a draft vocabulary of {size} tokens: expected 1..{vocab_size} (the target's vocabulary)")
    counts = torch.bincount(windows.flatten().cpu(), minlength=vocab_size)
    return torch.sort(counts, descending=True, stable=True).indices[:size].sort().values


def fresh_head(target, cfg: MTPTrainConfig, windows: torch.Tensor) -> nn.Module:
    """A new head of layout `cfg.arch` for `target`, before training: specfx's and DeepSeek's
    layer start as a copy of the target's last layer, EAGLE's are random; EAGLE-3's draft
    vocabulary is the `cfg.draft_vocab` most frequent tokens of `windows`."""
    if cfg.arch == "specfx":
        return new_head(target)
    if cfg.arch != "eagle3":
        return new_layout_head(target, cfg.arch)
    vocab_size = target_parts(target).config.vocab_size
    ids = draft_vocabulary(windows, cfg.draft_vocab or vocab_size, vocab_size)
    head = new_layout_head(target, "eagle3", draft_vocab_size=ids.numel())
    head.d2t.copy_(ids - torch.arange(ids.numel()))
    return head


def initial_head(target, cfg: MTPTrainConfig) -> nn.Module:
    """The head `cfg.init` (a folder in any layout `MTPHead` loads, or a shipped head's name) that
    training goes on from, in place of a fresh one: for `target` (another's is refused) and of
    layout `cfg.arch`."""
    from specfx.drafters import MTPHead

    head = MTPHead(cfg.init).load(target)
    if head.layout != cfg.arch:
        raise ValueError(f"the head to train on from ({cfg.init!r}) is of layout {head.layout!r}, "
                         f"not {cfg.arch!r}: pass --arch {head.layout}")
    return head


def draft_ids(head: nn.Module) -> torch.Tensor | None:
    """The target ids a head's logits cover, where that is not the whole vocabulary: EAGLE-3's
    draft vocabulary `arange + d2t` (its logits are -inf elsewhere); None for the others."""
    d2t = getattr(head, "d2t", None)
    return None if d2t is None else torch.arange(d2t.numel(), device=d2t.device) + d2t


def head_loss(head: nn.Module, parts, ids: torch.Tensor, feats: Features, regression_weight: float,
              chain_weight: float = 0.0):
    """(loss, ce, agreement) of the head on windows ids [B, T] with the target's Features [B, T, ...].

    `chain_weight` adds the cross-entropy of a second draft that reads the head's own g_i where
    h_{i+1} would be (EAGLE-3's training-time test, simplified: the second pass attends over
    second-pass entries only), which trains the chain directly instead of through g ~ h.
    """
    T = ids.shape[1]
    embeds = parts.embed(ids[:, 1:])                                  # t_{i+1}, i = 0..T-2
    combine = head.combiner(parts)
    hidden = feats.taps.to(embeds.dtype)
    if combine is not None:                                           # EAGLE-3's fc trains here
        hidden = combine(hidden)
    pos = torch.arange(T - 1, device=ids.device)[None].expand(ids.shape[0], -1)
    # An explicit causal mask: not every attention backend infers one when given none.
    g = head(embeds, hidden[:, : T - 1], position_ids=pos,
             position_embeddings=head.position_embeddings(parts, embeds, pos),
             attention_mask=position_mask(pos, T - 1, embeds.dtype))
    logits = head.logits(parts, g).float()
    with torch.no_grad():
        target_logits = parts.lm_head(parts.norm(feats.last[:, 1:].to(embeds.dtype))).float()
    agree = (logits.argmax(-1) == target_logits.argmax(-1)).float().mean()
    vocab = draft_ids(head)
    if vocab is not None:                  # both over the draft vocabulary: no -inf logit meets a 0
        logits, target_logits = logits[..., vocab], target_logits[..., vocab]
    ce = _cross_entropy(target_logits, logits)
    reg = F.smooth_l1_loss(_rms_normalise(g.float()), _rms_normalise(hidden[:, 1:].detach().float()))
    loss = ce + regression_weight * reg
    if chain_weight:                       # draft 2 at position i + 1: (t_{i+2}, g_i) -> t_{i+3}
        e2, pos2 = parts.embed(ids[:, 2:]), pos[:, : T - 2] + 1
        g2 = head(e2, g[:, : T - 2], position_ids=pos2, position_embeddings=head.position_embeddings(parts, e2, pos2),
                  attention_mask=position_mask(pos[:, : T - 2], T - 2, embeds.dtype))
        logits2 = head.logits(parts, g2).float()
        loss = loss + chain_weight * _cross_entropy(target_logits[:, 1:], logits2 if vocab is None else logits2[..., vocab])
    return loss, ce, agree


def _cross_entropy(target_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the head's logits against the target's next-token distribution."""
    return -(target_logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()


def _rms_normalise(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def lr_at(step: int, cfg: MTPTrainConfig) -> float:
    """Linear warm-up then cosine decay to `min_lr_ratio * lr`."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def train_head(target, windows: torch.Tensor, cfg: MTPTrainConfig, *, log_path: Path | None = None,
               progress: bool = True) -> tuple[nn.Module, list[dict]]:
    """Train a head of layout `cfg.arch` (a new one, or `cfg.init`) for the frozen `target` on
    token windows [N, T]; returns (head, curve)."""
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    parts = target_parts(target)
    head = (initial_head(target, cfg) if cfg.init else fresh_head(target, cfg, windows)).float().train()
    frozen = [(p, p.requires_grad) for p in target.parameters()]
    for p, _ in frozen:
        p.requires_grad_(False)
    bar = _Progress(windows.shape[0] + cfg.steps) if progress else None
    device = next(target.parameters()).device
    feats = precompute(target, windows, head.taps(len(parts.layers)), progress=bar.precomputed if bar else None)
    windows = windows.to(device)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    curve: list[dict] = []
    t0 = time.perf_counter()
    try:
        for step in range(cfg.steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            idx = torch.randint(0, windows.shape[0], (cfg.batch_size,), generator=gen)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                loss, ce, agree = head_loss(head, parts, windows[idx], feats[idx], cfg.regression_weight,
                                            cfg.chain_weight)
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
def evaluate_head(head: nn.Module, target, windows: torch.Tensor, *, batch_size: int = 8) -> dict:
    """Held-out: the head's cross-entropy against the target and its greedy agreement (draft 1)."""
    parts = target_parts(target)
    param = next(target.parameters())
    head = copy.deepcopy(head).to(param.dtype)                      # the caller's head stays as it is
    taps = head.taps(len(parts.layers))
    ce_sum, agree_sum, n = 0.0, 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        ids = windows[i : i + batch_size].to(param.device)
        _, ce, agree = head_loss(head, parts, ids, features(target, ids, taps), 0.0)
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
