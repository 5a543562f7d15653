"""Acceptance and the in-place state update, shared by every drafter's fused step.

All of it is device tensor math with static shapes: no `.item()`, no `nonzero()`, no
boolean-mask indexing, so it lives inside the captured step.
"""

from __future__ import annotations

import torch


def greedy_accept(drafts: torch.Tensor, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification of `drafts` [B, k] against `target_logits` [B, k+1, V].

    Returns (emitted [B, k+1], n [B]): n drafts were accepted and emitted[:, :n+1] are the
    tokens to keep, the last of them the target's own (bonus) token. Because accepted drafts
    equal the target's argmax, the emitted row is the argmax itself.
    """
    greedy = target_logits.argmax(-1)                               # [B, k+1]
    n = (drafts == greedy[:, :-1]).long().cumprod(1).sum(1)         # [B]
    return greedy, n


def commit(tokens, lengths, max_lens, done, eos, accept_hist, emitted, n) -> None:
    """Write emitted[:, :n+1] after each active row's tokens and advance its length by n+1.

    Slots past n are written too (static shapes): they lie beyond the new length and the next
    step overwrites them. Done rows keep their tokens and length.
    """
    width = emitted.shape[1]
    j = torch.arange(width, device=emitted.device)                  # [k+1]
    pos = (lengths[:, None] + j).clamp(max=tokens.shape[1] - 1)     # [B, k+1]
    active = ~done
    tokens.scatter_(1, pos, torch.where(active[:, None], emitted, tokens.gather(1, pos)))
    new_len = lengths + (n + 1) * active
    kept = j[None, :] <= n[:, None]
    hit_eos = ((emitted[:, :, None] == eos).any(-1) & kept).any(1)
    done.logical_or_(hit_eos | (new_len >= max_lens))
    lengths.copy_(new_len)
    accept_hist.add_(((n[:, None] == j) & active[:, None]).long().sum(0))
