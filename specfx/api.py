"""Public API: `specfx.compile` and the `SpeculativeModel` it returns.

    fast = specfx.compile(model, draft=specfx.EarlyExit(layer=4), num_speculative_tokens=4)
    out = fast.generate(input_ids, max_new_tokens=128)    # == model.generate(do_sample=False)
    print(fast.last_stats)

`specfx.compile(draft=...)` with no model returns a decorator. Shapes (batch, k, max_seq_len)
are fixed at compile time; with the Inductor backend the step is compiled (and warmed up) here,
and `compile_s` records how long that took, apart from any generate timing.
"""

from __future__ import annotations

import time

import torch

from specfx import generation, pipeline
from specfx.drafters import default_num_speculative_tokens, parse_draft
from specfx.generation import GenerationDefaults, StaticShape
from specfx.runtime.generate import Runtime
from specfx.runtime.stats import GenerationStats


class SpeculativeModel:
    """A model compiled for speculative decoding over static buffers."""

    def __init__(self, model, *, draft=None, num_speculative_tokens: int | None = None,
                 max_seq_len: int = 2048, batch_size: int = 1, backend: str = "inductor",
                 sync_every: int = 8, warmup: bool = True, cudagraphs="auto", skinny_matmul: bool | str | None = None,
                 prefill_chunk: int = pipeline.PREFILL_CHUNK):
        self.model = model.eval()
        drafter = pipeline.resolve_drafter(model, parse_draft(draft), num_speculative_tokens)
        tree = getattr(drafter, "tree", None)
        if tree is not None and num_speculative_tokens not in (None, len(tree)):
            raise ValueError(f"draft {drafter}: the tree sets the drafts per step (depth {len(tree)}); "
                             f"num_speculative_tokens={num_speculative_tokens} disagrees: leave it out")
        k = num_speculative_tokens if num_speculative_tokens is not None else \
            len(tree) if tree is not None else default_num_speculative_tokens(model, 4, drafter)
        t0 = time.perf_counter()
        self.graphs = pipeline.build(model, drafter, k=k, batch_size=batch_size,
                                     max_seq_len=max_seq_len, prefill_chunk=prefill_chunk,
                                     matmul=matmul_plan(model, backend, skinny_matmul))
        self.drafter = self.graphs.drafter
        self.runtime = Runtime(self.graphs, backend=backend, sync_every=sync_every, cudagraphs=cudagraphs)
        self.capture_s = time.perf_counter() - t0
        self.backend, self.batch_size, self.max_seq_len = backend, batch_size, max_seq_len
        self.shape = StaticShape(batch_size, max_seq_len, self.graphs.structure.vocab_size, self.runtime.device)
        self.last_stats: GenerationStats | None = None
        self.compile_s = 0.0
        if warmup and backend != "eager":
            t1 = time.perf_counter()
            self.runtime.warmup()
            self.compile_s = time.perf_counter() - t1

    @property
    def num_speculative_tokens(self) -> int:
        return self.graphs.k

    @property
    def defaults(self) -> GenerationDefaults:
        """EOS/pad ids and sampling settings from the model's configs, read at each call."""
        return GenerationDefaults.from_model(self.model)

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, *,
                 max_new_tokens: int = 64, do_sample: bool = False, temperature: float | None = None,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 eos_token_id=None, pad_token_id: int | None = None, streamer=None,
                 stream_prompt: bool = True, **unsupported) -> torch.Tensor:
        """Generate; returns [B, prompt + new] like `model.generate`.

        Greedy by default (equal to `model.generate(do_sample=False)`). With `do_sample=True`
        it samples from the model's distribution after temperature/top-k/top-p (unset values
        come from the model's generation_config, then transformers' defaults, top-k 50
        included); speculative rejection sampling keeps that distribution exactly. `seed` makes a run reproducible.

        `input_ids` is 2-D `[batch, prompt_len]` on the model's device; where `attention_mask` is
        0 the token is padding (left or right), dropped. Calls from several threads run one
        after another (the static state is shared). `stream_prompt=False` hands the streamer
        only the new tokens (for a caller that has streamed the prompt itself).
        """
        if unsupported:
            raise TypeError(f"unsupported generate arguments: {sorted(unsupported)}")
        out, self.last_stats = generation.generate(
            self.runtime, self.defaults, self.shape, input_ids, attention_mask,
            max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, eos_token_id=eos_token_id, pad_token_id=pad_token_id, streamer=streamer,
            stream_prompt=stream_prompt)
        return out

    def export(self, out_dir, formats=("pt2", "aoti", "onnx"), *, tokenizer=None):
        """Write a loadable artifact folder (see `specfx.export`); returns its manifest."""
        from specfx.export import export

        return export(self, out_dir, formats, tokenizer=tokenizer)

    def profile(self, repeats: int = 20) -> tuple[float, float]:
        """Time the draft and verify graphs apart (seconds per step); fills `last_stats`."""
        with self.runtime.state.lock:
            draft_s, verify_s = self.runtime.profile(repeats)
        if self.last_stats is not None:
            self.last_stats.draft_s, self.last_stats.verify_s = draft_s, verify_s
        return draft_s, verify_s

    def __repr__(self) -> str:
        return (f"SpeculativeModel(draft={self.drafter}, k={self.num_speculative_tokens}, "
                f"batch_size={self.batch_size}, max_seq_len={self.max_seq_len}, backend={self.backend!r})")


def compile(model=None, *, draft=None, num_speculative_tokens: int | None = None,
            max_seq_len: int = 2048, batch_size: int = 1, backend: str = "inductor",
            sync_every: int = 8, warmup: bool = True, cudagraphs="auto", skinny_matmul: bool | str | None = None,
            prefill_chunk: int = pipeline.PREFILL_CHUNK):
    """Compile `model` for speculative decoding; with no model, return a decorator.

    `num_speculative_tokens=None` takes the model's tuned k (zoo models) or 4; an MTP head
    drafts the model's default tree (`config.specfx_mtp_tree`, saved by `specfx bench
    --sweep-tree --save-default`) where the draft names no tree and no k is given. With
    `warmup=False` compilation happens at the first `generate` instead of here. On CUDA the
    step is captured as one CUDA graph (`cudagraphs="auto"`; False turns it off).
    `skinny_matmul` rewrites few-row matmuls where a measurement on this machine says the
    rewrite is faster (None: on for Inductor on the CPU; see `specfx.matmul_choice`); a string
    names the kernels instead of measuring them ("tiled", or "1:reduce,tiled": M=1 reduced;
    `$SPECFX_MATMUL` sets one for every compile).
    A prompt is prefilled in chunks of at most `prefill_chunk` tokens (one graph serves every
    width up to it): larger chunks read the weights fewer times and keep the matmuls wider,
    smaller ones keep the prefill's activations and attention scores small.
    """
    kwargs = dict(draft=draft, num_speculative_tokens=num_speculative_tokens, max_seq_len=max_seq_len,
                  batch_size=batch_size, backend=backend, sync_every=sync_every, warmup=warmup,
                  cudagraphs=cudagraphs, skinny_matmul=skinny_matmul, prefill_chunk=prefill_chunk)
    if model is None:
        def decorator(fn_or_model):
            m = fn_or_model() if callable(fn_or_model) and not isinstance(fn_or_model, torch.nn.Module) \
                else fn_or_model
            return SpeculativeModel(m, **kwargs)
        return decorator
    return SpeculativeModel(model, **kwargs)


def skinny_default(model, backend: str) -> bool:
    """Whether the skinny-matmul rewrite is on by default: for Inductor on the CPU."""
    return backend == "inductor" and next(model.parameters()).device.type == "cpu"


def matmul_plan(model, backend: str, skinny_matmul: bool | str | None):
    """The skinny-matmul choice for this model (a kernel spec fixes it, see
    `specfx.matmul_choice.FixedPlan`), or None where the rewrite is off."""
    from specfx.matmul_choice import plan

    if skinny_matmul is None:
        skinny_matmul = skinny_default(model, backend)
    if not skinny_matmul:
        return None
    return plan(list(model.parameters()), skinny_matmul if isinstance(skinny_matmul, str) else None)
