"""The embedded models, their corpus split, tokenizer and training loop."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specfx import zoo
from specfx.zoo import corpus
from specfx.zoo.train import TrainConfig, build_model, exit_layers, layer_drop_probs, train


def test_heldout_split_is_disjoint_and_about_five_percent():
    files = corpus.list_files()
    train_files, heldout = corpus.split(files)
    assert set(train_files).isdisjoint(heldout)
    assert sorted(train_files + heldout) == sorted(files)
    assert 0.02 < len(heldout) / len(files) < 0.09
    assert files == sorted(files)


def test_manifest_records_the_heldout_files():
    m = json.loads(zoo.MANIFEST.read_text())
    assert m["python"].count(".") == 2
    recorded = {f["path"] for f in m["files"] if f["heldout"]}
    assert recorded == {f["path"] for f in m["files"] if corpus.is_heldout(f["path"])}
    assert all(len(f["sha256"]) == 64 for f in m["files"])


@pytest.mark.parametrize("name", ["pycoder", "pycoder-draft"])
def test_zoo_models_load_through_plain_transformers(name):
    p = zoo.path(name)
    model = AutoModelForCausalLM.from_pretrained(str(p))
    tok = AutoTokenizer.from_pretrained(str(p))
    assert model.dtype == torch.float32
    assert model.config.model_type == "llama"
    assert tok.eos_token_id is not None and tok.bos_token_id is not None and tok.pad_token_id is not None
    ids = tok("def f(x):\n    return", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape == (1, ids.shape[1] + 4)


def test_zoo_shapes_follow_the_spec():
    target = zoo.info("pycoder")
    draft = zoo.info("pycoder-draft")
    assert 15e6 <= target["parameters"] <= 25e6
    assert len(target["heldout"]["top1_by_exit"]) >= 12
    assert 2 <= len(draft["heldout"]["top1_by_exit"]) <= 4
    tcfg = AutoModelForCausalLM.from_pretrained(str(zoo.path("pycoder"))).config
    dcfg = AutoModelForCausalLM.from_pretrained(str(zoo.path("pycoder-draft"))).config
    # Per-token cost ~ matmul parameters (layers + lm_head); the draft must be <= 1/6.
    cost = lambda c: c.num_hidden_layers * (4 * c.hidden_size**2 + 3 * c.hidden_size * c.intermediate_size) + c.vocab_size * c.hidden_size  # noqa: E731
    assert cost(dcfg) <= cost(tcfg) / 6


def test_zoo_total_size_is_small():
    total = sum(p.stat().st_size for p in zoo.ZOO_DIR.rglob("*") if p.is_file())
    assert total <= 60 * 2**20


def test_tokenizer_round_trips_source_text():
    tok = AutoTokenizer.from_pretrained(str(zoo.path("pycoder")))
    assert 4096 <= len(tok) <= 8192
    _, heldout = corpus.split(corpus.list_files())
    for f in heldout[:5]:
        text = corpus.read(f)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    weird = "x = '\u00e9\u4e2d\U0001f600'\t\r\n  \n"
    assert tok.decode(tok(weird, add_special_tokens=False)["input_ids"]) == weird


@pytest.mark.parametrize("task", zoo.TASKS)
def test_prompts_are_fixed_and_sized(task):
    tok = AutoTokenizer.from_pretrained(str(zoo.path("pycoder")))
    prompts = zoo.prompts(task)
    assert len(prompts) >= 64
    for p in prompts:
        assert 20 <= len(tok(p, add_special_tokens=False)["input_ids"]) <= 200
    with pytest.raises(ValueError, match="unknown task"):
        zoo.prompts("nope")


def test_unknown_zoo_name_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="available: .*pycoder"):
        zoo.path("gpt-17")


def test_layerskip_schedules():
    p = layer_drop_probs(12, 0.2)
    assert p[0] == 0.0 and abs(p[-1] - 0.2) < 1e-9 and p == sorted(p)
    # Rotational curriculum: each intermediate layer is on once every R steps; the last always.
    seen = [exit_layers(s, 12, 4) for s in range(4)]
    assert all(11 in s for s in seen)
    assert sorted(l for s in seen for l in s if l != 11) == list(range(11))


@pytest.mark.parametrize("kind", ["layerskip", "draft"])
def test_training_loop_lowers_the_loss(kind):
    class Tok:
        bos_token_id, eos_token_id, pad_token_id = 1, 0, 2

        def __len__(self):
            return 64

    torch.manual_seed(0)
    model = build_model(kind, Tok(), hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                        num_attention_heads=2, num_key_value_heads=2)
    # A learnable stream: a repeated pattern of 16 tokens.
    stream = torch.arange(3, 19).repeat(200)
    cfg = TrainConfig(kind=kind, steps=30, batch_size=4, seq_len=32, warmup=3, lr=1e-2)
    curve = train(model, stream, cfg, progress=False)
    first, last = curve[0]["ce"], sum(r["ce"] for r in curve[-5:]) / 5
    assert last < first - 1.0


def test_editing_prompts_repeat_a_heldout_function():
    for p in zoo.prompts("editing")[:10]:
        original, _, rewrite = p.partition("# The same function, rewritten with type hints:\n")
        name = rewrite.removeprefix("def ").rstrip("(")
        assert f"def {name}(" in original
