"""Artifacts from someone else: native code only on request, no path out of the folder, no
unlisted program files, and a pt2 program that unpickles nothing (a planted payload never runs).

Every tampered copy below has its sha256s rewritten in the manifest, as a tamperer would:
the checks must hold without them.
"""

from __future__ import annotations

import json
import pickle
import shutil
import zipfile

import pytest
import torch

import specfx
from helpers import tiny_model
from specfx.artifact import sha256
from specfx.cli.main import main

IDS = torch.tensor([[5, 17, 9, 33]])


@pytest.fixture(scope="module")
def fast():
    # The drafter is beside the point here: prompt lookup over one layer exports quickly.
    return specfx.compile(tiny_model("llama", layers=1, seed=3), draft="ngram:2", num_speculative_tokens=2,
                          max_seq_len=32, backend="eager")


@pytest.fixture(scope="module")
def artifact(fast, tmp_path_factory):
    path = tmp_path_factory.mktemp("safety") / "tiny"
    fast.export(path, formats=("pt2",))
    return path


@pytest.fixture
def copy(artifact, tmp_path):
    return shutil.copytree(artifact, tmp_path / "copy", symlinks=True)


def tamper(path, edit=None):
    """Apply `edit` to the manifest, then rewrite every listed file's sha256 to match."""
    manifest = json.loads((path / "manifest.json").read_text())
    if edit is not None:
        edit(manifest)
    for name, record in manifest["files"].items():
        if (path / name).is_file():
            record["sha256"] = sha256(path / name)
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_the_untouched_artifact_loads_and_is_exact(artifact, fast):
    loaded = specfx.load(artifact)
    assert torch.equal(loaded.generate(IDS, max_new_tokens=8), fast.generate(IDS, max_new_tokens=8))
    # The loaded model checks its arguments too, against the manifest's vocabulary.
    with pytest.raises(ValueError, match=r"input_ids\[0, 0\] = 96 is outside the vocabulary \[0, 96\)"):
        loaded.generate(torch.tensor([[96, 3]]), max_new_tokens=2)


def test_native_code_needs_an_explicit_opt_in(copy, capsys):
    tamper(copy, lambda m: m["formats"].append("aoti"))
    with pytest.raises(ValueError, match=r"runs their native code in this process.*whoever wrote the folder "
                                         r"wrote the manifest too.*trust_native_code=True"):
        specfx.load(copy, format="aoti")
    assert main(["run", str(copy), "--prompt", "x", "--format", "aoti"]) == 2
    assert "--trust-native-code" in capsys.readouterr().err
    # With the opt-in the gate opens (this copy holds no AOTI package, so loading then fails on that).
    with pytest.raises(KeyError, match="aoti"):
        specfx.load(copy, format="aoti", trust_native_code=True)


class _Payload:
    """Unpickling this creates `marker`: a stand-in for any code a pickle can run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _plant_pickle(program, payload):
    """Rewrite the pt2 archive so that its first weight is stored pickled, as `payload`."""
    src = program.with_suffix(".orig")
    program.rename(src)
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(program, "w") as zout:
        for info in zin.infolist():
            data = zin.read(info)
            if info.filename.endswith("model_weights_config.json"):
                config = json.loads(data)
                first = next(iter(config["config"].values()))
                first["use_pickle"], first["path_name"] = True, "weight_9999"
                data = json.dumps(config).encode()
                zout.writestr(info.filename.replace("model_weights_config.json", "weight_9999"),
                              pickle.dumps(payload))
            zout.writestr(info, data)
    src.unlink()


def test_a_pickle_planted_in_a_pt2_program_never_runs(copy, tmp_path):
    marker = tmp_path / "payload-ran"
    _plant_pickle(copy / "pt2" / "step.pt2", _Payload(marker))
    tamper(copy)
    with pytest.raises(ValueError, match=r"step\.pt2 is not a program as specfx export writes it: .* is stored "
                                         r"pickled.*can run code"):
        specfx.load(copy)
    assert not marker.exists()
    # The payload is real: torch.export.load on its own runs it.
    with pytest.raises(Exception):
        torch.export.load(str(copy / "pt2" / "step.pt2"))
    assert marker.exists()


@pytest.mark.parametrize("member, message", [
    ("data/aotinductor/model/model.so", r"holds .*data/aotinductor/model/model\.so"),
    ("data/sample_inputs/model.pt", "pickled sample inputs"),
    ("extra/notes.txt", r"holds .*extra/notes\.txt"),
])
def test_a_pt2_program_with_more_than_a_program_is_refused(copy, member, message):
    program = copy / "pt2" / "prefill.pt2"
    with zipfile.ZipFile(program) as z:
        root = z.namelist()[0].split("/")[0]
    with zipfile.ZipFile(program, "a") as z:
        z.writestr(f"{root}/{member}", b"\x80\x04N.")
    tamper(copy)
    with pytest.raises(ValueError, match=message):
        specfx.load(copy)


@pytest.mark.parametrize("name", ["../outside.pt2", "/etc/hostname", "pt2/../../outside.pt2"])
def test_file_names_that_leave_the_folder_are_refused(copy, name):
    (copy / "pt2" / "step.pt2").rename(copy.parent / "outside.pt2")     # the program, moved out

    def edit(m):
        m["programs"]["step"]["pt2"] = name
        m["files"][name] = m["files"].pop("pt2/step.pt2")

    tamper(copy, edit)
    with pytest.raises(ValueError, match=f"names the file {name!r}, which is not a relative path inside"):
        specfx.load(copy)


@pytest.mark.parametrize("name", ["pt2/step.pt2", "weights.safetensors"])
def test_a_symlink_out_of_the_folder_is_refused(copy, tmp_path, name):
    outside = tmp_path / "elsewhere" / name.replace("/", "_")
    outside.parent.mkdir()
    shutil.move(copy / name, outside)
    (copy / name).symlink_to(outside)                       # same bytes: the sha256 still matches
    tamper(copy)
    with pytest.raises(ValueError, match=r"resolves to .*elsewhere.*outside .*copy \(a symlink\?\)"):
        specfx.load(copy)


@pytest.mark.parametrize("name", ["pt2/extra.pt2", "pt2/sub/model.so", "onnx/payload.pkl", "aoti/step.so"])
def test_unlisted_files_in_program_folders_are_refused(copy, name):
    (copy / name).parent.mkdir(parents=True, exist_ok=True)
    (copy / name).write_bytes(b"\x80\x04N.")
    with pytest.raises(ValueError, match=f"does not list: {name}; refusing the artifact"):
        specfx.load(copy)
    (copy / name).unlink()
    (copy / "README.md").write_text("notes")                  # outside the program folders: allowed
    specfx.load(copy)
