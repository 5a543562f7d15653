"""What `specfx.load` accepts from an artifact folder that someone else may have written.

The manifest's sha256s show only that the files are the ones the manifest lists; whoever wrote
the folder wrote the manifest too. So, before anything is loaded:

- `require_trust`: format "aoti" loads shared libraries from the folder and runs their native
  code in this process; it needs `trust_native_code=True`, as transformers gates
  `trust_remote_code`.
- `inside(folder, name)`: a file the manifest names must lie inside the folder: no absolute
  name, no `..`, no symlink that resolves outside.
- `check_program_folders`: `pt2/`, `aoti/` and `onnx/` hold only files the manifest lists.
- `check_pt2_archive`: a pt2 program holds only what `specfx export` writes: the program as
  JSON and tensors as raw bytes. `torch.export.load` would also unpickle pickled weights,
  constants and sample inputs (unpickling can run code) and load AOTI code from the archive;
  an archive with any of those is refused before `torch.export.load` sees it.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from pathlib import Path, PurePosixPath

PROGRAM_DIRS = ("pt2", "aoti", "onnx")
NATIVE_FORMATS = ("aoti",)

# Members of a pt2 archive (under its one top-level folder) as torch.export.save writes a
# program whose weights are left out; anything else is refused.
_PT2_MEMBER = re.compile(r"archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id"
                         r"|models/model\.json|data/sample_inputs/model\.pt"
                         r"|data/weights/model_weights_config\.json|data/weights/weight_\d+"
                         r"|data/constants/model_constants_config\.json|data/constants/tensor_\d+")
_PT2_CONFIGS = ("data/weights/model_weights_config.json", "data/constants/model_constants_config.json")


def require_trust(folder: Path, format: str, trust_native_code: bool) -> None:
    """Refuse to load native code from `folder` unless the caller said they trust it."""
    if format in NATIVE_FORMATS and not trust_native_code:
        raise ValueError(
            f"format={format!r} loads the shared libraries in {folder / format} and runs their native code in "
            "this process, with your rights. The sha256s in manifest.json show only that the files are the "
            "ones it lists, and whoever wrote the folder wrote the manifest too. Load it only if you built it "
            f"or trust who did: specfx.load(path, format={format!r}, trust_native_code=True), or "
            "specfx run --trust-native-code. format='pt2' runs no code from the folder.")


def inside(folder: Path, name) -> Path:
    """`folder / name`, refused unless `name` is a relative path that stays inside `folder`."""
    if not isinstance(name, str) or not name or PurePosixPath(name).is_absolute() or Path(name).is_absolute() \
            or ".." in PurePosixPath(name).parts or "\\" in name:
        raise ValueError(f"manifest.json names the file {name!r}, which is not a relative path inside "
                         f"{folder}; refusing the artifact")
    path = folder / name
    if not path.resolve().is_relative_to(folder.resolve()):
        raise ValueError(f"{path} resolves to {path.resolve()}, outside {folder} (a symlink?); "
                         "refusing the artifact")
    return path


def check_program_folders(folder: Path, manifest: dict) -> None:
    """Every file (or link) under the program folders is one the manifest lists."""
    listed = set(manifest.get("files", {}))
    unlisted = []
    for d in PROGRAM_DIRS:
        for root, dirs, files in os.walk(folder / d):
            links = [x for x in dirs if os.path.islink(os.path.join(root, x))]   # not walked into
            for name in [*files, *links]:
                rel = Path(root, name).relative_to(folder).as_posix()
                if rel not in listed:
                    unlisted.append(rel)
    if unlisted:
        raise ValueError(f"{folder} holds files in its program folders that manifest.json does not list: "
                         f"{', '.join(sorted(unlisted)[:5])}; refusing the artifact (remove them, or re-export)")


def check_pt2_archive(path: Path) -> None:
    """Refuse a pt2 archive holding anything `torch.export.load` would unpickle or load as code."""
    def refuse(what: str):
        raise ValueError(f"{path} is not a program as specfx export writes it: {what}. torch.export.load "
                         "would unpickle or load it, which can run code; refusing the artifact (re-export it)")

    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        refuse("not a zip archive")
    with archive:
        infos = [i for i in archive.infolist() if not i.is_dir()]
        roots = {i.filename.split("/", 1)[0] for i in infos}
        if len(roots) != 1:
            refuse(f"{len(roots)} top-level folders")
        root = roots.pop()
        for info in infos:
            member = info.filename[len(root) + 1:]
            if not _PT2_MEMBER.fullmatch(member):
                refuse(f"it holds {info.filename}")
            if member == "data/sample_inputs/model.pt" and info.file_size:
                refuse("it holds pickled sample inputs")
        for config in _PT2_CONFIGS:
            try:
                entries = json.loads(archive.read(f"{root}/{config}"))["config"]
            except (KeyError, ValueError, TypeError):
                refuse(f"{config} is missing or not a valid config")
            for fqn, meta in entries.items():
                if not isinstance(meta, dict) or meta.get("use_pickle") is not False:
                    refuse(f"{fqn!r} is stored pickled")
                if not re.fullmatch(r"(weight|tensor)_\d+", str(meta.get("path_name"))):
                    refuse(f"{fqn!r} is not a plain tensor ({meta.get('path_name')!r})")
