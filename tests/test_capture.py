"""Capture and the StructureMap across architectures; clear errors for unsupported models."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers import ARCHS, span, tiny_model
from specfx.capture import capture
from specfx.passes import StructureError, find_structure


@pytest.mark.parametrize("arch", ARCHS + ("gemma2",))
def test_capture_matches_eager_and_maps_structure(arch):
    if arch == "gemma2":
        from transformers import AutoModelForCausalLM, Gemma2Config

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(Gemma2Config(
            vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16)).eval()
    else:
        model = tiny_model(arch, layers=3)
    cg = capture(model, width=5, batch_size=2, max_seq_len=16)
    s = cg.structure
    assert s.num_layers == 3
    assert s.stack_path.endswith("layers")
    assert len(s.layer_outputs) == 3 and len(set(s.layer_outputs)) == 3
    assert s.kv_buffers == [(f"kv_k_{i}", f"kv_v_{i}") for i in range(3)]
    assert s.final_norm.endswith("norm") and s.lm_head.endswith("lm_head")
    assert s.hidden_size == 64 and s.vocab_size == 96
    ids = torch.randint(3, 96, (2, 5))
    pos = torch.arange(5).expand(2, 5)
    with torch.no_grad():
        (ours,) = cg.gm(ids, pos, span(16))
        ref = model(ids).logits
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_rows_at_different_positions():
    """Each row reads only its own cache, at its own positions; slots past a row's positions
    (stale KV) are masked, whatever they hold."""
    model = tiny_model("llama", layers=2)
    cg = capture(model, width=3, batch_size=2, max_seq_len=16)
    for name, buf in cg.gm.named_buffers():
        if name.startswith("kv_"):
            buf.normal_(generator=torch.Generator().manual_seed(0))     # stale KV everywhere
    g = torch.Generator().manual_seed(1)
    seq0, seq1 = torch.randint(3, 96, (3,), generator=g), torch.randint(3, 96, (6,), generator=g)
    with torch.no_grad():
        cg.gm(torch.stack([seq0, seq1[:3]]), torch.tensor([[0, 1, 2], [0, 1, 2]]), span(16))
        # Row 0 again at positions 0..2, row 1 at 3..5 over its cached first three tokens.
        (out,) = cg.gm(torch.stack([seq0, seq1[3:]]), torch.tensor([[0, 1, 2], [3, 4, 5]]), span(16))
        ref0, ref1 = model(seq0[None]).logits[0], model(seq1[None]).logits[0, 3:]
    torch.testing.assert_close(out[0], ref0, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1], ref1, atol=1e-4, rtol=1e-4)


class _NoStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(10, 8), nn.Linear(8, 10)

    def forward(self, input_ids, positions):
        return (self.out(self.emb(input_ids)),)


def test_graph_without_decoder_stack_names_the_missing_part():
    ep = torch.export.export(_NoStack(), (torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long)))
    with pytest.raises(StructureError, match="decoder stack not found"):
        find_structure(ep.module())


class _Out:
    def __init__(self, logits):
        self.logits = logits


class _NoCacheModel(nn.Module):
    """HF-like signature, repeated layers, but attention never calls cache.update."""

    def __init__(self):
        super().__init__()
        self.config = type("C", (), {"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8,
                                     "num_key_value_heads": 2})()
        self.emb = nn.Embedding(10, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.norm, self.lm_head = nn.LayerNorm(8), nn.Linear(8, 10)

    def forward(self, input_ids, position_ids=None, attention_mask=None, past_key_values=None, use_cache=None):
        h = self.emb(input_ids)
        for layer in self.layers:
            h = h + layer(h)
        return _Out(self.lm_head(self.norm(h)))


def test_model_without_kv_cache_names_the_missing_part():
    # Its layers never reach specfx's attention (which the cache writes go with): refused by name.
    with pytest.raises(StructureError, match=r"_NoCacheModel: attention not found"):
        capture(_NoCacheModel(), width=2, batch_size=1, max_seq_len=8)


def test_captures_are_reused_per_model_and_never_share_kv(monkeypatch):
    """A second compile of one model copies its exported graphs instead of exporting again; the
    two compiled models keep KV caches of their own (generating with one between the other's
    calls changes nothing). A model of the same structure with other weights (a replaced
    weight, another seed) gets copies over its own tensors; one whose structure differs (weights
    tied, a hook, a module's setting) is exported anew. The cache holds none of the model's
    tensors and lets the model go."""
    import gc
    import weakref

    import specfx
    from specfx import capture as capture_module
    from helpers import hf_greedy

    exports = []
    real = capture_module.export_graph
    monkeypatch.setattr(capture_module, "export_graph", lambda *a, **kw: exports.append(1) or real(*a, **kw))
    monkeypatch.setattr(capture_module, "_shared", type(capture_module._shared)())
    model = tiny_model("llama", layers=2)
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    ref = hf_greedy(model, ids, 12)

    def compile(m):
        return specfx.compile(m, draft="early-exit:1", num_speculative_tokens=2, backend="eager", max_seq_len=48)

    first = compile(model)
    exported = len(exports)
    second = compile(model)
    assert len(exports) == exported > 0
    other = torch.randint(3, 96, (1, 20), generator=torch.Generator().manual_seed(1))
    out = first.generate(ids[:, :5], max_new_tokens=3)            # first's cache half filled
    torch.testing.assert_close(second.generate(ids, max_new_tokens=12), ref, rtol=0, atol=0)
    second.generate(other, max_new_tokens=20)
    torch.testing.assert_close(first.generate(ids, max_new_tokens=12), ref, rtol=0, atol=0)
    assert out.shape[1] == 8

    with torch.no_grad():                                  # a replaced weight: the same graphs
        model.lm_head.weight = nn.Parameter(model.lm_head.weight.flip(0))
    third = compile(model)
    twin = tiny_model("llama", layers=2, seed=7)           # another model of the structure: the same
    fourth = compile(twin)
    assert len(exports) == exported
    torch.testing.assert_close(third.generate(ids, max_new_tokens=12), hf_greedy(model, ids, 12), rtol=0, atol=0)
    torch.testing.assert_close(fourth.generate(ids, max_new_tokens=12), hf_greedy(twin, ids, 12), rtol=0, atol=0)

    tied = tiny_model("llama", layers=2, seed=8)           # tied weights read one path: exported anew
    tied.lm_head.weight = tied.model.embed_tokens.weight
    torch.testing.assert_close(compile(tied).generate(ids, max_new_tokens=12), hf_greedy(tied, ids, 12),
                               rtol=0, atol=0)
    assert len(exports) == 2 * exported
    hooked = tiny_model("llama", layers=2, seed=9)         # a hook: its own graphs, never shared
    hooked.model.norm.register_forward_hook(lambda m, args, out: out * 2)
    torch.testing.assert_close(compile(hooked).generate(ids, max_new_tokens=12), hf_greedy(hooked, ids, 12),
                               rtol=0, atol=0)
    assert len(exports) == 3 * exported
    scaled = tiny_model("llama", layers=2, seed=10)        # a module's setting: exported anew
    scaled.model.layers[0].self_attn.scaling *= 0.5
    torch.testing.assert_close(compile(scaled).generate(ids, max_new_tokens=12), hf_greedy(scaled, ids, 12),
                               rtol=0, atol=0)
    assert len(exports) == 4 * exported

    ours = {id(t) for t in (*model.parameters(), *model.buffers())}            # the cache holds none
    cached = capture_module._captures[model].values()
    assert cached and not any(id(t) in ours for c in cached for t in c.constants.values())
    assert all(c.graph.owning_module is None for c in cached)                    # nor a module that does
    gone = weakref.ref(model)
    del model, first, second, third, cached
    gc.collect()
    assert gone() is None


def test_a_graph_that_reads_a_weight_outside_its_module_is_not_kept():
    """`export_cached` keeps no graph that reads a tensor of the model as a constant (a module
    the exported one holds outside its tree): a copy would go on reading the old weight."""
    from specfx.capture import export_cached

    class Reads(nn.Module):
        def __init__(self, other):
            super().__init__()
            self.__dict__["other"] = other                 # not a submodule

        def forward(self, x):
            return (x @ self.other.weight.T,)

    owner = nn.Linear(4, 4, bias=False)
    x = torch.randn(2, 4)
    export_cached(owner, Reads(owner), (x,))
    with torch.no_grad():
        owner.weight = nn.Parameter(torch.randn(4, 4))
    torch.testing.assert_close(export_cached(owner, Reads(owner), (x,))(x)[0], x @ owner.weight.T)
