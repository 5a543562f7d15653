"""What grouping the tiled linears of one input saves: pycoder's 85 weight matrices through the
tiled kernel one linear a kernel, against a layer's q, k and v (and its gate and up) as one
`tiled_linears` kernel each (49 kernels), at 1, 4 and 8 rows.

As `specfx.matmul_choice` times its kernels: each kernel's input waits on the one before (as
in a step), all of them compiled into one graph, the forms timed round-robin in one process
(median of `--rounds`), repeated `--repeats` times.

    python benchmarks/grouped_linears.py [--rows 1,4,8] [--rounds 30] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import fx

from specfx import zoo
from specfx.kernels import tiled_linear
from specfx.matmul_choice import machine
from specfx.passes.skinny_matmul import MATERIALIZE
from specfx.runtime.compile import compile_graph
from timing import round_args, timed_rounds


def chain(groups: list[list[torch.Tensor]]) -> fx.GraphModule:
    """`(*weights, *xs) -> outputs`: each group as one kernel (`tiled_linears`, or `tiled_linear`
    for one weight), its input x[K] plus the first column of the kernel before."""
    graph = fx.Graph()
    weights = [[graph.placeholder(f"w{g}_{i}") for i in range(len(ws))] for g, ws in enumerate(groups)]
    xs = {K: graph.placeholder(f"x{K}") for K in sorted({ws[0].shape[1] for ws in groups})}
    outs, y = [], None
    for ws, nodes in zip(groups, weights):
        x = xs[ws[0].shape[1]]
        if y is not None:
            first = graph.call_function(torch.ops.aten.slice.Tensor, (y, 1, 0, 1))
            x = graph.call_function(torch.ops.aten.add.Tensor, (x, first))
        x = graph.call_function(MATERIALIZE, (x, [ws[0].shape[1], 1]))
        if len(nodes) == 1:
            y = graph.call_function(torch.ops.specfx.tiled_linear.default, (x, nodes[0], tiled_linear.VERSION))
        else:
            y = graph.call_function(torch.ops.specfx.tiled_linears.default, (x, nodes, tiled_linear.VERSION))
        outs.append(y)
    graph.output(outs)
    return fx.GraphModule(torch.nn.Module(), graph)


def weight_groups(model) -> tuple[list[list[torch.Tensor]], list[list[torch.Tensor]]]:
    """A Llama's weight matrices one a kernel, and grouped by input (q, k, v; o; gate, up; down;
    lm_head), in a step's order."""
    one, grouped = [], []
    for layer in model.model.layers:
        a, m = layer.self_attn, layer.mlp
        qkv, gate_up = [a.q_proj, a.k_proj, a.v_proj], [m.gate_proj, m.up_proj]
        one += [[lin.weight.detach()] for lin in (*qkv, a.o_proj, *gate_up, m.down_proj)]
        grouped += [[lin.weight.detach() for lin in qkv], [a.o_proj.weight.detach()],
                    [lin.weight.detach() for lin in gate_up], [m.down_proj.weight.detach()]]
    one.append([model.lm_head.weight.detach()])
    grouped.append([model.lm_head.weight.detach()])
    return one, grouped


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,4,8")
    round_args(ap)
    args = ap.parse_args()
    model, _ = zoo.load("pycoder")
    one, grouped = weight_groups(model)
    calls = {}
    with torch.no_grad():
        for M in (int(r) for r in args.rows.split(",")):
            xs = [torch.randn(M, K) for K in sorted({ws[0].shape[1] for ws in one})]
            for name, groups in (("one a kernel", one), ("grouped", grouped)):
                fn = compile_graph(chain(groups), "inductor")
                flat = [w for ws in groups for w in ws] + xs
                calls[(M, name, len(groups))] = lambda fn=fn, flat=flat: fn(*flat)
    print(f"{machine()}; ms for all 85 matrices, median of {args.rounds} rounds, each repeat on its own line")
    runs = timed_rounds(calls, args.rounds, args.repeats, lambda key: f"M={key[0]} {key[1]} ({key[2]} kernels)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(machine=machine(), rounds=args.rounds,
                           runs=[[dict(rows=M, form=name, kernels=n, ms=t) for (M, name, n), t in ms.items()] for ms in runs]),
                      f, indent=1)


if __name__ == "__main__":
    main()
