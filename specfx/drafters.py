"""Drafter configurations: validated dataclasses, and the string forms the CLI accepts.

`parse_draft("early-exit:4")` -> `EarlyExit(layer=4)` (`"early-exit:4:weights=target"`: drafting on the
model's own weights); `"ngram:3"` -> `PromptLookup(ngram=3)`;
`"draft-model:pycoder-draft"` -> `DraftModel("pycoder-draft")`; `"mtp:pycoder-mtp"` -> `MTPHead("pycoder-mtp")`;
`"mtp:pycoder-mtp:tree=4x2x2x1"` -> `MTPHead("pycoder-mtp", tree=(4, 2, 2, 1))` (a draft tree, also for a draft model
and an early exit on stored weights: `"early-exit:3:tree=2x2x1:weights=int8"`);
`"none"` or None -> `NoDraft()`.
The transform for each config lives in `specfx.pipeline`, registered by config type.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class NoDraft:
    """Plain static decoding, compiled: the no-speculation baseline."""

    name = "none"

    def __str__(self) -> str:
        return "none"


EARLY_EXIT_TREE = ("an early exit drafts a tree from a stored copy of its layers only (weights_dtype 'int8' or "
                   "'bfloat16'): on the model's own weights the verify pass continues from the drafts' exit "
                   "hidden states, which only the tree's spine has")


@dataclass(frozen=True)
class EarlyExit:
    """Self-speculation: draft with the first `layer` layers of the model and its head.

    `layer=None` means the model's default exit layer (see `default_exit_layer`).
    `weights_dtype` picks how the drafts run those layers (see `draft_weights`):

    - "target": on the model's own weights, as LayerSkip does. The drafts' KV and exit hidden
      states are the model's, so the verify pass continues from the exit: it runs layers >= E
      (counting from 0) over the pending token and the drafts;
    - "int8" or "bfloat16": on a copy of those layers' and the head's weights stored at fewer
      bytes (drafting only). The drafts write their KV into the model's cache for layers < E,
      and the verify pass runs every layer over the pending token and the drafts, writing the
      model's own KV over theirs: the output stays the model's. This wins where a pass over a
      few rows costs about one over a single row (the CPU's tiled kernel), so that drafting,
      not verifying, is what speculation pays for;
    - None: int8 where the tiled kernel drafts a float32 model, "target" elsewhere.

    `tree` drafts a spine tree (`runtime.tree.Tree.spine`: the exit's top candidates at each
    depth, one draft pass per depth along the top choices) instead of a chain. It needs a stored
    copy ("int8" or "bfloat16"): on the model's own weights the verify pass continues from the
    drafts' exit hidden states, and only the spine's drafts have one.
    """

    layer: int | None = None
    weights_dtype: str | None = None
    tree: tuple[int, ...] | None = None    # candidates per depth of a spine tree (`runtime.tree.Tree.spine`)
    name = "early-exit"

    def __post_init__(self):
        if self.layer is not None and (not isinstance(self.layer, int) or self.layer < 1):
            raise ValueError(f"EarlyExit(layer={self.layer!r}): the exit layer must be an int >= 1")
        _check_weights(self)
        _check_tree(self)
        if self.tree is not None and self.weights_dtype == "target":
            raise ValueError(f"EarlyExit(tree={self.tree!r}, weights_dtype='target'): {EARLY_EXIT_TREE}")

    def __str__(self) -> str:
        return (("early-exit" if self.layer is None else f"early-exit:{self.layer}") + _tree_suffix(self.tree)
                + _weights_suffix(self))

    def draft_weights(self, target, tiled: bool):
        """The dtype the drafts' copy of the first layers and the head is stored in; None: the
        drafts run the model's own weights and the verify pass continues from the exit."""
        return _weights(self, target, tiled)


@dataclass(frozen=True)
class PromptLookup:
    """Prompt lookup: draft the tokens that followed the latest earlier match of the last
    `ngram` tokens (shorter n-grams as fallback), on device; no draft model."""

    ngram: int = 3
    name = "ngram"

    def __post_init__(self):
        if not isinstance(self.ngram, int) or self.ngram < 1:
            raise ValueError(f"PromptLookup(ngram={self.ngram!r}): ngram must be an int >= 1")

    def __str__(self) -> str:
        return f"ngram:{self.ngram}"


@dataclass(frozen=True, eq=False)
class DraftModel:
    """Draft-target speculation with a separate small model sharing the target's tokenizer.

    `model` is an `nn.Module` (a Hugging Face causal LM) or a zoo name / checkpoint directory.
    """

    model: object
    tree: tuple[int, ...] | None = None    # candidates per depth of a spine tree (`runtime.tree.Tree.spine`)
    name = "draft-model"

    def __post_init__(self):
        if not isinstance(self.model, (str, Path)) and not hasattr(self.model, "config"):
            raise TypeError("DraftModel(model): expected a Hugging Face causal LM, a zoo name or a path")
        _check_tree(self)

    def __str__(self) -> str:
        if isinstance(self.model, (str, Path)):
            return f"draft-model:{self.model}{_tree_suffix(self.tree)}"
        name = getattr(self.model.config, '_name_or_path', '') or type(self.model).__name__
        return f"draft-model:{name}{_tree_suffix(self.tree)}"

    def load(self, like):
        """The draft module, on the device and in the dtype of the target `like`."""
        model = self.model
        if isinstance(model, (str, Path)):
            from transformers import AutoModelForCausalLM

            from specfx import zoo

            model = AutoModelForCausalLM.from_pretrained(str(zoo.resolve(str(model))))
        param = next(like.parameters())
        return model.to(param.device, param.dtype).eval()


@dataclass(frozen=True)
class MTPHead:
    """An MTP/EAGLE-style head trained for this target (`specfx train mtp`), drafting from the
    target's own hidden states.

    `path` is a head checkpoint folder or a zoo name; None means the model's default head
    (`config.specfx_mtp_head`, set for the zoo's `pycoder`).
    """

    path: str | Path | None = None
    layout: str | None = None        # None: found from the folder (specfx, eagle, eagle3, deepseek-mtp)
    tree: tuple[int, ...] | None = None    # candidates per depth of a spine tree (`runtime.tree.Tree.spine`)
    weights_dtype: str | None = None       # the head's weights for drafting (see `head_weights`)
    name = "mtp"

    def __post_init__(self):
        from specfx.heads import LAYOUTS

        _check_weights(self)
        if self.path is not None and not isinstance(self.path, (str, Path)):
            raise TypeError(f"MTPHead(path): expected a head folder or zoo name, got {type(self.path).__name__}")
        if self.layout is not None and self.layout not in LAYOUTS:
            raise ValueError(f"MTPHead(layout={self.layout!r}): expected one of {', '.join(LAYOUTS)}")
        _check_tree(self)

    def __str__(self) -> str:
        return ("mtp" if self.path is None else f"mtp:{self.path}") + _tree_suffix(self.tree) + _weights_suffix(self)

    def head_weights(self, target, tiled: bool):
        """The dtype the head's weights (and its copy of the target's lm_head) are stored in for
        drafting, None for the target's own. Drafts only propose (verification keeps the output
        the target's), so they may read fewer bytes: `weights_dtype` "int8" (each row's integers
        times its scale, `mtp.StoredLinear`, multiplied by rows quantized to int8 too) or
        "bfloat16", widened as they are read; "target"
        keeps the target's. None takes int8 where `tiled` (the few-row kernel, which reads int8
        as it is, runs the head: the CPU with a float32 target) and the target's elsewhere.

        On pycoder (2-core CPU, 8 prompts x 128 tokens, alternating rounds,
        `benchmarks/cpu/interleaved_int8.json`) the MTP step took 2.087 ms in the generate loop
        with int8 head weights and 2.436 with the target's float32, against 1.475 for plain
        decoding; 3.15 tokens a call either way."""
        return _weights(self, target, tiled)

    def load(self, target):
        """The head module for `target` (refused if it was trained for another target)."""
        from specfx import zoo
        from specfx.heads import load_layout

        path = self.path if self.path is not None else default_mtp_head(target)
        p = Path(path)
        if not p.is_dir() and str(path) in zoo.names():
            p = zoo.path(str(path))
        return load_layout(p, target, self.layout)


DrafterConfig = NoDraft | EarlyExit | PromptLookup | DraftModel | MTPHead


def _check_tree(config) -> None:
    """A drafter's `tree`: candidates per depth, e.g. (4, 2, 2, 1) (see `Tree.spine`)."""
    tree = config.tree
    if tree is None:
        return
    if isinstance(tree, list):
        tree = tuple(tree)
        object.__setattr__(config, "tree", tree)       # frozen: the config stays hashable
    if not isinstance(tree, tuple) or not tree or any(not isinstance(b, int) or b < 1 for b in tree):
        raise ValueError(f"{type(config).__name__}(tree={tree!r}): expected candidates per depth, one or more "
                         "ints >= 1, e.g. (4, 2, 2, 1)")


def tree_name(tree: tuple[int, ...]) -> str:
    """"4x2x2x1" for (4, 2, 2, 1): how specs, the CLI and the sweep write a tree."""
    return "x".join(map(str, tree))


DRAFT_WEIGHTS = ("target", "bfloat16", "int8")    # a drafter's `weights_dtype`, None aside


def _check_weights(config) -> None:
    if config.weights_dtype not in (None, *DRAFT_WEIGHTS):
        raise ValueError(f"{type(config).__name__}(weights_dtype={config.weights_dtype!r}): expected None (int8 "
                         "where the tiled kernel drafts, else the target's) or one of "
                         + ", ".join(map(repr, DRAFT_WEIGHTS)))


def _weights_suffix(config) -> str:
    return "" if config.weights_dtype is None else f":weights={config.weights_dtype}"


def _weights(config, target, tiled: bool):
    """The torch dtype named by `config.weights_dtype` (None for "target"), or `draft_weights`'s
    default when it names none."""
    import torch

    if config.weights_dtype == "target":
        return None
    if config.weights_dtype is not None:
        return getattr(torch, config.weights_dtype)
    return draft_weights(target, tiled)


def draft_weights(target, tiled: bool):
    """The dtype a draft-only weight (an MTP head's, early exit's copy of its layers) is stored in by
    default: int8 where `tiled` (the few-row kernel runs the draft and reads int8 as it is: the CPU)
    and the target is float32, None (the target's own) elsewhere."""
    import torch

    return torch.int8 if tiled and next(target.parameters()).dtype == torch.float32 else None


def parse_tree(text: str) -> tuple[int, ...] | None:
    """(4, 2, 2, 1) from "4x2x2x1"; None when `text` is not of that form."""
    parts = text.strip().split("x")
    return tuple(int(p) for p in parts) if all(p.isdigit() for p in parts) else None


def _tree_suffix(tree) -> str:
    return "" if tree is None else ":tree=" + tree_name(tree)


def _split_last(spec: str, arg: str, key: str, example: str) -> tuple[str, str | None]:
    """("pycoder-mtp:tree=2x2", "bfloat16") from "pycoder-mtp:tree=2x2:weights=bfloat16" (key
    "weights="): an option that goes last, after a colon."""
    head, sep, value = arg.rpartition(key)
    if not sep:
        return arg, None
    if (head and not head.endswith(":")) or not value or ":" in value:
        raise ValueError(f"bad draft spec {spec!r}: {key}<value> goes last, after a colon, e.g. {example}")
    return head[:-1], value


def _split_tree(spec: str, arg: str) -> tuple[str, tuple[int, ...] | None]:
    """("pycoder-mtp", (4, 2, 2, 1)) from "pycoder-mtp:tree=4x2x2x1" (or "tree=4x2x2x1")."""
    head, sep, tree = arg.rpartition("tree=") if "tree=" in arg else (arg, "", "")
    if not sep:
        return arg, None
    if head and not head.endswith(":"):
        raise ValueError(f"bad draft spec {spec!r}: the tree goes last, after a colon, e.g. mtp:pycoder-mtp:tree=4x2x2x1")
    shape = parse_tree(tree)
    if shape is None:
        raise ValueError(f"bad draft spec {spec!r}: expected tree=<candidates per depth>, e.g. tree=4x2x2x1")
    return head[:-1], shape


def parse_draft(spec) -> DrafterConfig:
    """A drafter config from a config object, a string such as "early-exit:4", or None."""
    if spec is None:
        return NoDraft()
    if isinstance(spec, DrafterConfig):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"draft must be a drafter config or a string, got {type(spec).__name__}")
    name, _, arg = spec.strip().partition(":")
    if name == "none" and not arg:
        return NoDraft()
    if name == "early-exit":
        arg, weights = _split_last(spec, arg, "weights=", "early-exit:3:tree=2x2x1:weights=int8")
        arg, tree = _split_tree(spec, arg)
        if arg and not arg.isdigit():
            raise ValueError(f"bad draft spec {spec!r}: expected early-exit:<layer>, e.g. early-exit:4")
        return EarlyExit(layer=int(arg) if arg else None, weights_dtype=weights, tree=tree)
    if name == "ngram":
        if arg and not arg.lstrip("-").isdigit():
            raise ValueError(f"bad draft spec {spec!r}: expected ngram:<n>, e.g. ngram:3")
        return PromptLookup(ngram=int(arg)) if arg else PromptLookup()
    if name == "mtp":
        arg, weights = _split_last(spec, arg, "weights=", "mtp:pycoder-mtp:tree=4x2x2x1:weights=bfloat16")
        arg, tree = _split_tree(spec, arg)
        return MTPHead(arg or None, tree=tree, weights_dtype=weights)
    if name == "draft-model":
        arg, tree = _split_tree(spec, arg)
        if not arg:
            raise ValueError(f"bad draft spec {spec!r}: expected draft-model:<zoo name or checkpoint path>")
        return DraftModel(arg, tree=tree)
    raise ValueError(f"unknown draft spec {spec!r}; expected one of: none, early-exit, early-exit:<layer>, "
                     "ngram, ngram:<n>, draft-model:<path>, mtp, mtp:<path>")


def default_exit_layer(model) -> int:
    """The model's default exit layer.

    A model can name its own (`config.specfx_exit_layer`, set for the zoo models by the
    `specfx bench --sweep-exit` sweep). Otherwise a quarter of the depth, at least 1: LayerSkip
    reports the sweet spot for self-speculation early in the stack, where the draft is cheap.
    """
    config = model.config
    chosen = getattr(config, "specfx_exit_layer", None)
    if chosen:
        return int(chosen)
    return max(1, config.num_hidden_layers // 4)


def default_mtp_head(model) -> str:
    """The model's own MTP head (`config.specfx_mtp_head`: a zoo name or a folder)."""
    head = getattr(model.config, "specfx_mtp_head", None)
    if not head:
        raise ValueError("this model names no default MTP head (config.specfx_mtp_head); "
                         "pass one: MTPHead('path/to/head') or draft='mtp:PATH' (train one with `specfx train mtp`)")
    return str(head)


def default_num_speculative_tokens(model, fallback: int, drafter=None) -> int:
    """The model's k for `drafter`, else `fallback`: early exit's own from the exit-layer sweep
    (`config.specfx_exit_num_speculative_tokens`, with `specfx_exit_layer`), otherwise the
    model's (`config.specfx_num_speculative_tokens`)."""
    config = model.config
    if isinstance(drafter, EarlyExit) and getattr(config, "specfx_exit_num_speculative_tokens", None):
        return int(config.specfx_exit_num_speculative_tokens)
    return int(getattr(config, "specfx_num_speculative_tokens", None) or fallback)


def check_same_tokenizer(target, draft) -> None:
    """Refuse a draft whose tokenizer is not the target's (vocab sizes may differ by padding).

    Compares the tokenizers saved with both checkpoints where they can be found, and the
    special token ids of both configs.
    """
    tc, dc = target.config, draft.config
    for attr in ("bos_token_id", "eos_token_id"):
        a, b = getattr(tc, attr, None), getattr(dc, attr, None)
        if a is not None and b is not None and a != b:
            raise ValueError(f"draft model has a different tokenizer: {attr} is {b} in the draft, {a} in the target")
    t_tok, d_tok = _tokenizer_of(tc), _tokenizer_of(dc)
    if t_tok is None or d_tok is None:
        return
    t_vocab, d_vocab = t_tok.get_vocab(), d_tok.get_vocab()
    if t_vocab == d_vocab:
        return
    t_inv = {i: t for t, i in t_vocab.items()}
    d_inv = {i: t for t, i in d_vocab.items()}
    for i in range(min(len(t_inv), len(d_inv))):
        if t_inv.get(i) != d_inv.get(i):
            raise ValueError(f"draft model has a different tokenizer: token id {i} is {d_inv.get(i)!r} in the "
                             f"draft and {t_inv.get(i)!r} in the target; use a draft trained with the target's tokenizer")


def _tokenizer_of(config):
    path = getattr(config, "_name_or_path", "") or ""
    if not path or not (Path(path) / "tokenizer.json").is_file() and not (Path(path) / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
