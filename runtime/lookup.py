"""Prompt lookup: propose drafts by n-gram matching over the token buffer, on device.

`ngram_propose(tokens, lengths, ngram, k)` finds, for each row, the latest earlier occurrence of
the row's last n tokens (n = ngram, then shorter down to 1) and proposes the k tokens that
followed it. Static shapes: every window of the buffer is compared at once (`unfold`), the
latest match is a max over positions, and a row with no match proposes its last token again
(harmless: verification rejects it and emits the target's own token).
"""

from __future__ import annotations

import torch


def ngram_propose(tokens: torch.Tensor, lengths: torch.Tensor, ngram: int, k: int) -> torch.Tensor:
    """Drafts [B, k] for rows `tokens` [B, S] holding `lengths` [B] known tokens."""
    S = tokens.shape[1]
    pos = torch.arange(S, device=tokens.device)
    last = tokens.gather(1, (lengths - 1).clamp(min=0)[:, None])                 # [B, 1]
    start = last.new_full(last.shape, -1)                                        # continuation start
    for n in range(1, ngram + 1):                                                 # longer n wins: later
        tail = tokens.gather(1, (lengths[:, None] - n + torch.arange(n, device=tokens.device)).clamp(min=0))
        windows = tokens.unfold(1, n, 1)                                          # [B, S-n+1, n]
        hit = (windows == tail[:, None, :]).all(-1)                               # [B, S-n+1]
        j = pos[: S - n + 1]
        # An earlier occurrence, followed by at least one known token, in a row long enough.
        ok = hit & (j[None] + n < lengths[:, None]) & (lengths[:, None] > n)
        latest = torch.where(ok, j[None], -1).amax(-1, keepdim=True)              # [B, 1]
        start = torch.where(latest >= 0, latest + n, start)
    idx = (start + torch.arange(k, device=tokens.device)).clamp(min=0, max=S - 1)  # [B, k]
    drafts = tokens.gather(1, idx)
    return torch.where(start >= 0, drafts, last.expand_as(drafts))
