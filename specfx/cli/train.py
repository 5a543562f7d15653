"""`specfx train layerskip|draft|mtp|prompts`: reproduce the embedded models (seeded)."""

from __future__ import annotations

import argparse
import json

from specfx.heads import LAYOUTS

EPILOG = """examples:
  specfx train layerskip --out specfx/zoo/pycoder --steps 1200 --threads 2
  specfx train draft --out specfx/zoo/pycoder-draft --tokenizer specfx/zoo/pycoder --steps 1500 --threads 1
  specfx train mtp --target pycoder --out specfx/zoo/pycoder-mtp --threads 2
  specfx train mtp --target pycoder --arch eagle3 --draft-vocab 2048 --out pycoder-eagle3 --threads 2
  specfx train prompts --tokenizer specfx/zoo/pycoder --out specfx/zoo/prompts/pycode.jsonl
  specfx train prompts --task editing --tokenizer specfx/zoo/pycoder --out specfx/zoo/prompts/pyedit.jsonl
"""


def add_parser(sub):
    p = sub.add_parser(
        "train", help="train an embedded model (LayerSkip target or draft)",
        description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("kind", choices=["layerskip", "draft", "mtp", "prompts"],
                   help="which model to train (mtp: a draft head for --target; prompts: cut the "
                        "evaluation prompts with --tokenizer)")
    p.add_argument("--out", required=True, help="output directory (HF checkpoint), or the .jsonl for prompts")
    p.add_argument("--tokenizer", default=None, help="reuse this tokenizer directory (default: train one)")
    p.add_argument("--target", default=None, help="mtp only: the zoo model or checkpoint the head drafts for")
    p.add_argument("--windows", type=int, default=None,
                   help="mtp only: windows of target hidden states to precompute (default: the shipped head's)")
    p.add_argument("--generated", type=int, default=None,
                   help="mtp only: also train on this many windows of the target's own greedy continuations "
                        "of training-corpus prefixes (default: the shipped head's)")
    p.add_argument("--init", default=None,
                   help="mtp only: train on from this head (a folder, or a shipped head's name such as "
                        "pycoder-mtp) instead of a fresh one; its layout must be --arch's")
    p.add_argument("--eval-prompts", type=int, default=16,
                   help="mtp only: evaluation prompts over which the head's acceptance is measured")
    p.add_argument("--arch", choices=LAYOUTS, default="specfx",
                   help="mtp only: the head's layout. specfx: specfx's own head (eh_proj over the normed "
                        "embedding and last hidden state, one target layer, its own norm, the target's "
                        "lm_head); eagle: EAGLE-1 (fc over embedding and normed last hidden state, one "
                        "Llama layer, the target's lm_head); eagle3: EAGLE-3 (fc over three target layers, "
                        "a midlayer, its own lm_head over --draft-vocab tokens); deepseek-mtp: DeepSeek-V3's "
                        "MTP module (enorm/hnorm/eh_proj over the normed last hidden state, one target layer, "
                        "the target's lm_head)")
    p.add_argument("--draft-vocab", type=int, default=None,
                   help="mtp --arch eagle3 only: draft vocabulary size, the target's most frequent tokens "
                        "in the training windows (default: the target's whole vocabulary)")
    p.add_argument("--regression-weight", type=float, default=0.5, help="mtp only: weight of the feature regression")
    p.add_argument("--chain-weight", type=float, default=None,
                   help="mtp only: weight of a second draft's cross-entropy, the head reading its own output "
                        "(EAGLE-3's training-time test; default 1 for --arch eagle3, else the shipped head's)")
    p.add_argument("--teacher", default=None, help="draft only: distill from this target directory")
    p.add_argument("--task", choices=["completion", "editing"], default="completion",
                   help="prompts only: which evaluation set to cut")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 1200; mtp: the shipped head's)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 16; mtp 8)")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-3; mtp 1e-3)")
    p.add_argument("--p-max", type=float, default=0.1, help="layer dropout of the last layer")
    p.add_argument("--exit-every", type=int, default=4, help="rotational curriculum period R")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--model", type=json.loads, default={}, help='config overrides as JSON, e.g. \'{"num_hidden_layers": 2}\'')
    return p


def run(args) -> int:
    from rich.console import Console

    from specfx.zoo.build import build

    if args.kind == "prompts":
        from transformers import AutoTokenizer

        from specfx.zoo.prompts import write_prompts

        if not args.tokenizer:
            raise ValueError("specfx train prompts needs --tokenizer DIR")
        n = write_prompts(AutoTokenizer.from_pretrained(args.tokenizer), args.out, task=args.task)
        Console().print(f"wrote {n} prompts to {args.out}")
        return 0
    if args.kind == "mtp":
        from specfx.mtp_train import MTPTrainConfig
        from specfx.zoo.build import build_mtp

        if not args.target:
            raise ValueError("specfx train mtp needs --target (a zoo model or checkpoint directory)")
        shipped = MTPTrainConfig()
        chain = args.chain_weight
        if chain is None:
            chain = 1.0 if args.arch == "eagle3" else shipped.chain_weight
        info = build_mtp(args.target, args.out, threads=args.threads, steps=args.steps or shipped.steps,
                         batch_size=args.batch_size or shipped.batch_size, seq_len=args.seq_len,
                         lr=args.lr or shipped.lr, windows=args.windows or shipped.windows,
                         regression_weight=args.regression_weight, seed=args.seed, num_prompts=args.eval_prompts,
                         arch=args.arch, draft_vocab=args.draft_vocab, chain_weight=chain,
                         generated=shipped.generated if args.generated is None else args.generated,
                         init=args.init)
        Console().print_json(json.dumps({"heldout": info["heldout"], "acceptance": info["acceptance"]}))
        return 0
    info = build(
        args.kind, args.out, tokenizer=args.tokenizer, teacher=args.teacher, threads=args.threads,
        steps=args.steps or 1200, batch_size=args.batch_size or 16, seq_len=args.seq_len, lr=args.lr or 2e-3,
        p_max=args.p_max, exit_every=args.exit_every, seed=args.seed, model_overrides=args.model,
    )
    Console().print_json(json.dumps(info["heldout"]))
    return 0
