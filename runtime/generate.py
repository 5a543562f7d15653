"""The generate loop: chunked prefill, then the fused step, reading the device rarely.

- `Runtime(graphs, backend=..., sync_every=N)` compiles the prefill graph(s) and the fused step.
- `Runtime.generate(prompts, max_new_tokens, eos_ids, streamer)` returns the new tokens of each
  row and a `GenerationStats`. The prefill writes every prompt token's KV and appends each
  row's first new token (from the target's head over the last prompt token's hidden state:
  no drafting before the first token). The host reads device state once after it (TTFT); a
  draft model's own prefill and an MTP head's first pass (`prefill_drafts`) run only then, as
  the first token needs neither. Then the host reads
  at most every `sync_every` steps (done flags and lengths, and new tokens for the
  streamer); near the end it reads sooner, so that no step runs once every row is done. On
  the CPU, where device memory is host memory, each step's attention span is chosen from the
  lengths just before it (`cover`).
- `Runtime.profile()` times the draft and verify graphs apart (compiled on their own).
"""

from __future__ import annotations

import time

import torch
from torch import fx

from specfx.runtime.compile import SPAN, WIDTH, compile_graph
from specfx.runtime.cudagraph import GraphedStep
from specfx.runtime.memory import PeakMemory
from specfx.runtime.accept import commit
from specfx.runtime.sampling import filters_for
from specfx.runtime.stats import GenerationStats, acceptance_stats
from specfx.runtime.step import propose

SPAN_ALIGN = 16      # attention spans are whole vectors of slots (AVX-512's 16 floats)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _host_list(t: torch.Tensor) -> list:
    """`t.tolist()`; from CUDA through a pinned buffer, a non-blocking copy and an explicit
    synchronize: a deliberate sync point, which `set_sync_debug_mode("error")` lets pass (it
    flags a blocking copy, such as `.tolist()` of a device tensor, as a hidden sync)."""
    if t.device.type != "cuda":
        return t.tolist()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    _sync(t.device)
    return host.tolist()


class Runtime:
    """Runs one `Graphs` bundle (see `specfx.pipeline`) over its static state."""

    def __init__(self, graphs, *, backend: str = "inductor", sync_every: int = 8, cudagraphs="auto"):
        if sync_every < 1:
            raise ValueError(f"sync_every must be >= 1, got {sync_every}")
        if cudagraphs not in ("auto", True, False):
            raise ValueError(f"cudagraphs must be 'auto', True or False, got {cudagraphs!r}")
        self.graphs, self.state, self.backend, self.sync_every = graphs, graphs.state, backend, sync_every
        self.device = self.state.tokens.device
        if cudagraphs is True and self.device.type != "cuda":
            raise ValueError("cudagraphs=True needs the model on a CUDA device")
        self.cudagraphs = self.device.type == "cuda" and cudagraphs is not False
        # On the CPU attention reads only the slots that the next step can reach (chosen before
        # each step from the lengths, which are host memory there); elsewhere the whole cache (a
        # CUDA graph needs fixed shapes).
        self.live_span = self.device.type == "cpu"
        self.prefill_fns = [(self._compile(p.gm, WIDTH), p.kv) for p in graphs.prefills]
        self.first_fn = self._compile(graphs.first)
        self.prime_fn = None if graphs.prime is None else self._compile(graphs.prime)
        self._first_hist = torch.zeros(1, dtype=torch.long, device=self.device)   # the first token is no step
        self.step_fn = self._compile(graphs.step)
        self._sample_fns: dict[str, object] = {}          # warp variant -> compiled sampling step
        self.filters = "any"                               # the variant the next sampling steps run
        self._graphed: dict[tuple, GraphedStep] = {}
        # The host reads done flags and lengths through pinned buffers with non-blocking copies.
        pinned = self.device.type == "cuda"
        self._done_host = torch.empty(self.state.batch_size, dtype=torch.bool, pin_memory=pinned)
        self._lengths_host = torch.empty(self.state.batch_size, dtype=torch.long, pin_memory=pinned)
        self.draft_s: float | None = None
        self.verify_s: float | None = None

    def _compile(self, gm: fx.GraphModule, dynamic: dict | None = None):
        """Compiled with the span symbolic where it is live, and `dynamic`'s sizes symbolic."""
        return compile_graph(gm, self.backend, dynamic={**(SPAN if self.live_span else {}), **(dynamic or {})})

    @property
    def max_seq_len(self) -> int:
        return self.graphs.max_seq_len

    @torch.no_grad()
    def prefill(self, longest_prompt: int, sample: bool = False, drafts: bool = True) -> None:
        """Write the KV of every prompt token, in chunks of at most `prefill_chunk` tokens (and
        at least 2: a slot past the prompt is the first new token's, which the first step writes
        again), then append each row's first new token: the argmax (or, with `sample`, a draw
        from the warped distribution) of the target's logits at its last prompt token. Then,
        with `drafts`, what drafting needs (`prefill_drafts`); `generate` runs that after
        the first token is out, since no draft is needed for it."""
        st = self.state
        last = st.lengths - 1                                         # [B]: each row's last prompt token
        hidden = None
        fn, kv = self.prefill_fns[0]                                  # the target's (with any head it fills)
        for start, ids, pos in self._chunks(longest_prompt):
            h = fn(ids, pos, st.span, *st.kv[kv])[0]                  # [B, W, H]: the target's last layer
            width = pos.shape[1]
            at = (last - start).clamp(0, width - 1)[:, None, None].expand(-1, 1, h.shape[-1])
            here = ((last >= start) & (last < start + width))[:, None, None]
            hidden = h.gather(1, at) if hidden is None else torch.where(here, h.gather(1, at), hidden)
        logits = self.first_fn(hidden, last[:, None], st.span)[0][:, -1]                 # [B, V]
        if sample:
            st.draw()
        first = propose(logits, sample and self.filters, st.noise[:, 0], (st.temperature, st.top_k, st.top_p))[0]
        commit(st.tokens, st.lengths, st.max_lens, st.done, st.eos, self._first_hist, first, last * 0)
        if drafts:
            self.prefill_drafts(longest_prompt)

    @torch.no_grad()
    def prefill_drafts(self, longest_prompt: int) -> None:
        """What drafting needs before the first step and not before the first token: a draft
        model's prefill over the prompts, chunked as the target's, and the drafter's `prime`
        pass (an MTP head's output at the first token)."""
        st = self.state
        for fn, kv in self.prefill_fns[1:]:
            for _, ids, pos in self._chunks(longest_prompt):
                fn(ids, pos, st.span, *st.kv[kv])
        if self.prime_fn is not None:
            self.cover(steps=1)                 # the first new token's slot, past the prompt's
            self.prime_fn(*st.step_args())

    def _chunks(self, longest_prompt: int):
        """(start, ids [B, W], positions [B, W]) of each prefill chunk, the span covering it."""
        st, C = self.state, self.graphs.prefill_chunk
        for start in range(0, longest_prompt, C):
            width = max(2, min(C, longest_prompt - start))
            pos = torch.arange(start, start + width, device=self.device).clamp(max=st.seq_len - 1)
            pos = pos.expand(st.batch_size, width).contiguous()      # [B, W]
            self.cover(start + width)
            yield start, st.tokens.gather(1, pos), pos

    def cover(self, positions: int | None = None, steps: int = 0) -> None:
        """Make attention span every position below `positions` (default: the longest row's
        length) and those that `steps` more steps can reach: the first writes the KV of its
        tree's N+1 rows from the pending token's slot (length - 1) on (k+1 for a chain; a
        drafter's own KV stays within them), and each step advances a row by at most k+1."""
        st, k, rows = self.state, self.graphs.k, self.graphs.tree.size + 1
        if not self.live_span:
            st.set_span(st.seq_len)
            return
        if positions is None:
            positions = int(st.lengths.max())
        reach = positions + ((steps - 1) * (k + 1) + rows - 1 if steps else 0)     # the last step's last slot + 1
        st.set_span(-(-reach // SPAN_ALIGN) * SPAN_ALIGN)

    @torch.no_grad()
    def step(self, sample: bool = False) -> None:
        """One step outside `generate` (a test, a profile): the span is set from the lengths first."""
        self.cover(steps=1)
        (self._sample_step if sample else self._step)()

    def sample_step(self) -> None:
        """One sampling step outside `generate` (see `step`)."""
        self.step(sample=True)

    def _step(self) -> None:
        self.step_fn(*self.state.step_args())

    def _sample_step(self) -> None:
        """Draw this step's random numbers from the state's generator, then run the step."""
        fn = self._sample_fns.get(self.filters)
        if fn is None:
            fn = self._sample_fns[self.filters] = self._compile(self.graphs.fused_sample_step(self.filters))
        self.state.draw()
        fn(*self.state.step_args())

    def warmup(self) -> None:
        """Prefill (over more than one chunk where the length allows) and two steps on a dummy
        prompt, so compilation, or CUDA-graph capture, happens before the first real token."""
        prompt = torch.zeros(min(self.graphs.prefill_chunk + 1, self.max_seq_len - 2), dtype=torch.long)
        self.generate([prompt], max_new_tokens=2, eos_ids=[])

    def step_callable(self, sample: bool):
        """What one loop iteration calls: the step, or its CUDA-graph replay (the loop sets the span)."""
        fn = self._sample_step if sample else self._step
        if not self.cudagraphs:
            return fn
        key = (sample, self.filters if sample else None)
        if key not in self._graphed:
            self._graphed[key] = GraphedStep(fn, self.state, sample=sample).capture()
        return self._graphed[key]

    def steps_left(self, limits: list[int]) -> int:
        """Read done flags and lengths (the loop's only sync point between steps) and return a
        lower bound on the steps until every row is done: 0 when all are, else the longest
        remaining row over the most tokens one step emits (k+1). `limits`: each row's last length."""
        self._done_host.copy_(self.state.done, non_blocking=True)
        self._lengths_host.copy_(self.state.lengths, non_blocking=True)
        _sync(self.device)
        done, lengths = self._done_host.tolist(), self._lengths_host.tolist()
        left = [limit - n for limit, n, d in zip(limits, lengths, done) if not d]
        return -(-max(left) // (self.graphs.k + 1)) if left else 0

    @torch.no_grad()
    def generate(self, prompts: list[torch.Tensor], max_new_tokens: int, eos_ids: list[int],
                 streamer=None, sampling: dict | None = None) -> tuple[list[list[int]], GenerationStats]:
        """Generate for each prompt; `sampling` = dict(temperature, top_k, top_p, seed) or None."""
        st = self.state
        st.load_prompts(prompts, max_new_tokens, eos_ids)
        if sampling is not None:              # the cheapest warp exact for these settings
            self.filters = filters_for(sampling["top_k"], sampling["top_p"], st.noise.shape[-1])
        step = self.step_callable(sampling is not None)   # captures before seeding: runs reproduce
        if sampling is not None:
            st.set_sampling(**sampling)
        prompt_lens = [p.numel() for p in prompts]
        eos = set(eos_ids)
        streamed = [0] * len(prompts)
        _sync(self.device)
        with PeakMemory(self.device) as mem:
            t0 = time.perf_counter()
            self.prefill(max(prompt_lens), sample=sampling is not None, drafts=False)
            limits = [p + max_new_tokens for p in prompt_lens]
            left = self.steps_left(limits)                            # sync: first tokens are ready
            t_first = time.perf_counter()
            lengths = self._lengths_host.tolist()
            first_tokens = sum(min(lengths[b] - prompt_lens[b], max_new_tokens) for b in range(len(prompts)))
            if streamer is not None:
                self._stream(streamer, streamed, prompt_lens, max_new_tokens, eos)
            if left > 0 and max_new_tokens > 1:          # the drafter catches up before the first step
                self.prefill_drafts(max(prompt_lens))
            steps = 0
            # Each step emits >= 1 token per active row: max_new_tokens - 1 steps always suffice.
            while steps < max_new_tokens - 1 and left > 0:
                n = min(self.sync_every, max_new_tokens - 1 - steps, left)
                for _ in range(n):
                    self.cover(steps=1)        # the CPU's lengths are host memory: no sync
                    step()
                steps += n
                if streamer is not None:
                    self._stream(streamer, streamed, prompt_lens, max_new_tokens, eos)
                left = self.steps_left(limits)                        # sync at most every `sync_every` steps
            lengths = _host_list(st.lengths)
            t_end = time.perf_counter()
        rows = self._collect(prompt_lens, lengths, max_new_tokens, eos)
        if streamer is not None:
            self._stream(streamer, streamed, prompt_lens, max_new_tokens, eos)
            streamer.end()
        calls, mean, by_pos = acceptance_stats(_host_list(st.accept_hist))
        new = sum(len(r) for r in rows)
        stats = GenerationStats(
            ttft_s=t_first - t0, total_s=t_end - t0, new_tokens=new, steps=steps,
            decode_tokens_per_s=(new - first_tokens) / max(t_end - t_first, 1e-9),
            tokens_per_s=new / max(t_end - t0, 1e-9), target_calls=calls, mean_accepted=mean,
            acceptance_by_position=by_pos, draft_s=self.draft_s, verify_s=self.verify_s,
            peak_mem_bytes=mem.peak_bytes,
        )
        return rows, stats

    def _collect(self, prompt_lens, lengths, max_new_tokens, eos) -> list[list[int]]:
        """New tokens of each row: at most max_new_tokens, ending at the first EOS."""
        tokens = _host_list(self.state.tokens[: len(prompt_lens)])
        rows = []
        for b, p in enumerate(prompt_lens):
            new = tokens[b][p : min(lengths[b], p + max_new_tokens)]
            cut = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
            rows.append(new[:cut])
        return rows

    def _stream(self, streamer, streamed, prompt_lens, max_new_tokens, eos) -> None:
        """Hand the streamer the tokens of row 0 it has not seen yet."""
        lengths = _host_list(self.state.lengths)
        row = self._collect(prompt_lens[:1], lengths[:1], max_new_tokens, eos)[0]
        if len(row) > streamed[0]:
            streamer.put(torch.tensor(row[streamed[0]:]))
            streamed[0] = len(row)

    @torch.no_grad()
    def profile(self, repeats: int = 20) -> tuple[float, float]:
        """Median seconds per step spent drafting and verifying, each graph compiled alone.

        Drafting is every call of the drafter's graphs in one step (`Graphs.draft_calls`: for
        early exit on the model's own weights and a draft model k+1 calls, the last writing the
        last draft's KV; early exit on stored weights k; for an MTP head k - 1 drafts and one
        refill, which yields the next step's first draft); prompt
        lookup has no draft graph (its n-gram match is a few tensor ops). Verifying is one call
        of the verify graph (or, without a drafter, the decode graph).
        """
        seconds = {name: _median_time(call, repeats, self.device) for name, (call, _) in self.profile_calls().items()}
        return self.profile_totals(seconds)

    @torch.no_grad()
    def profile_calls(self) -> dict:
        """part name -> (a call of it compiled alone, its calls per step), as `profile` times them
        (the span covering one more step); a caller may time several models' parts together."""
        g = self.graphs
        self.cover(steps=1)
        calls, exit_hidden = {}, None
        for name, count in g.draft_calls.items():
            calls[name] = (self.part_call(name, exit_hidden), count)
            if name == "draft":
                exit_hidden = calls[name][0]()[-1]    # early exit on the model's weights: feeds verify
        calls[self.verify_part] = (self.part_call(self.verify_part, exit_hidden), 1)
        return calls

    def profile_totals(self, seconds: dict) -> tuple[float, float]:
        """(draft, verify) seconds per step from each part's seconds a call (`profile_calls`'
        names); sets `draft_s` and `verify_s`."""
        self.draft_s = sum(seconds[name] * count for name, count in self.graphs.draft_calls.items())
        self.verify_s = seconds[self.verify_part]
        return self.draft_s, self.verify_s

    @property
    def verify_part(self) -> str:
        """The part that verifies: "verify", or "decode" without a drafter."""
        return "verify" if "verify" in self.graphs.parts else "decode"

    def part_call(self, name: str, exit_hidden: torch.Tensor | None = None):
        """A call of part `name` (see `Graphs.parts`) compiled alone, on example inputs at its
        width for the state's rows as they stand (the pending token at each row's last
        position; `cover` the span first); early exit's verify reads `exit_hidden`."""
        st, gm = self.state, self.graphs.parts[name]
        last = (st.lengths - 1).clamp(min=0)[:, None]                # [B, 1]
        kv = st.kv[self.graphs.kv_slices[name]]
        inputs = [n for n in gm.graph.nodes if n.op == "placeholder"][: -len(kv)]
        width = inputs[0].meta["val"].shape[1]                      # input_ids, or hidden states [B, W, H]
        pos = (last + torch.arange(width, device=self.device)).clamp(max=st.seq_len - 1)
        # A verify graph takes `last` and places its rows itself (the tree_attention pass).
        values = {"positions": pos, "input_ids": st.tokens.gather(1, pos), "span": st.span, "last": last[:, 0]}
        if exit_hidden is not None:
            values["exit_hidden"] = exit_hidden.expand(-1, width, -1).contiguous()
        args = []
        for n in inputs:
            if n.name not in values:                                  # hidden states: zeros do
                val = n.meta["val"]
                values[n.name] = torch.zeros(val.shape, dtype=val.dtype, device=self.device)
            args.append(values[n.name])
        fn, args = self._compile(gm), (*args, *kv)
        return lambda: fn(*args)


def profile_together(runtimes: list[Runtime], repeats: int = 20) -> list[tuple[float, float]]:
    """Each runtime's (draft, verify) seconds a step, as `Runtime.profile` gives them, every
    runtime's parts timed together in `repeats` shuffled rounds (`matmul_choice.round_robin`), so
    that their ratios (a verify against plain decoding's decode graph) share the machine's drift:
    timed one runtime after another, a 4-row verify against the decode graph moved between 1.1x
    and 1.3x from run to run. A part a step calls n times is timed as n calls in a row, the first
    finding its weights cold as in a step, the others in the cache."""
    from specfx.matmul_choice import round_robin

    calls, counts = {}, {}
    for i, rt in enumerate(runtimes):
        for name, (call, n) in rt.profile_calls().items():
            calls[(i, name)] = lambda call=call, n=n, rt=rt: ([call() for _ in range(n)], _sync(rt.device))
            counts[(i, name)] = n
    seconds = round_robin(calls, repeats) if calls else {}
    return [rt.profile_totals({name: t / counts[(j, name)] for (j, name), t in seconds.items() if j == i})
            for i, rt in enumerate(runtimes)]


def _median_time(fn, repeats: int, device) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]
