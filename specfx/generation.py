"""`generate` around a `Runtime`: argument checks, generation defaults, the output tensor.

- `GenerationDefaults`: EOS/pad ids and configured sampling settings, read from a model
  (`from_model`) or from an artifact's manifest (`from_dict`), so a loaded artifact generates
  exactly like the model it came from without the model's code.
- `generate(runtime, defaults, shape, input_ids, ...)`: the body of `SpeculativeModel.generate`
  and `LoadedModel.generate`: checks the inputs against the static shapes, runs the runtime,
  and pads the new tokens into a `[B, prompt + new]` tensor like `model.generate`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from specfx.runtime.stats import GenerationStats


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
        """Sampling settings: the arguments, else the configured values, else the neutral ones."""
        pick = lambda value, configured, neutral: value if value is not None else (  # noqa: E731
            neutral if configured is None else configured)
        return dict(temperature=float(pick(temperature, self.temperature, 1.0)),
                    top_k=int(pick(top_k, self.top_k, 0) or 0), top_p=float(pick(top_p, self.top_p, 1.0)),
                    seed=seed)


@dataclass(frozen=True)
class StaticShape:
    """The batch and length a runtime was built for, and how its user gets bigger ones."""

    batch_size: int
    max_seq_len: int
    built: str = "compiled"              # how the error messages name where the shape came from
    remedy: str = "compile"


def generate(runtime, defaults: GenerationDefaults, shape: StaticShape, input_ids: torch.Tensor,
             attention_mask: torch.Tensor | None = None, *, max_new_tokens: int = 64, do_sample: bool = False,
             temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
             seed: int | None = None, eos_token_id=None, pad_token_id: int | None = None,
             streamer=None) -> tuple[torch.Tensor, GenerationStats]:
    """(`[B, prompt + new]` tokens, stats): `SpeculativeModel.generate`'s semantics."""
    sampling = defaults.sampling(temperature, top_k, top_p, seed) if do_sample else None
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    prompts = check_inputs(shape, input_ids, attention_mask, max_new_tokens, streamer)
    eos = defaults.eos_ids(eos_token_id)
    pad = pad_token_id if pad_token_id is not None else defaults.pad_id(eos)
    if streamer is not None:
        streamer.put(input_ids[0].cpu())
    rows, stats = runtime.generate(prompts, max_new_tokens, eos, streamer, sampling)
    width = max(len(r) for r in rows)
    new = torch.full((len(rows), width), pad, dtype=torch.long)
    for b, r in enumerate(rows):
        new[b, : len(r)] = torch.tensor(r, dtype=torch.long)
    return torch.cat([input_ids.cpu(), new], 1).to(input_ids.device), stats


def check_inputs(shape: StaticShape, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 max_new_tokens: int, streamer) -> list[torch.Tensor]:
    """Each row's prompt tokens, after checking that the request fits the static shapes."""
    B = input_ids.shape[0]
    if B > shape.batch_size:
        raise ValueError(f"batch of {B} is larger than the {shape.built} batch_size={shape.batch_size}; "
                         f"{shape.remedy} with batch_size>={B}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    prompts = rows(input_ids, attention_mask)
    if min(p.numel() for p in prompts) < 1:
        raise ValueError("every row needs at least one prompt token")
    longest = max(p.numel() for p in prompts)
    if longest + max_new_tokens > shape.max_seq_len:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_seq_len={shape.max_seq_len}; {shape.remedy} with a larger max_seq_len")
    if streamer is not None and B != 1:
        raise ValueError("streaming supports batch size 1 only")
    return prompts


def rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Each row's real tokens (padding dropped, left or right)."""
    if attention_mask is None:
        return [row for row in input_ids.cpu()]
    mask = attention_mask.cpu().bool()
    return [row[m] for row, m in zip(input_ids.cpu(), mask)]


def _ids(eos) -> tuple[int, ...]:
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)
