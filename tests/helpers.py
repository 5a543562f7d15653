"""Test helpers: tiny random models of several architectures, and the near-tie exactness rule."""

from __future__ import annotations

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, GemmaConfig, LlamaConfig, MistralConfig,
                          Qwen2Config)
from transformers.generation.streamers import BaseStreamer

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


# Hugging Face decoder families: the structural variants each one covers, and the config
# overrides of its tiny random-init model (None drops a common key the family does not take,
# e.g. num_key_value_heads where every head has its own KV). Windows of 16 tokens, so that
# tests run past them.
FAMILIES = {
    "llama": ("rotary, RMSNorm, untied head", {}),
    "mistral": ("sliding window", dict(sliding_window=16)),
    "mixtral": ("mixture of experts, sliding window",
                dict(sliding_window=16, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2": ("QKV bias, sliding window on upper layers",
              dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
    "qwen3": ("QK-norm", dict(head_dim=16)),
    "qwen2_moe": ("mixture of experts with a shared expert",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64)),
    "gemma": ("embedding multiplier, tied head", dict(head_dim=16)),
    "gemma2": ("alternating sliding window, attention and logit soft-capping",
               dict(head_dim=16, sliding_window=16, query_pre_attn_scalar=16, final_logit_softcapping=30.0,
                    attn_logit_softcapping=50.0)),
    "gemma3_text": ("alternating sliding window, QK-norm",
                    dict(head_dim=16, sliding_window=16, query_pre_attn_scalar=16, sliding_window_pattern=2)),
    "phi": ("parallel attention+MLP, partial rotary, LayerNorm with bias", dict(partial_rotary_factor=0.5)),
    "phi3": ("fused QKV, fused gate/up", {}),
    "gpt2": ("learned absolute positions, Conv1D, LayerNorm with bias, tied head",
             dict(n_embd=64, n_head=4, n_positions=512, n_inner=128, num_key_value_heads=None)),
    "gpt_neox": ("parallel attention+MLP, partial rotary, fused QKV",
                 dict(rotary_pct=0.25, num_key_value_heads=None)),
    "stablelm": ("partial rotary, LayerNorm with bias, QK-norm", dict(partial_rotary_factor=0.25, qk_layernorm=True)),
    "granite": ("embedding, residual, attention and logit multipliers",
                dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.1,
                     logits_scaling=8.0)),
    "olmo2": ("QK-norm, post-norm", {}),
    "starcoder2": ("LayerNorm with bias, sliding window", dict(sliding_window=16)),
    "cohere": ("parallel attention+MLP, logit scale, tied head", dict(logit_scale=0.5)),
    "cohere2": ("alternating sliding window, parallel attention+MLP", dict(sliding_window=16, sliding_window_pattern=2)),
    "smollm3": ("layers without rotary", dict(no_rope_layer_interval=2)),
    "opt": ("learned absolute positions (offset 2), embedding projection",
            dict(ffn_dim=128, word_embed_proj_dim=32, num_key_value_heads=None)),
    "gptj": ("parallel attention+MLP, partial interleaved rotary",
             dict(n_embd=64, n_head=4, n_positions=512, n_inner=128, rotary_dim=8, num_key_value_heads=None)),
}


def attention_through_interface(family: str) -> bool:
    """Whether the installed transformers runs `family`'s attention through its AttentionInterface
    (Falcon does from transformers 5.25 on; before, it computed attention itself)."""
    import importlib
    import inspect

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(module)


# Families specfx refuses, and the words of the refusal.
REFUSED = {"bloom": "attention not found"}
FALCON = ("multi-query attention, fused QKV, parallel attention+MLP", dict(num_key_value_heads=None))
if attention_through_interface("falcon"):
    FAMILIES["falcon"] = FALCON
else:
    REFUSED["falcon"] = "attention not found"


def tiny_checkpoint(path, family: str = "llama", *, layers: int = 4, seed: int = 2, eos: bool = False):
    """Save a tiny `family_model` with the embedded models' tokenizer (its vocabulary size) to
    `path`, as a checkpoint directory the CLI loads, and return the model; `eos`: the
    tokenizer's EOS id is the model's."""
    from transformers import AutoTokenizer

    from specfx import zoo

    tok = AutoTokenizer.from_pretrained(str(zoo.path("pycoder-draft")))
    model = family_model(family, layers=layers, vocab=len(tok), seed=seed)
    if eos:
        model.config.eos_token_id = model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model


def family_model(family: str, *, layers: int = 4, vocab: int = 96, seed: int = 0,
                 dtype: torch.dtype = torch.float32, **extra):
    """A tiny random-init model of a transformers family (`FAMILIES` or `REFUSED`), as `tiny_model`."""
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(FALCON[1] if family == "falcon" else FAMILIES[family][1] if family in FAMILIES else {})
    if "n_embd" in kw:                 # GPT-2 / GPT-J names
        kw["n_layer"] = layers
    kw.update(extra)
    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, **{k: v for k, v in kw.items() if v is not None})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    return model.to(dtype).eval()


def span(length: int) -> torch.Tensor:
    """A captured graph's `span` input: attention reads cache slots 0..length-1."""
    return torch.zeros(length, dtype=torch.uint8)


class RecordingStreamer(BaseStreamer):
    """A streamer that keeps every token list it is handed (`puts`) and counts `end` calls."""

    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, value):
        self.puts.append(value.flatten().tolist())

    def end(self):
        self.ends += 1


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
