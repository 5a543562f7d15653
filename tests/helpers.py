"""Test helpers: tiny random models of several architectures, and the near-tie exactness rule."""

from __future__ import annotations

import torch
from transformers import (AutoModelForCausalLM, GemmaConfig, LlamaConfig, MistralConfig,
                          Qwen2Config)

from specfx.exactness import greedy_mismatch

ARCHS = ("llama", "qwen2", "mistral", "gemma")
_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "gemma": GemmaConfig}


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


def span(length: int) -> torch.Tensor:
    """A captured graph's `span` input: attention reads cache slots 0..length-1."""
    return torch.zeros(length, dtype=torch.uint8)


def hf_greedy(model, ids, max_new_tokens, attention_mask=None, eos_token_id=None):
    with torch.no_grad():
        return model.generate(ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
                              do_sample=False, eos_token_id=eos_token_id, pad_token_id=0)


def unpadded(out: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, b: int) -> torch.Tensor:
    """Row b of a padded batch's output as one sequence [1, n]: its prompt tokens (where `mask`
    is 1), then its new tokens."""
    return torch.cat([ids[b][mask[b].bool()], out[b, ids.shape[1]:]])[None]


def assert_greedy_equal(model, ours: torch.Tensor, ref: torch.Tensor, prompt_len: int):
    """Token-for-token equality, except that a divergence at a near-tie ends the comparison
    (`specfx.exactness`). `ours` and `ref` are whole sequences, prompt then new tokens: the
    near-tie gap is measured on the prompt and the tokens before the divergence."""
    assert prompt_len >= 1, "pass whole sequences (prompt + new tokens): the near-tie gap needs the prompt"
    assert ours.shape[0] == ref.shape[0]
    assert torch.equal(ours[:, :prompt_len].cpu(), ref[:, :prompt_len].cpu()), "the prompts differ"
    for b in range(ours.shape[0]):
        why = greedy_mismatch(model, ours[b].tolist(), ref[b].tolist(), prompt_len)
        assert why is None, f"row {b}: {why}"
