"""The compile pipeline: capture -> passes -> fused step, one builder per drafter config.

`build(model, drafter, k=..., batch_size=..., max_seq_len=...)` returns `Graphs`: the prefill
graph, the fused step graph, the static state they share, and the PassManager's records.
Builders are registered against the config type (as torchao registers transforms against its
configs); a new drafter adds a config in `specfx.drafters` and a builder here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx

from specfx.capture import StaticDecoder, architecture, capture, example_span, export_graph, static_positions
from specfx.drafters import (DraftModel, EarlyExit, MTPHead, NoDraft, PromptLookup, check_same_tokenizer,
                             default_exit_layer)
from specfx.passes import (AttachEarlyExit, AttachMTPHead, CheckNoHostSync, CutAtExit, FindStructure,
                           FuseSpecStep, Pass, PassError, PassManager, ShareKVBuffers, SkinnyMatmul,
                           StructureError, StructureMap, TruncateAtExit, check_exit_layer)
from specfx.runtime.state import StaticState
from specfx.runtime.step import (DecodeStep, DraftModelStep, EarlyExitStep, MTPPrefill, MTPStep,
                                 PromptLookupStep, trace_step)

PREFILL_CHUNK = 64
KV_ALIGN = 16                        # the KV length is a multiple of this


class HostSyncError(RuntimeError):
    """The fused step contains ops that would sync the host."""


@dataclass
class Prefill:
    """A prefill graph and the slice of the state's KV list it writes."""

    name: str
    gm: fx.GraphModule               # (input_ids [B, W], positions [B, W], span, *kv) -> (hidden,), W <= C
    kv: slice


@dataclass
class Graphs:
    """Everything the runtime needs: graphs, state, and how they were built."""

    prefills: list[Prefill]          # the target's first, then a draft model's, if any
    step: fx.GraphModule | None      # (tokens, lengths, ..., top_p, kv) -> ()
    state: StaticState | None
    structure: StructureMap
    k: int
    drafter: object
    prefill_chunk: int
    max_seq_len: int
    parts: dict[str, fx.GraphModule] = field(default_factory=dict)  # draft / verify / decode / refill
    kv_slices: dict[str, slice] = field(default_factory=dict)        # part -> its slice of state.kv
    draft_calls: dict[str, int] = field(default_factory=dict)        # part -> calls per step (drafting)
    unfused_step: fx.GraphModule | None = None
    records: list = field(default_factory=list)
    make_step: Callable | None = None  # sample: False, True or a warp variant -> step module (before tracing)
    sample_steps: dict[str, fx.GraphModule] = field(default_factory=dict)   # warp variant -> fused step
    first: fx.GraphModule | None = None  # (hidden [B, 1, H], positions [B, 1], span) -> (logits [B, 1, V],)

    @property
    def prefill(self) -> fx.GraphModule:
        return self.prefills[0].gm

    def fused_sample_step(self, filters: str = "any") -> fx.GraphModule:
        """The sampling step with warp variant `filters` (`runtime.sampling.warp`), built on first use."""
        if filters not in self.sample_steps:
            pm = PassManager(self.records)
            name = "sample_step" if filters == "any" else f"sample_step[{filters}]"
            self.sample_steps[filters] = fuse_step(pm, self.make_step(filters), graph=name)
        return self.sample_steps[filters]


@dataclass
class Captured:
    """One model captured for the runtime: its structure, KV buffers and prefill graph."""

    structure: StructureMap
    decoder: StaticDecoder
    prefill: fx.GraphModule
    capture: Callable[[int], fx.GraphModule]   # width -> captured graph (not yet rewritten)

    @property
    def kv(self) -> list:
        return [t for i in range(self.structure.num_layers) for t in self.decoder.kv(i)]


@dataclass
class BuildContext:
    """What a drafter's builder gets."""

    graphs: Graphs
    pm: PassManager
    target: Captured
    drafter: object
    k: int
    seq_len: int
    batch_size: int
    model: object
    matmul: Callable | None = None                 # skinny_matmul's choice; None: pass off
    extra_kv: list = field(default_factory=list)   # KV buffers of a draft model, after the target's

    def tail(self) -> list[Pass]:
        """The passes that end every graph the runtime runs."""
        return tail_passes(self.matmul)


def tail_passes(matmul) -> list[Pass]:
    """KV buffers as inputs, then (with a measured plan) the skinny-matmul rewrite."""
    return [ShareKVBuffers(), *skinny_passes(matmul)]


def skinny_passes(matmul) -> list[Pass]:
    """The skinny-matmul rewrite with a measured plan; nothing without one."""
    return [SkinnyMatmul(matmul)] if matmul is not None else []


_BUILDERS: dict[type, Callable] = {}


def register(config_type: type):
    def deco(fn):
        _BUILDERS[config_type] = fn
        return fn
    return deco


def capture_model(pm: PassManager, model, *, name: str, batch_size: int, seq_len: int,
                  chunk: int, matmul=None) -> Captured:
    """Capture `model`'s prefill graph (any width up to `chunk`; head dropped: prefill only
    fills the KV cache), and map the model's structure on a one-token graph, whose node names
    the graphs of the other static widths share."""
    decoder = StaticDecoder(model, batch_size, seq_len)
    cap = lambda width, dynamic=False: capture(model, width=width, batch_size=batch_size,  # noqa: E731
                                               max_seq_len=seq_len, decoder=decoder, dynamic_width=dynamic).gm
    spare = {1: cap(1)}                  # the drafters' builders take it
    structure = pm.run(FindStructure(), spare[1], graph=f"{name} (width 1)").info["structure"]
    gm = cap(chunk, True)
    own = pm.run(FindStructure(), gm, graph=name).info["structure"]
    gm = pm.run_all([TruncateAtExit(own, own.num_layers, keep_head=False), *tail_passes(matmul)], gm, graph=name)
    return Captured(structure, decoder, gm, lambda width: spare.pop(width) if width in spare else cap(width))


def build(model, drafter, *, k: int, batch_size: int, max_seq_len: int,
          prefill_chunk: int = PREFILL_CHUNK, matmul=None) -> Graphs:
    """Capture `model`, run the drafter's passes and fuse its step.

    `matmul(M, N, K) -> Choice` turns on the skinny-matmul rewrite (see
    `specfx.matmul_choice.MatmulPlan`); None leaves every matmul to the backend.
    """
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    if batch_size < 1 or max_seq_len < 2:
        raise ValueError(f"batch_size must be >= 1 and max_seq_len >= 2, got {batch_size}, {max_seq_len}")
    drafter = resolve_drafter(model, drafter)
    builder = _BUILDERS.get(type(drafter))
    if builder is None:
        raise TypeError(f"no pipeline for drafter {drafter!r}")
    # Room for k+1 slots past the last real token, so a step never writes out of bounds, rounded
    # up so that the rows of a half-precision attention mask [B, 1, W, seq_len] stay aligned
    # (SDPA pads and copies an unaligned mask in every layer).
    seq_len = -(-(max_seq_len + k + 1) // KV_ALIGN) * KV_ALIGN
    pm = PassManager()
    chunk = min(prefill_chunk, max_seq_len)
    target = capture_model(pm, model, name="prefill", batch_size=batch_size, seq_len=seq_len, chunk=chunk,
                           matmul=matmul)
    L = target.structure.num_layers
    graphs = Graphs(prefills=[Prefill("prefill", target.prefill, slice(0, 2 * L))], step=None, state=None,
                    structure=target.structure, k=k, drafter=drafter, prefill_chunk=chunk,
                    max_seq_len=max_seq_len)
    ctx = BuildContext(graphs, pm, target, drafter, k, seq_len, batch_size, model, matmul)
    try:
        graphs.make_step, k_eff = builder(ctx)
    except PassError as e:
        if isinstance(e.__cause__, StructureError):   # a part the drafter needs: the user's to act on
            raise StructureError(f"{architecture(model)}, drafter {drafter}: {e.__cause__}") from e
        raise
    # The first new token comes from the prefill's last hidden state, through the head alone
    # (no KV buffers in it: of the tail passes only the skinny-matmul rewrite applies).
    graphs.first = pm.run_all([CutAtExit(target.structure, L), *skinny_passes(matmul)], target.capture(1),
                              graph="first")
    kv = target.kv + ctx.extra_kv   # the buffers the graphs were captured with: no second copy
    graphs.state = StaticState.allocate(batch_size=batch_size, seq_len=seq_len, k=k_eff,
                                        vocab_size=target.structure.vocab_size, kv=kv, device=kv[0].device)
    graphs.k = k_eff
    graphs.unfused_step = trace_step(graphs.make_step(False))
    graphs.step = fuse_step(pm, graphs.make_step(False), graph="step")
    graphs.records = pm.records
    return graphs


def fuse_step(pm: PassManager, step_module, *, graph: str) -> fx.GraphModule:
    """Trace a step module, inline its graph calls, and refuse it if it would sync the host."""
    fused = pm.run(FuseSpecStep(), trace_step(step_module), graph=graph).graph_module
    syncs = pm.run(CheckNoHostSync(), fused, graph=graph).info["host_syncs"]
    if syncs:
        raise HostSyncError("the fused step would sync the host: " + ", ".join(syncs))
    return fused


@register(NoDraft)
def _build_none(ctx: BuildContext):
    decode = ctx.pm.run_all(ctx.tail(), ctx.target.capture(1), graph="decode")
    ctx.graphs.parts["decode"] = decode
    num_kv = 2 * ctx.target.structure.num_layers
    ctx.graphs.kv_slices["decode"] = slice(0, num_kv)
    return lambda sample: DecodeStep(decode, num_kv=num_kv, max_pos=ctx.seq_len - 1, sample=sample), 0


@register(EarlyExit)
def _build_early_exit(ctx: BuildContext):
    s, E, k, pm = ctx.target.structure, ctx.drafter.layer, ctx.k, ctx.pm
    check_exit_layer(s, E)
    draft = pm.run_all([AttachEarlyExit(s, E), TruncateAtExit(s, E), *ctx.tail()], ctx.target.capture(1),
                       graph="draft")
    verify = pm.run_all([CutAtExit(s, E), *ctx.tail()], ctx.target.capture(k + 1), graph="verify")
    ctx.graphs.parts.update(draft=draft, verify=verify)
    ctx.graphs.kv_slices.update(draft=slice(0, 2 * E), verify=slice(2 * E, 2 * s.num_layers))
    ctx.graphs.draft_calls["draft"] = k + 1     # k drafts and the pass that writes the last one's KV
    return lambda sample: EarlyExitStep(draft, verify, k=k, exit_layer=E, num_layers=s.num_layers,
                                        max_pos=ctx.seq_len - 1, sample=sample), k


@register(PromptLookup)
def _build_prompt_lookup(ctx: BuildContext):
    verify = ctx.pm.run_all(ctx.tail(), ctx.target.capture(ctx.k + 1), graph="verify")
    ctx.graphs.parts["verify"] = verify
    num_kv = 2 * ctx.target.structure.num_layers
    ctx.graphs.kv_slices["verify"] = slice(0, num_kv)
    return lambda sample: PromptLookupStep(verify, k=ctx.k, ngram=ctx.drafter.ngram, num_kv=num_kv,
                                           max_pos=ctx.seq_len - 1, sample=sample), ctx.k


@register(MTPHead)
def _build_mtp(ctx: BuildContext):
    from specfx.mtp import Combine, StaticHead, target_parts

    s, k, pm, model = ctx.target.structure, ctx.k, ctx.pm, ctx.model
    head = ctx.drafter.load(model)
    if ctx.matmul is not None:
        ctx.matmul.include(head.parameters())
    static = StaticHead(model, head, ctx.batch_size, ctx.seq_len)
    param = next(model.parameters())
    hidden_size, taps = head.hidden_size, head.taps(s.num_layers)
    combiner = head.combiner(target_parts(model))

    def cap(width: int, name: str, logits: bool = False, dynamic: bool = False) -> fx.GraphModule:
        B = ctx.batch_size
        static.with_logits = logits
        ids = torch.zeros(B, width, dtype=torch.long, device=param.device)
        hidden = torch.zeros(B, width, hidden_size, dtype=param.dtype, device=param.device)
        args = (ids, hidden, static_positions(B, width, param.device), example_span(ctx.seq_len, param.device))
        gm = export_graph(static, args, span_arg=3, width_args=(0, 1, 2) if dynamic else ())
        return pm.run_all(ctx.tail(), gm, graph=name)

    def cap_combine(width: int, name: str, dynamic: bool = False) -> fx.GraphModule | None:
        if combiner is None:
            return None
        features = torch.zeros(ctx.batch_size, width, len(taps) * s.hidden_size, dtype=param.dtype,
                               device=param.device)
        gm = export_graph(Combine(combiner), (features,), width_args=(0,) if dynamic else ())
        return pm.run_all(ctx.tail(), gm, graph=name)

    attach = lambda: AttachMTPHead(s, head_hidden_size=hidden_size, taps=taps)  # noqa: E731
    draft, refill = cap(1, "draft", logits=True), cap(k + 1, "refill")
    verify = pm.run_all([attach(), *ctx.tail()], ctx.target.capture(k + 1), graph="verify")
    target_prefill = pm.run(attach(), ctx.graphs.prefill, graph="prefill").graph_module
    nt = 2 * s.num_layers
    history = torch.zeros(ctx.batch_size, ctx.seq_len, hidden_size, dtype=param.dtype, device=param.device)
    ctx.extra_kv.extend([*static.kv(), history])
    prefill = MTPPrefill(target_prefill, cap(ctx.graphs.prefill_chunk, "head_prefill", dynamic=True),
                         num_kv_target=nt, max_pos=ctx.seq_len - 1, taps=len(taps),
                         combine=cap_combine(ctx.graphs.prefill_chunk, "combine_prefill", dynamic=True))
    ctx.graphs.prefills[0] = Prefill("prefill", fuse_step(pm, prefill, graph="prefill"), slice(0, nt + 3))
    combine = cap_combine(k + 1, "combine")
    ctx.graphs.parts.update(draft=draft, refill=refill, verify=verify, **({"combine": combine} if combine else {}))
    ctx.graphs.kv_slices.update(draft=slice(nt, nt + 2), refill=slice(nt, nt + 2), verify=slice(0, nt))
    ctx.graphs.draft_calls.update(draft=k, refill=1)
    return lambda sample: MTPStep(draft, refill, verify, k=k, num_kv_target=nt, max_pos=ctx.seq_len - 1,
                                  sample=sample, taps=len(taps), combine=combine), k


@register(DraftModel)
def _build_draft_model(ctx: BuildContext):
    draft_model = ctx.drafter.load(like=ctx.model)
    check_same_tokenizer(ctx.model, draft_model)
    if ctx.matmul is not None:
        ctx.matmul.include(draft_model.parameters())
    d = capture_model(ctx.pm, draft_model, name="draft_prefill", batch_size=ctx.batch_size,
                      seq_len=ctx.seq_len, chunk=ctx.graphs.prefill_chunk, matmul=ctx.matmul)
    draft = ctx.pm.run_all(ctx.tail(), d.capture(1), graph="draft")
    verify = ctx.pm.run_all(ctx.tail(), ctx.target.capture(ctx.k + 1), graph="verify")
    nt, nd = 2 * ctx.target.structure.num_layers, 2 * d.structure.num_layers
    ctx.graphs.prefills.append(Prefill("draft_prefill", d.prefill, slice(nt, nt + nd)))
    ctx.extra_kv.extend(d.kv)
    ctx.graphs.parts.update(draft=draft, verify=verify)
    ctx.graphs.kv_slices.update(draft=slice(nt, nt + nd), verify=slice(0, nt))
    ctx.graphs.draft_calls["draft"] = ctx.k + 1  # k drafts and the catch-up pass
    return lambda sample: DraftModelStep(
        draft, verify, k=ctx.k, num_kv_target=nt, num_kv_draft=nd, draft_vocab=d.structure.vocab_size,
        target_vocab=ctx.target.structure.vocab_size, max_pos=ctx.seq_len - 1, sample=sample), ctx.k


def resolve_drafter(model, drafter):
    """Fill in model defaults (the exit layer) so the config names what will run."""
    if isinstance(drafter, EarlyExit) and drafter.layer is None:
        return EarlyExit(layer=default_exit_layer(model))
    return drafter
