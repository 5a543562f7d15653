"""The compile pipeline: capture -> passes -> fused step, one builder per drafter config.

`build(model, drafter, k=..., batch_size=..., max_seq_len=...)` returns `Graphs`: the prefill
graph, the fused step graph, the static state they share, and the PassManager's records.
Builders are registered against the config type (as torchao registers transforms against its
configs); a new drafter adds a config in `specfx.drafters` and a builder here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import fx

from specfx.capture import StaticDecoder, capture
from specfx.drafters import EarlyExit, NoDraft, PromptLookup, default_exit_layer
from specfx.passes import (AttachEarlyExit, CheckNoHostSync, CutAtExit, FindStructure, FuseSpecStep,
                           PassManager, ShareKVBuffers, StructureMap, TruncateAtExit, check_exit_layer)
from specfx.runtime.state import StaticState
from specfx.runtime.step import DecodeStep, EarlyExitStep, PromptLookupStep, trace_step

PREFILL_CHUNK = 64


class HostSyncError(RuntimeError):
    """The fused step contains ops that would sync the host."""


@dataclass
class Graphs:
    """Everything the runtime needs: graphs, state, and how they were built."""

    prefill: fx.GraphModule          # (input_ids [B, C], positions [B, C], *kv) -> (hidden,)
    step: fx.GraphModule             # (tokens, lengths, max_lens, done, eos, accept_hist, kv) -> ()
    state: StaticState
    structure: StructureMap
    k: int
    drafter: object
    prefill_chunk: int
    max_seq_len: int
    parts: dict[str, fx.GraphModule] = field(default_factory=dict)  # draft / verify / decode
    unfused_step: fx.GraphModule | None = None
    records: list = field(default_factory=list)
    make_step: Callable | None = None  # sample: bool -> step module (before tracing)
    sample_step: fx.GraphModule | None = None

    def fused_sample_step(self) -> fx.GraphModule:
        """The sampling variant of the step, built on first use."""
        if self.sample_step is None:
            pm = PassManager(self.records)
            self.sample_step = fuse_step(pm, self.make_step(True), graph="sample_step")
        return self.sample_step


_BUILDERS: dict[type, Callable] = {}


def register(config_type: type):
    def deco(fn):
        _BUILDERS[config_type] = fn
        return fn
    return deco


def build(model, drafter, *, k: int, batch_size: int, max_seq_len: int,
          prefill_chunk: int = PREFILL_CHUNK) -> Graphs:
    """Capture `model`, run the drafter's passes and fuse its step."""
    if k < 1:
        raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
    if batch_size < 1 or max_seq_len < 2:
        raise ValueError(f"batch_size must be >= 1 and max_seq_len >= 2, got {batch_size}, {max_seq_len}")
    drafter = resolve_drafter(model, drafter)
    builder = _BUILDERS.get(type(drafter))
    if builder is None:
        raise TypeError(f"no pipeline for drafter {drafter!r}")
    # Room for k+1 slots past the last real token, so a step never writes out of bounds.
    seq_len = max_seq_len + k + 1
    decoder = StaticDecoder(model, batch_size, seq_len)
    pm = PassManager()
    chunk = min(prefill_chunk, max_seq_len)
    prefill = capture(model, width=chunk, batch_size=batch_size, max_seq_len=seq_len, decoder=decoder)
    structure = pm.run(FindStructure(), prefill.gm, graph="prefill").info["structure"]
    L = structure.num_layers
    # Prefill only fills the KV cache: drop the head (lm_head over a whole chunk is wasted work).
    gm = pm.run_all([TruncateAtExit(structure, L, keep_head=False), ShareKVBuffers()], prefill.gm,
                    graph="prefill")
    graphs = Graphs(prefill=gm, step=None, state=None, structure=structure, k=k, drafter=drafter,
                    prefill_chunk=chunk, max_seq_len=max_seq_len)
    cap = lambda width: capture(model, width=width, batch_size=batch_size,  # noqa: E731
                                max_seq_len=seq_len, decoder=decoder)
    graphs.make_step, k_eff = builder(graphs, pm, cap, drafter, k, seq_len)
    kv = [t for i in range(L) for t in decoder.kv(i)]  # the buffers the graphs were captured with
    graphs.state = StaticState.allocate(batch_size=batch_size, seq_len=seq_len, k=k_eff,
                                        vocab_size=structure.vocab_size, kv=kv, device=kv[0].device)
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
def _build_none(graphs: Graphs, pm: PassManager, cap, drafter, k, seq_len):
    decode = pm.run_all([ShareKVBuffers()], cap(1).gm, graph="decode")
    graphs.parts["decode"] = decode
    num_kv = 2 * graphs.structure.num_layers
    return lambda sample: DecodeStep(decode, num_kv=num_kv, max_pos=seq_len - 1, sample=sample), 0


@register(EarlyExit)
def _build_early_exit(graphs: Graphs, pm: PassManager, cap, drafter: EarlyExit, k, seq_len):
    s = graphs.structure
    E = drafter.layer
    check_exit_layer(s, E)
    draft = pm.run_all([AttachEarlyExit(s, E), TruncateAtExit(s, E), ShareKVBuffers()], cap(1).gm,
                       graph="draft")
    verify = pm.run_all([CutAtExit(s, E), ShareKVBuffers()], cap(k + 1).gm, graph="verify")
    graphs.parts.update(draft=draft, verify=verify)
    return lambda sample: EarlyExitStep(draft, verify, k=k, exit_layer=E, num_layers=s.num_layers,
                                        max_pos=seq_len - 1, sample=sample), k


@register(PromptLookup)
def _build_prompt_lookup(graphs: Graphs, pm: PassManager, cap, drafter: PromptLookup, k, seq_len):
    verify = pm.run_all([ShareKVBuffers()], cap(k + 1).gm, graph="verify")
    graphs.parts["verify"] = verify
    num_kv = 2 * graphs.structure.num_layers
    return lambda sample: PromptLookupStep(verify, k=k, ngram=drafter.ngram, num_kv=num_kv,
                                           max_pos=seq_len - 1, sample=sample), k


def resolve_drafter(model, drafter):
    """Fill in model defaults (the exit layer) so the config names what will run."""
    if isinstance(drafter, EarlyExit) and drafter.layer is None:
        return EarlyExit(layer=default_exit_layer(model))
    return drafter
