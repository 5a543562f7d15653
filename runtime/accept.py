"""Acceptance and the in-place state update, shared by every drafter's fused step.

All of it is device tensor math with static shapes: no `.item()`, no `nonzero()`, no
boolean-mask indexing, so it lives inside the captured step.
"""

from __future__ import annotations

import torch

from specfx.runtime.tree import Tree, const, put_rows


def greedy_accept(drafts: torch.Tensor, target_logits: torch.Tensor,
                  tree: Tree | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Greedy verification of the drafts [B, N] of `tree` (default: a chain) against
    `target_logits` [B, N+1, V] (row 0: the pending token's).

    Returns (emitted [B, D+1], n [B], path): n drafts were accepted along the deepest
    root-to-node path whose every token is the target's argmax after its parent (the first such
    node in row order on ties), and emitted[:, :n+1] are the tokens to keep, the last of them the
    target's own (bonus) token. Because accepted drafts equal the target's argmax, the emitted
    row is the argmax along the path. `path` [B, D+1] holds the accepted path's rows by depth
    (None for a chain, where it is rows 0..n).
    """
    greedy = target_logits.argmax(-1)                               # [B, N+1]
    tree = tree or Tree.chain(drafts.shape[1])
    if tree.size == 0:
        return greedy, greedy[:, 0] * 0, None
    if tree.is_chain:
        return greedy, leading_true(drafts == greedy[:, :-1]), None
    match = drafts == greedy[:, const(greedy, tree.row_parents)]    # [B, N]: each node vs its parent's argmax
    hit = torch.cat([torch.ones_like(match[:, :1]), match], 1)      # [B, N+1]: the pending token always
    ancestors = const(greedy, tree.ancestors, torch.bool)          # [N+1, N+1]
    on_path = (hit[:, None, :] | ~ancestors).all(-1)                # [B, N+1]: the whole path to row r holds
    depth = torch.where(on_path, const(greedy, tree.depths), -1)
    best = depth.argmax(-1)                                         # [B]: first deepest
    path = const(greedy, tree.paths)[best]                          # [B, D+1]
    return greedy.gather(1, path), depth.gather(1, best[:, None])[:, 0], path


def leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[B, k] bool -> [B]: how many entries lead each row before its first False. An argmax
    (the first index of the maximum), not a cumulative product: Inductor writes it into the
    step's own loops, where a scan is a library call, and one library call in a CPU step
    keeps all of the step's buffers off the stack (`runtime.compile.CPU_WRAPPER`)."""
    stop = torch.cat([~mask, torch.ones_like(mask[:, :1])], 1)     # [B, k+1]: a stop after the last
    return stop.to(torch.int32).argmax(1)


def commit(tokens, lengths, max_lens, done, eos, accept_hist, emitted, n) -> None:
    """Write emitted[:, :n+1] after each active row's tokens and advance its length by n+1.

    Slots past n are written too (static shapes): they lie beyond the new length and the next
    step overwrites them. Done rows keep their tokens and length.
    """
    width = emitted.shape[1]
    j = torch.arange(width, device=emitted.device)                  # [k+1]
    pos = (lengths[:, None] + j).clamp(max=tokens.shape[1] - 1)     # [B, k+1]
    active = ~done
    put_rows(tokens, pos, torch.where(active[:, None], emitted, tokens.gather(1, pos)))
    new_len = lengths + (n + 1) * active
    kept = j[None, :] <= n[:, None]
    hit_eos = ((emitted[:, :, None] == eos).any(-1) & kept).any(1)
    done.logical_or_(hit_eos | (new_len >= max_lens))
    lengths.copy_(new_len)
    accept_hist.add_(((n[:, None] == j) & active[:, None]).long().sum(0))
