"""The fixed evaluation prompts, cut from held-out corpus files.

`make_prompts(tokenizer)` cuts, from each held-out file, up to `per_file` windows of whole lines
(20–200 tokens, ending at a line break before a non-blank line) at evenly spaced places, so the
model is asked to continue real code it never saw. `write_prompts` saves them as JSONL.
"""

from __future__ import annotations

import json
from pathlib import Path

from specfx.zoo import corpus

MIN_TOKENS, MAX_TOKENS, TARGET_TOKENS = 20, 200, 120


def _windows(lines: list[str], count_tokens, per_file: int) -> list[str]:
    """Up to `per_file` prompts of whole lines from evenly spaced start lines."""
    out = []
    starts = [len(lines) * (i + 1) // (per_file + 1) for i in range(per_file)]
    for s in starts:
        text, end = "", s
        while end < len(lines) and count_tokens(text + lines[end]) <= TARGET_TOKENS:
            text += lines[end]
            end += 1
        # End before a non-blank line so there is code to complete.
        while text and (end >= len(lines) or not lines[end].strip()):
            end -= 1
            text = "".join(lines[s:end])
        if MIN_TOKENS <= count_tokens(text) <= MAX_TOKENS:
            out.append(text)
    return out


def make_prompts(tokenizer, per_file: int = 2) -> list[str]:
    """Prompts from every held-out file, in the corpus's sorted order."""
    count = lambda t: len(tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    _, heldout = corpus.split(corpus.list_files())
    prompts = []
    for f in heldout:
        prompts += _windows(corpus.read(f).splitlines(keepends=True), count, per_file)
    return prompts


def write_prompts(tokenizer, path: str | Path, per_file: int = 2) -> int:
    """Write the prompts as JSONL (`{"prompt": ...}` per line); returns how many."""
    prompts = make_prompts(tokenizer, per_file)
    Path(path).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return len(prompts)
