"""Greedy exactness: specfx.compile(...).generate equals model.generate(do_sample=False)."""

from __future__ import annotations

import zlib

import pytest
import torch

import specfx
from helpers import ARCHS, RecordingStreamer, assert_greedy_equal, hf_greedy, tiny_model, unpadded

# k = 1, a middle k and k + 1 = 7 > the prompt; exits at every inner layer of the 4, drafting on
# the model's weights (the verify pass continues from the exit) and on an int8 copy of them (it
# runs every layer).
CASES = ([("none", 1)] + [(f"early-exit:{E}", k) for E, k in [(1, 1), (3, 3), (2, 6)]]
         + [("early-exit:2:weights=int8", 3), ("ngram:3", 4), ("ngram:1", 2)])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("draft,k", CASES)
def test_greedy_equals_model_generate(arch, draft, k):
    model = tiny_model(arch, layers=4, seed=zlib.crc32(f"{arch}/{draft}/{k}".encode()) % 1000)  # stable seed
    fast = specfx.compile(model, draft=draft, num_speculative_tokens=k, max_seq_len=96, backend="eager",
                          prefill_chunk=64)
    g = torch.Generator().manual_seed(k)
    for prompt_len in (1, 7, 70):  # 70 > one prefill chunk of 64
        ids = torch.randint(3, 96, (1, prompt_len), generator=g)
        ours = fast.generate(ids, max_new_tokens=24, eos_token_id=[])
        ref = hf_greedy(model, ids, 24, eos_token_id=None)
        assert_greedy_equal(model, ours, ref, prompt_len)
        stats = fast.last_stats
        assert stats.new_tokens == 24
        assert 1.0 <= stats.mean_accepted <= k + 1
        assert len(stats.acceptance_by_position) == (0 if draft == "none" else k)


@pytest.mark.parametrize("draft", ["none", "early-exit:2", "ngram:2"])
def test_the_first_token_comes_from_the_prefill(draft):
    """No step runs before the first new token (time to first token is the prefill's, with no
    drafting): one new token takes no step, n tokens at most n - 1; an EOS first token stops the
    row at once."""
    model = tiny_model("llama", layers=4, seed=8)
    fast = specfx.compile(model, draft=draft, num_speculative_tokens=3, max_seq_len=96, batch_size=2,
                          backend="eager", prefill_chunk=64)
    g = torch.Generator().manual_seed(2)
    for prompt_len in (1, 2, 64, 65):                     # a chunk boundary at the last prompt token
        ids = torch.randint(3, 96, (2, prompt_len), generator=g)
        ours = fast.generate(ids, max_new_tokens=1, eos_token_id=[])
        assert fast.last_stats.steps == 0 and fast.last_stats.target_calls == 0
        assert torch.equal(ours, hf_greedy(model, ids, 1, eos_token_id=None))
        ours = fast.generate(ids, max_new_tokens=5, eos_token_id=[])
        assert 1 <= fast.last_stats.steps <= 4
        for b in range(2):
            assert_greedy_equal(model, ours[b : b + 1], hf_greedy(model, ids[b : b + 1], 5), prompt_len)
    first = hf_greedy(model, ids[:1], 1)[0, -1].item()
    out = fast.generate(ids[:1], max_new_tokens=8, eos_token_id=first)
    assert out.shape[1] == ids.shape[1] + 1 and fast.last_stats.steps == 0


def test_prompt_lookup_accepts_repeated_text():
    model = tiny_model("mistral", layers=4, seed=12)
    ids = torch.randint(3, 96, (1, 10)).repeat(1, 5)
    fast = specfx.compile(model, draft=specfx.PromptLookup(ngram=3), num_speculative_tokens=4, max_seq_len=128,
                          backend="eager")
    ours = fast.generate(ids, max_new_tokens=32, eos_token_id=[])
    assert_greedy_equal(model, ours, hf_greedy(model, ids, 32), 50)
    # The model continues the pattern it was shown (or not); either way lookup must never be
    # wrong, and where the output repeats the prompt, drafts are accepted.
    new = ours[0, 50:].tolist()
    if new[:10] == ids[0, :10].tolist():
        assert fast.last_stats.mean_accepted > 2


def test_batched_rows_of_different_lengths_match_row_by_row():
    model = tiny_model("qwen2", layers=4, seed=3)
    fast = specfx.compile(model, draft="early-exit:2", num_speculative_tokens=3, max_seq_len=64,
                          batch_size=3, backend="eager")
    ids = torch.randint(3, 96, (3, 9))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0   # left padding
    mask[2, :8] = 0
    ids[mask == 0] = 0
    ours = fast.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[])
    ref = hf_greedy(model, ids, 12, attention_mask=mask, eos_token_id=None)
    assert ours.shape == ref.shape
    for b in range(3):
        row = unpadded(ours, ids, mask, b)
        n = int(mask[b].sum())
        assert_greedy_equal(model, row, hf_greedy(model, row[:, :n], 12), n)


def test_eos_stops_like_model_generate():
    model = tiny_model("llama", layers=4, seed=5)
    ids = torch.randint(3, 96, (1, 5))
    free = hf_greedy(model, ids, 20, eos_token_id=None)[0, 5:].tolist()
    eos = free[6]  # make the 7th generated token the EOS
    fast = specfx.compile(model, draft="early-exit:1", num_speculative_tokens=4, max_seq_len=64, backend="eager")
    ours = fast.generate(ids, max_new_tokens=20, eos_token_id=eos)
    ref = hf_greedy(model, ids, 20, eos_token_id=eos)
    assert torch.equal(ours, ref)
    assert ours[0, -1].item() == eos


def test_streamer_receives_the_generated_tokens():
    model = tiny_model("llama", layers=4, seed=1)
    fast = specfx.compile(model, draft="early-exit:2", num_speculative_tokens=2, max_seq_len=64,
                          backend="eager", sync_every=2)
    ids = torch.randint(3, 96, (1, 5))
    s = RecordingStreamer()
    out = fast.generate(ids, max_new_tokens=15, eos_token_id=[], streamer=s)
    assert s.ends == 1 and s.puts[0] == ids[0].tolist()
    assert sum(s.puts[1:], []) == out[0, 5:].tolist()
    assert len(s.puts) > 2  # streamed in several pieces, not all at the end


def test_decorator_form():
    model = tiny_model("llama", layers=4)

    @specfx.compile(draft="early-exit:2", num_speculative_tokens=2, max_seq_len=32, backend="eager")
    def fast():
        return model

    assert isinstance(fast, specfx.SpeculativeModel)
    ids = torch.randint(3, 96, (1, 4))
    assert_greedy_equal(model, fast.generate(ids, max_new_tokens=8, eos_token_id=[]), hf_greedy(model, ids, 8), 4)


@pytest.mark.parametrize("arch,draft_vocab", [(arch, 96) for arch in ARCHS]      # equal vocabularies,
                         + [("llama", 128), ("qwen2", 90)])                   # padded larger, smaller
def test_draft_model_greedy_equals_model_generate(arch, draft_vocab):
    model = tiny_model(arch, layers=4, seed=21)
    draft = tiny_model(arch, layers=2, vocab=draft_vocab, seed=22)
    fast = specfx.compile(model, draft=specfx.DraftModel(draft), num_speculative_tokens=3, max_seq_len=96,
                          backend="eager")
    for prompt_len in (1, 70):
        ids = torch.randint(3, 90, (1, prompt_len))
        ours = fast.generate(ids, max_new_tokens=20, eos_token_id=[])
        assert_greedy_equal(model, ours, hf_greedy(model, ids, 20), prompt_len)


def test_first_token_is_out_before_the_draft_model_prefills():
    """The first token needs no draft: it is streamed (and TTFT taken) before the draft model's
    prefill, which the steps then need (the draft KV is written before the first step)."""
    model, draft = tiny_model("llama", layers=3, seed=5), tiny_model("llama", layers=3, seed=5)
    fast = specfx.compile(model, draft=specfx.DraftModel(draft), num_speculative_tokens=3, max_seq_len=64,
                          backend="eager", warmup=False)
    rt = fast.runtime
    calls = []
    fn, kv = rt.prefill_fns[1]
    rt.prefill_fns[1] = (lambda *a: calls.append(1) or fn(*a)), kv

    class Order(RecordingStreamer):
        def put(self, value):
            super().put(value)
            self.draft_calls_at_put = getattr(self, "draft_calls_at_put", []) + [len(calls)]

    ids = torch.randint(3, 96, (1, 6))
    s = Order()
    out = fast.generate(ids, max_new_tokens=12, eos_token_id=[], streamer=s)
    assert s.draft_calls_at_put[:2] == [0, 0]          # the prompt, then the first token: no draft prefill yet
    assert calls and s.draft_calls_at_put[-1] == len(calls)
    assert_greedy_equal(model, out, hf_greedy(model, ids, 12), 6)
    assert fast.last_stats.acceptance_by_position == [1.0] * 3      # its KV was there for every step
    calls.clear()
    fast.generate(ids, max_new_tokens=1, eos_token_id=[])           # no step: no draft prefill at all
    assert not calls


def test_draft_model_identical_to_target_accepts_everything():
    model = tiny_model("qwen2", layers=3, seed=5)
    fast = specfx.compile(model, draft=specfx.DraftModel(tiny_model("qwen2", layers=3, seed=5)),
                          num_speculative_tokens=4, max_seq_len=64, backend="eager")
    ids = torch.randint(3, 96, (1, 6))
    assert_greedy_equal(model, fast.generate(ids, max_new_tokens=25, eos_token_id=[]), hf_greedy(model, ids, 25), 6)
    assert fast.last_stats.acceptance_by_position == [1.0] * 4


def test_early_exit_drafts_from_int8_layers_where_the_tiled_kernel_runs():
    """With the skinny-matmul pass on (the CPU), early exit drafts on an int8 copy of the layers
    before the exit and of the lm_head (`store_draft_weights`), and the verify pass runs every
    layer; the output is still the model's greedy output. Where the layers past the exit add
    nothing, the exit predicts what the model does and drafts are accepted all but always (1.0
    tokens a call of 4 when the copy's rows lose their scales: checked by breaking it)."""
    from specfx.kernels import tiled_linear

    if not tiled_linear.available()[0]:
        pytest.skip(tiled_linear.available()[1])
    model = tiny_model("llama", layers=4, seed=21)
    ids = torch.randint(3, 96, (1, 9))

    def compiled():
        fast = specfx.compile(model, draft="early-exit:2", num_speculative_tokens=3, max_seq_len=64,
                              backend="eager", skinny_matmul=True)
        stored = {str(t.dtype) for n, t in fast.graphs.parts["draft"].named_buffers() if n.startswith("draft_weight")}
        assert stored == {"torch.int8", "torch.float32"}                    # the rows and their scales
        assert fast.graphs.draft_calls == {"draft": 3}                      # k: the verify runs every layer
        return fast

    assert_greedy_equal(model, compiled().generate(ids, max_new_tokens=24, eos_token_id=[]), hf_greedy(model, ids, 24), 9)
    with torch.no_grad():
        for layer in model.model.layers[2:]:                  # the late layers' residual updates
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    fast = compiled()
    assert_greedy_equal(model, fast.generate(ids, max_new_tokens=24, eos_token_id=[]), hf_greedy(model, ids, 24), 9)
    assert fast.last_stats.mean_accepted > 3.0               # (4.0 in float32; a near-tie may differ in int8)