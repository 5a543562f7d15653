"""`specfx export`: compile a model's speculative step and write it as a loadable artifact folder."""

from __future__ import annotations

import argparse

EPILOG = """examples:
  specfx export pycoder --draft early-exit -o artifacts/pycoder-ee
  specfx export pycoder --draft early-exit:2 -k 4 --max-seq-len 512 --format pt2,onnx -o artifacts/pycoder-ee2
  specfx run artifacts/pycoder-ee --prompt "def parse(path):"      # load it and stream a completion
"""


def add_parser(sub):
    p = sub.add_parser("export", help="write the fused step, prefill, weights and tokenizer to a folder",
                       description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="zoo name (e.g. pycoder) or a local Hugging Face checkpoint directory")
    p.add_argument("--draft", default="early-exit", help="drafter: none, early-exit, early-exit:E, ngram:N, ... "
                                                         "(default: early-exit)")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=None, help="draft tokens per step")
    p.add_argument("--max-seq-len", type=int, default=1024, help="static cache length (prompt + new tokens)")
    p.add_argument("--batch-size", type=int, default=1, help="static batch size")
    p.add_argument("--format", default="pt2,aoti,onnx",
                   help="comma-separated: pt2 (torch.export), aoti (AOTInductor), onnx (greedy step); default all")
    p.add_argument("-o", "--output", required=True, help="folder to write (new, empty, or a previous artifact)")
    return p


def run(args) -> int:
    import time

    from rich.table import Table

    import specfx
    from specfx.cli.common import console as console_
    from specfx.cli.common import load_model

    console = console_()
    model, tok, _ = load_model(args.model)
    t0 = time.perf_counter()
    fast = specfx.compile(model, draft=args.draft, num_speculative_tokens=args.num_speculative_tokens,
                          max_seq_len=args.max_seq_len, batch_size=args.batch_size, backend="eager")
    t1 = time.perf_counter()
    console.print(f"built {fast} in {t1 - t0:.1f} s; exporting {args.format} ...", style="dim")
    manifest = fast.export(args.output, formats=args.format, tokenizer=tok)
    t2 = time.perf_counter()
    table = Table(title=f"{args.output}: {args.model}, draft={manifest['drafter']}, k={manifest['k']}, "
                        f"batch_size={manifest['batch_size']}, max_seq_len={manifest['max_seq_len']}")
    table.add_column("file")
    table.add_column("MiB", justify="right")
    table.add_column("sha256")
    for name, rec in manifest["files"].items():
        table.add_row(name, f"{rec['bytes'] / 2**20:.2f}", rec["sha256"][:16])
    console.print(table)
    console.print(f"exported {', '.join(manifest['formats'])} in {t2 - t1:.1f} s (build {t1 - t0:.1f} s); "
                  f"load with specfx.load({args.output!r}) or: specfx run {args.output} --prompt ...")
    return 0
