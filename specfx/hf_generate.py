"""transformers' front door: `model.generate(ids, custom_generate=specfx.generate_with(...))`.

- `generate_with(draft=..., num_speculative_tokens=..., max_seq_len=..., backend=..., **compile_kwargs)`
  returns a `SpecGenerate`, a callable for the callable form of transformers' `custom_generate`.
  transformers' `generate` resolves the call's arguments and the generation_config, prepares
  the attention mask, the logits processors and the stopping criteria, streams the prompt, and
  then calls it in place of its own decoding loop:
  `fn(model, input_ids, logits_processor=..., stopping_criteria=..., generation_config=..., **model_kwargs)`.
- The callable compiles the model once per settings (`SpeculativeModel`) and keeps the compiled
  model on the model object, so it lives as long as the model and no longer; the next call
  with the same settings reuses it.
- It maps what transformers prepared onto `SpeculativeModel.generate`: the length from
  `MaxLengthCriteria` (so `max_new_tokens` and `max_length` mean what they mean there), EOS ids
  from `EosTokenCriteria`, the pad id, greedy or sampling with the temperature / top-k / top-p
  warpers (seeded from torch's global generator, so `torch.manual_seed` makes a run
  reproducible), the attention mask and the streamer.
- Whatever else would change the output is refused (`UnsupportedGeneration`, naming it): other
  logits processors and stopping criteria, beams, several sequences per prompt, assisted
  generation, dict outputs and scores, a filled cache, model inputs other than the ids.

Written against transformers 5.x (`transformers/generation/utils.py`, `GenerationMixin.generate`).
To support one more feature, map it in `_plan` and drop it from the refusals.
"""

from __future__ import annotations

import inspect
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from specfx.api import SpeculativeModel
from specfx.drafters import DraftModel, parse_draft


class UnsupportedGeneration(ValueError):
    """A generation feature that specfx's fused step cannot run exactly."""


# Settings of `SpeculativeModel` that `generate_with` passes through as `compile_kwargs`.
COMPILE_KWARGS = ("batch_size", "sync_every", "warmup", "cudagraphs", "skinny_matmul")

# Where transformers' own processors and criteria come from, for the error messages.
_SOURCES = {
    "RepetitionPenaltyLogitsProcessor": "repetition_penalty",
    "EncoderRepetitionPenaltyLogitsProcessor": "encoder_repetition_penalty",
    "NoRepeatNGramLogitsProcessor": "no_repeat_ngram_size",
    "NoBadWordsLogitsProcessor": "bad_words_ids",
    "SequenceBiasLogitsProcessor": "sequence_bias",
    "MinLengthLogitsProcessor": "min_length",
    "MinNewTokensLengthLogitsProcessor": "min_new_tokens",
    "PrefixConstrainedLogitsProcessor": "prefix_allowed_tokens_fn",
    "ForcedBOSTokenLogitsProcessor": "forced_bos_token_id",
    "ForcedEOSTokenLogitsProcessor": "forced_eos_token_id",
    "InfNanRemoveLogitsProcessor": "remove_invalid_values",
    "ExponentialDecayLengthPenalty": "exponential_decay_length_penalty",
    "SuppressTokensLogitsProcessor": "suppress_tokens",
    "SuppressTokensAtBeginLogitsProcessor": "begin_suppress_tokens",
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "guidance_scale",
    "TopHLogitsWarper": "top_h",
    "MinPLogitsWarper": "min_p",
    "TypicalLogitsWarper": "typical_p",
    "EpsilonLogitsWarper": "epsilon_cutoff",
    "EtaLogitsWarper": "eta_cutoff",
    "LogitNormalization": "renormalize_logits",
    "MaxTimeCriteria": "max_time",
    "StopStringCriteria": "stop_strings",
    "ConfidenceCriteria": "assistant_confidence_threshold",
}
# Output options of generate that a plain tensor of tokens cannot carry.
_OUTPUTS = ("return_dict_in_generate", "output_scores", "output_logits", "output_attentions",
            "output_hidden_states")
# Model inputs that transformers' generate adds itself; anything else is refused.
_MODEL_KWARGS = ("attention_mask", "position_ids", "use_cache", "logits_to_keep", "cache", "past_key_values")

_compile_lock = threading.Lock()      # two first calls on one model compile once


def generate_with(draft=None, num_speculative_tokens: int | None = None, max_seq_len: int = 2048,
                  backend: str = "inductor", **compile_kwargs) -> SpecGenerate:
    """A `custom_generate` callable that runs `model.generate` through specfx:

        model.generate(ids, custom_generate=specfx.generate_with(draft="mtp"), max_new_tokens=64)

    The arguments are `specfx.compile`'s (`batch_size`, `sync_every`, `warmup`, `cudagraphs`,
    `skinny_matmul` as `compile_kwargs`); the model is compiled at the first call and reused by
    every later call with the same settings.
    """
    unknown = sorted(set(compile_kwargs) - set(COMPILE_KWARGS))
    if unknown:
        raise TypeError(f"generate_with() got unknown arguments {unknown}; it takes draft, "
                        f"num_speculative_tokens, max_seq_len, backend and {', '.join(COMPILE_KWARGS)}")
    settings = tuple(sorted(compile_kwargs.items()))
    try:
        hash(settings)
    except TypeError:
        raise TypeError(f"generate_with() arguments must be hashable (they key the compiled model); "
                        f"got {compile_kwargs}") from None
    return SpecGenerate(parse_draft(draft), num_speculative_tokens, max_seq_len, backend, settings)


@dataclass(frozen=True)
class SpecGenerate:
    """transformers' `custom_generate` callable running specfx's fused speculative step."""

    draft: object
    num_speculative_tokens: int | None
    max_seq_len: int
    backend: str
    compile_kwargs: tuple[tuple[str, object], ...]

    def compiled(self, model) -> SpeculativeModel:
        """The `SpeculativeModel` for `model` with these settings, compiled at the first call."""
        param = next(model.parameters())
        key = (_draft_key(self.draft), self.num_speculative_tokens, self.max_seq_len, self.backend,
               self.compile_kwargs, param.device, param.dtype)
        with _compile_lock:
            cache = model.__dict__.setdefault("_specfx_compiled", _CompiledModels())
            if key not in cache:
                cache[key] = SpeculativeModel(model, draft=self.draft,
                                              num_speculative_tokens=self.num_speculative_tokens,
                                              max_seq_len=self.max_seq_len, backend=self.backend,
                                              **dict(self.compile_kwargs))
            return cache[key]

    def __call__(self, model, input_ids, logits_processor, stopping_criteria, generation_config,
                 synced_gpus: bool = False, streamer=None, **model_kwargs) -> torch.Tensor:
        """Called by transformers' `generate` (see the module docstring); returns its tensor."""
        held = _held_by_generate()
        streamer = streamer if streamer is not None else held.get("streamer")
        plan = _plan(input_ids, list(logits_processor), list(stopping_criteria), generation_config,
                     model_kwargs, held.get("assistant_model"), synced_gpus or held.get("synced_gpus"))
        return self.compiled(model).generate(input_ids, model_kwargs.get("attention_mask"), streamer=streamer,
                                             stream_prompt=False, **plan)


class _CompiledModels(dict):
    """A model's `SpeculativeModel`s by settings; a copy of the model starts without any."""

    def __deepcopy__(self, memo):
        return type(self)()

    def __reduce__(self):
        return type(self), ()


def _draft_key(draft):
    """The drafter as a cache key: equal configs compile once (a `DraftModel` by its model)."""
    if isinstance(draft, DraftModel):
        return DraftModel, str(draft.model) if isinstance(draft.model, Path) else draft.model
    return draft


def _held_by_generate() -> dict:
    """`streamer`, `assistant_model` and `synced_gpus` as transformers' `generate` holds them.

    transformers 5.x does not pass them to a callable `custom_generate` (its
    `_extract_generation_mode_kwargs` replaces them with the callable's own extra keys), though
    it has already streamed the prompt; they are still locals of `generate`, the frame that
    called `SpecGenerate.__call__`. Called from anywhere else, there are none.
    """
    from transformers import GenerationMixin

    frame = sys._getframe(2)
    if frame.f_code is not inspect.unwrap(GenerationMixin.generate).__code__:
        return {}
    return {k: frame.f_locals.get(k) for k in ("streamer", "assistant_model", "synced_gpus")}


def _plan(input_ids, processors, criteria, config, model_kwargs, assistant_model, synced_gpus) -> dict:
    """`SpeculativeModel.generate`'s arguments for this call; `UnsupportedGeneration` listing
    everything it cannot run exactly."""
    from transformers.generation import EosTokenCriteria, MaxLengthCriteria

    refused = _refused_settings(config, assistant_model, synced_gpus)
    refused += _refused_model_kwargs(input_ids, model_kwargs)
    sampling, why = _sampling(processors, config)
    refused += why
    lengths = [c.max_length for c in criteria if type(c) is MaxLengthCriteria]
    eos = [i for c in criteria if type(c) is EosTokenCriteria
           for i in torch.as_tensor(c.eos_token_id).flatten().tolist()]
    refused += [f"stopping criterion {_origin(c, config, 'stopping_criteria')}"
                for c in criteria if type(c) not in (MaxLengthCriteria, EosTokenCriteria)]
    if not lengths:
        refused.append("no MaxLengthCriteria: set max_new_tokens")
    if refused:
        raise UnsupportedGeneration(
            "specfx.generate_with cannot run these generation settings exactly inside its fused step: "
            + "; ".join(refused) + ". Drop them, or call generate without custom_generate.")
    max_new_tokens = min(lengths) - input_ids.shape[1]
    if max_new_tokens < 1:
        raise ValueError(f"max_length={min(lengths)} leaves no room for new tokens after the "
                         f"{input_ids.shape[1]}-token input; set max_new_tokens instead")
    # transformers pads with the first EOS id where no pad id is set
    pad = config.pad_token_id if config.pad_token_id is not None else (eos[0] if eos else None)
    return dict(max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad, **sampling)


def _refused_settings(config, assistant_model, synced_gpus) -> list[str]:
    """generation_config settings (and generate arguments) that are no logits processor."""
    from transformers.generation.configuration_utils import GenerationMode

    refused = []
    mode = config.get_generation_mode(assistant_model)
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE):
        why = {GenerationMode.ASSISTED_GENERATION: "assistant_model, prompt_lookup_num_tokens or "
                                                   "assistant_early_exit; specfx drafts itself: choose the "
                                                   "drafter with generate_with(draft=...)",
               GenerationMode.CONTRASTIVE_SEARCH: "penalty_alpha",
               GenerationMode.DOLA_GENERATION: "dola_layers"}.get(mode, f"num_beams={config.num_beams}")
        refused.append(f"{mode.value.replace('_', ' ')} (from {why})")
    if (config.num_return_sequences or 1) > 1:
        refused.append(f"num_return_sequences={config.num_return_sequences}")
    refused += [f"{name}=True" for name in _OUTPUTS if getattr(config, name, False)]
    if synced_gpus:
        refused.append("synced_gpus=True")
    return refused


def _refused_model_kwargs(input_ids, model_kwargs) -> list[str]:
    """Model inputs beyond the ids and their mask, a cache that already holds tokens, and
    position ids other than the ones generate derives from the mask."""
    refused = [f"model input {name!r}" for name in sorted(model_kwargs) if name not in _MODEL_KWARGS]
    for name in ("cache", "past_key_values"):
        cache = model_kwargs.get(name)
        if cache is not None and cache.get_seq_length() > 0:
            refused.append(f"{name} holding {cache.get_seq_length()} tokens (specfx starts from the prompt)")
    positions = model_kwargs.get("position_ids")
    if positions is not None:
        mask = model_kwargs.get("attention_mask")
        if mask is None:
            expected = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        else:
            expected = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
        if positions.shape[-1] != input_ids.shape[1] or not (positions == expected).all():
            refused.append("position_ids other than the attention mask's (specfx numbers each row's tokens from 0)")
    return refused


def _origin(obj, config, argument: str) -> str:
    """A processor's or criterion's class and the setting that made it, for an error message."""
    source = _SOURCES.get(type(obj).__name__)
    if source is None or not hasattr(config, source):
        return f"{type(obj).__name__} (from {source or argument})"
    return f"{type(obj).__name__} (from {source}={getattr(config, source)!r})"


def _sampling(processors, config) -> tuple[dict, list[str]]:
    """(the sampling arguments, refusals): the temperature, top-k and top-p warpers, in
    transformers' order, are the only processors the step runs; greedy decoding takes none."""
    from transformers.generation import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    # Each warper keeps its setting under the name of the generate argument, in this order.
    order = {TemperatureLogitsWarper: "temperature", TopKLogitsWarper: "top_k", TopPLogitsWarper: "top_p"}
    names, settings, refused = list(order.values()), {}, []
    for p in processors:
        name = order.get(type(p))
        if name is None or not config.do_sample:
            refused.append(f"logits processor {_origin(p, config, 'logits_processor')}")
        elif any(names.index(name) <= names.index(seen) for seen in settings):
            refused.append(f"logits processor {type(p).__name__} after another of its kind or out of the "
                           "order temperature, top-k, top-p")
        elif name != "temperature" and (p.filter_value != -float("inf") or p.min_tokens_to_keep != 1
                                        and name == "top_p"):   # top-k folds min_tokens_to_keep into k
            refused.append(f"{type(p).__name__}(filter_value={p.filter_value}, "
                           f"min_tokens_to_keep={p.min_tokens_to_keep})")
        else:
            settings[name] = getattr(p, name)
    if not config.do_sample:
        return dict(do_sample=False), refused
    # The step draws from its own generator; seed it from torch's, which transformers samples from.
    seed = int(torch.randint(0, 2**62, ()).item())
    return dict(do_sample=True, temperature=float(settings.get("temperature", 1.0)),
                top_k=int(settings.get("top_k", 0)), top_p=float(settings.get("top_p", 1.0)), seed=seed), refused
