"""`specfx` command line: one subcommand per module in `specfx.cli`."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module in specfx.cli; each module has `add_parser(subparsers)` and `run(args)`.
COMMANDS = {
    "generate": "generate",
    "bench": "bench",
    "inspect": "inspect_cmd",
    "passes": "passes_cmd",
    "zoo": "zoo",
    "train": "train",
    "export": "export_cmd",
    "export-head": "export_head",
    "run": "run_cmd",
    "roofline": "roofline_cmd",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specfx",
        description="Speculative decoding compiler for PyTorch models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in COMMANDS.items():
        mod = importlib.import_module(f"specfx.cli.{module}")
        p = mod.add_parser(sub)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args._run(args) or 0
    except (ValueError, FileNotFoundError) as e:
        from rich.console import Console

        Console(stderr=True).print(f"[bold red]error:[/] {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
