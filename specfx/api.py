"""Public API: `specfx.compile` and the `SpeculativeModel` it returns.

    fast = specfx.compile(model, draft=specfx.EarlyExit(layer=4), num_speculative_tokens=4)
    out = fast.generate(input_ids, max_new_tokens=128)    # == model.generate(do_sample=False)
    print(fast.last_stats)

`specfx.compile(draft=...)` with no model returns a decorator. Shapes (batch, k, max_seq_len)
are fixed at compile time; with the Inductor backend the step is compiled (and warmed up) here,
and `compile_s` records how long that took, apart from any generate timing.
"""

from __future__ import annotations

import time

import torch

from specfx import pipeline
from specfx.drafters import default_num_speculative_tokens, parse_draft
from specfx.runtime.generate import Runtime
from specfx.runtime.stats import GenerationStats


class SpeculativeModel:
    """A model compiled for speculative decoding over static buffers."""

    def __init__(self, model, *, draft=None, num_speculative_tokens: int | None = None,
                 max_seq_len: int = 2048, batch_size: int = 1, backend: str = "inductor",
                 sync_every: int = 8, warmup: bool = True, cudagraphs="auto"):
        self.model = model.eval()
        k = num_speculative_tokens if num_speculative_tokens is not None else \
            default_num_speculative_tokens(model, 4)
        t0 = time.perf_counter()
        self.graphs = pipeline.build(model, parse_draft(draft), k=k, batch_size=batch_size,
                                     max_seq_len=max_seq_len)
        self.drafter = self.graphs.drafter
        self.runtime = Runtime(self.graphs, backend=backend, sync_every=sync_every, cudagraphs=cudagraphs)
        self.capture_s = time.perf_counter() - t0
        self.backend, self.batch_size, self.max_seq_len = backend, batch_size, max_seq_len
        self.last_stats: GenerationStats | None = None
        self.compile_s = 0.0
        if warmup and backend != "eager":
            t1 = time.perf_counter()
            self._warmup()
            self.compile_s = time.perf_counter() - t1

    @property
    def num_speculative_tokens(self) -> int:
        return self.graphs.k

    def _warmup(self) -> None:
        """Run prefill and two steps on a dummy prompt so compilation happens now."""
        prompt = torch.zeros(min(self.graphs.prefill_chunk + 1, self.max_seq_len - 2), dtype=torch.long)
        self.runtime.generate([prompt], max_new_tokens=2, eos_ids=[])

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int = 64, do_sample: bool = False, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 eos_token_id=None, pad_token_id: int | None = None, streamer=None,
                 **unsupported) -> torch.Tensor:
        """Generate; returns [B, prompt + new] like `model.generate`.

        Greedy by default (equal to `model.generate(do_sample=False)`). With `do_sample=True`
        it samples from the model's distribution after temperature/top-k/top-p (unset values
        come from the model's generation_config, as in transformers); speculative rejection
        sampling keeps that distribution exactly. `seed` makes a run reproducible.
        """
        if unsupported:
            raise TypeError(f"unsupported generate arguments: {sorted(unsupported)}")
        sampling = _sampling(self.model, temperature, top_k, top_p, seed) if do_sample else None
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        B, P = input_ids.shape
        if B > self.batch_size:
            raise ValueError(f"batch of {B} is larger than the compiled batch_size={self.batch_size}; "
                             f"compile with batch_size>={B}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        prompts = _rows(input_ids, attention_mask)
        longest = max(p.numel() for p in prompts)
        if min(p.numel() for p in prompts) < 1:
            raise ValueError("every row needs at least one prompt token")
        if longest + max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"max_seq_len={self.max_seq_len}; compile with a larger max_seq_len")
        if streamer is not None and B != 1:
            raise ValueError("streaming supports batch size 1 only")
        eos = _eos_ids(self.model, eos_token_id)
        pad = pad_token_id if pad_token_id is not None else _pad_id(self.model, eos)
        if streamer is not None:
            streamer.put(input_ids[0].cpu())
        rows, self.last_stats = self.runtime.generate(prompts, max_new_tokens, eos, streamer, sampling)
        width = max(len(r) for r in rows)
        new = torch.full((B, width), pad, dtype=torch.long)
        for b, r in enumerate(rows):
            new[b, : len(r)] = torch.tensor(r, dtype=torch.long)
        return torch.cat([input_ids.cpu(), new], 1).to(input_ids.device)

    def profile(self, repeats: int = 20) -> tuple[float, float]:
        """Time the draft and verify graphs apart (seconds per step); fills `last_stats`."""
        draft_s, verify_s = self.runtime.profile(repeats)
        if self.last_stats is not None:
            self.last_stats.draft_s, self.last_stats.verify_s = draft_s, verify_s
        return draft_s, verify_s

    def __repr__(self) -> str:
        return (f"SpeculativeModel(draft={self.drafter}, k={self.num_speculative_tokens}, "
                f"batch_size={self.batch_size}, max_seq_len={self.max_seq_len}, backend={self.backend!r})")


def compile(model=None, *, draft=None, num_speculative_tokens: int | None = None,
            max_seq_len: int = 2048, batch_size: int = 1, backend: str = "inductor",
            sync_every: int = 8, warmup: bool = True, cudagraphs="auto"):
    """Compile `model` for speculative decoding; with no model, return a decorator.

    `num_speculative_tokens=None` takes the model's tuned k (zoo models) or 4. With
    `warmup=False` compilation happens at the first `generate` instead of here. On CUDA the
    step is captured as one CUDA graph (`cudagraphs="auto"`; False turns it off).
    """
    kwargs = dict(draft=draft, num_speculative_tokens=num_speculative_tokens, max_seq_len=max_seq_len,
                  batch_size=batch_size, backend=backend, sync_every=sync_every, warmup=warmup,
                  cudagraphs=cudagraphs)
    if model is None:
        def decorator(fn_or_model):
            m = fn_or_model() if callable(fn_or_model) and not isinstance(fn_or_model, torch.nn.Module) \
                else fn_or_model
            return SpeculativeModel(m, **kwargs)
        return decorator
    return SpeculativeModel(model, **kwargs)


def _sampling(model, temperature, top_k, top_p, seed) -> dict:
    """Sampling settings, unset ones taken from the model's generation_config like transformers."""
    gen = getattr(model, "generation_config", None)

    def pick(value, name, default):
        configured = getattr(gen, name, None)
        return value if value is not None else (default if configured is None else configured)

    return dict(temperature=float(pick(temperature, "temperature", 1.0)), top_k=int(pick(top_k, "top_k", 0) or 0),
                top_p=float(pick(top_p, "top_p", 1.0)), seed=seed)


def _rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Each row's real tokens (padding dropped, left or right)."""
    if attention_mask is None:
        return [row for row in input_ids.cpu()]
    mask = attention_mask.cpu().bool()
    return [row[m] for row, m in zip(input_ids.cpu(), mask)]


def _eos_ids(model, eos_token_id) -> list[int]:
    if eos_token_id is None:
        gen = getattr(model, "generation_config", None)
        eos_token_id = getattr(gen, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(model.config, "eos_token_id", None)
    if eos_token_id is None:
        return []
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(e) for e in eos_token_id]


def _pad_id(model, eos: list[int]) -> int:
    gen = getattr(model, "generation_config", None)
    pad = getattr(gen, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.config, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    return int(pad)
