"""bfloat16 and float16 models run in their own dtype: greedy exactness under the near-tie rule
scaled to the dtype (`specfx.exactness.NEAR_TIE`), the sampling distribution, the bench flag.

By default each family x dtype runs one drafter, in turn (every drafter runs once); SPECFX_ALL_FAMILIES=1
runs them all.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import specfx
from helpers import assert_greedy_equal, family_model, hf_greedy, tiny_checkpoint
from test_families import DRAFTERS, PROMPT, make_drafter

FAMILIES = ("llama", "gemma2", "gpt2")     # rotary; soft-capping with sliding windows; learned positions
DTYPES = ("bfloat16", "float16")
ALL = os.environ.get("SPECFX_ALL_FAMILIES") == "1"


def _cases():
    i = 0
    for family in FAMILIES:
        for dtype in DTYPES:
            for j, draft in enumerate(DRAFTERS):
                if ALL or j == i % len(DRAFTERS):
                    yield family, dtype, draft
            i += 1


@pytest.mark.parametrize("family,dtype,draft", list(_cases()))
def test_half_precision_greedy_equals_model_generate(family, dtype, draft, tmp_path):
    dtype = getattr(torch, dtype)
    model = family_model(family, layers=3, seed=11, dtype=dtype)
    fast = specfx.compile(model, draft=make_drafter(draft, model, family, tmp_path, dtype=dtype),
                          num_speculative_tokens=3, max_seq_len=64, backend="eager")
    assert all(kv.dtype == dtype for kv in fast.graphs.state.kv)      # not up-cast
    ids = torch.randint(3, 96, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    ours = fast.generate(ids, max_new_tokens=32, eos_token_id=[])
    assert_greedy_equal(model, ours, hf_greedy(model, ids, 32, eos_token_id=None), PROMPT)


def test_bfloat16_sampling_keeps_the_distribution(tmp_path):
    from test_sampling import V_SMALL, _first_two_tv

    model = family_model("llama", layers=3, vocab=V_SMALL, seed=4, dtype=torch.bfloat16)
    tv1, tv2 = _first_two_tv(model, "early-exit:1", 3, tmp_path)
    assert tv1 < 0.05 and tv2 < 0.05, (tv1, tv2)


def test_bench_accepts_bfloat16(tmp_path):
    from specfx.cli.main import main

    tiny_checkpoint(tmp_path / "ckpt", layers=3, seed=2)
    out = tmp_path / "bench.json"
    rc = main(["bench", str(tmp_path / "ckpt"), "--dtype", "bfloat16", "--methods", "hf-greedy,specfx:ngram:2",
               "--num-prompts", "1", "--max-new-tokens", "8", "--repeats", "1", "--warmup", "0",
               "--backend", "eager", "-k", "2", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["settings"]["dtype"] == "bfloat16"
    assert [r["name"] for r in data["runs"]] == ["hf-greedy", "specfx:ngram:2"]
