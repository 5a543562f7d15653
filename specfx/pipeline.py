"""The compile pipeline: capture -> passes -> fused step, one builder per drafter config.

`build(model, drafter, k=..., batch_size=..., max_seq_len=...)` returns `Graphs`: the prefill
graph, the fused step graph, the static state they share, and the PassManager's records.
Builders are registered against the config type (as torchao registers transforms against its
configs); a new drafter adds a config in `specfx.drafters` and a builder here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx, nn

from specfx.capture import (StaticDecoder, architecture, capture, example_span, export_cached, export_graph,
                            static_positions)
from specfx.drafters import (EARLY_EXIT_TREE, DraftModel, EarlyExit, MTPHead, NoDraft, PromptLookup,
                             check_same_tokenizer, default_exit_layer)
from specfx.passes import (AttachEarlyExit, CheckNoHostSync, CutAtExit, DropHead, ExposeHidden, FindStructure,
                           InlineGraphCalls, Pass, PassError, PassManager, ShareKVBuffers, ShareRotary, SkinnyMatmul,
                           StoreDraftWeights, StructureError, StructureMap, TreeAttention, TruncateAtExit,
                           check_exit_layer)
from specfx.passes.store_draft_weights import stored_weights
from specfx.runtime.state import KVLayout, StaticState
from specfx.runtime.step import (DraftModelDrafter, EarlyExitDrafter, LookupDrafter, MTPDrafter, MTPPrefill,
                                 NoDrafter, Prime, SpecStep, trace_step)
from specfx.runtime.tree import Tree

# Prefill chunk: one graph serves every width up to it. On the 2-core CPU a 115-token prompt
# took 35 ms in chunks of 64 and 29 ms in one of 128 (fewer weight reads, wider matmuls).
PREFILL_CHUNK = 128
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
class Part:
    """A graph the step calls: what it reads of the state's KV list, and how often per step."""

    gm: fx.GraphModule
    kv: tuple[str, ...]              # its KV groups (`KVLayout`), its last inputs
    draft_calls: int = 0             # calls per step spent drafting (0: not a draft graph)


@dataclass
class Drafting:
    """What a drafter's builder returns: its KV layout, its graphs, and its step."""

    layout: KVLayout
    parts: dict[str, Part]           # draft / verify / refill / combine
    make_step: Callable              # sample: False, True or a warp variant -> step module (before tracing)
    prefills: list[Prefill]          # the target's (with any head it fills) first, then a draft model's
    extra_kv: list = field(default_factory=list)   # buffers after the target's (head, history, draft model)
    prime: nn.Module | None = None   # runs between the first token and the first step (`step.Prime`)


@dataclass
class Graphs:
    """Everything the runtime needs: graphs, state, and how they were built."""

    prefills: list[Prefill]          # the target's first, then a draft model's, if any
    step: fx.GraphModule             # (tokens, lengths, ..., top_p, span, kv) -> ()
    unfused_step: fx.GraphModule     # the step before its graph calls are inlined
    state: StaticState
    structure: StructureMap
    k: int                           # drafts on the proposal's longest path (0 without a drafter)
    tree: Tree                       # the proposal's shape: k + 1 tokens at most per step, tree.size drafts
    drafter: object
    prefill_chunk: int
    max_seq_len: int
    kv_layout: KVLayout
    parts: dict[str, fx.GraphModule]          # draft / verify / refill / combine
    kv_slices: dict[str, slice]               # part -> its slice of state.kv
    draft_calls: dict[str, int]               # draft part -> calls per step
    first: fx.GraphModule            # (hidden [B, 1, H], positions [B, 1], span) -> (logits [B, 1, V],)
    prime: fx.GraphModule | None     # (*step inputs, kv) -> (): the drafter's pass before the first step
    records: list
    make_step: Callable              # sample: False, True or a warp variant -> step module (before tracing)
    sample_steps: dict[str, fx.GraphModule] = field(default_factory=dict)   # warp variant -> fused step, on use

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
    capture: Callable[..., fx.GraphModule]   # (width, explicit_mask=False) -> captured graph, not yet rewritten

    @property
    def kv(self) -> list:
        return [t for i in range(self.structure.num_layers) for t in self.decoder.kv(i)]


@dataclass
class BuildContext:
    """What a drafter's builder gets."""

    pm: PassManager
    target: Captured
    drafter: object
    tree: Tree                                     # the proposal's shape: a chain of k, or the drafter's tree
    seq_len: int
    batch_size: int
    prefill_chunk: int
    model: object
    matmul: Callable | None = None                 # skinny_matmul's choice; None: pass off

    def tail(self, buffers: list[str] | None = None) -> list[Pass]:
        """The passes that end every graph the runtime runs (`buffers`: its KV buffers' names,
        for a graph without a StructureMap)."""
        return tail_passes(self.matmul, buffers)

    def tiled(self) -> bool:
        """Whether the graphs' few-row linears may run on the tiled kernel (the skinny-matmul
        pass is on and this Inductor compiles the kernel), which reads int8 and bfloat16 weights
        as stored."""
        from specfx.kernels import tiled_linear

        return self.matmul is not None and tiled_linear.available()[0]

    @property
    def k(self) -> int:
        """Drafts on the tree's longest path (k of a chain)."""
        return self.tree.depth

    @property
    def max_pos(self) -> int:
        return self.seq_len - 1

    def verify(self, passes: list[Pass] = (), *, drafts: int | None = None, name: str = "verify") -> fx.GraphModule:
        """The target over the pending token and `drafts` drafts in a chain (default: the
        tree's nodes), at the pending token's position `last` (see `SpecStep`)."""
        tree = self.tree if drafts is None else Tree.chain(drafts)
        gm = self.target.capture(tree.size + 1, explicit_mask=True)
        return self.pm.run_all([*passes, TreeAttention(tree, self.max_pos), *self.tail()], gm, graph=name)

    def target_prefill(self, layout: KVLayout, *groups: str) -> Prefill:
        """The target's prefill graph, writing the KV `groups` (default: "target") of `layout`."""
        return Prefill("prefill", self.target.prefill, layout.slice(*(groups or ("target",))))


SETTLE_CONTEXT = 200    # the context `_verify_call` verifies at
SETTLE_BACKEND = "inductor"


def _verify_call(ctx: BuildContext, kernel: str) -> Callable[[], object]:
    """A call of the target's verify pass over the proposal's rows with every linear on
    `kernel` (see `_settle_call`). What `MatmulPlan.settle` times for the model's weights."""
    from specfx.matmul_choice import FixedPlan

    gm = dataclasses.replace(ctx, pm=PassManager(), matmul=FixedPlan(kernel)).verify(name="settle")
    return _settle_call(ctx, gm, ctx.target.kv)


def _settle_draft(ctx: BuildContext, index: int | None, draft: Callable, kv: list, calls: int,
                  warm: bool = False) -> None:
    """With a measured plan on the CPU, the kernel of a draft's one-row linears (the plan's
    weight set `index`) timed in the draft's own one-row pass, `calls` in a row as a step runs
    them: `draft(plan)` is that graph with every linear under `plan`, reading the KV buffers
    `kv`; `warm`: a pass over the same weights precedes them in a step (`MatmulPlan.settle`)."""
    from specfx.matmul_choice import FixedPlan

    settle = getattr(ctx.matmul, "settle", None)
    if settle is not None and index is not None and ctx.tiled() and kv[0].device.type == "cpu":
        settle(1, lambda kernel: _settle_call(ctx, draft(FixedPlan(kernel)), kv), index, max(1, calls), warm)


def _settle_call(ctx: BuildContext, gm: fx.GraphModule, kv: list) -> Callable[[], object]:
    """A call of `gm` (a graph whose last inputs are the KV buffers `kv`) compiled by Inductor as
    the runtime compiles it, its rows at the end of a SETTLE_CONTEXT-token context in those
    buffers (nothing generates yet: a prefill overwrites what it writes), its other inputs
    zeros. What `MatmulPlan.settle` times."""
    from specfx.runtime.compile import SPAN, compile_graph
    from specfx.runtime.generate import SPAN_ALIGN

    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"][: -len(kv)]
    B, W, device = ctx.batch_size, inputs[0].meta["val"].shape[1], kv[0].device
    last = min(SETTLE_CONTEXT, ctx.seq_len - W - 1)
    span = min(ctx.seq_len, -(-(last + W) // SPAN_ALIGN) * SPAN_ALIGN)
    values = {"last": torch.full((B,), last, dtype=torch.long, device=device),
              "positions": static_positions(B, W, device) + last,
              "span": torch.zeros(span, dtype=torch.uint8, device=device)}
    args = [values[n.name] if n.name in values else
            torch.zeros(n.meta["val"].shape, dtype=n.meta["val"].dtype, device=device) for n in inputs]
    fn = compile_graph(gm, SETTLE_BACKEND, dynamic=SPAN)
    return lambda: fn(*args, *kv)


def tail_passes(matmul, buffers: list[str] | None = None) -> list[Pass]:
    """KV buffers as inputs, the rotary table computed once, then (with a measured plan) the
    skinny-matmul rewrite."""
    return [ShareKVBuffers(buffers), ShareRotary(), *skinny_passes(matmul)]


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

    def cap(width: int, explicit_mask: bool = False, dynamic: bool = False) -> fx.GraphModule:
        return capture(model, width=width, batch_size=batch_size, max_seq_len=seq_len, decoder=decoder,
                       dynamic_width=dynamic, explicit_mask=explicit_mask).gm

    spare = {1: cap(1)}                  # the drafters' builders take it
    structure = pm.run(FindStructure(), spare[1], graph=f"{name} (width 1)").info["structure"]
    gm = pm.run_all([FindStructure(), DropHead(), *tail_passes(matmul)], cap(chunk, dynamic=True), graph=name)

    def take(width: int, explicit_mask: bool = False) -> fx.GraphModule:
        return spare.pop(width) if (width, explicit_mask) == (1, False) and width in spare else cap(width, explicit_mask)

    return Captured(structure, decoder, gm, take)


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
    if prefill_chunk < 2:
        raise ValueError(f"prefill_chunk must be >= 2, got {prefill_chunk}")
    drafter = resolve_drafter(model, drafter, k)
    builder = _BUILDERS.get(type(drafter))
    if builder is None:
        raise TypeError(f"no pipeline for drafter {drafter!r}")
    # Room for k+1 slots past the last real token, so a step never writes out of bounds, rounded
    # up so that the rows of a half-precision attention mask [B, 1, W, seq_len] stay aligned
    # (SDPA pads and copies an unaligned mask in every layer).
    tree = Tree.spine(drafter.tree) if getattr(drafter, "tree", None) else Tree.chain(k)
    seq_len = -(-(max_seq_len + tree.size + 1) // KV_ALIGN) * KV_ALIGN
    pm = PassManager()
    chunk = min(prefill_chunk, max_seq_len)
    target = capture_model(pm, model, name="prefill", batch_size=batch_size, seq_len=seq_len, chunk=chunk,
                           matmul=matmul)
    L = target.structure.num_layers
    ctx = BuildContext(pm, target, drafter, tree, seq_len, batch_size, chunk, model, matmul)
    settle = getattr(matmul, "settle", None)          # a measured plan: the verify's kernel, timed in its graph
    if settle is not None and ctx.tiled() and target.kv[0].device.type == "cpu":
        settle(tree.size + 1, lambda kernel: _verify_call(ctx, kernel))
    try:
        drafting = builder(ctx)
    except PassError as e:
        if isinstance(e.__cause__, StructureError):   # a part the drafter needs: the user's to act on
            raise StructureError(f"{architecture(model)}, drafter {drafter}: {e.__cause__}") from e
        raise
    # The first new token comes from the prefill's last hidden state, through the head alone
    # (no KV buffers in it: of the tail passes only the skinny-matmul rewrite applies).
    first = pm.run_all([CutAtExit(L), *skinny_passes(matmul)], target.capture(1), graph="first")
    kv = target.kv + drafting.extra_kv   # the buffers the graphs were captured with: no second copy
    if len(kv) != len(drafting.layout):
        raise AssertionError(f"{drafter}: {len(kv)} KV buffers, layout {drafting.layout.groups}")
    step = drafting.make_step(False)
    state = StaticState.allocate(batch_size=batch_size, seq_len=seq_len, k=step.depth, nodes=step.k,
                                 vocab_size=target.structure.vocab_size, kv=kv, device=kv[0].device)
    parts = drafting.parts
    return Graphs(
        prefills=drafting.prefills, step=fuse_step(pm, step, graph="step"), unfused_step=trace_step(step),
        state=state, structure=target.structure, k=step.depth, tree=step.drafter.tree, drafter=drafter,
        prefill_chunk=chunk,
        max_seq_len=max_seq_len, kv_layout=drafting.layout, parts={n: p.gm for n, p in parts.items()},
        kv_slices={n: drafting.layout.slice(*p.kv) for n, p in parts.items()},
        draft_calls={n: p.draft_calls for n, p in parts.items() if p.draft_calls}, first=first,
        prime=None if drafting.prime is None else fuse_step(pm, drafting.prime, graph="prime"), records=pm.records, make_step=drafting.make_step)


def fuse_step(pm: PassManager, step_module, *, graph: str) -> fx.GraphModule:
    """Trace a step module, inline its graph calls, and refuse it if it would sync the host."""
    fused = pm.run(InlineGraphCalls(), trace_step(step_module), graph=graph).graph_module
    syncs = pm.run(CheckNoHostSync(), fused, graph=graph).info["host_syncs"]
    if syncs:
        raise HostSyncError("the fused step would sync the host: " + ", ".join(syncs))
    return fused


def _spec_step(ctx: BuildContext, drafter_for: Callable, verify: fx.GraphModule, layout: KVLayout) -> Callable:
    """sample -> the step module of a fresh drafter (`drafter_for()`) and the verify graph."""
    return lambda sample: SpecStep(drafter_for(), verify, layout=layout, max_pos=ctx.max_pos, sample=sample)


@register(NoDraft)
def _build_none(ctx: BuildContext) -> Drafting:
    layout = KVLayout((("target", 2 * ctx.target.structure.num_layers),))
    decode = ctx.verify(drafts=0, name="decode")     # the verify pass of the pending token alone
    return Drafting(layout, {"decode": Part(decode, ("target",))}, _spec_step(ctx, NoDrafter, decode, layout),
                    [ctx.target_prefill(layout)])


@register(EarlyExit)
def _build_early_exit(ctx: BuildContext) -> Drafting:
    s, E, k, pm = ctx.target.structure, ctx.drafter.layer, ctx.k, ctx.pm
    check_exit_layer(s, E)
    layout = KVLayout((("early", 2 * E), ("late", 2 * (s.num_layers - E))))
    stored = ctx.drafter.draft_weights(ctx.model, ctx.tiled())
    if stored is None and not ctx.tree.is_chain:
        raise ValueError(f"{ctx.drafter} (here on the model's own weights): {EARLY_EXIT_TREE}")

    def cut() -> list[Pass]:                          # the draft pass before the tail passes
        return [AttachEarlyExit(E), TruncateAtExit(E), *([StoreDraftWeights(stored)] if stored else [])]

    draft = pm.run_all(cut(), ctx.target.capture(1), graph="draft")
    if stored and ctx.matmul is not None:             # the stored copies' kernels are timed as a set of their own
        stored_set = ctx.matmul.include(stored_weights(draft), rows=next(ctx.model.parameters()).dtype)
        _settle_draft(ctx, stored_set, lambda plan: PassManager().run_all(
            [*cut(), *tail_passes(plan)], ctx.target.capture(1), graph="settle"), ctx.target.kv[: 2 * E], k)
    draft = pm.run_all(ctx.tail(), draft, graph="draft")
    if stored is None:
        # The drafts' KV and exit states are the model's: k drafts and the pass that computes the
        # last one's, then the verify pass runs layers >= E over them.
        verify = ctx.verify([CutAtExit(E)])
        parts = {"draft": Part(draft, ("early",), draft_calls=k + 1), "verify": Part(verify, ("late",))}
    else:
        # The drafts ran a stored copy of the layers: the verify pass runs every layer (over a
        # tree's nodes, which the spine's draft passes wrote no KV for).
        verify = ctx.verify()
        parts = {"draft": Part(draft, ("early",), draft_calls=k), "verify": Part(verify, ("early", "late"))}
    make = lambda: EarlyExitDrafter(draft, ctx.tree, reuse=stored is None)  # noqa: E731
    return Drafting(layout, parts, _spec_step(ctx, make, verify, layout),
                    [ctx.target_prefill(layout, "early", "late")])


@register(PromptLookup)
def _build_prompt_lookup(ctx: BuildContext) -> Drafting:
    layout = KVLayout((("target", 2 * ctx.target.structure.num_layers),))
    verify = ctx.verify()
    make = lambda: LookupDrafter(ctx.k, ctx.drafter.ngram, ctx.target.structure.vocab_size)  # noqa: E731
    return Drafting(layout, {"verify": Part(verify, ("target",))}, _spec_step(ctx, make, verify, layout),
                    [ctx.target_prefill(layout)])


@register(MTPHead)
def _build_mtp(ctx: BuildContext) -> Drafting:
    from specfx.mtp import Combine, StaticHead, StoredLinear, target_parts

    s, k, pm, model = ctx.target.structure, ctx.k, ctx.pm, ctx.model
    head = ctx.drafter.load(model)
    weights = ctx.drafter.head_weights(model, ctx.tiled())
    static = StaticHead(model, head, ctx.batch_size, ctx.seq_len, weights_dtype=weights)
    param = next(model.parameters())
    head_set = None
    if ctx.matmul is not None:
        # The head's linears, and where drafting reads its own stored copy of the lm_head, that copy.
        stored_head = static.lm_head.parameters() if isinstance(static.lm_head, StoredLinear) else ()
        head_set = ctx.matmul.include([*static.head.parameters(), *stored_head], rows=param.dtype if weights else None)
    hidden_size, taps = head.hidden_size, head.taps(s.num_layers)
    combiner = head.combiner(target_parts(model))
    layout = KVLayout((("target", 2 * s.num_layers), ("head", 2), ("history", 1), ("ahead", 2)))

    def cap(width: int, name: str, logits: bool = False, dynamic: bool = False, keep: bool = False,
            matmul=None) -> fx.GraphModule:
        B = ctx.batch_size
        static.with_logits = logits
        ids = torch.zeros(B, width, dtype=torch.long, device=param.device)
        hidden = torch.zeros(B, width, hidden_size, dtype=param.dtype, device=param.device)
        args = (ids, hidden, static_positions(B, width, param.device), example_span(ctx.seq_len, param.device))
        if keep:                                    # the one query whose outputs are kept: see StaticHead
            args += (torch.zeros(B, 1, dtype=torch.long, device=param.device),)
        gm = export_cached(model, static, args, key=static.settings(), modules=(head, static.lm_head),
                           span_arg=3, width_args=(0, 1, 2) if dynamic else ())
        if matmul is not None:                      # a graph `_settle_draft` times, not one of the build's
            return PassManager().run_all(tail_passes(matmul, static.kv_names()), gm, graph=name)
        return pm.run_all(ctx.tail(static.kv_names()), gm, graph=name)

    def cap_combine(width: int, name: str, dynamic: bool = False) -> fx.GraphModule | None:
        if combiner is None:
            return None
        features = torch.zeros(ctx.batch_size, width, len(taps) * s.hidden_size, dtype=param.dtype,
                               device=param.device)
        gm = export_graph(Combine(combiner), (features,), width_args=(0,) if dynamic else ())
        return pm.run_all(skinny_passes(ctx.matmul), gm, graph=name)

    attach = lambda: ExposeHidden(head_hidden_size=hidden_size, taps=taps)  # noqa: E731
    _settle_draft(ctx, head_set, lambda plan: cap(1, "settle", logits=True, matmul=plan), static.kv(),
                  ctx.tree.depth - 1, warm=True)        # the refill reads the head's weights before them
    draft, refill = cap(1, "draft", logits=True), cap(ctx.tree.depth + 1, "refill", logits=True, keep=True)
    verify = ctx.verify([attach()])
    target_prefill = pm.run(attach(), ctx.target.prefill, graph="prefill").graph_module
    history = torch.zeros(ctx.batch_size, ctx.seq_len, hidden_size, dtype=param.dtype, device=param.device)
    ahead = [torch.zeros(ctx.batch_size, 1, n, dtype=param.dtype, device=param.device)   # draft 1's logits, g
             for n in (s.vocab_size, hidden_size)]
    prefill = MTPPrefill(target_prefill, cap(ctx.prefill_chunk, "head_prefill", dynamic=True), layout=layout,
                         max_pos=ctx.max_pos, taps=len(taps),
                         combine=cap_combine(ctx.prefill_chunk, "combine_prefill", dynamic=True))
    combine = cap_combine(ctx.tree.size + 1, "combine")            # over the verify rows
    # Draft 1 comes from the previous step's refill (see MTPDrafter): a head pass per later depth.
    parts = {"draft": Part(draft, ("head",), draft_calls=ctx.tree.depth - 1),
             "refill": Part(refill, ("head",), draft_calls=1), "verify": Part(verify, ("target",))}
    if combine is not None:
        parts["combine"] = Part(combine, ())
    make = lambda: MTPDrafter(draft, refill, ctx.tree, taps=len(taps), combine=combine)  # noqa: E731
    return Drafting(layout, parts, _spec_step(ctx, make, verify, layout),
                    [Prefill("prefill", fuse_step(pm, prefill, graph="prefill"), layout.slice("target", "head", "history"))],
                    extra_kv=[*static.kv(), history, *ahead], prime=Prime(make(), layout=layout, max_pos=ctx.max_pos))


@register(DraftModel)
def _build_draft_model(ctx: BuildContext) -> Drafting:
    draft_model = ctx.drafter.load(like=ctx.model)
    check_same_tokenizer(ctx.model, draft_model)
    draft_set = None if ctx.matmul is None else ctx.matmul.include(draft_model.parameters())
    d = capture_model(ctx.pm, draft_model, name="draft_prefill", batch_size=ctx.batch_size,
                      seq_len=ctx.seq_len, chunk=ctx.prefill_chunk, matmul=ctx.matmul)
    draft = d.capture(1)                     # first: the graph FindStructure mapped (the timed ones are new)
    _settle_draft(ctx, draft_set, lambda plan: PassManager().run_all(tail_passes(plan), d.capture(1), graph="settle"),
                  d.kv, ctx.k + ctx.tree.is_chain)
    layout = KVLayout((("target", 2 * ctx.target.structure.num_layers), ("draft", 2 * d.structure.num_layers)))
    draft = ctx.pm.run_all(ctx.tail(), draft, graph="draft")
    verify = ctx.verify()
    if ctx.tree.is_chain:      # k drafts and the catch-up pass over the last
        refill = None
        parts = {"draft": Part(draft, ("draft",), draft_calls=ctx.k + 1)}
    else:                      # drafts along the spine, then a pass over the accepted path
        refill = ctx.pm.run_all([DropHead(), *ctx.tail()], d.capture(ctx.k + 1), graph="refill")
        parts = {"draft": Part(draft, ("draft",), draft_calls=ctx.k), "refill": Part(refill, ("draft",), draft_calls=1)}
    parts["verify"] = Part(verify, ("target",))
    make = lambda: DraftModelDrafter(draft, ctx.tree, draft_vocab=d.structure.vocab_size,  # noqa: E731
                                     target_vocab=ctx.target.structure.vocab_size, refill=refill)
    return Drafting(layout, parts, _spec_step(ctx, make, verify, layout),
                    [ctx.target_prefill(layout), Prefill("draft_prefill", d.prefill, layout.slice("draft"))],
                    extra_kv=d.kv)


def resolve_drafter(model, drafter, k: int | None = None):
    """Fill in model defaults (the exit layer, an MTP head's tree: `config.specfx_exit_layer`,
    `config.specfx_mtp_tree`, set by the sweeps) so the config names what will run. The default
    tree applies where no `k` is asked (a k asks for the chain of k)."""
    if isinstance(drafter, EarlyExit) and drafter.layer is None:
        return dataclasses.replace(drafter, layer=default_exit_layer(model))
    tree = getattr(model.config, "specfx_mtp_tree", None)
    if isinstance(drafter, MTPHead) and drafter.tree is None and tree and k is None:
        return dataclasses.replace(drafter, tree=tuple(tree))
    return drafter
