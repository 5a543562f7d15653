"""Export pycoder with early-exit speculation, load the artifact back, and generate from it.

    python examples/export_and_load.py [out_dir]      # default: a new temporary folder

The loaded model runs the exported programs (torch.export .pt2) over weights.safetensors,
without the model's Python code, and generates the same tokens as the compiled model.
"""

import sys
import tempfile
import time

from transformers import AutoTokenizer

import specfx
from specfx import zoo

out_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="pycoder-ee-")
model, tok = zoo.load("pycoder")
fast = specfx.compile(model, draft=specfx.EarlyExit(), max_seq_len=512, backend="eager")
t0 = time.perf_counter()
manifest = fast.export(out_dir, formats=("pt2",))
print(f"exported {fast} to {out_dir} in {time.perf_counter() - t0:.1f} s: {', '.join(manifest['files'])}")

t0 = time.perf_counter()
loaded = specfx.load(out_dir)
print(f"loaded {loaded} in {time.perf_counter() - t0:.1f} s")
tok = AutoTokenizer.from_pretrained(out_dir)                   # the artifact carries its tokenizer
ids = tok(zoo.prompts("completion")[0], return_tensors="pt").input_ids
out = loaded.generate(ids, max_new_tokens=64)
print(tok.decode(out[0, ids.shape[1]:]))
print(loaded.last_stats)
print("identical to the compiled model:", out.tolist() == fast.generate(ids, max_new_tokens=64).tolist())
