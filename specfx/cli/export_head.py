"""`specfx export-head`: write a draft head in the layout vLLM and SGLang serve (EAGLE-1, EAGLE-3, DeepSeek MTP)."""

from __future__ import annotations

import argparse

EPILOG = """examples:
  specfx train mtp --target pycoder --arch eagle3 --draft-vocab 2048 --out heads/pycoder-eagle3
  specfx export-head heads/pycoder-eagle3 --format eagle3 -o serve/pycoder-eagle3
  vllm serve PATH/TO/pycoder --speculative-config '{"method": "eagle3", "model": "serve/pycoder-eagle3", "num_speculative_tokens": 3}'

A head is written only in its own layout: layouts differ in what the head reads (which target
layers, before or after the final norm) and computes, so a converted head would not draft the
same tokens. `specfx train mtp --arch LAYOUT` trains a head of the layout to serve.
"""


def add_parser(sub):
    p = sub.add_parser("export-head", help="write a draft head in a serving engine's layout (eagle, eagle3, deepseek-mtp)",
                       description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("head", help="head folder (specfx train mtp) or zoo name")
    p.add_argument("--format", required=True, choices=["eagle", "eagle3", "deepseek-mtp"], help="layout to write")
    p.add_argument("--target", default=None,
                   help="the model the head drafts for (zoo name or checkpoint; default: the one its checkpoint names)")
    p.add_argument("-o", "--output", required=True, help="folder to write")
    return p


def run(args) -> int:
    import json
    from pathlib import Path

    from specfx import zoo
    from specfx.cli.common import console, load_model
    from specfx.heads import load_layout, write_layout

    head_dir = Path(args.head)
    if not head_dir.is_dir() and args.head in zoo.names():
        head_dir = zoo.path(args.head)
    target = args.target
    if target is None:
        config = json.loads((head_dir / "config.json").read_text()) if (head_dir / "config.json").is_file() else {}
        target = (config.get("target") or {}).get("name")
        if not target:
            raise ValueError(f"{args.head!r} does not name its target: pass --target")
    model, _, _ = load_model(target)
    head = load_layout(head_dir, model)
    out = write_layout(head, args.output, model, args.format)
    console().print(f"wrote {args.format} head for {target} to {out} "
                    f"({sum(p.numel() for p in head.parameters()):,} parameters)")
    return 0
