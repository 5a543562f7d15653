"""The fixed evaluation prompts, cut from held-out corpus files.

- completion (`pycode.jsonl`): `make_prompts(tokenizer)` cuts, from each held-out file, up to
  `per_file` windows of whole lines (20–200 tokens, ending at a line break before a non-blank
  line) at evenly spaced places, so the model continues real code it never saw.
- editing (`pyedit.jsonl`): `make_edit_prompts(tokenizer)` shows a held-out function and asks
  for it again "with type hints", starting the rewrite; the answer repeats much of the prompt,
  which is where prompt lookup shines.

`write_prompts(tokenizer, path, task)` saves either set as JSONL.
"""

from __future__ import annotations

import ast
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


EDIT_TEMPLATE = "# Original:\n{src}\n\n# The same function, rewritten with type hints:\n{head}"


def make_edit_prompts(tokenizer, per_file: int = 3, min_lines: int = 4, max_lines: int = 14) -> list[str]:
    """Editing prompts: a held-out function, then the start of its rewrite with type hints."""
    count = lambda t: len(tokenizer(t, add_special_tokens=False)["input_ids"])  # noqa: E731
    _, heldout = corpus.split(corpus.list_files())
    prompts = []
    for f in heldout:
        text = corpus.read(f)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        taken = 0
        for node in ast.walk(tree):
            if taken == per_file:
                break
            if not isinstance(node, ast.FunctionDef) or not min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
                continue
            src = "".join(lines[node.lineno - 1 : node.end_lineno]).rstrip()
            indent = len(src) - len(src.lstrip())
            src = "\n".join(line[indent:] for line in src.splitlines())
            prompt = EDIT_TEMPLATE.format(src=src, head=f"def {node.name}(")
            if MIN_TOKENS <= count(prompt) <= MAX_TOKENS:
                prompts.append(prompt)
                taken += 1
    return prompts


def write_prompts(tokenizer, path: str | Path, per_file: int = 2, task: str = "completion") -> int:
    """Write the prompts of `task` as JSONL (`{"prompt": ...}` per line); returns how many."""
    prompts = make_prompts(tokenizer, per_file) if task == "completion" else make_edit_prompts(tokenizer)
    Path(path).write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return len(prompts)
