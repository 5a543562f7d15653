"""`specfx roofline`: the machine's weight-streaming speed, and how close the decode and
verify steps come to it (see specfx.roofline for how each figure is measured)."""

from __future__ import annotations

import argparse
import json

EPILOG = """examples:
  specfx roofline pycoder
  specfx roofline pycoder --context 200 -k 3 --threads 2 --json roofline.json
  specfx roofline pycoder --verify-rows 8,12,16     # what verifying a draft tree of 7-15 nodes costs
"""


def add_parser(sub):
    p = sub.add_parser("roofline", help="weight-streaming probe vs the decode and verify steps",
                       description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="zoo name (e.g. pycoder) or a local Hugging Face checkpoint directory")
    p.add_argument("--context", type=int, default=200, help="tokens already in the cache when the steps run")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=3, help="drafts per step: verify reads k+1 rows")
    p.add_argument("--max-seq-len", type=int, default=1024, help="static cache length of the compiled steps")
    p.add_argument("--verify-rows", default="", help="more verify widths to time, comma-separated (e.g. 8,12,16)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", dest="json_out", default=None, help="write the figures as JSON here")
    return p


def run(args) -> int:
    import torch

    from specfx.cli.common import console, load_model
    from specfx.roofline import render, roofline

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.context + args.num_speculative_tokens + 2 > args.max_seq_len:
        raise ValueError(f"--context {args.context} does not fit --max-seq-len {args.max_seq_len}")
    model, _, _ = load_model(args.model)
    rows = tuple(int(r) for r in args.verify_rows.split(",") if r.strip())
    result = roofline(model, context=args.context, k=args.num_speculative_tokens, max_seq_len=args.max_seq_len,
                      verify_rows=rows)
    out = console()
    out.print(render(result))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
        out.print(f"wrote {args.json_out}", style="dim")
    return 0
