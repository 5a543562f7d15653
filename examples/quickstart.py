"""Quick start: compile the embedded pycoder model with early-exit speculation and compare.

    python examples/quickstart.py
"""

import time

import torch

import specfx
from specfx import zoo

model, tok = zoo.load("pycoder")
prompt = zoo.prompts("completion")[0]
ids = tok(prompt, return_tensors="pt").input_ids

t0 = time.perf_counter()
fast = specfx.compile(model, draft=specfx.EarlyExit(), max_seq_len=512)  # the model's default exit layer and k
print(f"{fast}: built and compiled in {time.perf_counter() - t0:.1f} s")

out = fast.generate(ids, max_new_tokens=64)
print(tok.decode(out[0, ids.shape[1]:]))
print(fast.last_stats)

with torch.no_grad():
    ref = model.generate(ids, max_new_tokens=64, do_sample=False, pad_token_id=tok.pad_token_id)
print("identical to model.generate:", torch.equal(out, ref))
