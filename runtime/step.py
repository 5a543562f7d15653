"""Step assembly: one decoding step as a module over the static state, ready to fuse.

Each step module calls the captured graphs (as submodules), then the shared acceptance and
state update, and returns nothing: all effects are in-place writes to the state tensors passed
in. `trace_step(module)` turns it into an FX graph whose graph calls stay `call_module` nodes;
the `fuse_spec_step` pass then inlines them into one flat graph.

- `DecodeStep`: plain static decoding (no speculation), one token per step.
- `EarlyExitStep`: k early-exit drafts, verification of k+1 positions by layers >= E fed with
  the drafts' exit hidden states, acceptance, bonus token.
- `PromptLookupStep`: k drafts copied from an earlier n-gram match in the token buffer, verified
  by the whole target in one pass of k+1 positions.
- `DraftModelStep`: k drafts from a separate draft model advancing in unison with the target
  (same positions and lengths, its own KV), then its catch-up pass over the last draft.
- `MTPStep`: k drafts from an MTP head fed by the target's final hidden states, verification
  of k+1 tokens by the whole target (which also returns its hidden states), then the head's
  refill over the verified positions. `MTPPrefill` fills the head's KV during prefill.

With `sample=True` (or the name of a `warp` variant, see `sampling.filters_for`) a step
samples instead of taking the argmax: drafts are drawn from the drafter's warped distribution
q, and `speculative_accept` (rejection sampling) keeps the target's distribution p. Random
numbers are step inputs, drawn by the runtime beforehand.
"""

from __future__ import annotations

import torch
from torch import fx, nn

from specfx.runtime.accept import commit, greedy_accept
from specfx.runtime.lookup import ngram_propose
from specfx.runtime.sampling import race, speculative_accept, warp


def _filters(sample) -> str:
    """The `warp` variant a sampling step runs (`sample=True`: the one exact for every setting)."""
    return "any" if sample is True else sample


def propose(logits, sample, noise, warping):
    """Next token [B, 1] from logits [B, V]: argmax, or a draw from warp(logits) (also returned)."""
    if not sample:
        return logits.argmax(-1)[:, None], None
    q = warp(logits, *warping, filters=_filters(sample))
    return race(q, noise)[:, None], q


def _offsets(last, k: int):
    """0..k on `last`'s device (made in the step: a module buffer would stay on the CPU)."""
    return torch.arange(k + 1, device=last.device)


def _verify(verify, tokens, last, drafts, k: int, max_pos: int, span, kv):
    """The target over [pending token, drafts] at positions last..last+k: (its outputs, positions)."""
    ids = torch.cat([tokens.gather(1, last[:, None]), drafts], 1)      # [B, k+1]
    pos = (last[:, None] + _offsets(last, k)).clamp(max=max_pos)      # [B, k+1]
    return verify(ids, pos, span, *kv), pos


def _accept(sample, drafts, q, target_logits, uniforms, noise, warping):
    """(emitted, n): greedy acceptance, or rejection sampling against warp(target_logits)."""
    if not sample:
        return greedy_accept(drafts, target_logits)
    return speculative_accept(drafts, q, warp(target_logits, *warping, filters=_filters(sample)), uniforms, noise)


class DecodeStep(nn.Module):
    """No draft: the target decodes the pending token and appends its argmax."""

    k = 0

    def __init__(self, target: fx.GraphModule, num_kv: int, max_pos: int, sample: bool = False):
        super().__init__()
        self.target, self.num_kv, self.max_pos, self.sample = target, num_kv, max_pos, sample

    def forward(self, tokens, lengths, max_lens, done, eos, accept_hist,
                uniforms, noise, temperature, top_k, top_p, span, kv):
        last = lengths - 1                                            # [B]
        x = tokens.gather(1, last[:, None])                           # [B, 1]
        logits = self.target(x, last[:, None], span, *[kv[i] for i in range(self.num_kv)])[0]
        emitted = propose(logits[:, -1], self.sample, noise[:, 0], (temperature, top_k, top_p))[0]
        commit(tokens, lengths, max_lens, done, eos, accept_hist, emitted, lengths * 0)


class EarlyExitStep(nn.Module):
    """k early-exit drafts + verification by the remaining layers + acceptance."""

    def __init__(self, draft: fx.GraphModule, verify: fx.GraphModule, *, k: int, exit_layer: int,
                 num_layers: int, max_pos: int, sample: bool = False):
        super().__init__()
        self.draft, self.verify = draft, verify
        self.k, self.exit_layer, self.num_layers, self.max_pos = k, exit_layer, num_layers, max_pos
        self.sample = sample

    def forward(self, tokens, lengths, max_lens, done, eos, accept_hist,
                uniforms, noise, temperature, top_k, top_p, span, kv):
        split = 2 * self.exit_layer
        kv_draft = [kv[i] for i in range(split)]
        kv_verify = [kv[i] for i in range(split, 2 * self.num_layers)]
        last = lengths - 1                                            # [B]
        x = tokens.gather(1, last[:, None])                           # [B, 1]
        warping = (temperature, top_k, top_p)
        hidden, drafts, qs = [], [], []
        # k+1 draft passes: the last one only computes the exit hidden state of draft k.
        for j in range(self.k + 1):
            pos = (last + j).clamp(max=self.max_pos)[:, None]         # [B, 1]
            out = self.draft(x, pos, span, *kv_draft)
            hidden.append(out[1])                                     # [B, 1, H]
            if j < self.k:
                x, q = propose(out[0][:, -1], self.sample, noise[:, j], warping)   # [B, 1], [B, V]
                drafts.append(x)
                qs.append(q)
        pos = (last[:, None] + _offsets(last, self.k)).clamp(max=self.max_pos)  # [B, k+1]
        target_logits = self.verify(torch.cat(hidden, 1), pos, span, *kv_verify)[0]
        emitted, n = _accept(self.sample, torch.cat(drafts, 1), torch.stack(qs, 1) if self.sample else None,
                             target_logits, uniforms, noise[:, self.k], warping)
        commit(tokens, lengths, max_lens, done, eos, accept_hist, emitted, n)


class PromptLookupStep(nn.Module):
    """k drafts from n-gram lookup in the token buffer + one verification pass of k+1 tokens."""

    def __init__(self, target: fx.GraphModule, *, k: int, ngram: int, num_kv: int, max_pos: int,
                 sample: bool = False):
        super().__init__()
        self.target, self.k, self.ngram, self.num_kv, self.max_pos = target, k, ngram, num_kv, max_pos
        self.sample = sample

    def forward(self, tokens, lengths, max_lens, done, eos, accept_hist,
                uniforms, noise, temperature, top_k, top_p, span, kv):
        last = lengths - 1                                            # [B]
        drafts = ngram_propose(tokens, lengths, self.ngram, self.k)   # [B, k]
        out, _ = _verify(self.target, tokens, last, drafts, self.k, self.max_pos, span,
                         [kv[i] for i in range(self.num_kv)])
        logits = out[0]                                               # [B, k+1, V]
        # Deterministic drafts: q is one-hot.
        q = (drafts[..., None] == torch.arange(logits.shape[-1], device=logits.device)).float() \
            if self.sample else None
        emitted, n = _accept(self.sample, drafts, q, logits, uniforms, noise[:, self.k],
                             (temperature, top_k, top_p))
        commit(tokens, lengths, max_lens, done, eos, accept_hist, emitted, n)


class DraftModelStep(nn.Module):
    """k drafts from a separate draft model (own KV), target verification of k+1 tokens."""

    def __init__(self, draft: fx.GraphModule, verify: fx.GraphModule, *, k: int, num_kv_target: int,
                 num_kv_draft: int, draft_vocab: int, target_vocab: int, max_pos: int, sample: bool = False):
        super().__init__()
        self.draft, self.verify, self.k, self.max_pos, self.sample = draft, verify, k, max_pos, sample
        self.num_kv_target, self.num_kv_draft = num_kv_target, num_kv_draft
        # Vocab sizes may differ by padding: drafts come from the shared part only.
        self.vocab, self.pad = min(draft_vocab, target_vocab), max(0, target_vocab - draft_vocab)
        self.max_draft_id = draft_vocab - 1

    def forward(self, tokens, lengths, max_lens, done, eos, accept_hist,
                uniforms, noise, temperature, top_k, top_p, span, kv):
        kv_target = [kv[i] for i in range(self.num_kv_target)]
        kv_draft = [kv[i] for i in range(self.num_kv_target, self.num_kv_target + self.num_kv_draft)]
        last = lengths - 1                                            # [B]
        x = tokens.gather(1, last[:, None])                           # [B, 1]
        warping = (temperature, top_k, top_p)
        drafts, qs = [], []
        # k draft passes, then a catch-up pass that writes draft k into the draft's KV cache.
        for j in range(self.k + 1):
            pos = (last + j).clamp(max=self.max_pos)[:, None]
            # A target token past the draft's vocab (padding) must not index out of its embedding.
            logits = self.draft(x.clamp(max=self.max_draft_id), pos, span, *kv_draft)[0][:, -1, : self.vocab]
            if j == self.k:
                break
            x, q = propose(logits, self.sample, noise[:, j, : self.vocab], warping)
            drafts.append(x)
            if self.sample:
                qs.append(torch.cat([q, q.new_zeros(q.shape[0], self.pad)], -1) if self.pad else q)
        drafts = torch.cat(drafts, 1)                                 # [B, k]
        target_logits = _verify(self.verify, tokens, last, drafts, self.k, self.max_pos, span,
                                kv_target)[0][0]                      # [B, k+1, V]
        emitted, n = _accept(self.sample, drafts, torch.stack(qs, 1) if self.sample else None,
                             target_logits, uniforms, noise[:, self.k], warping)
        commit(tokens, lengths, max_lens, done, eos, accept_hist, emitted, n)


def head_positions(positions: torch.Tensor, trash: int) -> torch.Tensor:
    """MTP head positions: a head query at p reads h_p; p < 0 (no hidden state yet) goes to
    the `trash` slot, the cache's last, which no real query reaches."""
    return torch.where(positions < 0, trash, positions).clamp(max=trash)


def _head_input(combine, out, first: int, taps: int) -> torch.Tensor:
    """The h a head reads, from a graph's outputs `out[first:first + taps]` at the layers it taps."""
    features = out[first] if taps == 1 else torch.cat([out[first + i] for i in range(taps)], -1)
    return features if combine is None else combine(features)[0]


def _gather_hidden(history: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """history [B, S, H] at positions [B, W] -> [B, W, H]."""
    return history.gather(1, positions[:, :, None].expand(-1, -1, history.shape[-1]))


def _scatter_hidden(history: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor) -> None:
    history.scatter_(1, positions[:, :, None].expand(-1, -1, history.shape[-1]), hidden.to(history.dtype))


class MTPStep(nn.Module):
    """k drafts from an MTP head + verification of k+1 tokens by the target + the head's refill.

    State (`kv`): the target's KV, then the head's key and value buffers, then the history of
    the target's final hidden states [B, S, H] (h_p written when position p is verified). Draft
    1 reads h at the pending token's predecessor (zeros for a one-token row); drafts 2..k feed
    the head its own output.
    After acceptance the head re-runs over the k+1 verified positions with the target's hidden
    states, so its KV holds what the target saw (the draft passes' entries are overwritten).
    """

    def __init__(self, head: fx.GraphModule, refill: fx.GraphModule, verify: fx.GraphModule, *, k: int,
                 num_kv_target: int, max_pos: int, sample: bool = False, taps: int = 1,
                 combine: fx.GraphModule | None = None):
        super().__init__()
        self.head, self.refill, self.verify, self.combine, self.taps = head, refill, verify, combine, taps
        self.k, self.nt, self.max_pos, self.sample = k, num_kv_target, max_pos, sample

    def forward(self, tokens, lengths, max_lens, done, eos, accept_hist,
                uniforms, noise, temperature, top_k, top_p, span, kv):
        kv_target = [kv[i] for i in range(self.nt)]
        head_kv, history = (kv[self.nt], kv[self.nt + 1]), kv[self.nt + 2]
        last = lengths - 1                                            # [B]
        x = tokens.gather(1, last[:, None])                           # [B, 1]
        warping = (temperature, top_k, top_p)
        # A one-token row has no hidden state yet: draft 1 reads zeros at head position 0 and sees
        # only its own entry there (never a stale one); the refill below rewrites slot 0.
        first = (last - 1)[:, None]                                   # [B, 1]
        h = _gather_hidden(history, first.clamp(min=0))               # [B, 1, H]
        h = torch.where(first[:, :, None] < 0, torch.zeros_like(h), h)
        drafts, qs = [], []
        for j in range(self.k):
            pos = (first + j).clamp(min=0, max=self.max_pos)
            logits, h = self.head(x, h, pos, span, *head_kv)
            x, q = propose(logits[:, -1], self.sample, noise[:, j], warping)
            drafts.append(x)
            qs.append(q)
        drafts = torch.cat(drafts, 1)                                 # [B, k]
        out, pos = _verify(self.verify, tokens, last, drafts, self.k, self.max_pos, span, kv_target)
        target_logits, hidden = out[0], _head_input(self.combine, out, 1, self.taps)  # [B, k+1, V], [B, k+1, H]
        emitted, n = _accept(self.sample, drafts, torch.stack(qs, 1) if self.sample else None,
                             target_logits, uniforms, noise[:, self.k], warping)
        _scatter_hidden(history, pos, hidden)
        # Refill: the token after position p is emitted[p - last] for every kept p.
        self.refill(emitted, hidden, pos, span, *head_kv)
        commit(tokens, lengths, max_lens, done, eos, accept_hist, emitted, n)


class MTPPrefill(nn.Module):
    """The target's prefill, then the head's over the same chunk (its KV from h, shifted by one).

    `forward(input_ids [B, C], positions [B, C], span, *kv) -> (hidden,)` (the target's last
    layer, as every prefill returns); `kv` as in `MTPStep`.
    Head position p reads (t_{p+1}, h_p): for this chunk's tokens at positions p+1 that is
    p = positions - 1, with h_{p} from the history (the previous chunk wrote the first one).
    """

    def __init__(self, target: fx.GraphModule, head: fx.GraphModule, *, num_kv_target: int, max_pos: int,
                 taps: int = 1, combine: fx.GraphModule | None = None):
        super().__init__()
        self.target, self.head, self.combine, self.taps = target, head, combine, taps
        self.nt, self.max_pos = num_kv_target, max_pos

    def forward(self, input_ids, positions, span, *kv):
        out = self.target(input_ids, positions, span, *[kv[i] for i in range(self.nt)])
        hidden = _head_input(self.combine, out, 1, self.taps)
        history = kv[self.nt + 2]
        _scatter_hidden(history, positions, hidden)
        hpos = head_positions(positions - 1, self.max_pos)
        self.head(input_ids, _gather_hidden(history, hpos), hpos, span, kv[self.nt], kv[self.nt + 1])
        return (out[0],)                                              # the target's last hidden state


class _LeafGraphs(fx.Tracer):
    """Trace a step, keeping calls into captured graphs as `call_module` nodes."""

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return isinstance(m, fx.GraphModule) or super().is_leaf_module(m, qualname)


def trace_step(step: nn.Module) -> fx.GraphModule:
    """FX graph of `step` with the captured graphs as call_module nodes (before fusion)."""
    graph = _LeafGraphs().trace(step)
    return fx.GraphModule(step, graph, step.__class__.__name__)
