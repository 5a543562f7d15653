"""`specfx generate`: stream a completion and print what the run measured."""

from __future__ import annotations

import argparse

EPILOG = """examples:
  specfx generate pycoder --prompt "def fibonacci(n):"
  specfx generate pycoder --prompt "import os" --draft early-exit:3 -k 4 --max-new-tokens 64
"""


def add_parser(sub):
    p = sub.add_parser("generate", help="stream a completion with speculative decoding",
                       description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="zoo name (e.g. pycoder) or a local Hugging Face checkpoint directory")
    p.add_argument("--prompt", required=True, help="text to complete")
    p.add_argument("--draft", default="early-exit", help="drafter: none, early-exit, early-exit:E (default: early-exit)")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=None, help="draft tokens per step")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens to generate")
    p.add_argument("--max-seq-len", type=int, default=1024, help="static cache length")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (eager: no compilation)")
    return p


def run(args) -> int:
    from specfx.cli.common import console as console_
    from specfx.cli.common import stats_table
    from transformers import TextStreamer

    import specfx
    from specfx.cli.common import load_model

    console = console_()
    model, tok, _ = load_model(args.model)
    console.print(f"compiling {args.model} with draft={args.draft} ({args.backend}) ...", style="dim")
    fast = specfx.compile(model, draft=args.draft, num_speculative_tokens=args.num_speculative_tokens,
                          max_seq_len=args.max_seq_len, backend=args.backend)
    console.print(f"{fast} ready in {fast.capture_s + fast.compile_s:.1f} s", style="dim")
    ids = tok(args.prompt, return_tensors="pt").input_ids
    fast.generate(ids, max_new_tokens=args.max_new_tokens, streamer=TextStreamer(tok))
    print()
    console.print(stats_table(fast.last_stats))
    return 0
