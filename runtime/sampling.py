"""Exact speculative sampling with static shapes and no host sync.

- `warp(logits, temperature, top_k, top_p)`: the sampling distribution after temperature,
  top-k and top-p (HF's order), as probabilities.
- `race(probs, noise)`: a categorical sample as `argmax(probs / noise)` with `noise ~ Exp(1)`
  (the exponential race): no `multinomial`, no data-dependent shape.
- `speculative_accept(draft_tokens, q, p, uniforms, noise)`: rejection sampling of Leviathan et
  al. (2022) / Chen et al. (2023). Draft i is accepted while `u_i * q_i(x_i) < p_i(x_i)`; at the
  first rejection the token is drawn from `normalize(max(p - q, 0))`; if all k are accepted the
  bonus token is drawn from `p_k`. The output keeps the target's distribution `p` exactly.

Random numbers come in as tensors (the runtime draws them from its own `torch.Generator`), so
every function here is pure and can be tested directly.
"""

from __future__ import annotations

import torch


def warp(logits: torch.Tensor, temperature, top_k, top_p) -> torch.Tensor:
    """Probabilities after temperature, then top-k, then top-p (HF's order and tie rules).

    The settings may be Python numbers or 1-element tensors (so one compiled step serves every
    setting); top_k <= 0 and top_p >= 1 disable those filters. Static shapes throughout.
    """
    # Written to trace symbolically too: no tuple unpacking of tensors, no Python shape logic.
    V = logits.shape[-1]
    temperature, top_k, top_p = (torch.tensor([v], device=logits.device) if isinstance(v, (int, float)) else v
                                 for v in (temperature, top_k, top_p))
    logits = logits.float() / temperature
    sort = logits.sort(dim=-1)                                        # ascending
    ordered, order = sort[0], sort[1]
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)
    kth = ordered.gather(-1, (V - k).expand_as(ordered[..., :1]))     # k-th largest value
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    cum = ordered.softmax(-1).cumsum(-1)
    last = torch.arange(V, device=logits.device) == V - 1
    drop_sorted = (cum <= 1 - top_p) & ~last                          # always keep the top token
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill((logits < kth) | drop, float("-inf")).softmax(-1)


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Sample index ~ probs along the last dim, given `noise ~ Exp(1)` of the same shape."""
    return (probs / noise).argmax(-1)


def speculative_accept(draft_tokens: torch.Tensor, q: torch.Tensor, p: torch.Tensor,
                       uniforms: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling of k drafts.

    draft_tokens [B, k], q [B, k, V] (the drafter's probabilities, one-hot for deterministic
    drafters), p [B, k+1, V] (the target's), uniforms [B, k] ~ U[0, 1), noise [B, V] ~ Exp(1).
    Returns (emitted [B, k+1], n [B]): emitted[:, :n+1] are the new tokens, n drafts accepted.
    """
    k = draft_tokens.shape[1]
    idx = draft_tokens[..., None]                                     # [B, k, 1]
    p_x = p[:, :-1].gather(-1, idx)[..., 0]                           # [B, k]
    q_x = q.gather(-1, idx)[..., 0]
    # u ~ U[0, 1): P(u < p/q) = min(1, p/q); strict, so a token with p = 0 is never accepted.
    accept = uniforms * q_x < p_x                                     # never divides by q
    n = accept.long().cumprod(1).sum(1)                               # [B]
    # Distribution at position n: the residual after a rejection, or p_k after k acceptances.
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], 1)             # [B, k+1, V]
    at = n[:, None, None].expand(-1, 1, p.shape[-1])
    p_n, q_n = p.gather(1, at)[:, 0], q_pad.gather(1, at)[:, 0]       # [B, V]
    residual = (p_n - q_n).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    # p == q leaves no residual mass (rejection then has probability 0); fall back to p, no NaN.
    dist = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_n)
    token = race(dist, noise)                                         # [B]
    j = torch.arange(k + 1, device=draft_tokens.device)
    drafts = torch.cat([draft_tokens, draft_tokens[:, :1]], 1)        # [B, k+1]
    emitted = torch.where(j[None] < n[:, None], drafts, token[:, None])
    return emitted, n
