"""`specfx inspect`: the StructureMap, what each pass did, and the fused step's health."""

from __future__ import annotations

import argparse
import json

EPILOG = """examples:
  specfx inspect pycoder --draft early-exit
  specfx inspect pycoder --draft early-exit:3 -k 4 --graph verify
  specfx inspect pycoder --draft none --json out.json
"""


def add_parser(sub):
    p = sub.add_parser("inspect", help="show what the passes did to a model", description=__doc__,
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="zoo name (e.g. pycoder) or a local Hugging Face checkpoint directory")
    p.add_argument("--draft", default="early-exit", help="drafter spec (default: early-exit)")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=None, help="draft tokens per step")
    p.add_argument("--max-seq-len", type=int, default=256, help="static cache length")
    p.add_argument("--graph", choices=["draft", "verify", "refill", "prefill", "step", "decode"], default=None,
                   help="also print this graph's code")
    p.add_argument("--json", dest="json_out", default=None, help="write the report as JSON here")
    return p


def run(args) -> int:
    from rich.table import Table
    from rich.tree import Tree

    from specfx.cli.common import console, load_model
    from specfx.inspect import inspect_model

    out = console()
    model, _, _ = load_model(args.model)
    report = inspect_model(model, args.draft, name=args.model, k=args.num_speculative_tokens,
                           max_seq_len=args.max_seq_len)
    s = report.structure
    tree = Tree(f"[bold]StructureMap[/] of {args.model}")
    stack = tree.add(f"decoder stack [cyan]{s['stack_path']}[/]: {s['num_layers']} x {s['layer_type']}")
    for i, (node, kv) in enumerate(zip(s["layer_outputs"], s["kv_buffers"])):
        stack.add(f"layer {i}: residual output [green]{node}[/], KV {kv[0]}, {kv[1]}")
    tree.add(f"embedding node [green]{s['embedding']}[/]")
    head = tree.add(f"head: norm [cyan]{s['final_norm']}[/], lm_head [cyan]{s['lm_head']}[/]")
    head.add(f"{len(s['head_nodes'])} nodes from the last layer's output to the logits")
    tree.add(f"inputs: [green]{s['input_ids']}[/], positions [green]{s['positions']}[/]; "
             f"hidden {s['hidden_size']}, vocab {s['vocab_size']}")
    out.print(tree)

    table = Table(title=f"pass pipeline (draft={report.drafter}, k={report.k})")
    for col in ("graph", "pass", "kind", "modified", "reason", "+nodes", "-nodes", "ms"):
        table.add_column(col, justify="right" if col in ("+nodes", "-nodes", "ms") else "left")
    for r in report.passes:
        table.add_row(r["graph"], r["name"], r["kind"], "yes" if r["modified"] else "no", r["reason"],
                      str(r["nodes_added"]), str(r["nodes_removed"]), f"{r['ms']:.1f}")
    out.print(table)
    if report.tree != list(range(-1, len(report.tree) - 1)):      # not a chain: draw it
        out.print(_draw_tree(report.tree))

    st = report.step
    ops = Table(title=f"fused step: {st.nodes} nodes, static shapes: {'yes' if st.static_shapes else 'NO'}, "
                      f"host syncs: {len(st.host_syncs)}, graph breaks (fullgraph): {st.graph_breaks}")
    ops.add_column("op")
    ops.add_column("count", justify="right")
    for op, n in list(st.ops.items())[:12]:
        ops.add_row(op, str(n))
    out.print(ops)
    for bad in st.host_syncs:
        out.print(f"[red]host sync:[/] {bad}")
    if args.graph:
        if args.graph not in report.graphs:
            raise ValueError(f"no {args.graph!r} graph for draft={report.drafter}; have {sorted(report.graphs)}")
        out.rule(f"{args.graph} graph")
        out.print(report.graphs[args.graph], markup=False, highlight=False)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
        out.print(f"wrote {args.json_out}", style="dim")
    return 0 if not st.host_syncs and st.graph_breaks == 0 else 1


def _draw_tree(parents: list[int]):
    """The draft tree as a rich Tree: each node by depth and its rank among its siblings."""
    from rich.tree import Tree

    root = Tree(f"[bold]draft tree[/]: {len(parents)} nodes, verified with the pending token in one pass")
    branch, depth = {-1: root.add("pending token")}, {-1: 0}
    for i, p in enumerate(parents):
        depth[i] = depth[p] + 1
        rank = parents[:i].count(p)
        branch[i] = branch[p].add(f"node {i}: depth {depth[i]}, candidate {rank + 1}" + (" (spine)" if rank == 0 else ""))
    return root
