"""Profile the compiled plain-decoding step of pycoder on the CPU (where does a step go?).

    python examples/profile_step.py [THREADS]

Prints decode tokens/s of specfx:none and of `model.generate`, then the torch.profiler table of
20 compiled steps.
"""

import sys
import time

import torch

import specfx
from specfx import zoo

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
model, tok = zoo.load("pycoder")
ids = tok(zoo.prompts()[0], return_tensors="pt").input_ids
fast = specfx.compile(model, draft="none", max_seq_len=256)
fast.generate(ids, max_new_tokens=64)
print(f"threads {torch.get_num_threads()}: specfx:none decode {fast.last_stats.decode_tokens_per_s:.1f} tok/s")
with torch.no_grad():
    t = time.perf_counter()
    model.generate(ids, max_new_tokens=64, do_sample=False, pad_token_id=tok.pad_token_id)
    print(f"model.generate: {64 / (time.perf_counter() - t):.1f} tok/s")

from torch.profiler import ProfilerActivity, profile  # noqa: E402

with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(20):
        fast.runtime.step()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
