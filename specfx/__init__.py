"""specfx: speculative decoding as a compiler plugin for torch.compile.

    import specfx
    fast = specfx.compile(model, draft=specfx.EarlyExit(layer=4), num_speculative_tokens=4)
    out = fast.generate(input_ids, max_new_tokens=128)

Exact: greedy output equals `model.generate(do_sample=False)` token for token. From transformers:

    model.generate(input_ids, custom_generate=specfx.generate_with(draft="mtp"), max_new_tokens=128)
"""

__version__ = "0.1.0"

from specfx.api import SpeculativeModel, compile  # noqa: E402
from specfx.drafters import DraftModel, EarlyExit, MTPHead, NoDraft, PromptLookup, parse_draft  # noqa: E402
from specfx.export import load  # noqa: E402
from specfx.hf_generate import generate_with  # noqa: E402

__all__ = ["DraftModel", "EarlyExit", "MTPHead", "NoDraft", "PromptLookup", "SpeculativeModel", "compile", "generate_with", "load", "parse_draft", "__version__"]
