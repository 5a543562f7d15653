"""MTP heads: the attach pass, exactness in the fused step, training, and refused heads."""

from __future__ import annotations

import json

import pytest
import torch

import specfx
from helpers import ARCHS, assert_greedy_equal, hf_greedy, span, tiny_model, unpadded
from specfx.capture import capture
from specfx.mtp import final_hidden, load_head, new_head, save_head, target_parts
from specfx.mtp_train import MTPTrainConfig, evaluate_head, train_head
from specfx.passes import ExposeHidden, find_host_syncs


@pytest.fixture(scope="module")
def trained():
    """A tiny Llama and a head trained on random token windows (a few seconds).

    Random text, not the model's own greedy output: a random model's greedy text soon repeats
    one token, and a test of positions needs inputs whose every position differs.
    """
    torch.manual_seed(0)
    model = tiny_model("llama", layers=3, vocab=64, seed=31)
    text = torch.randint(3, 64, (112, 40), generator=torch.Generator().manual_seed(0))
    cfg = MTPTrainConfig(steps=150, batch_size=16, seq_len=40, windows=96, lr=3e-3, warmup=10, bf16=False)
    head, curve = train_head(model, text[:96], cfg, progress=False)
    return model, head, text[96:], curve


def _saved(tmp_path, model, head=None):
    path = tmp_path / "head"
    save_head(head if head is not None else new_head(model), path, model)
    return path


def test_expose_hidden_exposes_the_final_hidden_state():
    model = tiny_model("llama", layers=3)
    cg = capture(model, width=4, max_seq_len=32)
    before = len(next(n for n in cg.gm.graph.nodes if n.op == "output").args[0])
    res = ExposeHidden(head_hidden_size=64)(cg.gm)
    assert res.modified and before == 1
    ids = torch.randint(3, 96, (1, 4))
    with torch.no_grad():
        logits, hidden = res.graph_module(ids, torch.arange(4)[None], span(32))
        ref_logits = model(ids).logits
    assert torch.allclose(logits, ref_logits, atol=1e-4)
    assert torch.allclose(hidden, final_hidden(model, ids), atol=1e-4)
    again = ExposeHidden(head_hidden_size=64)(res.graph_module)
    assert not again.modified and "already" in again.reason


def test_expose_hidden_refuses_a_head_of_another_size():
    cg = capture(tiny_model("llama", layers=2), width=2, max_seq_len=16)
    with pytest.raises(ValueError, match="hidden states of size 32, the model's are 64"):
        ExposeHidden(head_hidden_size=32)(cg.gm)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_equals_model_generate(tmp_path, arch, k):
    model = tiny_model(arch, layers=3, seed=40 + k)
    fast = specfx.compile(model, draft=specfx.MTPHead(_saved(tmp_path, model)), num_speculative_tokens=k,
                          max_seq_len=96, batch_size=2, backend="eager", prefill_chunk=64)
    g = torch.Generator().manual_seed(k)
    for prompt_len in (1, 70):   # 70 > one prefill chunk of 64
        ids = torch.randint(3, 96, (1, prompt_len), generator=g)
        ours = fast.generate(ids, max_new_tokens=20, eos_token_id=[])
        assert_greedy_equal(model, ours, hf_greedy(model, ids, 20), prompt_len)
    # Rows of different lengths in one batch.
    ids = torch.randint(3, 96, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ours = fast.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[])
    for b in range(2):
        row = unpadded(ours, ids, mask, b)
        n = int(mask[b].sum())
        assert_greedy_equal(model, row, hf_greedy(model, row[:, :n], 12), n)


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_a_head_with_stored_weights_drafts_exactly(tmp_path, weights):
    """`MTPHead(weights_dtype="bfloat16" or "int8")` keeps the head's weights (and its copy of
    the lm_head) in that dtype, for drafting only: the output is still the target's greedy output."""
    model = tiny_model("llama", layers=3, seed=43)
    draft = specfx.parse_draft(f"mtp:{_saved(tmp_path, model)}:weights={weights}")
    assert draft.weights_dtype == weights
    fast = specfx.compile(model, draft=draft, num_speculative_tokens=3, max_seq_len=64, backend="eager")
    matrices = {name: t.dtype for name, t in fast.graphs.parts["draft"].named_parameters() if t.dim() == 2}
    assert [n for n, d in matrices.items() if d != getattr(torch, weights)] == ["embed.weight"], matrices   # the target's
    assert "lm_head.weight" in matrices and len(matrices) > 5
    assert all(p.dtype == torch.float32 for p in model.parameters())           # the target's own stay
    ids = torch.randint(3, 96, (1, 9))
    assert_greedy_equal(model, fast.generate(ids, max_new_tokens=20, eos_token_id=[]), hf_greedy(model, ids, 20), 9)
    with pytest.raises(ValueError, match="weights_dtype='float16'"):
        specfx.MTPHead(weights_dtype="float16")
    with pytest.raises(ValueError, match="expected None .* or one of 'target', 'bfloat16', 'int8'"):
        specfx.parse_draft("mtp:pycoder-mtp:weights=int4")
    # A tree sweep over such a head keeps its weights (the tree goes before them in a spec).
    from specfx.sweep import tree_spec

    assert tree_spec("mtp:h:weights=bfloat16", (2, 1)) == "mtp:h:tree=2x1:weights=bfloat16"
    assert specfx.parse_draft(tree_spec("mtp:h:weights=bfloat16", (2, 1))).weights_dtype == "bfloat16"


def test_trained_head_drafts_in_the_step_what_it_predicts_offline(tmp_path, trained):
    """At k=1 a step at `length` tokens drafts the head's prediction from (t_{length-1},
    h_{length-2}); replaying the greedy output offline (steps start after the prefill's first
    token) must predict exactly which steps accept.
    Rows of random prompts of many lengths (across a prefill chunk boundary) check the head's
    positions, its prefill and its refill."""
    model, head, _, curve = trained
    assert curve[-1]["agreement"] > curve[0]["agreement"]
    B, N = 24, 6
    fast = specfx.compile(model, draft=specfx.MTPHead(_saved(tmp_path, model, head)), num_speculative_tokens=1,
                          max_seq_len=128, batch_size=B, backend="eager", prefill_chunk=64)
    g = torch.Generator().manual_seed(1)
    lens = [2 + (i * 7) % 90 for i in range(B)]
    prompts = [torch.randint(3, 64, (n,), generator=g) for n in lens]
    ids = torch.zeros(B, max(lens), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, -len(p):], mask[b, -len(p):] = p, 1
    ours = fast.generate(ids, attention_mask=mask, max_new_tokens=N, eos_token_id=[])
    accepted = calls = 0
    for b, p in enumerate(prompts):
        seq = unpadded(ours, ids, mask, b)
        assert_greedy_equal(model, seq, hf_greedy(model, p[None], N), len(p))
        # Offline: pred[q] is the head's guess for the token at q + 2, from the whole sequence.
        pred = _head_logits(head, model, seq).argmax(-1)[0]
        length = len(p) + 1                                # the first token comes from the prefill
        while length < len(p) + N:
            hit = pred[length - 2].item() == seq[0, length].item() if length < seq.shape[1] else False
            accepted, calls, length = accepted + hit, calls + 1, length + 1 + hit
    assert 0.2 * calls < accepted < calls                  # both outcomes occur: the check has teeth
    assert fast.last_stats.target_calls == calls
    assert round(fast.last_stats.acceptance_by_position[0] * calls) == accepted


def test_train_head_improves_held_out_agreement(trained):
    model, head, heldout, _ = trained
    fresh = evaluate_head(new_head(model), model, heldout)
    after = evaluate_head(head, model, heldout)
    assert after["top1_agreement"] > fresh["top1_agreement"] + 0.2


def test_head_round_trips_through_its_checkpoint(tmp_path, trained):
    model, head, _, _ = trained
    loaded = load_head(_saved(tmp_path, model, head), model)
    for (n, a), (_, b) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), n
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["target"]["hidden_size"] == 64 and len(config["target"]["weights"]["shapes"]) == 16


@pytest.mark.parametrize("dtype, atol", [(torch.bfloat16, 0.1), (torch.float16, 0.02)])
def test_head_loads_for_a_half_precision_copy_of_its_target(tmp_path, dtype, atol):
    model = tiny_model("llama", layers=2, seed=1)
    path = _saved(tmp_path, model)
    ref = load_head(path, model)
    half = tiny_model("llama", layers=2, seed=1).to(dtype)
    head = load_head(path, half)
    for (n, a), (_, b) in zip(ref.state_dict().items(), head.state_dict().items()):
        assert b.dtype == dtype and torch.equal(b, a.to(dtype)), n
    # The same predictions, to half precision (logits of size ~2 here).
    ids = torch.randint(3, 96, (1, 12), generator=torch.Generator().manual_seed(0))
    ours, theirs = _head_logits(head, half, ids).float(), _head_logits(ref, model, ids)
    torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def _head_logits(head, model, seq):
    """The head's logits [1, n-1, V] over `seq` [1, n]: position q predicts the token at q + 2
    from (the token at q + 1, the model's final hidden state at q)."""
    parts = target_parts(model)
    with torch.no_grad():
        h = final_hidden(model, seq)
        e = parts.embed(seq[:, 1:])
        pos = torch.arange(seq.shape[1] - 1)[None]
        return parts.lm_head(head.norm(head(e, h[:, :-1], position_ids=pos, position_embeddings=parts.position_embeddings(e, pos))))


def test_head_for_another_target_is_refused(tmp_path):
    model = tiny_model("llama", layers=3, seed=1)
    path = _saved(tmp_path, model)
    with pytest.raises(ValueError, match="trained for another target: the weights of this model"):
        specfx.compile(tiny_model("llama", layers=3, seed=2), draft=specfx.MTPHead(path), backend="eager")
    with pytest.raises(ValueError, match="trained for another target: num_hidden_layers"):
        load_head(path, tiny_model("llama", layers=4, seed=1))
    with pytest.raises(ValueError, match="trained for another target: hidden_size"):
        load_head(path, tiny_model("llama", layers=3, hidden_size=32))
    with pytest.raises(ValueError, match="trained for another target: vocab_size"):
        load_head(path, tiny_model("llama", layers=3, vocab=128, seed=1))
    with pytest.raises(ValueError, match="trained for another target: model_type"):
        load_head(path, tiny_model("qwen2", layers=3, seed=1))


def test_missing_or_corrupt_head_is_refused(tmp_path):
    model = tiny_model("llama", layers=2)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_head(tmp_path / "nope", model)
    path = _saved(tmp_path, model)
    weights = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(weights[: len(weights) // 2])
    with pytest.raises(ValueError, match="model.safetensors is corrupt"):
        load_head(path, model)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="missing model.safetensors"):
        load_head(path, model)
    path = _saved(tmp_path, model)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is corrupt"):
        load_head(path, model)
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="not an MTP head"):
        load_head(path, model)


def test_mtp_spec_strings_and_default_head():
    assert specfx.parse_draft("mtp:pycoder-mtp") == specfx.MTPHead("pycoder-mtp")
    assert specfx.parse_draft("mtp") == specfx.MTPHead()
    with pytest.raises(ValueError, match="names no default MTP head"):
        specfx.compile(tiny_model("llama", layers=2), draft="mtp", backend="eager")
    with pytest.raises(TypeError, match="head folder or zoo name"):
        specfx.MTPHead(3)


def test_a_head_is_not_a_model():
    from specfx import zoo

    with pytest.raises(ValueError, match="is an MTP head, not a model"):
        zoo.load("pycoder-mtp")


def test_a_head_drafts_from_int8_weights_where_the_tiled_kernel_runs_it():
    """By default the head's weights are int8 where the few-row kernel drafts (the CPU, a float32
    target) and the target's elsewhere; a spec names any of them."""
    model = tiny_model("llama", layers=2)
    head = specfx.MTPHead()
    assert head.head_weights(model, tiled=True) == torch.int8
    assert head.head_weights(model, tiled=False) is None
    assert head.head_weights(model.to(torch.bfloat16), tiled=True) is None
    for spec, dtype in (("target", None), ("bfloat16", torch.bfloat16), ("int8", torch.int8)):
        assert specfx.parse_draft(f"mtp:h:weights={spec}").head_weights(model, tiled=True) == dtype


def test_int8_weights_keep_each_row_to_half_a_step_of_its_scale():
    """`StoredLinear` in int8: each row's integers in [-127, 127] times the row's scale (its largest
    magnitude over 127) are the float weight to half a step; the product scales the columns."""
    from specfx.mtp import StoredLinear

    linear = torch.nn.Linear(48, 24, bias=True)
    with torch.no_grad():
        linear.weight[3] *= 100                                     # rows of very different ranges
        linear.weight[5] = 0                                        # and an all-zero row
    stored = StoredLinear(linear, torch.int8)
    q, scale = stored.weight.float(), stored.scale
    assert stored.weight.dtype == torch.int8 and q.abs().max() == 127 and scale.shape == (24,)
    assert ((q * scale[:, None] - linear.weight).abs() <= scale[:, None] / 2 + 1e-7).all()
    assert torch.equal(q[5], torch.zeros(48))
    x = torch.randn(5, 48)
    torch.testing.assert_close(stored(x), x @ (q * scale[:, None]).T + linear.bias)
    torch.testing.assert_close(stored(x), linear(x), atol=0.05, rtol=0.02)


def test_head_graphs_are_exported_once_per_structure_and_read_each_heads_weights(tmp_path, monkeypatch):
    """A second build over a head of the same structure (a chain and a tree, another head's
    weights) copies the head's exported graphs instead of exporting them again, and the copies
    draft with the new head's weights: the same drafts as a build that exported them itself. A
    head stored in int8 is another structure: exported anew."""
    from specfx import capture as capture_module

    exports = []
    real = capture_module.export_graph
    monkeypatch.setattr(capture_module, "export_graph",
                        lambda root, *a, **kw: exports.append(type(root).__name__) or real(root, *a, **kw))
    model = tiny_model("llama", layers=2, seed=3)
    first, other = new_head(model), new_head(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    paths = [_saved(tmp_path / name, model, head) for name, head in (("first", first), ("other", other))]
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(0))

    def drafts(path, **kw):
        fast = specfx.compile(model, draft=specfx.MTPHead(path, **kw), num_speculative_tokens=3, max_seq_len=64,
                              backend="eager")
        out = fast.generate(ids, max_new_tokens=24, eos_token_id=[])
        return out.tolist(), fast.graphs.state.accept_hist.tolist()

    drafts(paths[0])
    exported = exports.count("StaticHead")
    assert exported > 0
    drafts(paths[0], tree=(2, 1, 1))
    shared = drafts(paths[1])
    assert exports.count("StaticHead") == exported          # the chain's head graphs, copied
    monkeypatch.setattr(capture_module, "_shared", type(capture_module._shared)())
    capture_module._captures.pop(model)
    assert shared == drafts(paths[1])                      # as a build of its own drafts
    assert exports.count("StaticHead") == 2 * exported
    drafts(paths[1], weights_dtype="int8")
    assert exports.count("StaticHead") == 3 * exported


@pytest.mark.parametrize("weights_dtype", [None, "bfloat16", "int8"])
def test_mtp_artifact_round_trip(tmp_path, weights_dtype):
    model = tiny_model("qwen2", layers=2, seed=5)
    fast = specfx.compile(model, draft=specfx.MTPHead(_saved(tmp_path, model), weights_dtype=weights_dtype),
                          num_speculative_tokens=2, max_seq_len=48, backend="eager")
    fast.export(tmp_path / "art", formats=("pt2",))
    loaded = specfx.load(tmp_path / "art")
    # The head's pass before the first step travels with the step (draft 1 of each step reads it).
    assert loaded.manifest["programs"]["prime"]["role"] == "prime"
    ids = torch.randint(3, 96, (1, 7))
    assert torch.equal(loaded.generate(ids, max_new_tokens=16, eos_token_id=[]),
                       fast.generate(ids, max_new_tokens=16, eos_token_id=[]))
    assert loaded.last_stats.acceptance_by_position == fast.last_stats.acceptance_by_position


def test_unsupported_model_names_the_missing_part():
    class NoLayers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = tiny_model("llama", layers=2).config
            self.model = torch.nn.Module()

        def get_input_embeddings(self):
            return torch.nn.Embedding(4, 4)

        def get_output_embeddings(self):
            return torch.nn.Linear(4, 4)

    with pytest.raises(ValueError, match="decoder layers"):
        target_parts(NoLayers())


def test_mtp_step_has_no_host_sync_and_its_state_layout(tmp_path):
    model = tiny_model("llama", layers=3)
    fast = specfx.compile(model, draft=specfx.MTPHead(_saved(tmp_path, model)), num_speculative_tokens=2,
                          max_seq_len=32, backend="eager")
    g = fast.graphs
    assert find_host_syncs(g.step) == [] and find_host_syncs(g.fused_sample_step()) == []
    assert find_host_syncs(g.prefill) == [] and find_host_syncs(g.prime) == []
    assert not any(n.op == "call_module" for n in g.step.graph.nodes)
    # Target KV, the head's key and value, the hidden-state history, draft 1's logits and g.
    assert len(g.state.kv) == 2 * 3 + 5
    assert g.state.kv[-3].shape == (1, g.state.seq_len, 64)
    assert [t.shape for t in g.state.kv[-2:]] == [(1, 1, model.config.vocab_size), (1, 1, 64)]
    # Draft 1 is the previous step's refill at the accepted row: one head pass per later draft.
    assert g.draft_calls == {"draft": 1, "refill": 1}


@pytest.mark.slow
def test_mtp_step_compiles_fullgraph(tmp_path):
    model = tiny_model("llama", layers=2, seed=8)
    fast = specfx.compile(model, draft=specfx.MTPHead(_saved(tmp_path, model)), num_speculative_tokens=2,
                          max_seq_len=32, backend="inductor", warmup=False)
    fast.graphs.state.load_prompts([torch.ones(3, dtype=torch.long)], 4, [])
    explain = torch._dynamo.explain(fast.graphs.step)(*fast.graphs.state.step_args())
    assert explain.graph_break_count == 0 and explain.graph_count == 1
    ids = torch.randint(3, 96, (1, 5))
    assert_greedy_equal(model, fast.generate(ids, max_new_tokens=12, eos_token_id=[]), hf_greedy(model, ids, 12), 5)


def test_train_mtp_cli_needs_a_target(capsys):
    from specfx.cli.main import main

    assert main(["train", "mtp", "--out", "unused"]) == 2
    assert "needs --target" in capsys.readouterr().err


def test_inspect_reports_the_mtp_pipeline(tmp_path):
    from specfx.inspect import inspect_model

    model = tiny_model("llama", layers=2, seed=3)
    report = inspect_model(model, specfx.MTPHead(_saved(tmp_path, model)), k=2, max_seq_len=32).to_dict()
    attach = [p for p in report["passes"] if p["name"] == "expose_hidden"]
    assert [p["graph"] for p in attach] == ["verify", "prefill"] and all(p["modified"] for p in attach)
    assert report["step"]["host_syncs"] == [] and report["step"]["graph_breaks"] == 0
    assert report["drafter"].startswith("mtp:")
