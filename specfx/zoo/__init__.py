"""The embedded models: small Hugging Face checkpoints shipped inside the package.

- `path(name)`: the checkpoint directory (`AutoModelForCausalLM.from_pretrained` takes it).
- `load(name)`: `(model, tokenizer)`, the model in float32 and eval mode.
- `names()`: the shipped models and heads; `info(name)`: what training measured (held-out loss,
  accuracy; for an MTP head, agreement with its target and acceptance per draft position).
- `prompts(task)`: the fixed evaluation prompts every machine benchmarks.

Models are trained by `specfx train` (see `specfx.zoo.build`); `MANIFEST` names the corpus.
"""

from __future__ import annotations

import json
from pathlib import Path

ZOO_DIR = Path(__file__).resolve().parent
PROMPTS_DIR = ZOO_DIR / "prompts"
MANIFEST = ZOO_DIR / "pycoder" / "corpus_manifest.json"


def names() -> list[str]:
    """Names of the shipped models (directories holding a config.json)."""
    return sorted(p.parent.name for p in ZOO_DIR.glob("*/config.json"))


def path(name: str) -> Path:
    """Checkpoint directory of the zoo model `name`."""
    p = ZOO_DIR / name
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"no zoo model named {name!r}; available: {', '.join(names()) or 'none'}"
        )
    return p


def load(name: str, dtype=None):
    """`(model, tokenizer)` of zoo model `name`, float32 by default, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = resolve(name)
    model = AutoModelForCausalLM.from_pretrained(str(p), dtype=dtype or torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(str(p))


def info(name: str) -> dict:
    """The training record of `name`: parameters, config, held-out metrics.

    For a model, its `specfx_train.json`; for an MTP head (`kind == "mtp"`), the record kept
    in the head's `config.json`.
    """
    p = path(name)
    if (p / "specfx_train.json").is_file():
        return json.loads((p / "specfx_train.json").read_text())
    return json.loads((p / "config.json").read_text())["train"]


TASKS = ("completion", "editing")


def prompts(task: str = "completion") -> list[str]:
    """The evaluation prompts of `task` (a file `prompts/<file>.jsonl`)."""
    files = {"completion": "pycode.jsonl", "editing": "pyedit.jsonl"}
    if task not in files:
        raise ValueError(f"unknown task {task!r}; expected one of {sorted(files)}")
    lines = (PROMPTS_DIR / files[task]).read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]


def resolve(name_or_path: str) -> Path:
    """A zoo name or a local checkpoint directory of a model (not an MTP head), as a path."""
    p = Path(name_or_path)
    if not (p / "config.json").is_file():
        p = path(name_or_path)
    if json.loads((p / "config.json").read_text()).get("format") == "specfx-mtp-head":
        raise ValueError(f"{name_or_path!r} is an MTP head, not a model: use it as a drafter, "
                         f"draft='mtp:{name_or_path}' (specfx.MTPHead)")
    return p
