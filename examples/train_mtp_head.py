"""Train a small MTP head for a random-init model, then draft with it (about a minute on CPU).

    python examples/train_mtp_head.py

The target is a 4-layer Llama with random weights; its training data is its own greedy
continuations of random prompts, so the head learns what this target predicts. The full `pycoder-mtp`
training is `specfx train mtp --target pycoder --out DIR`.
"""

import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import specfx
from specfx.mtp import save_head
from specfx.mtp_train import MTPTrainConfig, evaluate_head, train_head

torch.manual_seed(0)
config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, bos_token_id=1, eos_token_id=2,
                     pad_token_id=0)
target = LlamaForCausalLM(config).eval()

# Data: the target's own greedy continuations of random prompts.
with torch.no_grad():
    prompts = torch.randint(3, 256, (160, 4))
    text = target.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False,
                           max_new_tokens=60, min_new_tokens=60, pad_token_id=0)
train, heldout = text[:144], text[144:]

cfg = MTPTrainConfig(steps=300, batch_size=16, seq_len=64, windows=144, lr=3e-3, warmup=20, bf16=False)
head, curve = train_head(target, train, cfg)
print("held-out:", evaluate_head(head, target, heldout))

with tempfile.TemporaryDirectory() as folder:
    save_head(head, folder, target)
    fast = specfx.compile(target, draft=specfx.MTPHead(folder), num_speculative_tokens=3,
                          backend="eager", max_seq_len=256)
    ids = heldout[:1, :8]
    out = fast.generate(ids, max_new_tokens=64)
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=64,
                          pad_token_id=0)
    print("equal to target.generate:", torch.equal(out, ref))
    print(fast.last_stats)
