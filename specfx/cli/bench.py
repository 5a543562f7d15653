"""`specfx bench`: methods side by side on the same prompts (see specfx.bench for how)."""

from __future__ import annotations

import argparse
import json

from specfx.cli.common import DTYPES
from specfx.drafters import tree_name
from specfx.sweep import TREES

EPILOG = """examples:
  specfx bench pycoder
  specfx bench pycoder --methods hf-greedy,specfx:none,specfx:early-exit --max-new-tokens 128 --json out.json
  specfx bench ./my-hf-checkpoint --methods hf-greedy,specfx:early-exit:4 -k 3
  specfx bench pycoder --sweep-exit
  specfx bench pycoder --sweep-tree --save-default
  specfx bench pycoder --sample --temperature 0.7
  specfx bench pycoder --task editing --methods hf-greedy,hf-prompt-lookup,specfx:none,specfx:ngram:3
  specfx bench pycoder --methods hf-greedy,hf-assisted,specfx:draft-model
"""

DEFAULT_METHODS = "hf-greedy,hf-early-exit,specfx:none,specfx:early-exit"
DEFAULT_SAMPLE_METHODS = "hf-sample,specfx:none,specfx:early-exit"


def add_parser(sub):
    p = sub.add_parser("bench", help="benchmark decoding methods side by side", description=__doc__,
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="zoo name (e.g. pycoder) or a local Hugging Face checkpoint directory")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated methods (default: {DEFAULT_METHODS}, or with --sample "
                        f"{DEFAULT_SAMPLE_METHODS}); ':E' picks an exit layer")
    p.add_argument("--prompts", default=None, help="JSONL file of {\"prompt\": ...} (default: the zoo's evaluation set)")
    p.add_argument("--task", choices=["completion", "editing"], default="completion",
                   help="zoo prompt set: completion, or editing (the answer repeats the prompt)")
    p.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--repeats", type=int, default=3, help="timed passes over the prompts (median kept)")
    p.add_argument("--warmup", type=int, default=2, help="untimed prompts per method first")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=None,
                   help="draft tokens per step (default: the model's tuned k, else 4)")
    p.add_argument("--backend", default="inductor", help="torch.compile backend for specfx methods")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="load the model in this dtype and run every method in it (not up-cast)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--json", dest="json_out", default=None, help="write the results as JSON here")
    p.add_argument("--sample", action="store_true",
                   help="sample instead of greedy (baseline hf-sample; default methods change accordingly)")
    p.add_argument("--temperature", type=float, default=1.0, help="with --sample")
    p.add_argument("--top-p", type=float, default=1.0, help="with --sample")
    p.add_argument("--top-k", type=int, default=0, help="with --sample (0: off)")
    p.add_argument("--sweep-exit", action="store_true",
                   help="try every exit layer and k in {2,3,4,6}, run the five best predictions for real; "
                        "print the sweet spot")
    p.add_argument("--exit-layers", default=None,
                   help="with --sweep-exit: the exit layers to try, comma-separated (default: every one)")
    p.add_argument("--sweep-tree", action="store_true",
                   help="try draft-tree shapes of --sweep-draft (and the model's saved tree) against its chain "
                        "of k, run the chain, the three best predictions and the saved tree for real; print the best")
    p.add_argument("--sweep-draft", default="mtp",
                   help="with --sweep-tree: the drafter (default: the model's MTP head)")
    p.add_argument("--trees", default=None,
                   help=f"with --sweep-tree: the shapes, comma-separated (default {','.join(map(tree_name, TREES))})")
    p.add_argument("--save-default", action="store_true",
                   help="with --sweep-exit: store the best (exit layer, k) in the model's config.json; with "
                        "--sweep-tree: the best tree as the model's default MTP tree")
    p.add_argument("--check", type=int, default=None,
                   help="with a sweep: how many of the best predictions run for real (default: 5 exit pairs, "
                        "3 trees; 0 trusts the prediction)")
    p.add_argument("--rounds", type=int, default=None,
                   help="with a sweep: rounds of those runs, each in a new order (default: 3 exit pairs, 5 trees)")
    return p


def _checks(args) -> dict:
    """The sweep's `check` and `rounds` where given (else the sweep's own defaults)."""
    return {name: getattr(args, name) for name in ("check", "rounds") if getattr(args, name) is not None}


def _tree_shape(text: str) -> tuple[int, ...]:
    from specfx.drafters import parse_tree

    shape = parse_tree(text)
    if shape is None or min(shape) < 1:
        raise ValueError(f"--trees: expected shapes like 4x2x2x1, got {text!r}")
    return shape


def _report_sweep(result, table, args, console) -> None:
    """Print a sweep's table and write its JSON where --json says."""
    console.print(table)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result.to_dict(), f, indent=1)


def _sweep_tree(args, model, tok, prompts, path, console) -> int:
    from specfx.sweep import TREES, render_tree_sweep, save_tree_default, sweep_tree

    if args.save_default and not args.sweep_draft.startswith("mtp"):
        raise ValueError("--save-default with --sweep-tree saves an MTP head's default tree: --sweep-draft mtp[:HEAD]")
    k = args.num_speculative_tokens or getattr(model.config, "specfx_num_speculative_tokens", None) or 3
    trees = TREES if not args.trees else tuple(_tree_shape(t) for t in args.trees.split(","))
    result = sweep_tree(model, tok, prompts, draft=args.sweep_draft, k=k, trees=trees, max_new_tokens=args.max_new_tokens,
                        num_prompts=args.num_prompts or 8, backend=args.backend, **_checks(args),
                        log=lambda m: console.print(m, style="dim", markup=False))
    _report_sweep(result, render_tree_sweep(result), args, console)
    if args.save_default:
        save_tree_default(path, result.best)
        best = result.best["tree"]
        console.print(f"saved default MTP tree {best} in {path}/config.json" if best else
                      f"the chain of {k} is best: no default tree in {path}/config.json")
    return 0


def run(args) -> int:
    from specfx.cli.common import console as console_
    import torch

    from specfx.cli.common import load_model, load_prompts

    console = console_()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, path = load_model(args.model, args.dtype)
    prompts = load_prompts(args.prompts, args.num_prompts, args.task)
    if args.sweep_tree:
        return _sweep_tree(args, model, tok, prompts, path, console)
    if args.sweep_exit:
        from specfx.sweep import render_sweep, save_default, sweep_exit

        layers = None if args.exit_layers is None else [int(e) for e in args.exit_layers.split(",")]
        result = sweep_exit(model, tok, prompts, max_new_tokens=args.max_new_tokens, backend=args.backend,
                            layers=layers, **_checks(args), log=lambda m: console.print(m, style="dim", markup=False))
        _report_sweep(result, render_sweep(result), args, console)
        if args.save_default:
            save_default(path, result.best)
            console.print(f"saved default exit layer {result.best['exit_layer']}, k={result.best['k']} in {path}/config.json")
        return 0
    from specfx.bench import render, run_bench

    methods = args.methods or (DEFAULT_SAMPLE_METHODS if args.sample else DEFAULT_METHODS)
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p) if args.sample else None
    result = run_bench(model, tok, prompts, [m.strip() for m in methods.split(",") if m.strip()],
                       model_name=args.model, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                       warmup=args.warmup, k=args.num_speculative_tokens, backend=args.backend,
                       sampling=sampling, log=lambda m: console.print(m, style="dim", markup=False))
    console.print(render(result))
    import sys

    console.print("command: specfx " + " ".join(sys.argv[1:]) if sys.argv[0].endswith("specfx") else "",
                  style="dim", markup=False)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(result.to_dict(), f, indent=1)
        console.print(f"wrote {args.json_out}", style="dim")
    return 0
