"""The training corpus of the embedded models: the interpreter's own standard library.

- `stdlib_root()` / `list_files()`: the Python sources, in a fixed sorted order.
- `is_heldout(relpath)`: a whole-file split chosen by a hash of the relative path (about 5%).
- `manifest()`: Python version, file list and sha256 of each file, saved next to the models.
- `token_stream(tokenizer, files)`: every file tokenized and joined by EOS, as one LongTensor.

Test suites (`test/`, `tests/`, `idle_test/`) and `site-packages` are left out: the first are
dominated by fixtures, the second is not the standard library.
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from pathlib import Path

import torch

HELDOUT_PERCENT = 5
_SKIP_PARTS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def list_files(root: Path | None = None) -> list[str]:
    """Relative paths of the corpus files, sorted, POSIX separators."""
    root = root or stdlib_root()
    rel = (p.relative_to(root) for p in root.rglob("*.py"))
    return sorted(r.as_posix() for r in rel if not _SKIP_PARTS.intersection(r.parts))


def is_heldout(relpath: str) -> bool:
    """True for the ~5% of files kept for evaluation (stable across machines)."""
    digest = hashlib.sha256(relpath.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT


def split(files: list[str]) -> tuple[list[str], list[str]]:
    """(train, heldout) lists, each keeping the sorted order."""
    return [f for f in files if not is_heldout(f)], [f for f in files if is_heldout(f)]


def read(relpath: str, root: Path | None = None) -> str:
    """Text of one corpus file (undecodable bytes replaced, never skipped)."""
    return ((root or stdlib_root()) / relpath).read_bytes().decode("utf-8", errors="replace")


def manifest(root: Path | None = None) -> dict:
    """What the models were trained on: interpreter version, files, hashes, split."""
    root = root or stdlib_root()
    files = list_files(root)
    return {
        "python": platform.python_version(),
        "stdlib": str(root),
        "heldout_percent": HELDOUT_PERCENT,
        "files": [
            {
                "path": f,
                "sha256": hashlib.sha256((root / f).read_bytes()).hexdigest(),
                "heldout": is_heldout(f),
            }
            for f in files
        ],
    }


def token_stream(tokenizer, files: list[str], root: Path | None = None) -> torch.Tensor:
    """All files tokenized and joined with EOS between them: LongTensor [N]."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    texts = [read(f, root) for f in files]
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)
