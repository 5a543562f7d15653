"""Which kernel runs the few-row matmuls, measured on this machine and remembered.

`MatmulPlan(weights)` answers `plan(M, N, K, dtype) -> Choice` for the `skinny_matmul` pass. For a
model's weights and M rows it times every linear of the model at M rows, one after another as
a step runs them (each linear's input depends on the one before, as in a step, so Inductor
cannot run several of them in one loop), in graphs compiled as the runtime compiles its own:

- **tiled**: specfx's register-tiled kernel (`specfx.kernels.tiled_linear`; float32, where this
  torch's Inductor compiles it);
- **reduce**: the pass's product-and-sum, which Inductor generates itself;
- **BLAS**: `F.linear`, which Inductor hands to the BLAS library;

median of `REPEATS` passes taken round-robin over the kernels (so that the machine's drift
reaches each alike), and the fastest is chosen for that row count. Timing one small
weight at a time in a loop misleads: in cache, or with the call overhead of a lone kernel, a
BLAS call looks faster than it runs in a step, where each weight is read once from memory.
Over several rows a fourth measurement settles between the tiled kernel and the reduction,
which the chains leave out there: the model's own verify pass at that width, compiled under
each (`MatmulPlan.settle`), since in a graph the reduction fuses with what surrounds it. A
draft's weights (a head's, early exit's stored copies, a draft model's) are settled the same
way at one row where their chains chose the tiled kernel: in the draft's one-row pass, timed
as a step runs it, after the model's weights (a head's also after its refill's pass over its own).
A row count is measured once per machine and weight set: results are kept in
`$SPECFX_CACHE_DIR/matmul.json` (default `~/.cache/specfx`), keyed by CPU, threads, torch
version, dtype, M, the weights' shapes and the kernels' versions.

`FixedPlan(spec)` names the kernels instead of measuring them (`skinny_matmul="tiled"`, or
`SPECFX_MATMUL=tiled` for every compile): a kernel for every row count, after optional
`M:kernel` exceptions, as in "1:reduce,tiled". The choice then costs no compile of its own
(each measured row count compiles one timing graph per kernel) and is the same on every
machine, as a test suite wants; a kernel that does not fit a matmul falls back as a cached
choice does (see `SkinnyMatmul`).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import random
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import fx

from specfx.kernels import tiled_linear
from specfx.passes.skinny_matmul import KERNELS, MATERIALIZE, MAX_ROWS, SHOWN, Choice
from specfx.runtime.compile import CPU_INDUCTOR, compile_graph

REPEATS = 15
GRAPH_REPEATS = 15     # rounds of `MatmulPlan.settle`'s two graphs
_GRAPH = {True: "the model's verify", False: "the draft's pass"}    # what `settle` times: set 0's, another's
# The reduction replaces the tiled kernel in a verify graph only where its graph ran in under
# this fraction of the tiled one's time. Timed alone, the two are within a few percent on some
# machines and the order flips with the machine's drift, while in the generate loop the tiled
# verify is the faster one: on a 2-core AMD EPYC with AVX-512, a settle that timed pycoder's
# 4-row verify at 1.654 ms (reduction) against 1.670 (tiled) put the MTP step in the loop at
# 1.932 ms (`benchmarks/interleaved.py`) where the tiled verify's took 1.62.
SETTLE_MARGIN = 0.95
# ... and only where it did so in each of this many blocks of GRAPH_REPEATS rounds. One block can
# land on a moment that favours one graph: on a 2-core AMD EPYC with AVX-512 one timed pycoder's
# 4-row verify at 3.32 ms (reduction) against 3.65 (tiled), a choice kept on disk that slowed the
# MTP chain's verify to 4.29 ms in `specfx bench` (the 8-row tree's, tiled: 3.78), where six
# blocks timed minutes later put the reduction at 1.04-1.15x the tiled kernel.
SETTLE_BLOCKS = 5
ENV = "SPECFX_MATMUL"          # a FixedPlan's spec, for every compile that does not name one
_memory: dict[str, dict] = {}


def cache_file() -> Path:
    return Path(os.environ.get("SPECFX_CACHE_DIR") or Path.home() / ".cache" / "specfx") / "matmul.json"


def machine() -> str:
    """What a measurement holds for: CPU model and the vector instructions torch uses on it (one
    model name, "AMD EPYC", covers cores with AVX2 only and cores with AVX-512, where the kernels
    compile to other code), threads, torch version."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu} ({torch.backends.cpu.get_cpu_capability()})|{torch.get_num_threads()} threads|torch {torch.__version__}"


class MatmulPlan:
    """`plan(M, N, K, dtype) -> Choice`: the kernel under which the linears of the weight set
    holding an [N, K] weight of `dtype` ran fastest at M rows."""

    def __init__(self, weights):
        self.sets: list[tuple[list[torch.Tensor], torch.dtype]] = []
        self.include(weights)
        self.measured: dict[str, dict] = {}
        # (set, M) -> a graph of that set's linears at M rows (the model's verify, a draft's pass),
        # ms under each kernel (see `settle`)
        self.in_graph: dict[tuple[int, int], dict] = {}

    def include(self, weights, rows: torch.dtype | None = None) -> int | None:
        """Another weight set (a draft model's, a head's, early exit's stored copies), measured
        as a set of its own, with rows of dtype `rows` (default: the weights'; float32 for weights
        stored in bfloat16 or int8 and widened where they are read: `mtp.store_weights`, the
        `store_draft_weights` pass). Returns the set's index (`settle` takes it), None where it
        holds no matrix."""
        ws = [w.detach() for w in weights if w.dim() == 2]
        if not ws:
            return None
        self.sets.append((ws, rows or ws[0].dtype))
        return len(self.sets) - 1

    def __call__(self, M: int, N: int, K: int, dtype: torch.dtype | None = None) -> Choice:
        """The kernel for M rows times a weight [N, K] stored in `dtype`: chosen from the timing
        of the measured set that holds such a weight. A draft's int8 layer has its target
        layer's shape, and the two sets' kernels differ (pycoder on a 2-core EPYC at one row:
        the float32 model's reduction and tiled kernel tie, the int8 head's reduction is 4x its
        tiled kernel), so the dtype decides where it is given."""
        def holds(ws, same_dtype: bool) -> bool:
            return any(tuple(w.shape) == (N, K) and (not same_dtype or w.dtype == dtype) for w in ws)

        index = next((i for same in ((True, False) if dtype is not None else (False,))
                      for i, (ws, _) in enumerate(self.sets) if holds(ws, same)), None)
        if index is None:
            return Choice("blas", f"{N}x{K}: not a weight of the measured models")
        weights, rows = self.sets[index]
        t = self.timing(weights, M, rows)
        times = _kernel_ms(t)
        best = min(times, key=times.get)
        took = ", ".join(f"{SHOWN[k]} {ms:.2f} ms" for k, ms in times.items())
        graph = self.in_graph.get((index, M))
        if graph is not None and best == "tiled":
            blocks = list(zip(graph["tiled"], graph["reduce"]))
            under = sum(r < SETTLE_MARGIN * t for t, r in blocks)
            best = "reduce" if under == len(blocks) else "tiled"
            took += f"; {_GRAPH[index == 0]} at these rows took " + ", ".join(
                f"{SHOWN[k]} {statistics.median(graph[k]):.2f} ms" for k in ("tiled", "reduce"))
            if best == "tiled" and any(r < t for t, r in blocks):
                took += (f" (the reduction's under {SETTLE_MARGIN:.0%} of the tiled kernel's in {under} "
                         f"of {len(blocks)} blocks)")
        return Choice(best, f"M={M}: {t['linears']} linears took {took}: {SHOWN[best]}")

    def settle(self, M: int, run: Callable[[str], Callable[[], object]], index: int = 0, calls: int = 1,
               warm: bool = False) -> None:
        """Choose between the tiled kernel and the reduction for the linears of weight set
        `index` at M rows, where the chains chose the tiled kernel, by timing a graph of those
        linears at M rows compiled under each, round-robin, in `SETTLE_BLOCKS` blocks of rounds
        (the reduction replaces the tiled kernel only where it ran in under `SETTLE_MARGIN` of its
        time in every block): `run(kernel)` is a call of it with every linear on `kernel`. The
        model's own set (0) is settled in its verify pass over 1 < M <= MAX_ROWS rows, where the
        chains leave the reduction out (see `forms`); a draft's set in its one-row draft pass,
        where they time it but not what it fuses with, as a step runs it: `calls` passes in a row
        (a step's drafts), after the model's weights have streamed through the caches (a step's
        verify pass, untimed), and with `warm` after one more pass, untimed, which leaves the
        draft's weights in the cache (an MTP head's refill, which reads them after the verify
        pass, before the next step's drafts).

        Only a whole graph shows what the reduction costs: there it fuses with the norms,
        residuals and rotary around it, and a layer's kernels merge, which the chains of lone
        linears cannot show, and which way that tips depends on the machine. pycoder's verify of
        4 rows, 2 threads, the two graphs round-robin in one process: on a 2-core AMD EPYC
        (AVX2) the reduction's ran 8-12% faster (3.19-3.46 against 3.51-3.95 ms), on an Intel
        Xeon (AVX-512) it cost 1.32x the tiled kernel's (an earlier build). At one row, on a
        2-core AMD EPYC with AVX-512, the chains of pycoder's int8 MTP head timed the tiled kernel
        at 0.086 ms against the reduction's 0.118, while the head's pass (one fused kernel on the
        reduction) ran in 154-169 us against 196-230 among the step's other parts, and early
        exit's int8 draft pass in 492-527 against 640-645. Called one after the other, the head's
        pass took 108 us tiled against 140, its weights in the cache; after a 96 MB stream, 385
        against 297, four in a row 917 against 802. Remembered like the chains' timings; a
        compile of each graph the first time."""
        if not (1 < M if index == 0 else 0 < M) or M > MAX_ROWS or not 0 <= index < len(self.sets):
            return
        weights, rows = self.sets[index]
        times = _kernel_ms(self.timing(weights, M, rows))
        if min(times, key=times.get) != "tiled":
            return
        what = _GRAPH[index == 0]
        key = self._key(weights, M, rows, ("verify graph" if index == 0 else
                                           f"draft graph x{calls}" + (" warm" if warm else ""))
                        + f" in {SETTLE_BLOCKS} blocks")
        graph = _load().get(key)
        if graph is None:
            model = self.sets[0][0]

            def before(kernel: str) -> None:       # a draft's: the verify's stream, then the refill's pass
                for w in model:
                    w.sum()
                if warm:
                    passes[kernel]()

            try:
                passes = {k: run(k) for k in ("tiled", "reduce")}
                timed = {k: _times(fn, calls) for k, fn in passes.items()}
                blocks = [round_robin(timed, GRAPH_REPEATS, before=None if index == 0 else before)
                          for _ in range(SETTLE_BLOCKS)]
            except Exception as e:          # noqa: BLE001 - a timing, not the compile: the chains' choice stands
                warnings.warn(f"{what} at {M} rows could not be timed under both kernels "
                              f"({type(e).__name__}: {e}); its linears stay on the tiled kernel")
                return
            graph = {k: [b[k] * 1e3 for b in blocks] for k in passes}     # ms a block
            _store(key, graph)
        self.in_graph[(index, M)] = graph

    @staticmethod
    def _key(weights: list[torch.Tensor], M: int, rows: torch.dtype | None, what: str = "") -> str:
        """Where a measurement of `weights` at M rows is kept: machine, dtypes, shapes, kernels."""
        shapes = Counter(tuple(w.shape) for w in weights)
        digest = hashlib.sha256(repr(sorted(shapes.items())).encode()).hexdigest()[:12]
        w0 = weights[0]
        rows = rows or w0.dtype
        stored = "" if rows == w0.dtype else f" rows {rows}"
        return f"{machine()}|{what + '|' if what else ''}{w0.dtype}{stored}|{w0.device.type}|M={M}|{digest}|{_kernel_flags()}"

    def timing(self, weights: list[torch.Tensor], M: int, rows: torch.dtype | None = None) -> dict:
        """Measured (or remembered) ms of all `weights` at M rows (of dtype `rows`, default the
        weights') through each kernel."""
        key = self._key(weights, M, rows)
        if key not in self.measured:
            cached = _load().get(key)
            if cached is None:
                cached = measure(weights, M, rows)
                _store(key, cached)
            self.measured[key] = cached
        return self.measured[key]


class FixedPlan:
    """`plan(M, N, K, dtype) -> Choice` from a spec such as "tiled" or "1:reduce,tiled": the
    kernel named for M rows, else the one named without a row count."""

    def __init__(self, spec: str):
        self.spec, self.kernels = spec, {}
        for part in spec.split(","):
            rows, _, kernel = part.strip().rpartition(":")
            if kernel not in KERNELS or (rows and not rows.isdigit()):
                raise ValueError(f"matmul plan {spec!r}: expected a kernel of {KERNELS}, each optionally "
                                 f"after 'M:' (as in '1:reduce,tiled'), got {part.strip()!r}")
            self.kernels[int(rows) if rows else None] = kernel
        if None not in self.kernels:
            raise ValueError(f"matmul plan {spec!r}: name a kernel for every other row count (as in '1:reduce,tiled')")

    def include(self, weights, rows: torch.dtype | None = None) -> None:
        """Nothing to measure (see `MatmulPlan.include`)."""

    def __call__(self, M: int, N: int, K: int, dtype: torch.dtype | None = None) -> Choice:
        kernel = self.kernels.get(M, self.kernels[None])
        return Choice(kernel, f"M={M}: {SHOWN[kernel]}, as the plan {self.spec!r} says")


def plan(weights, spec: str | None = None):
    """The plan for a model's `weights`: fixed by `spec` or `$SPECFX_MATMUL`, else measured."""
    spec = spec or os.environ.get(ENV)
    return FixedPlan(spec) if spec else MatmulPlan(weights)


def reduce_form(w: torch.Tensor, x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [rows, K] @ w[N, K].T as the skinny_matmul pass writes it."""
    return torch.stack([(w * x[m]).sum(-1) for m in range(rows)], 0)


FORMS = {
    "tiled": lambda w, x, M: torch.ops.specfx.tiled_linear(x, w, tiled_linear.VERSION),
    "reduce": lambda w, x, M: reduce_form(w, x, M),
    "blas": lambda w, x, M: F.linear(x, w.to(x.dtype)),
}


def _kernel_flags() -> str:
    """The Inductor settings and kernel versions a measurement was made with (a change re-measures)."""
    from torch._inductor import config

    return ",".join([f"{k}={v}" for k, v in sorted(CPU_INDUCTOR.items())]
                    + [f"tiled={tiled_linear.VERSION}", f"ahead={tiled_linear.AHEAD_LOCALITY}",
                       f"chain={CHAIN_VERSION}"]
                    + (["kernel_profile"] if config.cpp.enable_kernel_profile else []))


def forms(weights: list[torch.Tensor], M: int, rows: torch.dtype | None = None) -> list[str]:
    """The kernels worth timing for these weights at M rows of dtype `rows` (default: the
    weights'): the tiled one for float32 rows and float32, bfloat16 or int8 weights on the CPU, where
    it compiles; the reduction up to the rows the pass unrolls, and at one row only where the
    tiled kernel runs.

    Over several rows a chain does not tell how the reduction runs in a step's graph, so there
    the graph decides (`MatmulPlan.settle`). On pycoder (2 threads, an Intel Xeon, the verify
    graph alone, the two kernels alternating in one process) it cost 1.32x the tiled kernel's
    verify at 4 rows, 1.07x at 3 and 1.04x at 2, where the chain had timed it 16% faster at 4
    rows and 3% at 3; on a 2-core AMD EPYC it ran 8-12% faster at 4 rows. At one row the
    chains time the reduction too; there a draft's pass settles what they cannot show."""
    w0 = weights[0]
    tiled = ((rows or w0.dtype) == torch.float32 and w0.dtype in tiled_linear.WEIGHT_DTYPES
             and w0.device.type == "cpu" and tiled_linear.available()[0])
    reduce = M <= MAX_ROWS and (M == 1 or not tiled)
    return [k for k in KERNELS if (k != "tiled" or tiled) and (k != "reduce" or reduce)]


def measure(weights: list[torch.Tensor], M: int, rows: torch.dtype | None = None) -> dict:
    """Median ms of all `weights` at M rows through each kernel of `forms`: `{"linears": n, "<kernel>_ms": ms}`."""
    times = round_robin(chains(weights, M, rows), REPEATS)
    return {"linears": len(weights), **{f"{name}_ms": s * 1e3 for name, s in times.items()}}


def chains(weights: list[torch.Tensor], M: int, rows: torch.dtype | None = None) -> dict:
    """kernel -> a call that runs all `weights` at M rows through it (compiled; see `_chain`)."""
    ks = sorted({w.shape[1] for w in weights})
    w0 = weights[0]
    xs = {K: torch.randn(M, K, dtype=rows or w0.dtype, device=w0.device) for K in ks}
    args = [*weights, *(xs[K] for K in ks)]
    out = {}
    for name in forms(weights, M, rows):
        fn = compile_graph(_chain(weights, ks, lambda w, x, form=FORMS[name]: form(w, x, M)), "inductor")
        out[name] = lambda fn=fn: fn(*args)
    return out


def round_robin(calls: dict, repeats: int, before: Callable[[str], object] | None = None) -> dict:
    """name -> median seconds of `calls[name]()`, timed in `repeats` rounds that each call every
    one once (after a round of warm-up), so that a drift in the machine's speed reaches each
    alike: timed one after another, a slow moment once decided a kernel choice, and a step
    compared with a probe timed seconds apart moved by a third. Each round calls them in a new
    order (seeded, so a run repeats): in a fixed order a call always follows the same other one,
    whose data it finds in the cache or has to evict (a step compiled twice on one state, the
    first copy called right after another model's step, timed 6% slower than the second).
    `before(name)`, where given, runs untimed before each call."""
    times = {name: [] for name in calls}
    order, shuffle = list(calls), random.Random(0).shuffle
    with torch.no_grad():
        for r in range(repeats + 1):
            shuffle(order)
            for name in order:
                fn = calls[name]
                if before is not None:
                    before(name)
                t = time.perf_counter()
                fn()
                if r:
                    times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


CHAIN_VERSION = 5    # how the forms are timed, and which (a change re-measures)


def _chain(weights: list[torch.Tensor], ks: list[int], kernel) -> fx.GraphModule:
    """A graph `(*weights, *xs) -> [y_0, y_1, ...]` with y_i = kernel(w_i, xs[K of w_i] + y_{i-1}[:, :1]):
    each linear waits for the one before, as in a step. Its input is materialized first, as the
    pass does for the reduction (the tiled kernel and BLAS take a realized input anyway)."""
    graph = fx.Graph()
    ws = [graph.placeholder(f"w{i}") for i in range(len(weights))]
    xs = {K: graph.placeholder(f"x{K}") for K in ks}
    tracer = fx.proxy.GraphAppendingTracer(graph)
    outs, y = [], None
    for w, t in zip(ws, weights):
        x = fx.Proxy(xs[t.shape[1]], tracer)
        y = kernel(fx.Proxy(w, tracer), MATERIALIZE(x if y is None else x + y[:, :1], [t.shape[1], 1]))
        outs.append(y.node)
    graph.output(outs)
    return fx.GraphModule(torch.nn.Module(), graph)


def _times(fn: Callable[[], object], n: int) -> Callable[[], object]:
    """A call of `fn` n times in a row (`fn` itself for one)."""
    return fn if n == 1 else lambda: [fn() for _ in range(n)]


def _kernel_ms(timing: dict) -> dict:
    """kernel -> ms, from a measurement's `{"<kernel>_ms": ms}`."""
    return {k: timing[f"{k}_ms"] for k in KERNELS if f"{k}_ms" in timing}


def _load() -> dict:
    path = cache_file()
    if str(path) not in _memory:
        try:
            _memory[str(path)] = json.loads(path.read_text())
        except (OSError, ValueError):
            _memory[str(path)] = {}
    return _memory[str(path)]


def _store(key: str, value: dict) -> None:
    table = _load()
    table[key] = value
    path = cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass                                    # a read-only home: measured again next time
