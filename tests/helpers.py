"""Test helpers: tiny random models of several architectures, and the near-tie exactness rule."""

from __future__ import annotations

import torch
from transformers import (AutoModelForCausalLM, GemmaConfig, LlamaConfig, MistralConfig,
                          Qwen2Config)

ARCHS = ("llama", "qwen2", "mistral", "gemma")
_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "gemma": GemmaConfig}
# Top-2 logit gap under which a divergence counts as a near-tie: 1e-4 in float32 (DESIGN.md);
# half precision rounds logits far more coarsely, so its gap scales with its epsilon.
NEAR_TIE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 6e-2}


def tiny_model(arch: str = "llama", *, layers: int = 4, vocab: int = 96, seed: int = 0, **extra):
    """A random-init model, small enough for CPU tests (float32, eval mode)."""
    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "gemma":
        kw["head_dim"] = 16
    kw.update(extra)
    model = AutoModelForCausalLM.from_config(_CONFIGS[arch](**kw))
    # Spread the weights so random logits are not all near ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    return model.eval()


def hf_greedy(model, ids, max_new_tokens, attention_mask=None, eos_token_id=None):
    with torch.no_grad():
        return model.generate(ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                              do_sample=False, eos_token_id=eos_token_id, pad_token_id=0)


def unpadded(out: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, b: int) -> torch.Tensor:
    """Row b of a padded batch's output as one sequence [1, n]: its prompt tokens (where `mask`
    is 1), then its new tokens."""
    return torch.cat([ids[b][mask[b].bool()], out[b, ids.shape[1]:]])[None]


def assert_greedy_equal(model, ours: torch.Tensor, ref: torch.Tensor, prompt_len: int):
    """Token-for-token equality, except that a divergence at a near-tie ends the comparison.

    `ours` and `ref` are whole sequences, prompt then new tokens: where batched verification
    changes fp32 rounding enough to flip an argmax, the top-2 logit gap of the reference at that
    point, measured on the prompt and the tokens before it, must be below NEAR_TIE; anything
    else fails.
    """
    assert prompt_len >= 1, "pass whole sequences (prompt + new tokens): the near-tie gap needs the prompt"
    assert ours.shape[0] == ref.shape[0]
    assert torch.equal(ours[:, :prompt_len].cpu(), ref[:, :prompt_len].cpu()), "the prompts differ"
    for b in range(ours.shape[0]):
        a, r = ours[b].tolist(), ref[b].tolist()
        n = min(len(a), len(r))
        diff = next((i for i in range(prompt_len, n) if a[i] != r[i]), None)
        if diff is None:
            assert len(a) == len(r), f"row {b}: lengths differ {len(a)} vs {len(r)}"
            continue
        param = next(model.parameters())
        with torch.no_grad():
            logits = model(torch.tensor([r[:diff]], device=param.device)).logits[0, -1].float()
        top2 = logits.topk(2).values
        gap = (top2[0] - top2[1]).item()
        assert gap < NEAR_TIE[param.dtype], (f"row {b}: first divergence at {diff - prompt_len} is not a near-tie "
                                f"(top-2 gap {gap:.2e}); ours {a[diff]} vs reference {r[diff]}")
