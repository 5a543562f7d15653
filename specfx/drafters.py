"""Drafter configurations: validated dataclasses, and the string forms the CLI accepts.

`parse_draft("early-exit:4")` -> `EarlyExit(layer=4)`; `"ngram:3"` -> `PromptLookup(ngram=3)`;
`"none"` or None -> `NoDraft()`.
The transform for each config lives in `specfx.pipeline`, registered by config type.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NoDraft:
    """Plain static decoding, compiled: the no-speculation baseline."""

    name = "none"

    def __str__(self) -> str:
        return "none"


@dataclass(frozen=True)
class EarlyExit:
    """LayerSkip self-speculation: draft with the first `layer` layers and the shared head.

    `layer=None` means the model's default exit layer (see `default_exit_layer`).
    """

    layer: int | None = None
    name = "early-exit"

    def __post_init__(self):
        if self.layer is not None and (not isinstance(self.layer, int) or self.layer < 1):
            raise ValueError(f"EarlyExit(layer={self.layer!r}): the exit layer must be an int >= 1")

    def __str__(self) -> str:
        return "early-exit" if self.layer is None else f"early-exit:{self.layer}"


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


DrafterConfig = NoDraft | EarlyExit | PromptLookup


def parse_draft(spec) -> DrafterConfig:
    """A drafter config from a config object, a string such as "early-exit:4", or None."""
    if spec is None:
        return NoDraft()
    if isinstance(spec, (NoDraft, EarlyExit, PromptLookup)):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"draft must be a drafter config or a string, got {type(spec).__name__}")
    name, _, arg = spec.strip().partition(":")
    if name == "none" and not arg:
        return NoDraft()
    if name == "early-exit":
        if not arg:
            return EarlyExit()
        if not arg.isdigit():
            raise ValueError(f"bad draft spec {spec!r}: expected early-exit:<layer>, e.g. early-exit:4")
        return EarlyExit(layer=int(arg))
    if name == "ngram":
        if arg and not arg.lstrip("-").isdigit():
            raise ValueError(f"bad draft spec {spec!r}: expected ngram:<n>, e.g. ngram:3")
        return PromptLookup(ngram=int(arg)) if arg else PromptLookup()
    raise ValueError(f"unknown draft spec {spec!r}; expected one of: none, early-exit, early-exit:<layer>, "
                     "ngram, ngram:<n>")


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


def default_num_speculative_tokens(model, fallback: int) -> int:
    """k chosen by the sweep for this model (`config.specfx_num_speculative_tokens`), else `fallback`."""
    return int(getattr(model.config, "specfx_num_speculative_tokens", None) or fallback)
