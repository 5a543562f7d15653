"""`specfx passes`: every registered pass, its kind and what it does."""

from __future__ import annotations

import argparse


def add_parser(sub):
    return sub.add_parser("passes", help="list the registered FX passes", description=__doc__,
                          epilog="example:\n  specfx passes", formatter_class=argparse.RawDescriptionHelpFormatter)


def run(args) -> int:
    from rich.table import Table

    from specfx.cli.common import console
    from specfx.passes import REGISTRY

    table = Table(title="specfx passes")
    for col in ("pass", "kind", "what it does"):
        table.add_column(col)
    for name, cls in sorted(REGISTRY.items()):
        table.add_row(name, cls.kind, cls.summary())
    console().print(table)
    return 0
