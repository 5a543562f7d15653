"""`specfx zoo`: the embedded models and what training measured on held-out files."""

from __future__ import annotations

import argparse

EPILOG = """example:
  specfx zoo
"""


def add_parser(sub):
    return sub.add_parser(
        "zoo", help="list the embedded models with their held-out quality",
        description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def run(args) -> int:
    from specfx.cli.common import console as console_
    from rich.table import Table

    from specfx import zoo

    table = Table(title="specfx zoo (held-out = corpus files never trained on)")
    for col in ("model", "params", "layers", "held-out loss", "top-1", "top-1 by exit layer (1..L)"):
        table.add_column(col, justify="left" if col in ("model", "top-1 by exit layer (1..L)") else "right")
    for name in zoo.names():
        info = zoo.info(name)
        ho = info["heldout"]
        if info.get("kind") == "mtp":
            acc = info["acceptance"]
            table.add_row(
                name, f"{info['parameters'] / 1e6:.1f}M", "1 (head)", "-", f"{ho['top1_agreement']:.3f}",
                f"MTP head for {info['target']}: acceptance by draft position "
                + " ".join(f"{a:.2f}" for a in acc["acceptance_by_position"])
                + f" ({acc['mean_accepted']:.2f} tokens/call at k={acc['k']})",
            )
            continue
        by_exit = " ".join(f"{a:.2f}" for a in ho["top1_by_exit"])
        extra = ho.get("greedy_agreement_with_target")
        if extra is not None:
            by_exit += f"  (greedy agreement with target {extra:.2f})"
        table.add_row(
            name, f"{info['parameters'] / 1e6:.1f}M", str(len(ho["top1_by_exit"])),
            f"{ho['loss']:.3f}", f"{ho['top1']:.3f}", by_exit,
        )
    console_().print(table)
    return 0
