"""Step assembly: one decoding step as a module over the static state, ready to fuse.

Every drafter runs the same step, `SpecStep`: its drafter makes a `Proposal` (draft tokens
hanging off the pending token in a static `Tree`), the target verifies the pending token and
the drafts in one pass, acceptance picks the accepted path (`greedy_accept`, or rejection
sampling), the drafter updates what it keeps after verification, and `commit` writes the new
tokens. The verify graph gets the pending token's position; it computes the rows' positions,
the KV slots they write and the visibility mask from its static tree (the `tree_attention`
pass, see `Tree`): siblings share a position, never a slot. The step returns nothing: all
effects are in-place writes to the state tensors passed in. `trace_step(module)` turns it into
an FX graph whose graph calls stay `call_module` nodes; the `inline_graph_calls` pass then
inlines them into one flat graph.

The drafters (each declares the KV groups its graphs read, see `runtime.state.KVLayout`):
- `NoDrafter`: no drafts; the step is plain decoding, one token per step.
- `EarlyExitDrafter`: k early-exit drafts; the verify graph is layers >= E fed with the drafts'
  exit hidden states, or every layer where the drafts ran a stored copy of the weights.
- `LookupDrafter`: k drafts copied from an earlier n-gram match in the token buffer.
- `DraftModelDrafter`: k drafts from a separate draft model advancing in unison with the target
  (same positions and lengths, its own KV), then its catch-up pass over the last draft.
- `MTPDrafter`: k drafts from an MTP head fed by the target's final hidden states; after
  verification the head's refill over the verified positions. `MTPPrefill` fills the head's KV
  during prefill.
These two, and early exit on stored weights, also draft spine trees (`Tree.spine`: their top
candidates at each depth); the step then moves the accepted path's KV into place
(`move_path_kv`), and the draft model and the head refill along it (early exit's verify pass
has written the model's KV over every node of its layers).

With `sample=True` (or the name of a `warp` variant, see `sampling.filters_for`) a step
samples instead of taking the argmax: drafts are drawn from the drafter's warped distribution
q (a spine tree's candidates at a depth without replacement), and rejection sampling
(`speculative_accept`, over a tree `tree_speculative_accept`) keeps the target's distribution
p. Random numbers are step inputs, drawn by the runtime beforehand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx, nn

from specfx.runtime.accept import commit, greedy_accept
from specfx.runtime.lookup import ngram_propose
from specfx.runtime.sampling import race, race_top, speculative_accept, top_indices, tree_speculative_accept, warp
from specfx.runtime.state import KVLayout
from specfx.runtime.tree import Tree, move_path_kv, put_rows


def _filters(sample) -> str:
    """The `warp` variant a sampling step runs (`sample=True`: the one exact for every setting)."""
    return "any" if sample is True else sample


def propose(logits, sample, noise, warping):
    """Next token [B, 1] from logits [B, V]: argmax, or a draw from warp(logits) (also returned)."""
    if not sample:
        return logits.argmax(-1)[:, None], None
    q = warp(logits, *warping, filters=_filters(sample))
    return race(q, noise)[:, None], q


def candidates(logits, width: int, sample, noise, warping):
    """A drafter's `width` candidates at one depth of a spine tree, from logits [B, V]:
    (the spine token [B, 1], all candidates [B, width], q or None). One candidate is `propose`'s
    token; more are the top `width` in rank order, or, when sampling, `width` draws from q
    without replacement in draw order (`race_top`). The first is the spine token."""
    if width == 1:
        x, q = propose(logits, sample, noise, warping)
        return x, x, q
    if not sample:
        top = top_indices(logits, width)                              # [B, width]
        return top[:, :1], top, None
    q = warp(logits, *warping, filters=_filters(sample))
    drawn = race_top(q, noise, width)
    return drawn[:, :1], drawn, q


@dataclass
class StepInputs:
    """What a drafter reads in a step: the step's inputs, named, and the static settings."""

    tokens: torch.Tensor               # [B, S]
    last: torch.Tensor                 # [B]: the pending token's position
    pending: torch.Tensor              # [B, 1]: the last known token, not yet in the KV cache
    noise: torch.Tensor                # [B, N+1, V] (sampling)
    warping: tuple                     # (temperature, top_k, top_p)
    span: torch.Tensor
    kv: list
    layout: KVLayout
    max_pos: int
    sample: object

    def group(self, *names: str) -> list:
        return self.layout.take(self.kv, *names)

    @classmethod
    def of(cls, tokens, lengths, noise, warping, span, kv, *, layout: KVLayout, max_pos: int, sample=False):
        """The inputs of a step over the state's `tokens` and `lengths` (the pending token is each
        row's last)."""
        last = lengths - 1                                            # [B]
        return cls(tokens, last, tokens.gather(1, last[:, None]), noise, warping, span, kv, layout, max_pos, sample)


@dataclass
class Proposal:
    """A drafter's proposal: tokens [B, N] in the drafter's tree, the drafter's probabilities
    q [B, D, V] at each depth when sampling (None when greedy; a chain's depth is its node; a
    spine tree's siblings share their depth's), and what the verify graph reads in place of
    token ids, when it is not the tokens (early exit: the exit hidden states [B, N+1, H])."""

    tokens: torch.Tensor | None        # None: no drafts (N = 0)
    q: torch.Tensor | None = None
    verify_input: torch.Tensor | None = None


class Drafter(nn.Module):
    """Makes a step's proposal; `tree` fixes its shape, `verify_kv` the KV groups of the
    target rows that the verify graph reads."""

    tree: Tree
    verify_kv: tuple[str, ...] = ("target",)

    def propose(self, s: StepInputs) -> Proposal:
        raise NotImplementedError

    def after_verify(self, s: StepInputs, out, positions: torch.Tensor, emitted: torch.Tensor, n: torch.Tensor,
                     path: torch.Tensor | None) -> None:
        """Update what the drafter keeps from the verify outputs `out` (default: nothing): the
        accepted path's rows are `path` [B, D+1] (None for a chain: rows 0..k), at `positions`
        [B, D+1], followed by `emitted` [B, D+1], of which the first n [B] drafts were accepted
        (emitted[n] is the next pending token)."""

    def prime(self, s: StepInputs) -> None:
        """Prepare the first step after the prefill and the first token (see `Prime`; default:
        nothing, and the pipeline builds no prime pass for the drafter)."""


class NoDrafter(Drafter):
    """No drafts: the verify pass is the decode pass of the pending token alone."""

    tree = Tree.chain(0)

    def propose(self, s: StepInputs) -> Proposal:
        return Proposal(None)


class EarlyExitDrafter(Drafter):
    """k early-exit drafts from the first E layers and the head attached there (KV group
    "early"), or a spine tree's candidates, one pass per depth along the spine.

    `reuse`: the drafts ran the model's own weights, so their KV and exit hidden states are the
    model's; one more pass computes draft k's, and the verify graph runs layers >= E (group
    "late") over the exit hidden states (a chain only: a tree's siblings have none). Otherwise
    (a stored copy of the weights) a pass per depth, and the verify graph runs every layer over
    the drafts' tokens, writing the model's KV over the drafts' in group "early"."""

    def __init__(self, draft: fx.GraphModule, tree: Tree, reuse: bool = True):
        super().__init__()
        if reuse and not tree.is_chain:
            raise ValueError(f"an early exit on the model's own weights drafts chains, not {tree}")
        self.draft, self.tree, self.branching, self.reuse = draft, tree, _spine(tree), reuse
        self.verify_kv = ("late",) if reuse else ("early", "late")

    def propose(self, s: StepInputs) -> Proposal:
        D, x = len(self.branching), s.pending
        hidden, drafts, qs = [], [], []
        for j in range(D + 1 if self.reuse else D):
            pos = (s.last + j).clamp(max=s.max_pos)[:, None]          # [B, 1]
            out = self.draft(x, pos, s.span, *s.group("early"))
            hidden.append(out[1])                                     # [B, 1, H]
            if j < D:
                x, cand, q = candidates(out[0][:, -1], self.branching[j], s.sample, s.noise[:, j], s.warping)
                drafts.append(cand)
                qs.append(q)
        return Proposal(torch.cat(drafts, 1), torch.stack(qs, 1) if s.sample else None,
                        torch.cat(hidden, 1) if self.reuse else None)


class LookupDrafter(Drafter):
    """k drafts copied from an earlier n-gram match in the token buffer (one-hot q)."""

    def __init__(self, k: int, ngram: int, vocab_size: int):
        super().__init__()
        self.tree, self.ngram, self.vocab_size = Tree.chain(k), ngram, vocab_size

    def propose(self, s: StepInputs) -> Proposal:
        drafts = ngram_propose(s.tokens, s.last + 1, self.ngram, self.tree.size)   # [B, k]
        q = (drafts[..., None] == torch.arange(self.vocab_size, device=drafts.device)).float() \
            if s.sample else None
        return Proposal(drafts, q)


def _spine(tree: Tree) -> tuple[int, ...]:
    if tree.branching is None:
        raise ValueError(f"this drafter drafts chains and spine trees (Tree.spine), not {tree}")
    return tree.branching


class DraftModelDrafter(Drafter):
    """Drafts from a separate draft model with its own KV (group "draft"), advancing in unison
    with the target (same positions and lengths). A chain of k: k passes, then a catch-up pass
    that writes draft k into that KV. A spine tree: one pass per depth along the spine (its top
    candidates are the nodes), then, after verification, a refill pass over the accepted path."""

    def __init__(self, draft: fx.GraphModule, tree: Tree, *, draft_vocab: int, target_vocab: int,
                 refill: fx.GraphModule | None = None):
        super().__init__()
        self.draft, self.tree, self.branching, self.refill = draft, tree, _spine(tree), refill
        if not tree.is_chain and refill is None:
            raise ValueError("a draft model drafting a tree needs its refill graph (the accepted path's KV)")
        # Vocab sizes may differ by padding: drafts come from the shared part only.
        self.vocab, self.pad = min(draft_vocab, target_vocab), max(0, target_vocab - draft_vocab)
        self.max_draft_id = draft_vocab - 1

    def propose(self, s: StepInputs) -> Proposal:
        D, x = len(self.branching), s.pending
        drafts, qs = [], []
        # A chain's last pass writes draft D's KV (the catch-up); a tree's refill writes the path's.
        for j in range(D + 1 if self.refill is None else D):
            pos = (s.last + j).clamp(max=s.max_pos)[:, None]
            # A target token past the draft's vocab (padding) must not index out of its embedding.
            logits = self.draft(x.clamp(max=self.max_draft_id), pos, s.span, *s.group("draft"))[0][:, -1, : self.vocab]
            if j == D:
                break
            x, cand, q = candidates(logits, self.branching[j], s.sample, s.noise[:, j, : self.vocab], s.warping)
            drafts.append(cand)
            if s.sample:
                qs.append(torch.cat([q, q.new_zeros(q.shape[0], self.pad)], -1) if self.pad else q)
        return Proposal(torch.cat(drafts, 1), torch.stack(qs, 1) if s.sample else None)

    def after_verify(self, s: StepInputs, out, positions: torch.Tensor, emitted: torch.Tensor, n: torch.Tensor,
                     path: torch.Tensor | None) -> None:
        if self.refill is None:
            return
        # The path's tokens at their positions: the pending token, then each emitted one (the
        # spine's KV holds the spine's token where a sibling was accepted).
        ids = torch.cat([s.pending, emitted[:, :-1]], 1).clamp(max=self.max_draft_id)   # [B, D+1]
        self.refill(ids, positions, s.span, *s.group("draft"))


def head_positions(positions: torch.Tensor, trash: int) -> torch.Tensor:
    """MTP head positions: a head query at p reads h_p; p < 0 (no hidden state yet) goes to
    the `trash` slot, the cache's last, which no real query reaches."""
    return torch.where(positions < 0, trash, positions).clamp(max=trash)


def _head_input(combine, out, first: int, taps: int) -> torch.Tensor:
    """The h a head reads, from a graph's outputs `out[first:first + taps]` at the layers it taps."""
    features = out[first] if taps == 1 else torch.cat([out[first + i] for i in range(taps)], -1)
    return features if combine is None else combine(features)[0]


def _gather_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [B, S, F] at rows [B, W] -> [B, W, F]."""
    return x.gather(1, rows[:, :, None].expand(-1, -1, x.shape[-1]))


class MTPDrafter(Drafter):
    """Drafts from an MTP head (one head pass per depth, along the spine of a spine tree; a
    chain of k by default), and its refill after verification.

    KV groups: the head's key and value buffers ("head"), the history of the target's final
    hidden states [B, S, H] ("history": h_p written when position p is verified), and the head's
    output one position ahead ("ahead": logits [B, 1, V] and g [B, 1, H] at the pending token's
    predecessor). Head position p reads (t_{p+1}, h_p), so draft 1 comes from the head at
    position last - 1 over (pending, h_{last-1}): that is the row of the previous step's refill
    at the accepted position (same token, hidden state, position and KV), and the refill keeps
    its output there instead of a draft pass computing it again (`prime` computes it once
    after the prefill). Drafts 2.. feed the head its own output g. After acceptance the head
    re-runs over the D+1 positions of the accepted path with the target's hidden states, so its
    KV holds what the target saw (the draft passes' entries are overwritten).
    """

    def __init__(self, head: fx.GraphModule, refill: fx.GraphModule, tree: Tree, *, taps: int = 1,
                 combine: fx.GraphModule | None = None):
        super().__init__()
        self.head, self.refill, self.combine, self.taps = head, refill, combine, taps
        self.tree, self.branching = tree, _spine(tree)

    def prime(self, s: StepInputs) -> None:
        """The head at the pending token's predecessor, which the first step's draft 1 reads. A
        one-token row has no hidden state yet: it reads zeros at head position 0 and sees only
        its own entry there (never a stale one); the refill rewrites slot 0."""
        (history,), ahead = s.group("history"), s.group("ahead")
        first = (s.last - 1)[:, None]                                 # [B, 1]
        h = _gather_rows(history, first.clamp(min=0))                 # [B, 1, H]
        h = torch.where(first[:, :, None] < 0, torch.zeros_like(h), h)
        out = self.head(s.pending, h, first.clamp(min=0, max=s.max_pos), s.span, *s.group("head"))
        for i, buffer in enumerate(ahead):                            # logits, g
            buffer.copy_(out[i])

    def propose(self, s: StepInputs) -> Proposal:
        x, (logits, h) = s.pending, s.group("ahead")                  # [B, 1], [B, 1, V], [B, 1, H]
        drafts, qs = [], []
        for j, width in enumerate(self.branching):           # the head runs along the spine
            if j:
                pos = (s.last - 1 + j).clamp(min=0, max=s.max_pos)[:, None]
                logits, h = self.head(x, h, pos, s.span, *s.group("head"))
            x, cand, q = candidates(logits[:, -1], width, s.sample, s.noise[:, j], s.warping)
            drafts.append(cand)
            qs.append(q)
        return Proposal(torch.cat(drafts, 1), torch.stack(qs, 1) if s.sample else None)

    def after_verify(self, s: StepInputs, out, positions: torch.Tensor, emitted: torch.Tensor, n: torch.Tensor,
                     path: torch.Tensor | None) -> None:
        hidden = _head_input(self.combine, out, 1, self.taps)        # [B, N+1, H]
        if path is not None:
            hidden = _gather_rows(hidden, path)                       # [B, D+1, H]: the accepted path's
        put_rows(s.group("history")[0], positions, hidden)
        # Refill: the token after position p is emitted[p - last] for every kept p. Its row n
        # (the new pending token over h at its predecessor) is the next step's draft 1, the
        # refill's only output.
        refilled = self.refill(emitted, hidden, positions, s.span, n[:, None], *s.group("head"))
        for i, buffer in enumerate(s.group("ahead")):                # logits, g
            buffer.copy_(refilled[i])


class SpecStep(nn.Module):
    """One step of any drafter: propose, verify the pending token and the drafts in one target
    pass, accept, let the drafter update, commit."""

    def __init__(self, drafter: Drafter, verify: fx.GraphModule, *, layout: KVLayout, max_pos: int, sample=False):
        super().__init__()
        if sample and not drafter.tree.is_chain and drafter.tree.branching is None:
            raise NotImplementedError(f"sampling over {drafter.tree} is not supported: draft a spine tree or a chain")
        self.drafter, self.verify, self.layout, self.max_pos, self.sample = drafter, verify, layout, max_pos, sample

    @property
    def k(self) -> int:
        """Drafts per step."""
        return self.drafter.tree.size

    @property
    def depth(self) -> int:
        """The most drafts one step accepts (k for a chain)."""
        return self.drafter.tree.depth

    def forward(self, tokens, lengths, max_lens, done, eos, accept_hist,
                uniforms, noise, temperature, top_k, top_p, span, kv):
        tree = self.drafter.tree
        s = StepInputs.of(tokens, lengths, noise, (temperature, top_k, top_p), span, kv, layout=self.layout,
                          max_pos=self.max_pos, sample=self.sample)
        p = self.drafter.propose(s)
        ids = s.pending if p.tokens is None else torch.cat([s.pending, p.tokens], 1)   # [B, N+1]
        target_kv = s.group(*self.drafter.verify_kv)
        # The verify graph places the rows itself (the `tree_attention` pass): positions, KV
        # slots and the tree's mask follow from `last`.
        out = self.verify(ids if p.verify_input is None else p.verify_input, s.last, span, *target_kv)
        emitted, n, path = self._accept(p, out[0], uniforms, noise[:, tree.depth], s.warping)
        if path is not None:     # a tree: the accepted path's KV moves to the slots of its positions
            move_path_kv(target_kv, s.last, path, self.max_pos)
        pos = Tree.chain(tree.depth).positions(s.last).clamp(max=self.max_pos)       # [B, D+1]: the kept rows
        self.drafter.after_verify(s, out, pos, emitted, n, path)
        commit(tokens, lengths, max_lens, done, eos, accept_hist, emitted, n)

    def _accept(self, p: Proposal, target_logits, uniforms, noise, warping):
        """(emitted, n, path): greedy acceptance, or rejection sampling against warp(target_logits)."""
        if not self.sample:
            return greedy_accept(p.tokens, target_logits, self.drafter.tree)
        target = warp(target_logits, *warping, filters=_filters(self.sample))   # [B, N+1, V]
        if p.tokens is None:
            token = race(target[:, 0], noise)[:, None]
            return token, token[:, 0] * 0, None
        tree = self.drafter.tree
        if not tree.is_chain:
            return tree_speculative_accept(p.tokens, p.q, target, uniforms, noise, tree.branching)
        return (*speculative_accept(p.tokens, p.q, target, uniforms, noise), None)


class Prime(nn.Module):
    """The drafter's pass between the first token and the first step (`Drafter.prime`), over
    the step's inputs: `forward(*step inputs, kv) -> ()`, writing the state in place."""

    def __init__(self, drafter: Drafter, *, layout: KVLayout, max_pos: int):
        super().__init__()
        self.drafter, self.layout, self.max_pos = drafter, layout, max_pos

    def forward(self, tokens, lengths, max_lens, done, eos, accept_hist,
                uniforms, noise, temperature, top_k, top_p, span, kv):
        self.drafter.prime(StepInputs.of(tokens, lengths, noise, (temperature, top_k, top_p), span, kv,
                                         layout=self.layout, max_pos=self.max_pos))


class MTPPrefill(nn.Module):
    """The target's prefill, then the head's over the same chunk (its KV from h, shifted by one).

    `forward(input_ids [B, C], positions [B, C], span, *kv) -> (hidden,)` (the target's last
    layer, as every prefill returns); `kv` the groups "target", "head", "history" of `layout`.
    Head position p reads (t_{p+1}, h_p): for this chunk's tokens at positions p+1 that is
    p = positions - 1, with h_{p} from the history (the previous chunk wrote the first one).
    """

    def __init__(self, target: fx.GraphModule, head: fx.GraphModule, *, layout: KVLayout, max_pos: int,
                 taps: int = 1, combine: fx.GraphModule | None = None):
        super().__init__()
        self.target, self.head, self.combine, self.taps = target, head, combine, taps
        self.layout, self.max_pos = layout, max_pos

    def forward(self, input_ids, positions, span, *kv):
        out = self.target(input_ids, positions, span, *self.layout.take(kv, "target"))
        hidden = _head_input(self.combine, out, 1, self.taps)
        (history,) = self.layout.take(kv, "history")
        put_rows(history, positions, hidden)
        hpos = head_positions(positions - 1, self.max_pos)
        self.head(input_ids, _gather_rows(history, hpos), hpos, span, *self.layout.take(kv, "head"))
        return (out[0],)                                              # the target's last hidden state


class _LeafGraphs(fx.Tracer):
    """Trace a step, keeping calls into captured graphs as `call_module` nodes."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, fx.GraphModule) or super().is_leaf_module(m, qualname)


def trace_step(step: nn.Module) -> fx.GraphModule:
    """FX graph of `step` with the captured graphs as call_module nodes (before fusion)."""
    graph = _LeafGraphs().trace(step)
    return fx.GraphModule(step, graph, step.__class__.__name__)
