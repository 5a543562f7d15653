"""`make demo`: the main job on the embedded model, offline.

1. A short side-by-side benchmark on `pycoder` (held-out prompts, greedy): transformers'
   `generate`, specfx without speculation, with LayerSkip early-exit speculation and with
   pycoder's MTP head.
2. One completion streamed through the compiled speculative model, with its `last_stats`.
"""

from __future__ import annotations

import sys

import torch
from transformers import TextStreamer


def main(num_prompts: int = 6, max_new_tokens: int = 64) -> None:
    import specfx
    from specfx import zoo
    from specfx.bench import render, run_bench
    from specfx.cli.common import console

    out = console()
    model, tok = zoo.load("pycoder")
    prompts = zoo.prompts("completion")[:num_prompts]
    out.rule("[bold]1. benchmark: pycoder, held-out prompts, greedy")
    result = run_bench(model, tok, prompts, ["hf-greedy", "specfx:none", "specfx:early-exit", "specfx:mtp"],
                       model_name="pycoder", max_new_tokens=max_new_tokens, repeats=1, warmup=1,
                       log=lambda m: out.print(m, style="dim", markup=False))
    out.print(render(result))
    out.print("(printed by `make demo`; the full table comes from `specfx bench pycoder`)", style="dim")

    out.rule("[bold]2. a completion, streamed by specfx (MTP head)")
    fast = specfx.compile(model, draft="mtp", max_seq_len=result.settings["max_seq_len"])
    prompt = prompts[0]
    print(prompt, end="")
    sys.stdout.flush()
    ids = tok(prompt, return_tensors="pt").input_ids
    fast.generate(ids, max_new_tokens=max_new_tokens, streamer=TextStreamer(tok, skip_prompt=True))
    print()
    out.print(str(fast.last_stats), markup=False)
    torch._dynamo.reset()


if __name__ == "__main__":
    main()
