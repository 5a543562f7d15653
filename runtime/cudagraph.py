"""CUDA-graph capture of the decoding step over the runtime's static state.

- `StaticBuffers(state)`: the registry of every state tensor's address; `check()` asserts that
  none moved (a replayed graph reads and writes fixed addresses).
- `GraphedStep(fn, state, sample=...)`: warms `fn` up on a side stream, restores the state the
  warm-up advanced, captures one call of `fn` (for sampling: the random draws from the state's
  generator, registered with the graph, then the fused step) and replays it. A recompile during
  the capture is an error (`set_stance("fail_on_recompile")`).

The runtime uses it on CUDA when `cudagraphs` is on; prefill stays outside the graph.
"""

from __future__ import annotations

import torch


class StaticBuffers:
    """Addresses of the state tensors, so a test (or a debug run) can prove they never move."""

    def __init__(self, state):
        self.state = state
        self.addresses = self._read()

    def _read(self) -> dict[str, int]:
        return {name: t.data_ptr() for name, t in self.state.tensors().items()}

    def check(self) -> None:
        now = self._read()
        moved = [name for name, ptr in self.addresses.items() if now.get(name) != ptr]
        if moved:
            raise RuntimeError(f"static buffers moved since capture: {moved}")

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.state.tensors().items()}

    def restore(self, snap: dict[str, torch.Tensor]) -> None:
        for name, t in self.state.tensors().items():
            t.copy_(snap[name])


class GraphedStep:
    """One decoding step captured as a CUDA graph; call it to replay."""

    def __init__(self, fn, state, *, sample: bool = False, warmup: int = 3):
        self.fn, self.state, self.sample, self.warmup = fn, state, sample, warmup
        self.buffers = StaticBuffers(state)
        self.graph = None
        self.warmup_runs = 0

    def capture(self) -> GraphedStep:
        if not self.state.tokens.is_cuda:
            raise RuntimeError("CUDA-graph capture needs the state on a CUDA device")
        snap = self.buffers.snapshot()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):   # compiles, autotunes, allocates outside the capture
                self.fn()
                self.warmup_runs += 1
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        if self.sample:
            self.graph.register_generator_state(self.state.generator)
        # Everything was compiled in the warm-up: a recompile here would run Inductor inside the
        # capture, so it is an error. thread_local: an unsafe CUDA call made by another thread
        # (a compile worker, a profiler) does not abort this thread's capture.
        with torch.compiler.set_stance("fail_on_recompile"), \
                torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.fn()
        self.buffers.restore(snap)        # warm-up advanced the state; capture ran nothing
        torch.cuda.synchronize()
        return self

    def __call__(self) -> None:
        self.graph.replay()
