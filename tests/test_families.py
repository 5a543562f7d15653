"""Greedy exactness across Hugging Face decoder families (`helpers.FAMILIES`), every drafter.

Each family's tiny random model generates well past its sliding window (16) where it has one.
The whole family x drafter matrix takes minutes on one core, so by default each family runs one
drafter, in turn (every drafter runs on several families), and the four families that
tests/test_exactness.py covers run none here; SPECFX_ALL_FAMILIES=1 runs the whole matrix, as
`scripts/family_table.py` does to write README's table.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

import specfx
from helpers import FAMILIES, REFUSED, assert_greedy_equal, family_model, hf_greedy
from specfx.mtp import new_head, save_head

# early-exit:2 drafts on an int8 copy of its layers (as on the CPU by default), early-exit:1 on the model's.
DRAFTERS = ("none", "early-exit:1", "early-exit:2:weights=int8", "ngram:2", "draft-model", "mtp")
ALL = os.environ.get("SPECFX_ALL_FAMILIES") == "1"
PROMPT, NEW = 10, 40     # 50 positions: well past a window of 16
# Family x drafter pairs refused at compile time, and the words of the refusal.
REFUSED_DRAFTERS = {("opt", "mtp"): "embedding projection"}


COVERED = {"llama", "qwen2", "mistral", "gemma"}   # every drafter in tests/test_exactness.py and test_mtp.py


def _cases():
    for i, family in enumerate(FAMILIES):
        for j, draft in enumerate(DRAFTERS):
            if ALL or (j == i % len(DRAFTERS) and family not in COVERED):
                yield family, draft


def make_drafter(draft: str, model, family: str, tmp_path, *, dtype=torch.float32):
    """The drafter config for a name of DRAFTERS: a draft model of 2 layers of the same
    family, an MTP head with random weights (its layer a copy of the target's last)."""
    if draft == "draft-model":
        return specfx.DraftModel(family_model(family, layers=2, seed=7, dtype=dtype))
    if draft == "mtp":
        return specfx.MTPHead(save_head(new_head(model), tmp_path / "head", model))
    return draft


def check_family(family: str, draft: str, tmp_path, *, new_tokens: int = NEW, backend: str = "eager",
                 layers: int = 3):
    seed = zlib.crc32(f"{family}/{draft}".encode()) % 1000
    model = family_model(family, layers=layers, seed=seed)
    fast = specfx.compile(model, draft=make_drafter(draft, model, family, tmp_path),
                          num_speculative_tokens=3, max_seq_len=64, backend=backend)
    ids = torch.randint(3, 96, (1, PROMPT), generator=torch.Generator().manual_seed(seed))
    ours = fast.generate(ids, max_new_tokens=new_tokens, eos_token_id=[])
    assert_greedy_equal(model, ours, hf_greedy(model, ids, new_tokens, eos_token_id=None), PROMPT)
    assert fast.last_stats.new_tokens == new_tokens


@pytest.mark.parametrize("family,draft", list(_cases()))
def test_family_greedy_equals_model_generate(family, draft, tmp_path):
    if (family, draft) in REFUSED_DRAFTERS:
        with pytest.raises(ValueError, match=REFUSED_DRAFTERS[family, draft]):
            check_family(family, draft, tmp_path)
    else:
        check_family(family, draft, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("family,draft", [
    ("gpt2", "early-exit:1"),         # learned positions, Conv1D, LayerNorm with bias, tied head
    ("gpt_neox", "draft-model"),      # parallel attention+MLP, partial rotary, fused QKV
    ("gemma2", "ngram:2"),            # alternating sliding window, soft-capping
    ("granite", "ngram:2"),           # embedding, residual, attention and logit multipliers
    ("qwen3", "none"),                # QK-norm
    ("mixtral", "ngram:2"),           # mixture of experts
])
def test_family_compiled_with_inductor(family, draft, tmp_path):
    # One compiled case per structural variant: Inductor, the skinny-matmul rewrite and the span.
    # The lookup drafter's step is the verify pass over k+1 rows and little else, so the
    # variants run through a multi-row verify at a fraction of an early-exit step's compile
    # time; early exit, the draft model and the MTP head are compiled on other models (here
    # and in tests/test_compiled.py, test_compile_path.py, test_mtp.py, test_sampling.py).
    # Two layers: gemma2's local and global layer, and a layer past gpt2's exit; Inductor's
    # compile time grows with the layers, which add no variant of their own.
    check_family(family, draft, tmp_path, backend="inductor", layers=2)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_unsupported_family_is_refused_naming_the_part(family):
    model = family_model(family, layers=2)
    with pytest.raises(ValueError, match=rf"{type(model).__name__} \({family}\): {REFUSED[family]}"):
        specfx.compile(model, draft="early-exit:1", max_seq_len=32, backend="eager")


def test_alibi_position_bias_is_refused_naming_it():
    # ALiBi Falcon builds its bias from a padding mask; run on specfx's position mask it would
    # attend with the wrong bias (and before transformers 5.25 it bypassed attention besides).
    model = family_model("falcon", layers=2, alibi=True, num_key_value_heads=None)
    with pytest.raises(ValueError, match=r"FalconForCausalLM \(falcon\): ALiBi position bias \(config\.alibi\) "
                                         "is not supported"):
        specfx.compile(model, draft="early-exit:1", max_seq_len=32, backend="eager")


def test_a_config_that_misstates_the_kv_heads_is_refused():
    # The KV buffers are sized from the config; a model whose attention gives other shapes would
    # otherwise fail deep inside the trace with an indexing error.
    model = family_model("llama", layers=2)
    model.config.num_key_value_heads = 1                 # its k_proj still gives 2 heads
    with pytest.raises(ValueError, match=r"LlamaForCausalLM \(llama\): layer 0's attention gives keys of 2 heads "
                                         r"x 16, but its config says 1 KV heads x 16"):
        specfx.compile(model, draft="early-exit:1", max_seq_len=32, backend="eager")


def test_sliding_window_changes_the_output():
    # Without this, a window the model ignored would pass the tests above for the wrong reason.
    ids = torch.randint(3, 96, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    windowed = hf_greedy(family_model("mistral", seed=1), ids, NEW)
    full = hf_greedy(family_model("mistral", seed=1, sliding_window=None), ids, NEW)
    assert not torch.equal(windowed, full)


def test_family_list_covers_twenty_families():
    assert len(FAMILIES) >= 20


def test_eval_mode_dropouts_leave_the_graph():
    # Kept, a dropout after the embedding would keep the embedding (and input_ids) alive in an
    # early exit's verify graph, which starts after it (Phi, GPT-NeoX, StarCoder2, GPT-2).
    from specfx.capture import capture

    gm = capture(family_model("phi", layers=2), width=1, max_seq_len=16).gm
    assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.dropout.default]
