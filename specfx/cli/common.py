"""Helpers shared by CLI commands: load a model by zoo name or path, load prompts."""

from __future__ import annotations

import json
from pathlib import Path


def load_model(name_or_path: str):
    """(model float32 eval, tokenizer, checkpoint dir) from a zoo name or local directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specfx import zoo

    path = zoo.resolve(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(path)), path


def load_prompts(file: str | None, limit: int | None = None, task: str = "completion") -> list[str]:
    """Prompts from a JSONL file, or the zoo's evaluation set of `task`."""
    from specfx import zoo

    if file is None:
        prompts = zoo.prompts(task)
    else:
        prompts = [json.loads(line)["prompt"] for line in Path(file).read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"no prompts in {file}")
    return prompts[:limit] if limit else prompts


def console():
    """A rich Console; wide when output is not a terminal, so tables are not squeezed."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=200)
