"""Device-clean graphs: the whole pipeline on the `meta` device, on a CPU-only machine.

A meta tensor has a shape, a dtype and a device but no data. Any tensor the pipeline creates
without a device (a module buffer, an `arange`, a constant) lands on the CPU and meets the
model's meta tensors: a device-mismatch error here, the same error a CUDA model hits at capture.
For every drafter this builds the fused step on meta (capture, passes, fusion), runs prefill and
the greedy and sampling steps through the runtime, and `torch.export`s every program of an
artifact (prefills, step, sampling step). Writing the artifact's files (weights, pt2, AOTI, ONNX)
is skipped: meta tensors have no bytes to save.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves

import specfx
from helpers import tiny_model
from specfx.export import export_programs
from specfx.mtp import new_head

DRAFTERS = ["none", "early-exit:1", "ngram:2", "draft-model", "mtp"]


def _meta_drafter(name: str, target, monkeypatch):
    """The drafter config, its checkpoint (if any) random and on meta."""
    if name == "draft-model":
        return specfx.DraftModel(tiny_model("llama", layers=1, seed=2).to("meta"))
    if name == "mtp":
        # A head checkpoint is checked against values sampled from the target's weights, which a
        # meta target does not have: hand the pipeline a random head directly.
        head = new_head(target).to("meta")
        monkeypatch.setattr(specfx.MTPHead, "load", lambda self, model: head)
        return specfx.MTPHead("random-head")
    return name


def _devices(ep) -> set[str]:
    """Device types of every value the exported graph computes."""
    return {v.device.type for n in ep.graph.nodes for v in tree_leaves(n.meta.get("val"))
            if isinstance(v, torch.Tensor)}


@pytest.mark.parametrize("draft", DRAFTERS)
def test_pipeline_builds_runs_and_exports_on_meta(draft, monkeypatch):
    target = tiny_model("llama", layers=2, seed=1)
    drafter = _meta_drafter(draft, target, monkeypatch)
    fast = specfx.compile(target.to("meta"), draft=drafter, num_speculative_tokens=2, max_seq_len=32,
                          backend="eager")
    st, rt = fast.graphs.state, fast.runtime
    assert {t.device.type for t in st.tensors().values()} == {"meta"} and st.generator is None

    st.load_prompts([torch.arange(3, 9)], max_new_tokens=8, eos_ids=[2])
    rt.prefill(6)
    rt.step()
    st.set_sampling(0.8, 5, 0.9, seed=0)
    rt.sample_step()
    assert st.tokens.device.type == "meta"

    programs = export_programs(fast.graphs)
    assert set(programs) >= {"prefill", "step", "sample_step"}
    for name, (ep, _) in programs.items():
        assert _devices(ep) == {"meta"}, name
