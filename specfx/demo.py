"""`make demo`: the main job on the embedded model, offline.

Loads `pycoder`, completes three held-out prompts with `model.generate` while streaming the
text, and prints tokens/s for each.
"""

from __future__ import annotations

import time

import torch
from rich.console import Console
from transformers import TextStreamer


def main(num_prompts: int = 3, max_new_tokens: int = 64) -> None:
    from specfx import zoo

    console = Console()
    model, tok = zoo.load("pycoder")
    for prompt in zoo.prompts("completion")[:num_prompts]:
        console.rule("[bold]prompt (held-out file)")
        print(prompt, end="")
        console.rule("[bold]completion by pycoder")
        ids = tok(prompt, return_tensors="pt").input_ids
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                                 streamer=TextStreamer(tok, skip_prompt=True),
                                 pad_token_id=tok.pad_token_id)
        dt = time.perf_counter() - t0
        new = out.shape[1] - ids.shape[1]
        console.print(f"\n[green]{new} tokens in {dt:.2f} s = {new / dt:.1f} tokens/s[/] (model.generate, greedy)")


if __name__ == "__main__":
    main()
