"""Bad input gets a clear error, never a wrong answer."""

from __future__ import annotations

import pytest
import torch

import specfx
from helpers import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=4)


@pytest.mark.parametrize("E", [0, 4, 9])
def test_exit_layer_out_of_range(model, E):
    with pytest.raises(ValueError, match=r"exit layer|must be an int >= 1"):
        specfx.compile(model, draft=specfx.EarlyExit(layer=E) if E else "early-exit:0", backend="eager")


@pytest.mark.parametrize("k", [0, -2])
def test_k_below_one(model, k):
    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 1"):
        specfx.compile(model, draft="early-exit:2", num_speculative_tokens=k, backend="eager")


@pytest.mark.parametrize("chunk", [1, 0])
def test_prefill_chunk_below_two(model, chunk):
    with pytest.raises(ValueError, match="prefill_chunk must be >= 2"):
        specfx.compile(model, draft="early-exit:2", prefill_chunk=chunk, backend="eager")


def test_prompt_plus_new_tokens_beyond_max_seq_len(model):
    fast = specfx.compile(model, draft="early-exit:2", num_speculative_tokens=2, max_seq_len=32, backend="eager")
    with pytest.raises(ValueError, match="exceeds max_seq_len=32"):
        fast.generate(torch.ones(1, 20, dtype=torch.long), max_new_tokens=13)
    fast.generate(torch.ones(1, 20, dtype=torch.long), max_new_tokens=12)  # exactly fits


def test_batch_larger_than_compiled(model):
    fast = specfx.compile(model, draft="none", max_seq_len=32, batch_size=2, backend="eager")
    with pytest.raises(ValueError, match="larger than the compiled batch_size=2"):
        fast.generate(torch.ones(3, 4, dtype=torch.long), max_new_tokens=4)


@pytest.mark.parametrize("spec", ["early-exit:x", "medusa", "none:3", "ngram:x", "early-exit:weights=int8:2"])
def test_unknown_draft_spec(model, spec):
    with pytest.raises(ValueError, match="draft spec"):
        specfx.compile(model, draft=spec, backend="eager")


def test_early_exit_weights_name_a_dtype_or_the_target():
    with pytest.raises(ValueError, match="EarlyExit\\(weights_dtype='float16'\\): expected None .* 'target', 'bfloat16', 'int8'"):
        specfx.parse_draft("early-exit:2:weights=float16")
    assert specfx.parse_draft("early-exit:weights=target") == specfx.EarlyExit(weights_dtype="target")
    assert str(specfx.EarlyExit(2, weights_dtype="int8")) == "early-exit:2:weights=int8"


def test_non_layerskip_model_runs_and_reports_low_acceptance(model):
    # A random model was never trained for early exit: allowed, exact, and the stats say so.
    fast = specfx.compile(model, draft="early-exit:1", num_speculative_tokens=4, max_seq_len=64, backend="eager")
    fast.generate(torch.randint(3, 96, (1, 8)), max_new_tokens=24, eos_token_id=[])
    s = fast.last_stats
    assert s.acceptance_by_position[-1] < 0.5
    assert s.mean_accepted < 3


@pytest.mark.parametrize("spec", ["ngram:0", "ngram:-1"])
def test_ngram_below_one(model, spec):
    with pytest.raises(ValueError, match="ngram must be an int >= 1"):
        specfx.compile(model, draft=spec, backend="eager")


def _checkpoint(path, tokenizer, **config):
    m = tiny_model("llama", layers=2, vocab=len(tokenizer), **config)
    m.save_pretrained(path)
    tokenizer.save_pretrained(path)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path))


def test_draft_model_with_a_different_tokenizer_is_refused(tmp_path):
    from transformers import AutoTokenizer

    from specfx import zoo
    from specfx.zoo.tokenizer import train_tokenizer

    ours = AutoTokenizer.from_pretrained(str(zoo.path("pycoder-draft")))
    other = train_tokenizer(["SELECT * FROM t WHERE x = 1;"] * 50 + ["fn main() { }"] * 50, vocab_size=len(ours))
    target = _checkpoint(tmp_path / "target", ours)
    draft = _checkpoint(tmp_path / "draft", other)
    with pytest.raises(ValueError, match="different tokenizer: token id"):
        specfx.compile(target, draft=specfx.DraftModel(draft), backend="eager")
    # A draft with the same tokenizer is accepted, by object or by path.
    same = _checkpoint(tmp_path / "same", ours)
    specfx.compile(target, draft=specfx.DraftModel(same), max_seq_len=32, backend="eager")
    specfx.compile(target, draft=f"draft-model:{tmp_path / 'same'}", max_seq_len=32, backend="eager")


def test_draft_model_with_other_special_tokens_is_refused(model):
    draft = tiny_model("llama", layers=2, eos_token_id=5)
    with pytest.raises(ValueError, match="eos_token_id is 5 in the draft, 2 in the target"):
        specfx.compile(model, draft=specfx.DraftModel(draft), backend="eager")


def test_draft_model_spec_needs_a_model():
    with pytest.raises(ValueError, match="draft-model:<zoo name or checkpoint path>"):
        specfx.parse_draft("draft-model")
    with pytest.raises(TypeError, match="DraftModel"):
        specfx.DraftModel(3)


def test_head_that_reads_token_ids_refuses_early_exit_by_name():
    from transformers import LlamaForCausalLM

    class TokenBias(LlamaForCausalLM):
        """A head that adds a per-token bias of the input ids: the verify remainder needs the ids."""

        def __init__(self, config):
            super().__init__(config)
            self.token_bias = torch.nn.Parameter(torch.randn(config.vocab_size))

        def forward(self, input_ids=None, **kwargs):
            out = super().forward(input_ids=input_ids, **kwargs)
            out.logits = out.logits + self.token_bias[input_ids][..., None]
            return out

    model = TokenBias(tiny_model("llama", layers=3).config).eval()
    with pytest.raises(ValueError, match=r"TokenBias \(llama\), drafter early-exit:1: layers >= 1 still read input_ids"):
        specfx.compile(model, draft="early-exit:1", max_seq_len=32, backend="eager")
