"""`generate` around a `Runtime`: argument checks, generation defaults, the output tensor.

- `GenerationDefaults`: EOS/pad ids and configured sampling settings, read from a model
  (`from_model`) or from an artifact's manifest (`from_dict`), so a loaded artifact generates
  exactly like the model it came from without the model's code.
- `generate(runtime, defaults, shape, input_ids, ...)`: the body of `SpeculativeModel.generate`
  and `LoadedModel.generate`: checks the arguments (types, shapes, ids in the vocabulary, the
  device) and that they fit the static shapes, once per call on the host; runs the runtime
  holding the state's lock (one caller at a time); pads the new tokens into a
  `[B, prompt + new]` tensor like `model.generate`.
"""

from __future__ import annotations

import operator
from dataclasses import asdict, dataclass

import torch

from specfx.runtime.stats import GenerationStats


# What transformers' `generate` samples with where neither the call nor the generation_config
# sets a value (`GenerationConfig._get_default_generation_params`): top-k 50, not off.
UNSET_SAMPLING = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}


@dataclass(frozen=True)
class GenerationDefaults:
    """What `generate` falls back to when an argument is unset (as transformers does)."""

    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None      # None: the first EOS id, else 0
    temperature: float | None = None     # None: not configured (1.0)
    top_k: int | None = None             # None: not configured (off)
    top_p: float | None = None           # None: not configured (1.0)

    @classmethod
    def from_model(cls, model) -> GenerationDefaults:
        """The generation_config's values, then the model config's, like transformers."""
        gen, config = getattr(model, "generation_config", None), model.config
        eos = getattr(gen, "eos_token_id", None)
        if eos is None:
            eos = getattr(config, "eos_token_id", None)
        pad = getattr(gen, "pad_token_id", None)
        if pad is None:
            pad = getattr(config, "pad_token_id", None)
        return cls(eos_token_id=_ids(eos), pad_token_id=None if pad is None else int(pad),
                   temperature=getattr(gen, "temperature", None), top_k=getattr(gen, "top_k", None),
                   top_p=getattr(gen, "top_p", None))

    @classmethod
    def from_dict(cls, d: dict) -> GenerationDefaults:
        return cls(**{**d, "eos_token_id": tuple(d["eos_token_id"])})

    def to_dict(self) -> dict:
        return {**asdict(self), "eos_token_id": list(self.eos_token_id)}

    def eos_ids(self, eos_token_id=None) -> list[int]:
        return list(self.eos_token_id) if eos_token_id is None else list(_ids(eos_token_id))

    def pad_id(self, eos: list[int]) -> int:
        if self.pad_token_id is not None:
            return self.pad_token_id
        return eos[0] if eos else 0

    def sampling(self, temperature, top_k, top_p, seed) -> dict:
        """Sampling settings: the arguments, else the configured values, else transformers'
        own defaults (`UNSET_SAMPLING`), so `do_sample=True` alone samples as `model.generate` does."""
        pick = lambda value, configured, name: value if value is not None else (  # noqa: E731
            UNSET_SAMPLING[name] if configured is None else configured)
        return dict(temperature=float(pick(temperature, self.temperature, "temperature")),
                    top_k=int(pick(top_k, self.top_k, "top_k") or 0),
                    top_p=float(pick(top_p, self.top_p, "top_p")), seed=seed)


@dataclass(frozen=True)
class StaticShape:
    """What a runtime was built for (batch, length, vocabulary, device), and how its user gets
    bigger shapes."""

    batch_size: int
    max_seq_len: int
    vocab_size: int
    device: torch.device
    built: str = "compiled"              # how the error messages name where the shape came from
    remedy: str = "compile"


def generate(runtime, defaults: GenerationDefaults, shape: StaticShape, input_ids: torch.Tensor,
             attention_mask: torch.Tensor | None = None, *, max_new_tokens: int = 64, do_sample: bool = False,
             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, eos_token_id=None, pad_token_id: int | None = None,
             streamer=None, stream_prompt: bool = True) -> tuple[torch.Tensor, GenerationStats]:
    """(`[B, prompt + new]` tokens, stats): `SpeculativeModel.generate`'s semantics.

    The arguments are checked here, once per call on the host; then the call holds the state's
    lock, so concurrent calls on one model run one after another. `stream_prompt=False`: the
    streamer has had the prompt already (transformers' `generate` hands it over before it
    calls a `custom_generate`), so it gets only the new tokens.
    """
    prompts = check_inputs(shape, input_ids, attention_mask, max_new_tokens, streamer)
    eos = checked_ids("eos_token_id", defaults.eos_ids(eos_token_id), shape.vocab_size,
                      configured=eos_token_id is None)
    pad = pad_token_id if pad_token_id is not None else defaults.pad_id(eos)
    pad = checked_ids("pad_token_id", pad, shape.vocab_size, configured=pad_token_id is None)[0]
    sampling = defaults.sampling(temperature, top_k, top_p, seed) if do_sample else None
    with runtime.state.lock:
        if streamer is not None and stream_prompt:
            streamer.put(input_ids[0].cpu())
        rows, stats = runtime.generate(prompts, max_new_tokens, eos, streamer, sampling)
    width = max(len(r) for r in rows)
    new = torch.full((len(rows), width), pad, dtype=torch.long)
    for b, r in enumerate(rows):
        new[b, : len(r)] = torch.tensor(r, dtype=torch.long)
    return torch.cat([input_ids.cpu(), new], 1).to(input_ids.device), stats


def check_inputs(shape: StaticShape, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 max_new_tokens: int, streamer) -> list[torch.Tensor]:
    """Each row's prompt tokens, after checking the arguments and that they fit the static shapes."""
    check_ids_tensor(shape, input_ids, attention_mask)
    B = input_ids.shape[0]
    if B > shape.batch_size:
        raise ValueError(f"batch of {B} is larger than the {shape.built} batch_size={shape.batch_size}; "
                         f"{shape.remedy} with batch_size>={B}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise TypeError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompts = rows(input_ids, attention_mask)
    empty = [b for b, p in enumerate(prompts) if p.numel() < 1]
    if empty:
        raise ValueError(f"every row needs at least one prompt token; row {empty[0]} has none "
                         "(its attention_mask is all 0, or input_ids has no columns)")
    longest = max(p.numel() for p in prompts)
    if longest + max_new_tokens > shape.max_seq_len:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_seq_len={shape.max_seq_len}; {shape.remedy} with a larger max_seq_len")
    if streamer is not None and B != 1:
        raise ValueError("streaming supports batch size 1 only")
    return prompts


def check_ids_tensor(shape: StaticShape, input_ids, attention_mask) -> None:
    """input_ids: a 2-D tensor of integer ids in the vocabulary, on the model's device, where the
    mask is 1; attention_mask: None or 0/1 values of the same shape, on the same device."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}; "
                        "use the tokenizer's ids (torch.long)")
    if input_ids.dim() != 2 or input_ids.shape[0] < 1:
        raise ValueError(f"input_ids must be 2-D [batch, prompt_len] with at least one row, as model.generate "
                         f"takes it; got shape {tuple(input_ids.shape)} (one prompt: input_ids[None])")
    if input_ids.device != shape.device:
        raise ValueError(f"input_ids is on {input_ids.device}, the model on {shape.device}; "
                         f"move it there: input_ids.to({str(shape.device)!r})")
    keep = None
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask must be a torch.Tensor or None, got {type(attention_mask).__name__}")
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                             f"{tuple(input_ids.shape)}: they must be equal")
        if attention_mask.device != input_ids.device:
            raise ValueError(f"attention_mask is on {attention_mask.device}, input_ids on {input_ids.device}")
        keep = attention_mask.cpu()
        if not ((keep == 0) | (keep == 1)).all():
            bad = keep[(keep != 0) & (keep != 1)][0].item()
            raise ValueError(f"attention_mask must hold only 0 (padding) and 1 (prompt token), found {bad}")
        keep = keep.bool()
    ids = input_ids.cpu()
    outside = (ids < 0) | (ids >= shape.vocab_size)
    if keep is not None:
        outside &= keep                     # padding is dropped, whatever its id
    if outside.any():
        b, j = outside.nonzero()[0].tolist()
        raise ValueError(f"input_ids[{b}, {j}] = {ids[b, j].item()} is outside the vocabulary "
                         f"[0, {shape.vocab_size}) of the model")


def checked_ids(name: str, ids, vocab_size: int, *, configured: bool = False) -> list[int]:
    """`ids` (one id or a list of them) as ints, each in [0, vocab_size); else a clear error."""
    where = " (the model's configured value; pass it explicitly)" if configured else ""
    out = []
    for i in ids if isinstance(ids, (list, tuple)) else [ids]:
        try:
            if isinstance(i, bool):
                raise TypeError
            out.append(operator.index(i))
        except TypeError:
            raise TypeError(f"{name} must be an int or a list of ints, got {i!r}{where}") from None
        if not 0 <= out[-1] < vocab_size:
            raise ValueError(f"{name} {out[-1]} is outside the vocabulary [0, {vocab_size}) of the model{where}")
    return out


def rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Each row's real tokens: where the mask is 1, in order (left or right padding dropped)."""
    if attention_mask is None:
        return [row for row in input_ids.cpu()]
    mask = attention_mask.cpu().bool()
    return [row[m] for row, m in zip(input_ids.cpu(), mask)]


def _ids(eos) -> tuple:
    """An id or ids (int, list, tensor) as a tuple, unchecked (`checked_ids` checks them)."""
    if eos is None:
        return ()
    if isinstance(eos, torch.Tensor):
        eos = eos.tolist()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
