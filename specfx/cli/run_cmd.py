"""`specfx run`: load an exported artifact, stream a completion, and time start-up to the first token.

The timing table splits the time from process start to the first new token on screen: the
interpreter, `import specfx` and the CLI (from the process's start time in /proc, Linux only,
10 ms ticks), `specfx.load` (manifest and sha256 checks, weights, programs, state, and on CUDA
the step's CUDA-graph capture), the tokenizer (the `tokenizers` library on the folder's
tokenizer.json, the fast tokenizer AutoTokenizer wraps), and prefill plus the first step.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

EPILOG = """examples:
  specfx export pycoder --draft early-exit -o artifacts/pycoder-ee
  specfx run artifacts/pycoder-ee --prompt "def parse(path):"
  specfx run artifacts/pycoder-ee --prompt "import os" --format aoti --trust-native-code --max-new-tokens 64
"""


def add_parser(sub):
    p = sub.add_parser("run", help="load an exported artifact and stream a completion", description=__doc__,
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact", help="folder written by `specfx export`")
    p.add_argument("--prompt", required=True, help="text to complete")
    p.add_argument("--format", default="pt2", choices=["pt2", "aoti"], help="programs to load (default: pt2)")
    p.add_argument("--trust-native-code", action="store_true",
                   help="allow --format aoti: it runs the artifact's compiled native code in this process; "
                        "only for an artifact you built or trust")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens to generate")
    p.add_argument("--device", default=None, help="device to run on (default: where it was exported)")
    return p


def run(args) -> int:
    t_enter, since_start = time.perf_counter(), process_age()
    import specfx      # already imported with specfx.cli: its time is in the first row

    model = specfx.load(args.artifact, format=args.format, device=args.device,
                        trust_native_code=args.trust_native_code)
    t_load = time.perf_counter()
    tok = _tokenizer(Path(args.artifact))
    ids = tok.encode(args.prompt).ids
    t_tok = time.perf_counter()
    import torch

    printer = Printer(tok)
    model.generate(torch.tensor([ids], device=model.runtime.device), max_new_tokens=args.max_new_tokens,
                   streamer=printer)
    print()
    rows = [(f"specfx.load(format={args.format!r})", t_load - t_enter),
            ("tokenizer (tokenizer.json)", t_tok - t_load), ("prompt -> first token (prefill and its head)",
                                                              printer.first - t_tok)]
    _print_tables(rows, since_start, printer.first - t_enter, model)
    return 0


class Printer:
    """A streamer that prints decoded text as it comes and notes when the first new token arrived."""

    def __init__(self, tok):
        self.tok, self.ids, self.shown, self.prompt_seen, self.first = tok, [], "", False, None

    def put(self, ids) -> None:
        if self.prompt_seen and self.first is None:
            self.first = time.perf_counter()
        self.prompt_seen = True
        self.ids.extend(ids.tolist())
        text = self.tok.decode(self.ids)
        if not text.endswith("\ufffd"):      # wait for the rest of a multi-byte character
            print(text[len(self.shown):], end="", flush=True)
            self.shown = text

    def end(self) -> None:
        text = self.tok.decode(self.ids)
        print(text[len(self.shown):], end="", flush=True)
        self.shown = text


def process_age() -> float | None:
    """Seconds since this process started (Linux /proc, 10 ms resolution); None elsewhere."""
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return None
    start_ticks = int(stat.rsplit(")", 1)[1].split()[19])    # field 22 (starttime), after the command name
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def _tokenizer(folder: Path):
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {folder}: export with a tokenizer (specfx export does)")
    return Tokenizer.from_file(str(path))


def _print_tables(rows, since_start: float | None, since_enter: float, model) -> None:
    from rich.table import Table

    from specfx.cli.common import console as console_
    from specfx.cli.common import stats_table

    console = console_()
    timing = Table(title="load to first token (wall clock, this process)")
    timing.add_column("stage")
    timing.add_column("s", justify="right")
    if since_start is not None:
        timing.add_row("process start -> `specfx run` (interpreter, import specfx, CLI)", f"{since_start:.2f}")
    for name, seconds in rows:
        timing.add_row(name, f"{seconds:.2f}")
    if since_start is not None:
        timing.add_row("[bold]process start -> first token[/]", f"[bold]{since_start + since_enter:.2f}[/]")
    else:
        timing.add_row("[bold]`specfx run` -> first token[/] (no /proc: process start unknown)",
                       f"[bold]{since_enter:.2f}[/]")
    console.print(timing)
    console.print(stats_table(model.last_stats, f"last_stats ({model.format}, {model.runtime.device})"))
