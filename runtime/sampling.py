"""Exact speculative sampling with static shapes and no host sync.

- `warp(logits, temperature, top_k, top_p, filters=...)`: the sampling distribution after
  temperature, top-k and top-p (HF's order), as probabilities; `filters_for(top_k, top_p)`
  names the cheapest of its variants that is exact for those settings (the host's choice: one
  compiled step per variant, built when first used).
- `race(probs, noise)`: a categorical sample as `argmax(probs / noise)` with `noise ~ Exp(1)`
  (the exponential race): no `multinomial`, no data-dependent shape.
- `speculative_accept(draft_tokens, q, p, uniforms, noise)`: rejection sampling of Leviathan et
  al. (2022) / Chen et al. (2023). Draft i is accepted while `u_i * q_i(x_i) < p_i(x_i)`; at the
  first rejection the token is drawn from `normalize(max(p - q, 0))`; if all k are accepted the
  bonus token is drawn from `p_k`. The output keeps the target's distribution `p` exactly.
- `tree_speculative_accept(...)`: the same over a spine tree (`Tree.spine`), whose candidates at
  each depth are drawn from q without replacement (`race_top`): recursive rejection over
  siblings (SpecInfer's multi-draft sampling; Jeon et al. 2024 for draws without replacement).
  Candidate i is judged against the residual left by candidates 1..i-1 with q renormalized
  over the tokens not yet drawn; an accepted spine node descends, an accepted other candidate
  (a leaf) ends the path with a bonus token from the target at its row.

Random numbers come in as tensors (the runtime draws them from its own `torch.Generator`), so
every function here is pure and can be tested directly.
"""

from __future__ import annotations

import torch

from specfx.runtime.accept import leading_true


FILTERS = ("any", "top_k", "temperature")
TOP_K_CAP = 64          # the "top_k" variant's largest k


def filters_for(top_k: int, top_p: float, vocab_size: int) -> str:
    """The cheapest `warp` variant exact for these settings: "temperature" when top-k and
    top-p are off, "top_k" for 1 <= top_k <= TOP_K_CAP < vocab_size (top-p on or off;
    transformers' default top_k is 50), else "any"."""
    if top_k <= 0 and top_p >= 1:
        return "temperature"
    return "top_k" if 1 <= top_k <= TOP_K_CAP < vocab_size else "any"


def warp(logits: torch.Tensor, temperature, top_k, top_p, filters: str = "any") -> torch.Tensor:
    """Probabilities after temperature, then top-k, then top-p (HF's order and tie rules).

    The settings may be Python numbers or 1-element tensors (so one compiled step serves every
    setting); top_k <= 0 and top_p >= 1 disable those filters. Static shapes throughout. The
    `filters` variants compute the same distribution where they apply (see `filters_for`):
    - "any": every setting, and no sort: each cut is a threshold found by bisection over the
      values' order (`_keys`), 33 passes of a count or a sum over the vocabulary;
    - "top_k": top_k in 1..TOP_K_CAP, over more than TOP_K_CAP tokens: the TOP_K_CAP largest
      values (`topk`) hold both cuts;
    - "temperature": top-k and top-p off: a softmax.
    Top-k keeps every token tied with the k-th largest, as HF does; top-p drops the tokens whose
    value's cumulative mass (ascending, ties together) is <= 1 - top_p, keeping the largest.
    """
    if filters not in FILTERS:
        raise ValueError(f"warp filters must be one of {FILTERS}, got {filters!r}")
    V = logits.shape[-1]
    temperature, top_k, top_p = (torch.tensor([v], device=logits.device) if isinstance(v, (int, float)) else v
                                 for v in (temperature, top_k, top_p))
    logits = logits.float() / temperature
    if filters == "temperature":
        return logits.softmax(-1)
    if filters == "top_k":
        return _warp_capped(logits, top_k, top_p)
    key = _keys(logits)
    lowest, highest = key.amin(-1, keepdim=True), key.amax(-1, keepdim=True)
    # Top-k: the largest key t with count(key >= t) >= k, i.e. the k-th largest value.
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)
    kth = _bisect(lowest, highest, lambda t: (key >= t).sum(-1, keepdim=True) >= k)
    logits = logits.masked_fill(key < kth, float("-inf"))
    probs = logits.softmax(-1)
    # Top-p: the largest key t whose mass at or below it is <= 1 - top_p; those tokens go.
    cut = _bisect(lowest - 1, highest, lambda t: (probs * (key <= t)).sum(-1, keepdim=True) <= 1 - top_p)
    return logits.masked_fill((key <= cut) & (key < highest), float("-inf")).softmax(-1)


def _warp_capped(logits: torch.Tensor, top_k, top_p) -> torch.Tensor:
    """`warp` for 1 <= top_k <= TOP_K_CAP from the TOP_K_CAP largest values, descending."""
    top = logits.topk(TOP_K_CAP, dim=-1).values                                  # [..., CAP]
    kth = top.gather(-1, (top_k - 1).clamp(0, TOP_K_CAP - 1).expand_as(top[..., :1]))
    top = top.masked_fill(top < kth, float("-inf"))
    p = top.softmax(-1)
    # Mass at or below each value, ties together (a tie's first entry, descending, counts them all).
    at_or_below = 1 - (p.cumsum(-1) - p)
    at_or_below = (at_or_below[..., None, :] * (top[..., :, None] == top[..., None, :])).amax(-1)
    drop = at_or_below <= 1 - top_p                   # never the largest: its mass is 1
    cut = torch.where(drop, top, torch.full_like(top, float("-inf"))).amax(-1, keepdim=True)
    return logits.masked_fill((logits < kth) | (logits <= cut), float("-inf")).softmax(-1)


def _keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys ordered as the float32 values `x` are (IEEE bits, negatives' magnitude bits
    flipped), so a bisection over them ends on an exact value."""
    bits = x.contiguous().view(torch.int32).long()
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _bisect(lo: torch.Tensor, hi: torch.Tensor, holds) -> torch.Tensor:
    """The largest t in [lo, hi] where `holds(t)` (monotone: true up to some t, false after; true
    at lo), per row; 33 halvings cover any range of int32 keys."""
    for _ in range(33):
        mid = torch.div(lo + hi + 1, 2, rounding_mode="floor")
        ok = holds(mid)
        lo, hi = torch.where(ok, mid, lo), torch.where(ok, hi, mid - 1)
    return lo


def race(probs: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Sample index ~ probs along the last dim, given `noise ~ Exp(1)` of the same shape."""
    return (probs / noise).argmax(-1)


def race_top(probs: torch.Tensor, noise: torch.Tensor, width: int) -> torch.Tensor:
    """`width` draws without replacement from probs along the last dim, in draw order ([..., width]):
    the first is `race(probs, noise)`, each next one the race's winner among the tokens left."""
    return top_indices(probs / noise, width)


def top_indices(x: torch.Tensor, width: int) -> torch.Tensor:
    """The indices of the `width` largest values of x along its last dim, largest first
    ([..., width]; of equal values the lower index first): `width` rounds of argmax, each over
    what the rounds before left. Inductor compiles them as reductions; `topk` is a library call
    on the CPU, and one library call in a graph keeps all of its buffers on the heap (Inductor's
    rule): in pycoder's fused step over a 3x2x1 tree (a 2-core AMD EPYC, Inductor's kernel
    profile over 4 generations), the compiled graph's own time outside its kernels went from
    354 to 218 us a step."""
    ids = torch.arange(x.shape[-1], device=x.device)
    picks = []
    for _ in range(width):
        pick = x.argmax(-1, keepdim=True)
        picks.append(pick)
        x = x.masked_fill(ids == pick, float("-inf"))
    return torch.cat(picks, -1)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """normalize(max(p - q, 0)) along the last dim; p where that has no mass (p == q: a
    rejection then has probability 0), never NaN."""
    residual = (p - q).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)


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
    n = leading_true(accept)                                          # [B]
    # Distribution at position n: the residual after a rejection, or p_k after k acceptances.
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], 1)             # [B, k+1, V]
    at = n[:, None, None].expand(-1, 1, p.shape[-1])
    p_n, q_n = p.gather(1, at)[:, 0], q_pad.gather(1, at)[:, 0]       # [B, V]
    token = race(_residual(p_n, q_n), noise)                          # [B]
    j = torch.arange(k + 1, device=draft_tokens.device)
    drafts = torch.cat([draft_tokens, draft_tokens[:, :1]], 1)        # [B, k+1]
    emitted = torch.where(j[None] < n[:, None], drafts, token[:, None])
    return emitted, n


def tree_speculative_accept(drafts: torch.Tensor, q: torch.Tensor, p: torch.Tensor, uniforms: torch.Tensor,
                            noise: torch.Tensor, branching: tuple[int, ...]):
    """Rejection sampling over a spine tree (`Tree.spine(branching)`).

    drafts [B, N]: the nodes, depth by depth, the b_d candidates at depth d+1 drawn from q[:, d]
    without replacement in draw order (the first is the spine node); q [B, D, V] the drafter's
    distribution at each depth (along the spine); p [B, N+1, V] the target's at each row (row 0
    the pending token, row i+1 node i); uniforms [B, N] ~ U[0, 1), one per node; noise [B, V] ~ Exp(1).

    At each depth the candidates are judged in draw order, each against what the ones before it
    left: target p_i, with p_1 the target at the spine row above and, after a rejection,
    p_{i+1} = normalize(max(p_i - q_i, 0)), where q_i is q renormalized over the tokens not yet
    drawn (the law of draw i given draws 1..i-1). Candidate i is accepted when
    `u * q_i(x_i) < p_i(x_i)`. An accepted spine node (above the last depth) descends to the next
    depth; an accepted leaf ends the path, and the bonus token is drawn from the target at its
    row; when every candidate at a depth is rejected, the token is drawn from the last residual.
    A candidate of q-probability 0 (q's support was used up) is skipped. Each depth's
    randomness is its own, so judging every depth and keeping the reached ones is exact.

    Returns (emitted [B, D+1], n [B], path [B, D+1]) as `greedy_accept` does for a tree.
    """
    B, V = p.shape[0], p.shape[-1]
    D = len(branching)
    rows = torch.arange(B, device=p.device)
    alive = torch.ones(B, dtype=torch.bool, device=p.device)            # still on the spine
    n = torch.zeros(B, dtype=torch.long, device=p.device)
    final = p[:, 0]                                                     # the last token's distribution
    tokens, path = [], [torch.zeros_like(n)]
    node, spine_row = 0, 0
    for d, width in enumerate(branching):
        p_i, q_i = p[:, spine_row], q[:, d]
        taken = torch.zeros_like(alive)
        row = torch.zeros_like(n)                                       # the accepted candidate's row
        for i in range(width):
            x = drafts[:, node + i]
            q_x, p_x = q_i[rows, x], p_i[rows, x]
            valid = (q_x > 0) & ~taken
            ok = valid & (uniforms[:, node + i] * q_x < p_x)
            row = torch.where(ok, node + i + 1, row)
            taken = taken | ok
            rejected = valid & ~ok
            p_i = torch.where(rejected[:, None], _residual(p_i, q_i), p_i)
            left = q_i.scatter(-1, x[:, None], 0.0)                         # the tokens not yet drawn
            mass = left.sum(-1, keepdim=True)
            q_i = torch.where(rejected[:, None], left / mass.clamp(min=1e-30), q_i)
        descend = taken & (row == node + 1) & (d < D - 1)               # the spine node, with children
        stop = alive & ~descend
        final = torch.where(stop[:, None], torch.where(taken[:, None], p[rows, row], p_i), final)
        accepted = alive & taken
        n = n + accepted
        tokens.append(drafts[rows, (row - 1).clamp(min=0)])
        path.append(torch.where(accepted, row, path[-1]))
        alive = alive & descend
        spine_row, node = node + 1, node + width
    token = race(final, noise)                                          # [B]: the bonus or resampled token
    j = torch.arange(D + 1, device=p.device)
    drafted = torch.stack([*tokens, token], 1)                          # [B, D+1]
    emitted = torch.where(j[None] < n[:, None], drafted, token[:, None])
    return emitted, n, torch.stack(path, 1)
