"""Attention over the static KV cache, masked by positions, over a span the host chooses.

While a model is captured (`bind(config, positions, span, reduce=..., tiled=...)`), its attention layers
call `attention` here instead of transformers' own implementation (registered as "specfx" in
transformers' `AttentionInterface`). A query at position p sees cache slot s iff s <= p (and
p - s < window on sliding-window layers, which transformers passes as `sliding_window`), so
rejected drafts beyond a row's length are masked, never cropped. A verify graph may be given
its mask instead (`bind(..., visible=...)`: a draft tree's rows see their ancestors' slots),
still cut to the window.

Only the first `span.shape[0]` slots are read. `span` is a graph input whose length is the
one dynamic size of a captured graph: the runtime passes a length that covers every position
the next step can reach (on the CPU it reads the lengths before each step), so attention costs what the
context costs, not what `max_seq_len` costs, with one compiled graph and no recompilation. On
CUDA the runtime passes the whole cache, so the step keeps static shapes for CUDA graphs.

Forms of the same math:
- on the CPU (`reduce=True`), for a fixed width of at most `REDUCE_MAX_QUERIES` queries (decode,
  drafts, verification), where a BLAS-backed SDPA call costs several times more per layer,
  products and sums that stream the cache: in float32, specfx's tiled kernels
  (`tiled=True`; the capture asks `tiled_available` first): `tiled_attend`, each head's
  scores, masked softmax and weighted values in one kernel, one parallel region a layer (with
  Gemma 2's soft-capping, the scores as `tiled_linear` of the queries against the span of
  cached keys and the weighted values as `tiled_mix`, the softmax between them Inductor's),
  otherwise reductions that Inductor generates itself (one horizontal sum per query and slot).
  On pycoder at a 200-token context the tiled form took a decode graph from 2.24 to 2.15 ms, a
  4-row verify from 2.40 to 2.30 and a 16-row one from 4.90 to 4.24 (interleaved A/B, 15
  rounds); the fused kernel then took the decode graph from 1.693 to 1.654 ms and the 4-row
  verify from 2.224 to 2.099 (one process, round-robin, 40 rounds, a ~115-token prompt);
  A prefill chunk (a symbolic width) takes `tiled_attend` too, in tiles of 4 query rows (each
  tile reads its head's keys and values from the cache while they are warm): against SDPA,
  pycoder's first token over 8 prompts of 77-119 tokens 10.56 -> 10.07 ms, over one prompt of
  854 tokens 113.95 -> 93.93 ms (`benchmarks/prefill_attention.py`, and `--max-seq-len 1024
  --long 900`);
- `scaled_dot_product_attention`: elsewhere (fused kernels on CUDA), and for the CPU's wide or
  variable-width prefill where the tiled kernel does not apply (soft-capping, other dtypes),
  where one product-and-sum per query and slot loses to SDPA's GEMMs.
Logit soft-capping (Gemma 2's `softcap`) and grouped-query attention are handled in both; a
model that asks for anything else (attention sinks) is refused.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch._prims_common import make_contiguous_strides_for

from specfx.kernels.tiled_linear import VERSION, available, mix_fits, tiled_attend, tiled_linear, tiled_mix
from specfx.passes.skinny_matmul import MATERIALIZE

NAME = "specfx"
# A wide or variable-width query (a prefill chunk) takes the tiled kernel too, where it applies
# (float32 on the CPU, no soft-capping); False: SDPA (`benchmarks/prefill_attention.py`).
TILED_PREFILL = True
REDUCE_MAX_QUERIES = 16      # wider (or symbolic) widths: the tiled kernel where it applies, else SDPA
_IMPL = "_attn_implementation_internal"      # what a transformers config's `_attn_implementation` reads
_UNSET = object()


def _reduces(reduce: bool, width) -> bool:
    """Whether queries of this width take the reduction forms (`reduce` set, a fixed width of at
    most REDUCE_MAX_QUERIES)."""
    return reduce and isinstance(width, int) and width <= REDUCE_MAX_QUERIES


@dataclass
class _Bound:
    positions: torch.Tensor        # [B, W] long: each query's position
    span: torch.Tensor             # [L]: attention reads cache slots 0..L-1
    reduce: bool
    tiled: bool                    # reduce through the tiled kernels
    visible: torch.Tensor | None   # [B, 1, W, S] bool, given: which slots each query sees
    calls: int = 0                 # attention calls so far (0 after a forward: the model bypasses us)
    full: tuple | None = None      # (visible [B, 1, W, L], bias [B, W, L]) of the layers without a window


_bound: list[_Bound] = []          # the forward being captured (innermost last)


def visibility(positions: torch.Tensor, length, window: int) -> torch.Tensor:
    """[B, 1, W, length] bool: query (b, w) sees slot s iff s <= positions[b, w] (and
    positions[b, w] - s < window when window > 0)."""
    slots = torch.arange(length, device=positions.device)                       # [L]
    p = positions[:, :, None]                                                    # [B, W, 1]
    visible = slots <= p
    if window:
        visible = visible & (slots > p - window)
    return visible[:, None]


def mask_bias(visible: torch.Tensor) -> torch.Tensor:
    """`visible` [B, 1, W, L] bool as the tiled kernel's bias [B, W, L]: 0 where seen, -inf where not."""
    B, _, W, L = visible.shape
    return torch.where(visible, 0.0, float("-inf")).reshape(B, W, L)


def attend(q, k, v, visible, scale: float, softcap: float, reduce: bool, tiled: bool = False,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, W, D] over k, v [B, Hkv, L, D] where `visible` [B, 1, W, L]; with `reduce`,
    scores and weighted values as products and sums, through the tiled kernels where `tiled`
    (and the values' rows fit them), which read `visible` as `bias` [B, W, L] (0 where a query
    sees a slot, -inf where not; built from `visible` when not given).

    Returns [B, W, H, D], contiguous, as transformers' attention functions do.
    """
    if not reduce and not softcap:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2).contiguous()
    B, H, W, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    G = H // Hkv
    qg = q.reshape(B, Hkv, G * W, D)                                             # query heads by kv head
    tiled = reduce and tiled and mix_fits(v.shape, v.dtype, v.device)
    if tiled and not softcap:                # one kernel: scores, masked softmax, weighted values
        if bias is None:
            bias = mask_bias(visible)
        out = tiled_attend(qg.reshape(B * Hkv, G * W, D), k.reshape(B * Hkv, L, D), v.reshape(B * Hkv, L, D),
                           bias, scale, VERSION)
        return out.reshape(B, H, W, D).transpose(1, 2).contiguous()
    if tiled:
        scores = tiled_linear(qg.reshape(B * Hkv, G * W, D), k.reshape(B * Hkv, L, D), VERSION)
        scores = scores.reshape(B, Hkv, G * W, L)
    elif reduce:
        # Computed once into a buffer: else Inductor inlines the query's rotary (sin, cos)
        # into the score loop and recomputes it for every cache slot.
        qg = MATERIALIZE(qg, make_contiguous_strides_for(qg.shape))
        scores = (qg[:, :, :, None, :] * k[:, :, None, :, :]).sum(-1)           # [B, Hkv, G*W, L]
    else:
        scores = qg @ k.transpose(-1, -2)
    scores = scores * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap                          # Gemma 2's order
    scores = scores.reshape(B, H, W, L).masked_fill(~visible, float("-inf"))
    probs = scores.softmax(-1, dtype=torch.float32).to(q.dtype).reshape(B, Hkv, G * W, L)
    if tiled:
        out = tiled_mix(probs.reshape(B * Hkv, G * W, L), v.reshape(B * Hkv, L, D), VERSION)
    elif reduce:
        out = (probs[..., None] * v[:, :, None, :, :]).sum(-2)                  # [B, Hkv, G*W, D]
    else:
        out = probs @ v
    return out.reshape(B, H, W, D).transpose(1, 2).contiguous()


def tiled_available(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether attention of this dtype on this device can run through specfx's tiled kernels
    (`specfx.kernels.tiled_linear`): float32 on the CPU, where this torch's Inductor compiles
    them. Asked before capture: the check compiles a small graph."""
    return dtype == torch.float32 and device.type == "cpu" and available()[0]


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
              sliding_window=None, softcap=None, **kwargs):
    """transformers attention function: `(attn_output [B, W, H, D], None)`."""
    if not _bound:
        raise RuntimeError("specfx attention runs only inside a model bound by specfx.attention.bind")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{type(module).__name__}: attention sinks (s_aux) are not supported by specfx")
    b = _bound[-1]
    b.calls += 1
    L = b.span.shape[0]
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    window = int(sliding_window or 0)
    bias = None
    if not window and b.full is not None:
        visible, bias = b.full
    elif b.visible is None:
        visible = visibility(b.positions, L, window)
    else:
        visible = b.visible[..., :L]
        if window:           # a tree's slots past a query's position are its own rows', inside any window
            slots = torch.arange(L, device=b.positions.device)
            visible = visible & (slots > b.positions[:, :, None] - window)[:, None]
    reduce = _reduces(b.reduce, query.shape[2]) or (
        b.tiled and TILED_PREFILL and not softcap and mix_fits(value.shape, value.dtype, value.device))
    out = attend(query, key[:, :, :L], value[:, :, :L], visible, scale, float(softcap or 0.0), reduce, b.tiled,
                 bias)
    return out, None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, attention)


def _configs(config):
    """The config and every sub-config below it."""
    yield config
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None:
            yield from _configs(sub)


@contextlib.contextmanager
def bind(config, positions: torch.Tensor, span: torch.Tensor, *, reduce: bool, tiled: bool = False,
         visible: torch.Tensor | None = None):
    """Within the block, attention of models with this config runs `attention` at these
    positions (each query sees the slots up to its position, or those `visible` marks)."""
    _register()
    configs = list(_configs(config))
    saved = [c.__dict__.get(_IMPL, _UNSET) for c in configs]
    for c in configs:
        setattr(c, _IMPL, NAME)
    bound = _Bound(positions, span, reduce, tiled, visible)
    if tiled:
        # The tiled kernels' mask, built once ahead of the layers (outside every layer's nodes, so
        # passes that cut layers keep it) and read by every layer without a window: one buffer
        # where each layer had built a copy of its own.
        L = span.shape[0]
        full = visibility(positions, L, 0) if visible is None else visible[..., :L]
        bound.full = (full, mask_bias(full))
    _bound.append(bound)
    try:
        yield bound
    finally:
        _bound.pop()
        for c, value in zip(configs, saved):
            if value is _UNSET:
                delattr(c, _IMPL)
            else:
                setattr(c, _IMPL, value)
