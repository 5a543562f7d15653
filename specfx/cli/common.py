"""Helpers shared by CLI commands: load a model by zoo name or path, load prompts, show stats."""

from __future__ import annotations

import json
from pathlib import Path


DTYPES = ("float32", "bfloat16", "float16")


def load_model(name_or_path: str, dtype: str = "float32"):
    """(model in `dtype` (one of DTYPES), eval, tokenizer, checkpoint dir) from a zoo name or
    local directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specfx import zoo

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    path = zoo.resolve(name_or_path)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).eval()
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


def stats_table(stats, title: str = "last_stats"):
    """A rich Table of a GenerationStats, one metric a row."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, val in stats.to_dict().items():
        if isinstance(val, float):
            val = f"{val:.4g}"
        elif isinstance(val, list):
            val = " ".join(f"{v:.2f}" for v in val) or "-"
        table.add_row(key, str(val))
    return table


def console():
    """A rich Console; wide when output is not a terminal, so tables are not squeezed."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=200)
