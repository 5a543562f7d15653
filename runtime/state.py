"""Static decoding state: every tensor the fused step reads or writes, allocated once.

Convention: `lengths[b]` counts the tokens of row b known so far (prompt + accepted); the last
of them is *pending*: it is in `tokens` but not yet in the KV cache. A step feeds it first.
Rejected drafts leave KV entries beyond the length; positions mask them, the next step
overwrites them.

One caller at a time: the state is shared by every call on a compiled model, so `generate`
holds `state.lock` (a `CallerLock`) for the whole call; concurrent callers wait their turn.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields

import torch

MAX_EOS_IDS = 8
STEP_INPUTS = ("tokens", "lengths", "max_lens", "done", "eos", "accept_hist",
               "uniforms", "noise", "temperature", "top_k", "top_p", "span")


@dataclass(frozen=True)
class KVLayout:
    """The state's KV list as named groups in order, e.g. `(("target", 24), ("head", 2),
    ("history", 1))`: which buffers belong to whom, written once for a drafter and read by its
    builder, its step and the runtime (each graph takes its groups as its last inputs)."""

    groups: tuple[tuple[str, int], ...]

    def __len__(self) -> int:
        return sum(n for _, n in self.groups)

    def slice(self, *names: str) -> slice:
        """The span of `names`, which must be adjacent groups in this order (none: empty)."""
        if not names:
            return slice(0, 0)
        starts, at = {}, 0
        for name, n in self.groups:
            starts[name], at = (at, at + n), at + n
        missing = [n for n in names if n not in starts]
        if missing:
            raise KeyError(f"no KV group {missing} in {[g for g, _ in self.groups]}")
        spans = [starts[n] for n in names]
        if any(a[1] != b[0] for a, b in zip(spans, spans[1:])):
            raise ValueError(f"KV groups {names} are not adjacent in {[g for g, _ in self.groups]}")
        return slice(spans[0][0], spans[-1][1])

    def take(self, kv, *names: str) -> list:
        """The buffers of `names` from `kv` (a list, or a traced step's list input)."""
        s = self.slice(*names)
        return [kv[i] for i in range(s.start, s.stop)]


class CallerLock:
    """A lock for the static state: other threads wait; the holding thread calling again is
    refused (a streamer calling `generate` would overwrite the state its caller is using)."""

    def __init__(self):
        self._lock, self._owner = threading.Lock(), None

    def __enter__(self) -> CallerLock:
        if self._owner == threading.get_ident():
            raise RuntimeError("generate was called from inside a generate call on the same model (a "
                               "streamer?): the static state is in use; call it after this call returns")
        self._lock.acquire()
        self._owner = threading.get_ident()
        return self

    def __exit__(self, *exc) -> None:
        self._owner = None
        self._lock.release()

    def __deepcopy__(self, memo) -> CallerLock:
        return CallerLock()                   # a copied model has a state (and a lock) of its own


@dataclass
class StaticState:
    tokens: torch.Tensor       # [B, S] long
    lengths: torch.Tensor      # [B] long
    max_lens: torch.Tensor     # [B] long: prompt + max_new_tokens
    done: torch.Tensor         # [B] bool
    eos: torch.Tensor          # [MAX_EOS_IDS] long, end-of-sequence ids, -1 padded
    accept_hist: torch.Tensor  # [k+1] long: steps (per active row) that accepted n drafts
    uniforms: torch.Tensor     # [B, N] float: acceptance draws, one per draft node (sampling)
    noise: torch.Tensor        # [B, k+1, V] float: Exp(1) draws for the exponential race (sampling)
    temperature: torch.Tensor  # [1] float
    top_k: torch.Tensor        # [1] long, 0: off
    top_p: torch.Tensor        # [1] float, 1: off
    spans: torch.Tensor        # [S] uint8: `span` is a view of its first L entries
    kv: list[torch.Tensor]     # per layer: key, value [B, H, S + 1, D]
    generator: torch.Generator | None = None
    span: torch.Tensor | None = None   # [L]: attention reads slots 0..L-1 (only its length matters)
    lock: CallerLock = field(default_factory=CallerLock, repr=False, compare=False)

    @classmethod
    def allocate(cls, *, batch_size: int, seq_len: int, k: int, vocab_size: int,
                 kv: list[torch.Tensor], device, nodes: int | None = None) -> StaticState:
        """State for steps of at most k drafts accepted (the tree's depth) over `nodes` draft
        nodes (default k: a chain)."""
        z = lambda *s, dt=torch.long: torch.zeros(s, dtype=dt, device=device)  # noqa: E731
        return cls(
            tokens=z(batch_size, seq_len), lengths=z(batch_size), max_lens=z(batch_size),
            done=z(batch_size, dt=torch.bool), eos=torch.full((MAX_EOS_IDS,), -1, dtype=torch.long, device=device),
            accept_hist=z(k + 1), uniforms=z(batch_size, k if nodes is None else nodes, dt=torch.float32),
            noise=torch.ones(batch_size, k + 1, vocab_size, device=device),
            temperature=torch.ones(1, device=device), top_k=z(1), top_p=torch.ones(1, device=device),
            spans=z(seq_len, dt=torch.uint8), kv=kv,
            generator=None if torch.device(device).type == "meta" else torch.Generator(device=device),
        )

    def __post_init__(self):
        if self.span is None:
            self.span = self.spans

    def set_span(self, length: int) -> None:
        """Attention reads cache slots 0..length-1 (clamped to the cache) until the next call.

        The caller guarantees that no query of the steps it runs before then sits at a position
        >= length; the runtime sets it at its sync points, where it knows every row's length."""
        length = max(2, min(int(length), self.seq_len))
        if length != self.span.shape[0]:
            self.span = self.spans[:length]

    def step_args(self) -> tuple:
        """Arguments of the fused step, in its signature's order."""
        return tuple(getattr(self, name) for name in STEP_INPUTS) + (self.kv,)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("kv", "generator", "span", "lock")}
        out.update({f"kv_{i}": t for i, t in enumerate(self.kv)})
        return out

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def load_prompts(self, prompts: list[torch.Tensor], max_new_tokens: int, eos_ids: list[int]) -> None:
        """Reset for a new batch of prompts (1-D LongTensors); rows past len(prompts) start done.

        Everything goes to the device as whole host tensors in non-blocking copies (a blocking
        copy is a sync that `set_sync_debug_mode("error")` flags); a copy from pageable memory
        returns once the driver has staged the data, so the host tensors may be freed at once.
        """
        self.tokens.zero_()
        self.accept_hist.zero_()
        for b, p in enumerate(prompts):
            self.tokens[b, : p.numel()].copy_(p, non_blocking=True)
        idle = self.batch_size - len(prompts)                 # rows without a prompt: length 1, done
        lengths = [p.numel() for p in prompts]
        self.lengths.copy_(torch.tensor(lengths + [1] * idle), non_blocking=True)
        self.max_lens.copy_(torch.tensor([n + max_new_tokens for n in lengths] + [1] * idle), non_blocking=True)
        self.done.copy_(torch.tensor([False] * len(prompts) + [True] * idle), non_blocking=True)
        self.set_sampling(1.0, 0, 1.0, None)
        if len(eos_ids) > MAX_EOS_IDS:
            raise ValueError(f"at most {MAX_EOS_IDS} EOS token ids are supported, got {len(eos_ids)}")
        # Written in place: a captured CUDA graph reads these addresses.
        self.eos.copy_(torch.tensor(list(eos_ids) + [-1] * (MAX_EOS_IDS - len(eos_ids))), non_blocking=True)

    def set_sampling(self, temperature: float, top_k: int, top_p: float, seed: int | None) -> None:
        """Sampling settings (device tensors, so the compiled step is reused) and the RNG seed."""
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {top_k}")
        self.temperature.fill_(temperature)
        self.top_k.fill_(top_k)
        self.top_p.fill_(top_p)
        if self.generator is None:          # `meta` has no generator
            return
        # Only this state's generator: torch.seed() would reseed the process's global RNG.
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)

    def draw(self) -> None:
        """Fresh random numbers for one sampling step, from this state's generator (no sync)."""
        self.uniforms.uniform_(generator=self.generator)
        self.noise.exponential_(generator=self.generator).clamp_(min=1e-30)
