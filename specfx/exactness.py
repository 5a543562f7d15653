"""The greedy exactness rule of DESIGN.md, for tests and benchmarks.

Greedy output equals the model's own greedy output token for token, except where batched
verification changes fp32 rounding enough to flip an argmax: then the first divergence must be
at a near-tie, where the reference's top-2 logit gap (on the prompt and the tokens before it) is
below `NEAR_TIE` for the model's dtype; anything else is a bug.
"""

from __future__ import annotations

import torch

# 1e-4 in float32 (DESIGN.md); half precision rounds logits far more coarsely, so its gap
# scales with its epsilon.
NEAR_TIE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}


def greedy_mismatch(model, ours: list[int], ref: list[int], prompt_len: int) -> str | None:
    """None if the sequence `ours` matches the reference `ref` (both prompt + new tokens) under
    the rule; else what differs."""
    n = min(len(ours), len(ref))
    diff = next((i for i in range(prompt_len, n) if ours[i] != ref[i]), None)
    if diff is None:
        return None if len(ours) == len(ref) else f"lengths differ {len(ours)} vs {len(ref)}"
    param = next(model.parameters())
    with torch.no_grad():
        logits = model(torch.tensor([ref[:diff]], device=param.device)).logits[0, -1].float()
    top2 = logits.topk(2).values
    gap = (top2[0] - top2[1]).item()
    if gap < NEAR_TIE[param.dtype]:
        return None
    return (f"first divergence at {diff - prompt_len} is not a near-tie (top-2 gap {gap:.2e}); "
            f"ours {ours[diff]} vs reference {ref[diff]}")
