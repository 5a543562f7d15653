"""Training heads in the field's layouts (`specfx train mtp --arch eagle|eagle3|deepseek-mtp`):
each learns the target's next token, EAGLE-3's draft vocabulary is the most frequent tokens,
and a trained head saved as a specfx checkpoint drafts exactly in the compiled step."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

import specfx
from helpers import assert_greedy_equal, hf_greedy, tiny_checkpoint, tiny_model
from specfx.cli.main import main
from specfx.mtp import save_head, target_parts
from specfx.mtp_train import MTPTrainConfig, draft_vocabulary, evaluate_head, fresh_head, greedy_windows, train_head

ARCHS = {"eagle": None, "eagle3": 48, "deepseek-mtp": None}       # layout: draft vocabulary (of 64)


@pytest.fixture(scope="module", params=list(ARCHS))
def trained(request):
    """A tiny 4-layer Llama and a head of one layout trained on random token windows (~1 s)."""
    arch = request.param
    model = tiny_model("llama", layers=4, vocab=64, seed=31)
    text = torch.randint(3, 64, (112, 40), generator=torch.Generator().manual_seed(0))
    cfg = MTPTrainConfig(steps=150, batch_size=16, seq_len=40, windows=96, lr=3e-3, warmup=10, bf16=False,
                         arch=arch, draft_vocab=ARCHS[arch])
    head, _ = train_head(model, text[:96], cfg, progress=False)
    return model, cfg, head, text[:96], text[96:]


def test_training_improves_held_out_agreement(trained):
    model, cfg, head, train, heldout = trained
    assert head.layout == cfg.arch
    fresh = evaluate_head(fresh_head(model, cfg, train), model, heldout)
    after = evaluate_head(head, model, heldout)
    assert after["top1_agreement"] > fresh["top1_agreement"] + 0.15


def test_trained_head_drafts_exactly_from_its_checkpoint(tmp_path, trained):
    model, cfg, head, _, heldout = trained
    path = save_head(head, tmp_path / "head", model)
    assert json.loads((path / "config.json").read_text())["layout"] == cfg.arch
    fast = specfx.compile(model, draft=specfx.MTPHead(path), num_speculative_tokens=2, max_seq_len=96,
                          batch_size=1, backend="eager")
    accepted = 0.0
    for ids in heldout[:4, :20].split(1):
        ours = fast.generate(ids, max_new_tokens=24, eos_token_id=[])
        assert_greedy_equal(model, ours, hf_greedy(model, ids, 24), ids.shape[1])
        accepted += fast.last_stats.acceptance_by_position[0]
    assert accepted > 0


def test_eagle3_head_drafts_only_its_draft_vocabulary():
    model = tiny_model("llama", layers=4, vocab=64, seed=3)
    windows = torch.randint(0, 64, (8, 40), generator=torch.Generator().manual_seed(0)) % 50   # never 50..63
    cfg = MTPTrainConfig(arch="eagle3", draft_vocab=48)
    head = fresh_head(model, cfg, windows)
    ids = draft_vocabulary(windows, 48, 64)
    assert ids.max() < 50 and torch.equal(torch.arange(48) + head.d2t, ids)
    parts, pos = target_parts(model), torch.arange(8)[None]
    emb = parts.embed(windows[:1, :8])
    with torch.no_grad():
        g = head(emb, torch.randn(1, 8, 64), position_ids=pos,
                 position_embeddings=head.position_embeddings(parts, emb, pos))
        logits = head.logits(parts, g)
    outside = torch.ones(64, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(logits[..., outside]).all() and torch.isfinite(logits[..., ids]).all()


def test_draft_vocabulary_is_the_most_frequent_tokens():
    counts = {5: 4, 2: 3, 9: 3, 7: 1, 0: 2}
    stream = torch.tensor([t for t, n in counts.items() for _ in range(n)])
    windows = stream[torch.randperm(stream.numel(), generator=torch.Generator().manual_seed(0))].view(1, -1)
    assert draft_vocabulary(windows, 3, 12).tolist() == [2, 5, 9]
    assert draft_vocabulary(windows, 2, 12).tolist() == [2, 5]            # a tie goes to the lower id
    assert draft_vocabulary(windows, 6, 12).tolist() == [0, 1, 2, 5, 7, 9]
    with pytest.raises(ValueError, match="expected 1..12"):
        draft_vocabulary(windows, 13, 12)


def test_training_goes_on_from_a_saved_head_of_its_layout(trained, tmp_path):
    model, cfg, head, train, _ = trained
    save_head(head, tmp_path / "head", model)
    again, _ = train_head(model, train, replace(cfg, steps=1, lr=1e-12, init=str(tmp_path / "head")), progress=False)
    for (name, before), after in zip(head.state_dict().items(), again.state_dict().values()):
        assert torch.allclose(before.float(), after.float(), atol=1e-6), name
    other = next(arch for arch in ARCHS if arch != cfg.arch)
    with pytest.raises(ValueError, match=f"is of layout {cfg.arch!r}, not {other!r}"):
        train_head(model, train, replace(cfg, arch=other, draft_vocab=ARCHS[other], init=str(tmp_path / "head")),
                   progress=False)


def test_train_config_refuses_an_unknown_layout_or_a_misplaced_draft_vocab():
    with pytest.raises(ValueError, match="arch must be one of specfx, eagle, eagle3, deepseek-mtp"):
        MTPTrainConfig(arch="medusa")
    with pytest.raises(ValueError, match="draft_vocab is the size of an eagle3 head's"):
        MTPTrainConfig(arch="eagle", draft_vocab=32)
    with pytest.raises(ValueError, match="generated .* must be >= 0, got -1"):
        MTPTrainConfig(generated=-1)


def test_greedy_windows_continue_each_prefix_with_the_targets_greedy_tokens():
    model = tiny_model("llama", layers=2, vocab=64, seed=5)
    prefixes = torch.randint(3, 64, (5, 4), generator=torch.Generator().manual_seed(1))
    # The first greedy token after prefix 0 is made the end of sequence: it must not end a window.
    model.generation_config.eos_token_id = int(model(prefixes[:1]).logits[0, -1].argmax())
    windows = greedy_windows(model, prefixes, 12, batch_size=2)
    expected = prefixes.clone()
    with torch.no_grad():
        for _ in range(8):
            logits = model(expected).logits[:, -1]
            logits[:, model.generation_config.eos_token_id] = -float("inf")
            expected = torch.cat([expected, logits.argmax(-1, keepdim=True)], 1)
    assert windows.shape == (5, 12)
    assert torch.equal(windows, expected)


def test_train_mtp_cli_writes_an_eagle3_head(tmp_path):
    model = tiny_checkpoint(tmp_path / "target", "llama", layers=4, seed=2)
    head_dir = tmp_path / "head"
    rc = main(["train", "mtp", "--target", str(tmp_path / "target"), "--out", str(head_dir), "--arch", "eagle3",
               "--draft-vocab", "512", "--steps", "3", "--windows", "8", "--generated", "0", "--seq-len", "32", "--batch-size", "2",
               "--eval-prompts", "1", "--threads", "1"])
    assert rc == 0
    config = json.loads((head_dir / "config.json").read_text())
    assert config["layout"] == "eagle3" and config["train"]["config"]["draft_vocab"] == 512
    head = specfx.MTPHead(str(head_dir)).load(model)
    assert head.layout == "eagle3" and head.d2t.numel() == 512

