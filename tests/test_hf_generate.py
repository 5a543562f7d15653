"""transformers' front door: `model.generate(ids, custom_generate=specfx.generate_with(...))`
gives what plain `model.generate` gives, compiles once, and refuses what it cannot run."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from transformers import (GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria,
                          StoppingCriteriaList, TextStreamer)
from transformers.generation import TopKLogitsWarper, TopPLogitsWarper

import specfx
from helpers import RecordingStreamer, assert_greedy_equal, tiny_model, unpadded
from specfx import hf_generate, zoo
from specfx.hf_generate import UnsupportedGeneration


def run(model, ids=None, **kwargs):
    """`model.generate`, with or without `custom_generate` among the arguments."""
    with torch.no_grad():
        return model.generate(ids, **kwargs)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama", layers=3, seed=11)      # its greedy rows vary (EOS tests pick from them)


@pytest.fixture(scope="module")
def gen(tiny):
    """An eager ngram:2 front door for the tiny model, compiled by its first call."""
    g = specfx.generate_with(draft="ngram:2", num_speculative_tokens=3, max_seq_len=96, backend="eager")
    g.compiled(tiny)
    return g


IDS = torch.tensor([[5, 17, 33, 8, 41, 12, 9]])


# --- Exactness on the embedded model -------------------------------------------------------

@pytest.mark.slow
def test_greedy_equals_plain_generate_on_evaluation_prompts(pycoder, pycoder_references):
    model, _ = pycoder
    gen = specfx.generate_with(draft="mtp", max_seq_len=320, backend="eager")
    accepted = []
    # Every fourth evaluation prompt, through transformers' `generate` (the MTP head's exactness
    # on every prompt is tests/test_pycoder.py's).
    for ids, ref in pycoder_references[::4]:
        ours = run(model, ids, custom_generate=gen, do_sample=False, max_new_tokens=32)
        assert ours.shape == ref.shape
        assert_greedy_equal(model, ours, ref, ids.shape[1])
        accepted.append(gen.compiled(model).last_stats.mean_accepted)
    # The MTP head drafted and was accepted (one token per call would mean it never is).
    assert sum(accepted) / len(accepted) > 1.5


@pytest.mark.slow
def test_streamer_gets_what_plain_generate_streams(pycoder, capsys):
    model, tok = pycoder
    gen = specfx.generate_with(draft="ngram:3", max_seq_len=320, backend="eager", sync_every=2)
    ids = tok(zoo.prompts("completion")[1], return_tensors="pt").input_ids
    ours, ref = RecordingStreamer(), RecordingStreamer()
    out = run(model, ids, custom_generate=gen, max_new_tokens=32, streamer=ours)
    run(model, ids, max_new_tokens=32, streamer=ref)
    assert ours.puts[0] == ref.puts[0] == ids[0].tolist()        # the prompt, once
    assert sum(ours.puts[1:], []) == sum(ref.puts[1:], []) == out[0, ids.shape[1]:].tolist()
    assert ours.ends == ref.ends == 1
    assert len(ours.puts) > 2                                     # streamed as it went
    # A TextStreamer prints the same text.
    run(model, ids, custom_generate=gen, max_new_tokens=32, streamer=TextStreamer(tok, skip_prompt=True))
    printed = capsys.readouterr().out
    run(model, ids, max_new_tokens=32, streamer=TextStreamer(tok, skip_prompt=True))
    assert printed == capsys.readouterr().out and printed.strip()


@pytest.mark.slow
def test_left_padded_batch(pycoder):
    model, tok = pycoder
    texts = [t[-120:] for t in zoo.prompts("completion")[2:5]]
    batch = tok(texts, return_tensors="pt", padding=True, padding_side="left")
    ids, mask = batch.input_ids, batch.attention_mask
    assert (mask == 0).any() and mask[:, -1].all(), "left padding: the prompts must differ in length"
    gen = specfx.generate_with(draft="mtp", max_seq_len=320, backend="eager", batch_size=3)
    ours = run(model, ids, attention_mask=mask, custom_generate=gen, max_new_tokens=24)
    ref = run(model, ids, attention_mask=mask, max_new_tokens=24)
    assert ours.shape == ref.shape
    assert torch.equal(ours[:, : ids.shape[1]], ids)
    for b in range(3):
        n = int(mask[b].sum())
        row = unpadded(ours, ids, mask, b)
        assert_greedy_equal(model, row, unpadded(ref, ids, mask, b), n)
    # One prompt fewer than batch_size fits; more is refused.
    assert run(model, ids[:2], attention_mask=mask[:2], custom_generate=gen, max_new_tokens=4).shape[0] == 2
    with pytest.raises(ValueError, match="larger than the compiled batch_size=3"):
        run(model, ids.repeat(2, 1), attention_mask=mask.repeat(2, 1), custom_generate=gen, max_new_tokens=4)


# --- Lengths, EOS and padding ---------------------------------------------------------------

def test_greedy_equals_plain_generate_on_a_tiny_model(tiny, gen):
    ref = run(tiny, IDS, max_new_tokens=30, eos_token_id=None)
    assert_greedy_equal(tiny, run(tiny, IDS, custom_generate=gen, max_new_tokens=30, eos_token_id=None),
                        ref, IDS.shape[1])


def test_max_length_means_what_it_means_to_generate(tiny, gen):
    kwargs = dict(max_length=IDS.shape[1] + 11, eos_token_id=None)
    out = run(tiny, IDS, custom_generate=gen, **kwargs)
    assert out.shape[1] == IDS.shape[1] + 11
    assert torch.equal(out, run(tiny, IDS, **kwargs))


def test_eos_stops_and_pads_like_plain_generate(tiny, gen):
    free = run(tiny, IDS, max_new_tokens=20, eos_token_id=None)[0, IDS.shape[1]:].tolist()
    eos = free[5]                                                  # the 6th new token ends the row
    assert eos not in free[:5]
    kwargs = dict(max_new_tokens=20, eos_token_id=eos, pad_token_id=0)
    out = run(tiny, IDS, custom_generate=gen, **kwargs)
    assert torch.equal(out, run(tiny, IDS, **kwargs))
    assert out.shape[1] == IDS.shape[1] + 6 and out[0, -1] == eos


def test_eos_and_pad_come_from_where_generate_takes_them(tiny):
    """A batch where one row meets EOS early: the EOS id stops it and the pad id fills the rest
    of it, from the model's generation_config, a generation_config argument or the call's
    arguments, as transformers resolves them (not specfx's own defaults)."""
    gen = specfx.generate_with(draft="ngram:2", num_speculative_tokens=3, max_seq_len=96, backend="eager",
                               batch_size=2)
    ids = torch.cat([IDS, IDS.flip(1)])
    free = run(tiny, ids, max_new_tokens=16, eos_token_id=None)[:, IDS.shape[1]:].tolist()
    eos = next(t for t in free[0][2:8] if t not in free[1] and t not in free[0][:2])
    config = tiny.generation_config
    saved = config.eos_token_id, config.pad_token_id
    config.eos_token_id, config.pad_token_id = eos, 93
    try:
        for pad, kwargs in [(93, {}),
                            (92, dict(generation_config=GenerationConfig(eos_token_id=eos, pad_token_id=92))),
                            (90, dict(pad_token_id=90))]:
            out = run(tiny, ids, custom_generate=gen, max_new_tokens=16, **kwargs)
            assert torch.equal(out, run(tiny, ids, max_new_tokens=16, **kwargs)), kwargs
            assert eos in out[0].tolist() and out[0, -1] == pad, kwargs    # row 0 stopped, then padding
            assert (out[1, IDS.shape[1]:] != pad).all()
    finally:
        config.eos_token_id, config.pad_token_id = saved


def test_sampling_settings_reach_the_step(tiny, gen, monkeypatch):
    """transformers' warpers (its default top_k=50 included) become the step's settings; the
    seed comes from torch's generator, so manual_seed reproduces a run."""
    seen = []
    real = specfx.SpeculativeModel.generate
    monkeypatch.setattr(specfx.SpeculativeModel, "generate",
                        lambda self, *a, **kw: seen.append(kw) or real(self, *a, **kw))
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(run(tiny, IDS, custom_generate=gen, do_sample=True, temperature=0.7, top_p=0.9,
                          max_new_tokens=12))
    assert torch.equal(runs[0], runs[1])
    assert seen[0]["do_sample"] is True
    assert (seen[0]["temperature"], seen[0]["top_k"], seen[0]["top_p"]) == (0.7, 50, 0.9)
    assert seen[0]["seed"] == seen[1]["seed"]
    run(tiny, IDS, custom_generate=gen, do_sample=True, top_k=0, max_new_tokens=4)
    assert (seen[2]["temperature"], seen[2]["top_k"], seen[2]["top_p"]) == (1.0, 0, 1.0)


# --- Compiled once ------------------------------------------------------------------------

def test_compiles_once_per_model_and_settings(monkeypatch):
    built = []

    class Counted(specfx.SpeculativeModel):
        def __init__(self, model, **kwargs):
            built.append(kwargs)
            super().__init__(model, **kwargs)

    monkeypatch.setattr(hf_generate, "SpeculativeModel", Counted)
    model = tiny_model("llama", layers=2, seed=3)
    settings = dict(draft="ngram:2", num_speculative_tokens=2, max_seq_len=64, backend="eager")
    first = run(model, IDS, custom_generate=specfx.generate_with(**settings), max_new_tokens=8)
    # A new callable with equal settings (a config equal to the string) reuses the compiled model.
    again = specfx.generate_with(**{**settings, "draft": specfx.PromptLookup(ngram=2)})
    assert torch.equal(run(model, IDS, custom_generate=again, max_new_tokens=8), first)
    assert len(built) == 1
    assert again.compiled(model) is specfx.generate_with(**settings).compiled(model)
    # Other settings, or another model, compile anew.
    specfx.generate_with(**{**settings, "max_seq_len": 80}).compiled(model)
    other = tiny_model("llama", layers=2, seed=3)
    specfx.generate_with(**settings).compiled(other)
    assert len(built) == 3
    # A copy of the model has other weights: it starts without compiled models.
    assert "_specfx_compiled" in vars(model) and not vars(copy.deepcopy(model))["_specfx_compiled"]
    # The compiled models go with their model.
    compiled = weakref.ref(again.compiled(model))
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None and compiled() is None


@pytest.mark.slow
def test_inductor_compiles_at_the_first_call_only(monkeypatch):
    """The default backend: the first generate compiles, a later one (through a new callable
    with the same settings) compiles nothing and is still exact."""
    from torch._dynamo.utils import counters

    from specfx.runtime import generate as runtime_generate

    model = tiny_model("llama", layers=2, seed=11)
    settings = dict(draft="ngram:2", num_speculative_tokens=3, max_seq_len=96)
    first = run(model, IDS, custom_generate=specfx.generate_with(**settings), max_new_tokens=30, eos_token_id=None)
    assert_greedy_equal(model, first, run(model, IDS, max_new_tokens=30, eos_token_id=None), IDS.shape[1])
    compiled = []
    real = runtime_generate.compile_graph
    monkeypatch.setattr(runtime_generate, "compile_graph", lambda *a, **kw: compiled.append(a) or real(*a, **kw))
    inductor = lambda: sum(counters["inductor"][k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss",  # noqa: E731
                                                             "fxgraph_cache_bypass"))
    before = inductor()
    ids = IDS[:, :4]
    again = run(model, ids, custom_generate=specfx.generate_with(**settings), max_new_tokens=20, eos_token_id=None)
    assert compiled == [] and inductor() == before
    assert_greedy_equal(model, again, run(model, ids, max_new_tokens=20, eos_token_id=None), ids.shape[1])


def test_generate_with_checks_its_arguments():
    with pytest.raises(TypeError, match=r"unknown arguments \['batch'\]"):
        specfx.generate_with(draft="mtp", batch=2)
    with pytest.raises(ValueError):
        specfx.generate_with(draft="no-such-drafter")
    with pytest.raises(TypeError, match="must be hashable"):
        specfx.generate_with(cudagraphs=[True])


# --- Refusals -----------------------------------------------------------------------------

class Ban(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores.index_fill(-1, torch.tensor([3]), -float("inf"))


class StopAt(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == 3


REFUSED = [
    (dict(logits_processor=LogitsProcessorList([Ban()])), "logits processor Ban (from logits_processor)"),
    (dict(stopping_criteria=StoppingCriteriaList([StopAt()])), "stopping criterion StopAt (from stopping_criteria)"),
    (dict(num_beams=2), "beam search (from num_beams=2)"),
    (dict(num_beams=2, do_sample=True), "beam sample (from num_beams=2)"),
    (dict(repetition_penalty=1.3), "RepetitionPenaltyLogitsProcessor (from repetition_penalty=1.3)"),
    (dict(no_repeat_ngram_size=2), "NoRepeatNGramLogitsProcessor (from no_repeat_ngram_size=2)"),
    (dict(min_new_tokens=4), "MinNewTokensLengthLogitsProcessor (from min_new_tokens=4)"),
    (dict(bad_words_ids=[[4]]), "NoBadWordsLogitsProcessor (from bad_words_ids=[[4]])"),
    (dict(do_sample=True, min_p=0.1), "MinPLogitsWarper (from min_p=0.1)"),
    (dict(logits_processor=LogitsProcessorList([TopKLogitsWarper(5)])),
     "logits processor TopKLogitsWarper (from logits_processor)"),
    (dict(do_sample=True, logits_processor=LogitsProcessorList([TopKLogitsWarper(5)])),
     "logits processor TopKLogitsWarper after another of its kind"),
    (dict(do_sample=True, top_k=0, logits_processor=LogitsProcessorList([TopPLogitsWarper(0.9, min_tokens_to_keep=2)])),
     "TopPLogitsWarper(filter_value=-inf, min_tokens_to_keep=2)"),
    (dict(max_time=30.0), "stopping criterion MaxTimeCriteria (from max_time=30.0)"),
    (dict(do_sample=True, num_return_sequences=2), "num_return_sequences=2"),
    (dict(return_dict_in_generate=True), "return_dict_in_generate=True"),
    (dict(output_scores=True), "output_scores=True"),
    (dict(prompt_lookup_num_tokens=3), "assisted generation (from assistant_model, prompt_lookup_num_tokens"),
    (dict(position_ids=torch.arange(1, 8)[None]), "position_ids other than the attention mask's"),
]


@pytest.mark.parametrize("kwargs,message", REFUSED, ids=[m.split(" (")[0] for _, m in REFUSED])
def test_refuses_what_the_fused_step_cannot_run(tiny, gen, kwargs, message):
    with pytest.raises(UnsupportedGeneration, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        run(tiny, IDS, custom_generate=gen, max_new_tokens=8, **kwargs)


def test_refuses_an_assistant_model_that_transformers_does_not_pass_on(tiny, gen):
    with pytest.raises(UnsupportedGeneration, match="assisted generation .*generate_with\\(draft=...\\)"):
        run(tiny, IDS, custom_generate=gen, max_new_tokens=8, assistant_model=tiny_model("llama", layers=1))


def test_refuses_a_cache_that_holds_tokens(tiny, gen):
    from transformers import DynamicCache

    cache = DynamicCache(config=tiny.config)
    with torch.no_grad():
        tiny(IDS[:, :3], cache=cache)
    with pytest.raises(UnsupportedGeneration, match="cache holding 3 tokens"):
        run(tiny, IDS, custom_generate=gen, max_new_tokens=8, cache=cache)


def test_refuses_inputs_embeds(tiny, gen):
    embeds = tiny.get_input_embeddings()(IDS)
    with pytest.raises(UnsupportedGeneration, match="model input 'inputs_embeds'"):
        run(tiny, inputs_embeds=embeds, custom_generate=gen, max_new_tokens=8)


def test_every_refusal_is_listed_before_anything_runs(tiny, gen):
    with pytest.raises(UnsupportedGeneration) as e:
        run(tiny, IDS, custom_generate=gen, max_new_tokens=8, num_beams=2, repetition_penalty=1.2,
              output_scores=True)
    assert all(w in str(e.value) for w in ("num_beams=2", "repetition_penalty=1.2", "output_scores=True"))
