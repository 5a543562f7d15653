"""Static decoding state: every tensor the fused step reads or writes, allocated once.

Convention: `lengths[b]` counts the tokens of row b known so far (prompt + accepted); the last
of them is *pending*: it is in `tokens` but not yet in the KV cache. A step feeds it first.
Rejected drafts leave KV entries beyond the length; positions mask them, the next step
overwrites them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

STEP_INPUTS = ("tokens", "lengths", "max_lens", "done", "eos", "accept_hist")


@dataclass
class StaticState:
    tokens: torch.Tensor       # [B, S] long
    lengths: torch.Tensor      # [B] long
    max_lens: torch.Tensor     # [B] long: prompt + max_new_tokens
    done: torch.Tensor         # [B] bool
    eos: torch.Tensor          # [E] long, end-of-sequence ids (-1: none)
    accept_hist: torch.Tensor  # [k+1] long: steps (per active row) that accepted n drafts
    kv: list[torch.Tensor]     # per layer: key, value [B, H, S, D]

    @classmethod
    def allocate(cls, *, batch_size: int, seq_len: int, k: int, kv_shapes: list[tuple],
                 dtype: torch.dtype, device) -> StaticState:
        z = lambda *s, dt=torch.long: torch.zeros(s, dtype=dt, device=device)  # noqa: E731
        return cls(
            tokens=z(batch_size, seq_len), lengths=z(batch_size), max_lens=z(batch_size),
            done=z(batch_size, dt=torch.bool), eos=torch.full((1,), -1, dtype=torch.long, device=device),
            accept_hist=z(k + 1),
            kv=[torch.zeros(s, dtype=dtype, device=device) for s in kv_shapes],
        )

    def step_args(self) -> tuple:
        """Arguments of the fused step, in its signature's order."""
        return tuple(getattr(self, name) for name in STEP_INPUTS) + (self.kv,)

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "kv"}
        out.update({f"kv_{i}": t for i, t in enumerate(self.kv)})
        return out

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def load_prompts(self, prompts: list[torch.Tensor], max_new_tokens: int, eos_ids: list[int]) -> None:
        """Reset for a new batch of prompts (1-D LongTensors); rows past len(prompts) start done."""
        self.tokens.zero_()
        self.accept_hist.zero_()
        self.done.fill_(True)
        self.lengths.fill_(1)
        self.max_lens.fill_(1)
        for b, p in enumerate(prompts):
            self.tokens[b, : p.numel()] = p.to(self.tokens.device)
            self.lengths[b] = p.numel()
            self.max_lens[b] = p.numel() + max_new_tokens
            self.done[b] = False
        ids = eos_ids or [-1]
        if len(ids) != self.eos.numel():
            self.eos = torch.tensor(ids, dtype=torch.long, device=self.tokens.device)
        else:
            self.eos.copy_(torch.tensor(ids))
