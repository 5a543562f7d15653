"""Artifacts: export -> load round trips (pt2, AOTI), the ONNX step, clear errors, the CLI.

The loaded side must generate what `SpeculativeModel.generate` does, token for token, and must
do it without the model's code: a fresh process loads and generates with no
`transformers.models.*` module imported.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile

import pytest
import torch

import specfx
from helpers import assert_greedy_equal, tiny_checkpoint, tiny_model
from specfx.cli.main import main

PROMPTS = torch.tensor([[0, 0, 0, 5, 17, 9, 33, 41], [7, 8, 9, 10, 11, 12, 13, 14]])
MASK = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]])


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", layers=2, seed=3, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def fast(model):
    return specfx.compile(model, draft="early-exit:1", num_speculative_tokens=2, max_seq_len=48, batch_size=2,
                          backend="eager")


@pytest.fixture(scope="module")
def artifact(fast, tmp_path_factory):
    path = tmp_path_factory.mktemp("artifact") / "tiny-ee2"
    fast.export(path, formats=("pt2", "onnx"))
    return path


@pytest.fixture(scope="module")
def loaded(artifact):
    return specfx.load(artifact)


def fresh_process(code: str) -> dict:
    """Run `code` in a new interpreter; it prints one JSON line last."""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_writes_read_from_the_graph_are_the_functionalized_programs(fast):
    # The manifest's writes (and the ONNX step's outputs) come from the in-place ops of each
    # program's graph; functionalizing the program lists its mutated inputs in its signature.
    from specfx.export import _writes, export_programs

    programs = export_programs(fast.graphs)
    for name, (ep, info) in programs.items():
        by_signature = ep.run_decompositions({}).graph_signature.user_inputs_to_mutate.values()
        names = dict(zip(ep.graph_signature.user_inputs, info["inputs"]))
        assert _writes(ep, info["inputs"]) == [names[m] for m in by_signature], name
    ep, info = programs["step"]
    assert {"tokens", "lengths", "kv_0"} <= set(_writes(ep, info["inputs"]))


def test_pt2_generate_equals_in_process_generate(fast, loaded):
    for kwargs in (dict(), dict(do_sample=True, temperature=0.8, top_k=20, seed=7)):
        ref = fast.generate(PROMPTS, MASK, max_new_tokens=24, eos_token_id=[], **kwargs)
        out = loaded.generate(PROMPTS, MASK, max_new_tokens=24, eos_token_id=[], **kwargs)
        assert torch.equal(out, ref), kwargs
        assert loaded.last_stats.mean_accepted == fast.last_stats.mean_accepted
    # The generation defaults travel in the manifest: the model's EOS id ends rows here too.
    assert torch.equal(loaded.generate(PROMPTS, MASK, max_new_tokens=40), fast.generate(PROMPTS, MASK, max_new_tokens=40))


def test_artifact_stores_weights_once(artifact, model):
    from safetensors import safe_open

    manifest = json.loads((artifact / "manifest.json").read_text())
    with safe_open(str(artifact / "weights.safetensors"), "pt") as f:
        keys = set(f.keys())
    # Tied lm_head / embedding: one entry; every program's weights map onto those keys.
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert "lm_head.weight" not in keys and set(dict(model.named_parameters())) <= keys
    for entry in manifest["programs"].values():
        assert set(entry["weights"].values()) <= keys
    for name in ("prefill", "step", "sample_step"):
        with zipfile.ZipFile(artifact / "pt2" / f"{name}.pt2") as z:
            weights = [i for i in z.infolist() if "/data/weights/weight_" in i.filename]
            assert weights and all(i.file_size == 0 for i in weights), name
    assert manifest["programs"]["step"]["writes"][:4] == ["tokens", "lengths", "done", "accept_hist"]
    assert set(manifest["files"]) == {p.relative_to(artifact).as_posix() for p in artifact.rglob("*")
                                      if p.is_file() and p.name != "manifest.json"}


def test_fresh_process_loads_without_model_code(artifact, fast):
    ref = fast.generate(PROMPTS, MASK, max_new_tokens=16, eos_token_id=[])
    got = fresh_process(f"""
import json, sys, torch, specfx
m = specfx.load({str(artifact)!r})
out = m.generate(torch.tensor({PROMPTS.tolist()}), torch.tensor({MASK.tolist()}), max_new_tokens=16, eos_token_id=[])
print(json.dumps({{"tokens": out.tolist(), "model_code": sorted(k for k in sys.modules
      if k.startswith("transformers.models") or k == "transformers.modeling_utils")}}))
""")
    assert got["model_code"] == []
    assert got["tokens"] == ref.tolist()


def test_onnx_step_equals_pytorch_step(artifact, fast):
    import onnxruntime as ort

    spec = json.loads((artifact / "manifest.json").read_text())["onnx"]
    session = ort.InferenceSession(str(artifact / spec["file"]), providers=["CPUExecutionProvider"])
    rt, st = fast.runtime, fast.graphs.state
    st.load_prompts(specfx.generation.rows(PROMPTS, MASK), 30, [])
    rt.prefill(PROMPTS.shape[1])
    # The whole cache as the span: the same tokens as the runtime's shorter spans.
    tensors = {**st.tensors(), "span": st.spans, **{f"kv_{i}": t for i, t in enumerate(st.kv)}}
    feeds = {name: tensors[name].numpy().copy() for name in spec["inputs"]}
    for _ in range(5):
        rt.step()
        outs = dict(zip(spec["outputs"], session.run(spec["outputs"], feeds)))
        feeds.update({spec["updates"][name]: value for name, value in outs.items()})
        assert (feeds["tokens"] == st.tokens.numpy()).all() and (feeds["lengths"] == st.lengths.numpy()).all()
        assert (feeds["accept_hist"] == st.accept_hist.numpy()).all()
        for i, kv in enumerate(st.kv):
            assert torch.allclose(torch.from_numpy(feeds[f"kv_{i}"]), kv, atol=1e-4)
    assert st.lengths.min() >= PROMPTS.shape[1] - 3 + 5     # every step emitted tokens


@pytest.mark.slow
def test_aoti_round_trip(tmp_path):
    # Prompt lookup drafts inside the step without a draft pass (in the sampling step each draft
    # pass warps its logits too), which keeps the programs AOTInductor compiles small.
    model = tiny_model("llama", layers=1, seed=4)
    fast = specfx.compile(model, draft="ngram:2", num_speculative_tokens=2, max_seq_len=40, batch_size=2,
                          backend="eager")
    fast.export(tmp_path / "a", formats=("aoti",))
    loaded = specfx.load(tmp_path / "a", format="aoti", trust_native_code=True)
    # The compiled step writes its inputs in place, as the runtime needs.
    st = loaded.runtime.state
    st.load_prompts([PROMPTS[1]], 8, [])
    loaded.runtime.prefill(PROMPTS.shape[1])
    loaded.runtime.step()
    assert st.lengths[0] > PROMPTS.shape[1] and st.accept_hist.sum() == 1
    ref = fast.generate(PROMPTS, MASK, max_new_tokens=24, eos_token_id=[])
    assert_greedy_equal(model, loaded.generate(PROMPTS, MASK, max_new_tokens=24, eos_token_id=[]), ref,
                        PROMPTS.shape[1])
    # AOTI's sampling step draws what the in-process step draws from the same seed (its kernels
    # round differently; a flip would need a draw within ~1e-6 of a decision boundary). Over 24
    # tokens each seed's run accepts a draft as well as rejecting some.
    for seed in (1, 2):
        kw = dict(max_new_tokens=24, do_sample=True, temperature=1.0, seed=seed, eos_token_id=[])
        assert torch.equal(loaded.generate(PROMPTS, MASK, **kw), fast.generate(PROMPTS, MASK, **kw))


# --- errors ---


@pytest.fixture
def copy(artifact, tmp_path):
    path = tmp_path / "copy"
    shutil.copytree(artifact, path)
    return path


def edit_manifest(path, edit):
    manifest = json.loads((path / "manifest.json").read_text())
    edit(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_missing_files(copy, tmp_path):
    (copy / "pt2" / "step.pt2").unlink()
    with pytest.raises(FileNotFoundError, match=r"step\.pt2 is missing"):
        specfx.load(copy)
    with pytest.raises(FileNotFoundError, match="no manifest.json"):
        specfx.load(tmp_path)


def test_changed_file_fails_its_sha256(copy):
    with open(copy / "weights.safetensors", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match=r"weights\.safetensors does not match its sha256"):
        specfx.load(copy)


@pytest.mark.parametrize("field, value, message", [
    ("format", 99, "artifact format 99"),
    ("specfx", "9.9.0", "specfx major.minor must match"),
    ("torch", "2.1.0", "torch major.minor must match"),
])
def test_incompatible_versions(copy, field, value, message):
    def edit(m):
        (m if field == "format" else m["versions"])[field] = value
    edit_manifest(copy, edit)
    with pytest.raises(ValueError, match=message):
        specfx.load(copy)


def test_beyond_exported_shapes(loaded):
    with pytest.raises(ValueError, match="larger than the exported batch_size=2; export with batch_size>=3"):
        loaded.generate(torch.ones(3, 4, dtype=torch.long), max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds max_seq_len=48; export with a larger max_seq_len"):
        loaded.generate(torch.ones(1, 20, dtype=torch.long), max_new_tokens=29)
    loaded.generate(torch.ones(1, 20, dtype=torch.long), max_new_tokens=28)    # exactly fits


def test_unknown_or_missing_format(artifact, fast, tmp_path):
    with pytest.raises(ValueError, match="unknown format tflite for load; expected pt2, aoti"):
        specfx.load(artifact, format="tflite")
    with pytest.raises(ValueError, match="ONNX step runs under onnxruntime"):
        specfx.load(artifact, format="onnx")
    with pytest.raises(ValueError, match="unknown format pt3 for export"):
        fast.export(tmp_path / "x", formats=("pt3",))
    with pytest.raises(ValueError, match="holds the formats pt2, onnx, not 'aoti'"):
        specfx.load(artifact, format="aoti")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="not empty and holds no manifest.json"):
        fast.export(tmp_path / "busy", formats=("pt2",))


def test_export_replaces_a_previous_artifact(copy):
    # Another model's artifact (one layer, prompt lookup: quick to export) over the copy's.
    other = specfx.compile(tiny_model("llama", layers=1, seed=5), draft="ngram:2", num_speculative_tokens=2,
                           max_seq_len=48, batch_size=2, backend="eager")
    assert (copy / "onnx" / "step.onnx").is_file()
    manifest = other.export(copy, formats=("pt2",))
    assert manifest["formats"] == ["pt2"] and not (copy / "onnx" / "step.onnx").exists()
    loaded = specfx.load(copy)
    assert loaded.drafter == "ngram:2"
    out = loaded.generate(PROMPTS, MASK, max_new_tokens=8, eos_token_id=[])
    assert torch.equal(out, other.generate(PROMPTS, MASK, max_new_tokens=8, eos_token_id=[]))


# --- CLI ---


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_checkpoint(path, layers=1, seed=2, eos=True)
    return path


def test_cli_export_then_run(checkpoint, tmp_path, capsys):
    from transformers import AutoTokenizer

    out = tmp_path / "art"
    assert main(["export", str(checkpoint), "--draft", "ngram:2", "-k", "2", "--max-seq-len", "64",
                 "--format", "pt2", "-o", str(out)]) == 0
    assert "weights.safetensors" in capsys.readouterr().out
    tok = AutoTokenizer.from_pretrained(str(out))                 # the tokenizer sits at the top level
    assert tok("def f(x):").input_ids == AutoTokenizer.from_pretrained(str(checkpoint))("def f(x):").input_ids
    assert main(["run", str(out), "--prompt", "def f(x):", "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("def f(x):")
    for row in ("process start -> first token", "specfx.load(format='pt2')", "mean_accepted"):
        assert row in printed
    assert main(["run", str(out), "--prompt", "x", "--format", "aoti"]) == 2
    assert "not 'aoti'" in capsys.readouterr().err


# --- the embedded model ---


@pytest.mark.slow
def test_pycoder_early_exit_pt2_in_a_fresh_process(pycoder, tmp_path):
    """The embedded model's artifact, loaded by a new interpreter, decodes exactly the same
    tokens (AOTInductor's round trip runs on a tiny model: test_aoti_round_trip)."""
    from specfx import zoo

    model, tok = pycoder
    fast = specfx.compile(model, draft="early-exit", max_seq_len=256, backend="eager")
    fast.export(tmp_path / "pycoder", formats=("pt2",))
    prompts = [tok(p, return_tensors="pt").input_ids for p in zoo.prompts()[:3]]
    refs = [fast.generate(ids, max_new_tokens=64) for ids in prompts]
    got = fresh_process(f"""
import json, torch, specfx
m = specfx.load({str(tmp_path / "pycoder")!r}, format="pt2")
print(json.dumps([m.generate(torch.tensor(ids), max_new_tokens=64).tolist() for ids in {[p.tolist() for p in prompts]}]))
""")
    for ref, out in zip(refs, got):
        assert out == ref.tolist()                               # the very same ops: identical
