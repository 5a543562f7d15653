"""Artifacts: `export(spec_model, out_dir)` writes a folder; `load(folder)` runs it without the model's code.

The folder (DESIGN.md, "Artifacts"):

    manifest.json         versions, shapes, k, drafter, state layout, each program's inputs and
                          writes, generation defaults, the sha256 of every other file
    weights.safetensors   every weight once (tied and shared tensors are one entry)
    tokenizer.json, ...   the tokenizer: `AutoTokenizer.from_pretrained(folder)` works
    pt2/<name>.pt2        torch.export programs: each prefill, the first token's head (`first`),
                          the greedy step, the sampling step, and the drafter's pass between the
                          first token and the first step (`prime`, an MTP head's)
    aoti/<name>.pt2       AOTInductor packages of the same programs (compiled for one device)
    onnx/step.onnx        the greedy step with the state as inputs and the written state as outputs

Programs keep the runtime's calling convention and write the state in place: a prefill is
`(input_ids [B, C], positions [B, C], span [L], *kv) -> (hidden,)`, `first` `(hidden [B, 1, H],
positions [B, 1], span) -> (logits [B, 1, V],)` (the target's head over the last prompt token),
a step and `prime` `(*STEP_INPUTS, kv) -> ()`. The attention span's length L (2..seq_len, see `specfx.attention`) stays dynamic in
every program, as in the runtime's own graphs.
torch.export keeps in-place writes to inputs (`ep.module()` performs them) and AOTInductor
writes into the input buffers too, so both plug into `Runtime` as they are. ONNX has no in-place
writes: its step clones the state, runs, and returns what it wrote (manifest["onnx"] pairs them).

Weights: a .pt2 archive stores no bytes for a tensor without storage, so the programs are saved
with their weights swapped for meta tensors (shape and dtype only) and `load` puts the tensors
of weights.safetensors back; AOTI packages are compiled with `package_constants_in_so=False` and
get the same tensors through `load_constants`. The ONNX file carries its own copy (initializers).

An artifact loads where its format version, specfx major.minor and torch major.minor equal this
installation's (torch.export's serialization and AOTInductor's ABI hold within a release only).
CUDA graphs cannot be serialized: on CUDA, `load` captures the step before the first token.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

import torch
from torch import fx, nn

from specfx import __version__
from specfx.artifact import (FORMAT_VERSION, LOADABLE, MANIFEST, WEIGHTS, LoadedModel, dtype_name, load_artifact,
                             read_manifest, sha256)
from specfx.capture import without_stack_traces
from specfx.passes.skinny_matmul import strip_materialize
from specfx.runtime.compile import CPU_INDUCTOR
from specfx.runtime.state import STEP_INPUTS

FORMATS = ("pt2", "aoti", "onnx")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


def export(spec_model, out_dir, formats=FORMATS, *, tokenizer=None) -> dict:
    """Write `spec_model`'s programs, weights, tokenizer and manifest to `out_dir`; return the manifest.

    The tokenizer is `tokenizer` (saved with `save_pretrained`) or the tokenizer files found in
    the model's own checkpoint directory (`config._name_or_path`); with neither, none is written.
    """
    formats = _check_formats(formats, FORMATS, "export")
    out = Path(out_dir)
    previous = _previous_files(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written aside and moved in at the end: a failed export leaves `out` as it was.
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.") as tmp, spec_model.graphs.state.lock:
        manifest = _write(spec_model, Path(tmp), formats, tokenizer)
        _move_into(Path(tmp), out, [*manifest["files"], MANIFEST], previous)
    return manifest


def _write(spec_model, out: Path, formats: tuple[str, ...], tokenizer) -> dict:
    """Every file of the artifact, manifest last, into the empty folder `out`."""
    graphs, state = spec_model.graphs, spec_model.graphs.state
    programs = export_programs(graphs)
    eps = {name: ep for name, (ep, _) in programs.items()}
    weights, keys = _collect_weights(eps, spec_model.model, state)
    files = [_save_weights(weights, out / WEIGHTS, out)]
    entries = {name: {**info, "writes": _writes(eps[name], info["inputs"]), "weights": keys[name]}
               for name, (_, info) in programs.items()}
    if "aoti" in formats:                     # before the pt2 save empties the programs' weights
        for name, ep in eps.items():
            entries[name]["aoti"] = _save_aoti(ep, out / "aoti" / f"{name}.pt2", out, state.tokens.device)
            files.append(entries[name]["aoti"])
    if "pt2" in formats:
        for name, ep in eps.items():
            entries[name]["pt2"] = _save_pt2(ep, out / "pt2" / f"{name}.pt2", out)
            files.append(entries[name]["pt2"])
    onnx_entry = None
    if "onnx" in formats:
        onnx_entry = _save_onnx(graphs.step, state, entries["step"]["writes"], out / "onnx" / "step.onnx", out)
        files.extend(onnx_entry["files"])
    files.extend(_save_tokenizer(tokenizer, spec_model.model, out))
    manifest = {
        "format": FORMAT_VERSION,
        "versions": {"specfx": __version__, "torch": torch.__version__, "transformers": _version("transformers")},
        "formats": list(formats),
        "drafter": str(graphs.drafter), "k": graphs.k, "tree": list(graphs.tree.parents), "batch_size": state.batch_size,
        "max_seq_len": graphs.max_seq_len, "seq_len": state.seq_len, "prefill_chunk": graphs.prefill_chunk,
        "vocab_size": graphs.structure.vocab_size, "device": str(state.tokens.device),
        "state": {name: {"shape": list(t.shape), "dtype": dtype_name(t.dtype)} for name, t in state.tensors().items()},
        "step_inputs": [*STEP_INPUTS, "kv"],
        "programs": entries,
        "onnx": onnx_entry,
        "generation": spec_model.defaults.to_dict(),
        "tokenizer": "tokenizer.json" in files,
        "files": {f: _file_record(out / f) for f in sorted(files)},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def load(path, format: str = "pt2", device=None, *, trust_native_code: bool = False) -> LoadedModel:
    """The artifact in folder `path`, ready to `generate` (format "pt2" or "aoti").

    `device=None` runs it where it was exported. A pt2 artifact moves to any device; an AOTI
    package runs only on the device type it was compiled for. An AOTI package is native code
    that runs in this process: it loads only with `trust_native_code=True`, for an artifact you
    built or trust. A pt2 artifact runs no code from the folder (see `specfx.artifact_safety`).
    """
    if format == "onnx":
        raise ValueError("the ONNX step runs under onnxruntime (manifest['onnx'] names its inputs and outputs); "
                         "specfx.load runs format 'pt2' or 'aoti'")
    _check_formats([format], LOADABLE, "load")
    return load_artifact(Path(path), format, device, trust_native_code=trust_native_code)


def export_programs(graphs) -> dict[str, tuple[torch.export.ExportedProgram, dict]]:
    """name -> (its `torch.export` program, its manifest entry) for each prefill, the first token's
    head, the step, the sampling step and any prime pass."""
    out = {}
    for name, (gm, args, info) in _programs(graphs).items():
        lean = _lean(gm)
        shapes = _span_dynamic(lean, args, graphs.state, width=info["role"] == "prefill")
        with without_stack_traces():
            out[name] = (torch.export.export(lean, args, dynamic_shapes=shapes, strict=False), info)
    return out


def _programs(graphs) -> dict[str, tuple[fx.GraphModule, tuple, dict]]:
    """name -> (graph, example args, manifest entry) for each prefill, the first token's head, the
    step, the sampling step and the drafter's prime pass, if it has one."""
    st, C = graphs.state, graphs.prefill_chunk
    B, dev, kv_names = st.batch_size, st.tokens.device, [f"kv_{i}" for i in range(len(st.kv))]
    ids = torch.zeros(B, C, dtype=torch.long, device=dev)
    pos = torch.arange(C, device=dev).expand(B, C).contiguous()
    st.set_span(st.seq_len)
    programs = {}
    for p in graphs.prefills:
        r = range(len(st.kv))[p.kv]
        programs[p.name] = (p.gm, (ids, pos, st.span, *st.kv[p.kv]), {
            "role": "prefill", "kv": [r.start, r.stop],
            "inputs": ["input_ids", "positions", "span", *kv_names[p.kv]],
            "args": {n: {"shape": [B, C], "dtype": "int64"} for n in ("input_ids", "positions")},
            "outputs": ["hidden"]})
    H = graphs.structure.hidden_size
    hidden = torch.zeros(B, 1, H, dtype=st.kv[0].dtype, device=dev)
    programs["first"] = (graphs.first, (hidden, pos[:, :1].contiguous(), st.span), {
        "role": "first", "inputs": ["hidden", "positions", "span"],
        "args": {"hidden": {"shape": [B, 1, H], "dtype": dtype_name(hidden.dtype)},
                 "positions": {"shape": [B, 1], "dtype": "int64"}},
        "outputs": ["logits"]})
    step_inputs = [*STEP_INPUTS, *kv_names]
    programs["step"] = (graphs.step, st.step_args(), {"role": "step", "sample": False, "inputs": step_inputs,
                                                      "outputs": []})
    programs["sample_step"] = (graphs.fused_sample_step(), st.step_args(),
                               {"role": "step", "sample": True, "inputs": step_inputs, "outputs": []})
    if graphs.prime is not None:
        programs["prime"] = (graphs.prime, st.step_args(), {"role": "prime", "inputs": step_inputs, "outputs": []})
    if len(programs) != len(graphs.prefills) + 3 + (graphs.prime is not None):
        raise ValueError(f"program names must be unique, got prefills {[p.name for p in graphs.prefills]}")
    return programs


def _span_dynamic(module, args: tuple, state, *, width: bool = False):
    """torch.export's dynamic_shapes for `module(*args)`: the span's length symbolic, and with
    `width` (a prefill) dim 1 of its ids and positions (the first two args), all else static."""
    shapes = torch.export.ShapesCollection()
    span = next(a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.uint8 and a.dim() == 1)
    shapes[span] = (torch.export.Dim.DYNAMIC(min=2, max=state.seq_len),)      # as specfx.capture does
    if width:                                                         # (input_ids, positions, span, *kv)
        for t in args[:2]:
            shapes[t] = (None, torch.export.Dim.DYNAMIC(min=2, max=args[0].shape[1]))
    return shapes.dynamic_shapes(module, args)


def _lean(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy holding only the attributes its graph reads (passes leave unused KV buffers behind),
    without Inductor-only hints (`strip_materialize`)."""
    return strip_materialize(gm)


def _writes(ep, inputs: list[str]) -> list[str]:
    """The inputs a program writes in place, in input order: those that the written argument of
    an in-place op reaches through views. (torch.export's graph keeps its mutations as ops;
    functionalizing it to read them from its signature re-traces the whole program.)"""
    written = set()
    for node in ep.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        if schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                written.add(_view_base(node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)))
    names = dict(zip(ep.graph_signature.user_inputs, inputs))
    return [names[n.name] for n in ep.graph.nodes if n.op == "placeholder" and n in written and n.name in names]


def _view_base(node):
    """The node whose storage `node` views: followed through ops that return an alias of their
    first argument (view, slice, select, transpose, ...)."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.arguments or schema.arguments[0].alias_info is None:
            break
        node = node.args[0]
    return node


def _collect_weights(eps: dict, model, state) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, str]]]:
    """(key -> tensor, each stored once; program -> {its fqn -> key}), keys named as in `model`."""
    model_names: dict[int, str] = {}
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        model_names.setdefault(id(t), name)
    state_storages = {t.untyped_storage().data_ptr() for t in state.tensors().values()}
    weights, by_alias, keys = {}, {}, {}
    for prog, ep in eps.items():
        keys[prog] = {}
        for fqn, t in [*ep.state_dict.items(), *ep.constants.items()]:
            if not isinstance(t, torch.Tensor):
                continue
            if t.untyped_storage().data_ptr() in state_storages:
                raise ValueError(f"program {prog!r} holds state tensor {fqn!r} as a constant; the runtime "
                                 "could not write it: the state must reach a program as an input")
            alias = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
            if alias not in by_alias:
                key = model_names.get(id(t), f"{prog}/{fqn}")
                by_alias[alias], weights[key] = key, t.detach()
            keys[prog][fqn] = by_alias[alias]
    return weights, keys


def _save_weights(weights: dict[str, torch.Tensor], path: Path, out: Path) -> str:
    """safetensors, one entry per tensor (views of one storage become copies: the format wants that)."""
    from safetensors.torch import save_file

    seen, flat = set(), {}
    for key, t in weights.items():
        ptr = t.untyped_storage().data_ptr()
        flat[key] = t.contiguous() if ptr not in seen else t.clone(memory_format=torch.contiguous_format)
        seen.add(ptr)
    save_file({k: t.cpu() for k, t in flat.items()}, str(path), metadata={"format": "pt"})
    return path.relative_to(out).as_posix()


def _save_pt2(ep, path: Path, out: Path) -> str:
    """torch.export.save of `ep` with meta tensors for its weights (0 bytes each in the archive)."""
    for table in (ep.state_dict, ep.constants):
        for name, t in table.items():
            if isinstance(t, torch.Tensor):
                meta = torch.empty_like(t, device="meta")
                table[name] = nn.Parameter(meta, requires_grad=False) if isinstance(t, nn.Parameter) else meta
    ep.example_inputs = None                  # the state as example input would be a second copy
    path.parent.mkdir(exist_ok=True)
    torch.export.save(ep, str(path))
    return path.relative_to(out).as_posix()


def _save_aoti(ep, path: Path, out: Path, device: torch.device) -> str:
    """An AOTInductor package of `ep` without its weights (`load_constants` supplies them)."""
    path.parent.mkdir(exist_ok=True)
    torch._inductor.aoti_compile_and_package(ep, package_path=str(path), inductor_configs={
        "aot_inductor.package_constants_in_so": False, **(CPU_INDUCTOR if device.type == "cpu" else {})})
    return path.relative_to(out).as_posix()


class _StateInOut(nn.Module):
    """The step over a copy of the state, returning the tensors it wrote (ONNX has no in-place writes)."""

    def __init__(self, step: fx.GraphModule, written: list[int]):
        super().__init__()
        self.step, self.written = step, written

    def forward(self, *state):
        state = [t.clone() for t in state]
        n = len(STEP_INPUTS)
        self.step(*state[:n], state[n:])
        return tuple(state[i] for i in self.written)


def _save_onnx(step: fx.GraphModule, state, writes: list[str], path: Path, out: Path) -> dict:
    """The greedy step as ONNX: inputs STEP_INPUTS + kv_i, outputs `<name>_out` for each written input."""
    try:
        import onnx
    except ImportError as e:
        raise ImportError("format 'onnx' needs onnx and onnxscript: pip install 'specfx[onnx]'") from e
    inputs = [*STEP_INPUTS, *(f"kv_{i}" for i in range(len(state.kv)))]
    flat = (*state.step_args()[:-1], *state.kv)
    module = _StateInOut(_lean(step), [inputs.index(w) for w in writes])
    ep = torch.export.export(module, flat, dynamic_shapes=_span_dynamic(module, flat, state),
                             strict=False).run_decompositions()
    outputs = [f"{w}_out" for w in writes]
    path.parent.mkdir(exist_ok=True)
    program = torch.onnx.export(ep, flat, dynamo=True, input_names=inputs, output_names=outputs, verbose=False)
    program.save(str(path))
    onnx.checker.check_model(str(path))
    files = sorted(p.relative_to(out).as_posix() for p in path.parent.iterdir())   # + external data, if any
    return {"file": path.relative_to(out).as_posix(), "files": files, "inputs": inputs, "outputs": outputs,
            "updates": dict(zip(outputs, writes)), "weights": "embedded (ONNX initializers)"}


def _save_tokenizer(tokenizer, model, out: Path) -> list[str]:
    """Tokenizer files at the folder's top level: from `tokenizer`, else from the model's checkpoint."""
    if tokenizer is not None:
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.save_pretrained(tmp)
            return _copy_tokenizer_files(Path(tmp), out)
    source = Path(getattr(model.config, "_name_or_path", "") or "")
    if not (source / "tokenizer.json").is_file() and not (source / "tokenizer.model").is_file():
        return []
    return _copy_tokenizer_files(source, out)


def _copy_tokenizer_files(source: Path, out: Path) -> list[str]:
    names = [f for f in TOKENIZER_FILES if (source / f).is_file()]
    for f in names:
        shutil.copy(source / f, out / f)
    return names


def _previous_files(out: Path) -> list[str]:
    """The files of the artifact in `out` (a new export replaces them; none outside `out`); refuses any
    other non-empty folder."""
    if not out.is_dir() or not any(out.iterdir()):
        return []
    if not (out / MANIFEST).is_file():
        raise ValueError(f"{out} is not empty and holds no {MANIFEST}; export into an empty or new folder")
    inside = [f for f in read_manifest(out).get("files", {}) if (out / f).resolve().is_relative_to(out.resolve())]
    return [*inside, MANIFEST]


def _move_into(tmp: Path, out: Path, files: list[str], previous: list[str]) -> None:
    for name in previous:
        (out / name).unlink(missing_ok=True)
    for name in files:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        os.replace(tmp / name, out / name)


def _check_formats(formats, allowed, verb: str) -> tuple[str, ...]:
    formats = tuple(formats.split(",")) if isinstance(formats, str) else tuple(formats)
    unknown = [f for f in formats if f not in allowed]
    if unknown or not formats:
        raise ValueError(f"unknown format {', '.join(unknown) or '(none)'} for {verb}; expected {', '.join(allowed)}")
    return formats


def _file_record(path: Path) -> dict:
    return {"sha256": sha256(path), "bytes": path.stat().st_size}


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
