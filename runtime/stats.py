"""What a generate call measured (`SpeculativeModel.last_stats`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class GenerationStats:
    """Timings and acceptance of one `generate` call (acceptance counted per active row)."""

    ttft_s: float = 0.0                  # prompt in -> first new token on the host
    decode_tokens_per_s: float = 0.0     # new tokens after the first step / time after it
    tokens_per_s: float = 0.0            # all new tokens / whole call (prefill included)
    total_s: float = 0.0
    new_tokens: int = 0
    target_calls: int = 0                # fused steps x active rows (one target pass each)
    mean_accepted: float = 0.0           # tokens emitted per target call, bonus included
    acceptance_by_position: list[float] = field(default_factory=list)  # P(draft i accepted)
    draft_s: float | None = None         # per step, from the last `profile()` run
    verify_s: float | None = None        # per step, from the last `profile()` run
    peak_mem_bytes: int = 0
    steps: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        acc = ", ".join(f"{a:.2f}" for a in self.acceptance_by_position) or "-"
        ms = lambda v: "-" if v is None else f"{v * 1e3:.2f} ms"  # noqa: E731
        return (f"GenerationStats(new_tokens={self.new_tokens}, ttft={self.ttft_s * 1e3:.1f} ms, "
                f"decode={self.decode_tokens_per_s:.1f} tok/s, overall={self.tokens_per_s:.1f} tok/s, "
                f"target_calls={self.target_calls}, mean_accepted={self.mean_accepted:.2f}, "
                f"acceptance_by_position=[{acc}], draft={ms(self.draft_s)}, verify={ms(self.verify_s)}, "
                f"peak_mem={self.peak_mem_bytes / 2**20:.0f} MiB)")


def acceptance_stats(hist: list[int]) -> tuple[int, float, list[float]]:
    """(target_calls, mean tokens per call, P(position i accepted)) from the histogram of n."""
    calls = sum(hist)
    if calls == 0:
        return 0, 0.0, [0.0] * (len(hist) - 1)
    mean = sum((n + 1) * c for n, c in enumerate(hist)) / calls
    by_pos = [sum(hist[i + 1:]) / calls for i in range(len(hist) - 1)]
    return calls, mean, by_pos
