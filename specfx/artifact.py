"""Reading an artifact folder (see `specfx.export`): checks, programs, and `LoadedModel`.

- `load_artifact(folder, format, device)`: reads manifest.json, refuses an incompatible or
  altered artifact (format/specfx/torch versions, missing files, sha256) and one it cannot
  trust (`specfx.artifact_safety`: native code without opt-in, paths leaving the folder,
  unlisted files, pickles), loads the weights once, the programs of one format around them,
  and the static state the manifest describes.
- `LoadedModel`: `generate` and `last_stats` like `SpeculativeModel`, on `Runtime`.

It imports no model code: only torch, safetensors and specfx's runtime and generate helpers.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specfx import __version__
from specfx.artifact_safety import check_program_folders, check_pt2_archive, inside, require_trust
from specfx.generation import GenerationDefaults, StaticShape, generate
from specfx.runtime.generate import Runtime
from specfx.runtime.state import STEP_INPUTS, StaticState
from specfx.runtime.stats import GenerationStats
from specfx.runtime.tree import Tree

FORMAT_VERSION = 4
LOADABLE = ("pt2", "aoti")
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"


@dataclass
class LoadedPrefill:
    name: str
    gm: Callable             # (input_ids [B, C], positions [B, C], *kv) -> (hidden,)
    kv: slice


@dataclass
class Programs:
    """The loaded counterpart of `pipeline.Graphs`: what `Runtime` runs."""

    prefills: list[LoadedPrefill]
    first: Callable          # (hidden [B, 1, H], positions [B, 1], span) -> (logits [B, 1, V],)
    prime: Callable | None   # (*step inputs, kv) -> (): the drafter's pass before the first step
    step: Callable
    load_sample_step: Callable[[], Callable]   # loaded at the first sampling call, not before
    state: StaticState
    k: int
    tree: Tree
    prefill_chunk: int
    max_seq_len: int
    weights: dict[str, torch.Tensor]   # kept alive: AOTI constants point at these tensors

    def fused_sample_step(self, filters: str = "any") -> Callable:
        """The exported sampling step: its warp is exact for every setting, so it serves every
        variant the runtime asks for."""
        return self.load_sample_step()


class LoadedModel:
    """An exported artifact, ready to generate exactly like the `SpeculativeModel` it came from."""

    def __init__(self, path: Path, manifest: dict, programs: Programs, format: str):
        self.path, self.manifest, self.format = path, manifest, format
        self.runtime = Runtime(programs, backend="eager")
        self.defaults = GenerationDefaults.from_dict(manifest["generation"])
        self.shape = StaticShape(manifest["batch_size"], manifest["max_seq_len"], manifest["vocab_size"],
                                 self.runtime.device, built="exported", remedy="export")
        self.last_stats: GenerationStats | None = None
        if self.runtime.cudagraphs:           # capture the greedy step's CUDA graph before the first token
            self.runtime.warmup()

    @property
    def num_speculative_tokens(self) -> int:
        return self.manifest["k"]

    @property
    def drafter(self) -> str:
        return self.manifest["drafter"]

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int = 64, do_sample: bool = False, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 eos_token_id=None, pad_token_id: int | None = None, streamer=None,
                 **unsupported) -> torch.Tensor:
        """Generate; returns [B, prompt + new] (see `SpeculativeModel.generate`)."""
        if unsupported:
            raise TypeError(f"unsupported generate arguments: {sorted(unsupported)}")
        out, self.last_stats = generate(
            self.runtime, self.defaults, self.shape, input_ids, attention_mask, max_new_tokens=max_new_tokens,
            do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            eos_token_id=eos_token_id, pad_token_id=pad_token_id, streamer=streamer)
        return out

    def __repr__(self) -> str:
        return (f"LoadedModel({str(self.path)!r}, format={self.format!r}, draft={self.drafter}, "
                f"k={self.num_speculative_tokens}, batch_size={self.shape.batch_size}, "
                f"max_seq_len={self.shape.max_seq_len}, device={self.runtime.device})")


def load_artifact(folder: Path, format: str, device=None, *, trust_native_code: bool = False) -> LoadedModel:
    """Check, then load, the `format` programs of the artifact in `folder` (see `specfx.load`)."""
    manifest = read_manifest(folder)
    check_compatible(manifest)
    if format not in manifest["formats"]:
        raise ValueError(f"{folder} holds the formats {', '.join(manifest['formats'])}, not {format!r}; "
                         f"export it with that format (specfx export ... --format {format})")
    require_trust(folder, format, trust_native_code)
    exported_on = torch.device(manifest["device"])
    device = torch.device(device) if device is not None else exported_on
    if format == "aoti" and device.type != exported_on.type:
        raise ValueError(f"the aoti packages in {folder} were compiled for {exported_on.type}, not {device.type}; "
                         f"load format='pt2' or export on a {device.type} machine")
    programs = manifest["programs"]
    check_program_folders(folder, manifest)
    verify_files(folder, manifest, [WEIGHTS, *(entry[format] for entry in programs.values())])
    from safetensors.torch import load_file

    weights = load_file(str(folder / WEIGHTS), device=str(device))
    load_one = _load_pt2 if format == "pt2" else _load_aoti
    program = lambda name: load_one(folder / programs[name][format], programs[name]["weights"],  # noqa: E731
                                    weights, device, exported_on)
    prefills = [LoadedPrefill(name, program(name), slice(*entry["kv"]))
                for name, entry in programs.items() if entry["role"] == "prefill"]
    prime = program("prime") if "prime" in programs else None
    bundle = Programs(prefills, program("first"), prime, program("step"), lambda: _sample_step(manifest, program),
                      allocate_state(manifest, device),
                      manifest["k"], manifest_tree(manifest), manifest["prefill_chunk"], manifest["max_seq_len"],
                      weights)
    return LoadedModel(folder, manifest, bundle, format)


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"no {MANIFEST} in {folder}: not a specfx artifact (write one with specfx export)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-export the artifact") from e


def check_compatible(manifest: dict) -> None:
    """Same artifact format, same specfx major.minor, same torch major.minor; else a ValueError."""
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"artifact format {manifest.get('format')!r}, but this specfx reads format "
                         f"{FORMAT_VERSION}; re-export it with specfx {__version__}")
    versions = manifest.get("versions", {})
    for name, ours in (("specfx", __version__), ("torch", torch.__version__)):
        theirs = versions.get(name) or "?"
        if _major_minor(theirs) != _major_minor(ours):
            raise ValueError(f"artifact written with {name} {theirs}, this is {name} {ours}: {name} major.minor "
                             f"must match; re-export it here or load it with {name} {_major_minor(theirs)}.x")
    if manifest["step_inputs"] != [*STEP_INPUTS, "kv"]:
        raise ValueError(f"artifact step inputs {manifest['step_inputs']} differ from this runtime's "
                         f"{[*STEP_INPUTS, 'kv']}; re-export it with specfx {__version__}")


def verify_files(folder: Path, manifest: dict, names: list[str]) -> None:
    """Every file `names` lists lies inside `folder`, exists and has the sha256 the manifest recorded."""
    for name in names:
        path = inside(folder, name)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing from the artifact (the manifest lists it); re-export")
        if name not in manifest["files"]:
            raise ValueError(f"{MANIFEST} names {name} but records no sha256 for it; re-export the artifact")
        expected = manifest["files"][name]["sha256"]
        if sha256(path) != expected:
            raise ValueError(f"{path} does not match its sha256 in {MANIFEST} (expected {expected[:12]}...): "
                             "the file was changed or truncated; re-export the artifact")


def _sample_step(manifest: dict, program: Callable) -> Callable:
    if "sample_step" not in manifest["programs"]:
        raise NotImplementedError(f"this artifact has no sampling step (its step drafts a tree, "
                                  f"{manifest_tree(manifest)}, exported before trees sampled): re-export it to sample")
    return program("sample_step")


def manifest_tree(manifest: dict) -> Tree:
    """The step's proposal shape (artifacts without a "tree" entry draft a chain of k)."""
    parents = manifest.get("tree")
    return Tree.chain(manifest["k"]) if parents is None else Tree(tuple(parents))


def allocate_state(manifest: dict, device: torch.device) -> StaticState:
    """The runtime's static state at the manifest's shapes; a layout this runtime lacks is refused."""
    layout = manifest["state"]
    kv = [torch.zeros(spec["shape"], dtype=getattr(torch, spec["dtype"]), device=device)
          for name, spec in layout.items() if name.startswith("kv_")]
    state = StaticState.allocate(batch_size=manifest["batch_size"], seq_len=manifest["seq_len"], k=manifest["k"],
                                 nodes=manifest_tree(manifest).size, vocab_size=manifest["vocab_size"], kv=kv,
                                 device=device)
    ours = {name: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)} for name, t in state.tensors().items()}
    if ours != layout:
        raise ValueError(f"the artifact's state layout differs from this runtime's: {sorted(layout)} vs "
                         f"{sorted(ours)}; re-export it with specfx {__version__}")
    return state


def _load_pt2(path: Path, keys: dict[str, str], weights: dict, device: torch.device, exported_on: torch.device):
    """The program with the artifact's weights put back in place of its meta placeholders."""
    check_pt2_archive(path)                   # before torch.export.load, which may unpickle
    ep = torch.export.load(str(path))
    for fqn, key in keys.items():
        table = ep.state_dict if fqn in ep.state_dict else ep.constants
        table[fqn] = nn.Parameter(weights[key], requires_grad=False) if isinstance(table[fqn], nn.Parameter) \
            else weights[key]
    if device != exported_on:
        from torch.export.passes import move_to_device_pass

        ep = move_to_device_pass(ep, device)
    return ep.module()


def _load_aoti(path: Path, keys: dict[str, str], weights: dict, device: torch.device, exported_on: torch.device):
    """The compiled program, its constants pointing at the artifact's weights (no copy)."""
    runner = torch._inductor.aoti_load_package(str(path), run_single_threaded=device.type == "cuda",
                                               device_index=device.index if device.index is not None else -1)
    missing = [fqn for fqn in runner.get_constant_fqns() if fqn not in keys]
    if missing:
        raise ValueError(f"{path} needs constants the manifest does not map to weights: {missing[:5]}; re-export")
    runner.load_constants({fqn: weights[keys[fqn]] for fqn in runner.get_constant_fqns()},
                          check_full_update=True, user_managed=True)
    return runner


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _major_minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])
