"""specfx's few-row matmuls on the CPU, as ops that Inductor compiles into the step.

- `tiled_linear(x [M, K], w [N, K]) -> [M, N]` (`torch.ops.specfx.tiled_linear`): x @ w.T; also
  batched, `x [B, M, K]`, `w [B, N, K]` (attention's scores: queries against a span of cached
  keys, whose batches are a KV buffer's heads). Compiled, it is `linear` in `tiled_linear.h`,
  a register-tiled C++ kernel that reads each weight row once for all M rows and sums a
  tile's accumulators across lanes together (see the header).
- `tiled_linears(x [M, K], [w_0, w_1, ...]) -> [M, N_0 + N_1 + ...]`
  (`torch.ops.specfx.tiled_linears`): the linears of one input (a layer's q, k and v; its gate
  and up) as one kernel, `linears` in the header; each output as `tiled_linear` computes it.
- `tiled_glu(x [M, K], w_gate, w_up) -> [M, N]` (`torch.ops.specfx.tiled_glu`): a gated MLP's
  silu(x @ w_gate.T) * (x @ w_up.T) as one kernel, `glu` in the header: each thread gates the
  columns it computed.
- `tiled_mix(p [B, M, L], v [B, L, D]) -> [B, M, D]` (`torch.ops.specfx.tiled_mix`): p @ v,
  attention's weighted sum of cached values; compiled, `mix` in the header.
- `tiled_attend(q, k, v, bias, scale)` (`torch.ops.specfx.tiled_attend`): a few queries' whole
  attention over a span of cached keys and values, each head's scores, masked softmax and
  weighted values in one pass of one thread; compiled, `attend` in `tiled_attend.h`.
- Run eagerly (the eager backend, torch.export) they are `F.linear` / `torch.matmul` (and
  `attend_reference`, `quantized_reference` for an int8 weight). Compiled,
  the kernel is defined in the graph's own C++ source and called from its wrapper like
  Inductor's generated kernels: no dispatcher call, no Python, and the graph keeps its buffers
  on the stack (`runtime.compile`). K, D and the batch are fixed in the code; the rows M and
  the span (N, L) are passed at each call, so one compiled graph serves every span, and a
  prefill's graph every width.
- `stream_sum()`: the header's plain streaming sum as a call on a float32 CPU tensor (the
  roofline's probe of the machine's memory speed; no step uses it); `fma_peak()`: register-only
  multiply-adds on every thread (its probe of the machine's float32 compute); `handoff()`: a
  cache line passed between two threads (how far apart the kernels' threads sit).
- `register()` gives Inductor the lowerings (`runtime.compile` calls it before compiling);
  `available()` says whether this torch's Inductor compiles them (a small graph, compiled and
  checked once per process). Where it does not, nothing inserts them.

Their last argument is `VERSION`, a hash of the headers, of this module (the lowerings) and of the
cache the weight stream prefetches into (`ahead_locality`), so that a changed kernel or lowering is
a changed graph for Inductor's cache. float32 on the CPU only
(`tiled_linear` also takes a bfloat16 or int8 weight: a draft's weights, stored at half or a
quarter of the bytes; against int8 it quantizes x's rows too, `quantized_reference`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("tiled_linear.h").read_text()
ATTEND_SOURCE = Path(__file__).with_name("tiled_attend.h").read_text()
PREFETCH_ENV = "SPECFX_PREFETCH"   # "l1" or "l2": where the kernels' weight stream prefetches
L1_PREFETCH_FROM = 48 * 1024       # an L1 data cache of at least this many bytes a core takes it


@cache
def l1_data_cache() -> int | None:
    """Bytes of this machine's L1 data cache a core (None where the system does not say)."""
    try:
        size = os.sysconf("SC_LEVEL1_DCACHE_SIZE")
        if size > 0:
            return size
    except (ValueError, OSError, AttributeError):
        pass
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index0/size").read_text().strip().upper()
        return int(text.rstrip("K")) * 1024 if text.endswith("K") else int(text)
    except (OSError, ValueError):
        return None


def ahead_locality() -> int:
    """Which cache the tiled kernel's weight stream prefetches into (`SPECFX_AHEAD_LOCALITY` in
    the header): 3, the L1, where a core's L1 data cache holds `L1_PREFETCH_FROM` bytes or more;
    2, the L2, where it holds less or the system does not say. `$SPECFX_PREFETCH` ("l1", "l2")
    decides instead. Read when specfx is imported (`AHEAD_LOCALITY`); it is part of `VERSION`,
    so that a graph compiled with the other level is another graph for Inductor's cache."""
    named = os.environ.get(PREFETCH_ENV, "").strip().lower()
    if named:
        if named not in ("l1", "l2"):
            raise ValueError(f"${PREFETCH_ENV} must be l1 or l2, got {named!r}")
        return 3 if named == "l1" else 2
    size = l1_data_cache()
    return 3 if size is not None and size >= L1_PREFETCH_FROM else 2


def _version(locality: int) -> int:
    return int(hashlib.sha256((SOURCE + ATTEND_SOURCE + Path(__file__).read_text() + f"ahead={locality}").encode())
               .hexdigest()[:7], 16)


AHEAD_LOCALITY = ahead_locality()       # what the compiled kernels define, as of this import
VERSION = _version(AHEAD_LOCALITY)


# `tiled_linear`'s 2-D weights (its rows: float32), as the kernel's C++ parameter.
WEIGHT_DTYPES = {torch.float32: "const float* W", torch.bfloat16: "const uint16_t* W", torch.int8: "const int8_t* W"}
def store_rows(w: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A weight [N, K] as `tiled_linear` reads it in `dtype`: (stored, scale). int8 keeps each row
    as integers in [-127, 127] times the row's scale (its largest magnitude over 127; scale [N],
    in w's dtype, multiplies the product's columns); bfloat16 rounds it (scale None)."""
    if dtype != torch.int8:
        return w.to(dtype), None
    scale = w.float().abs().amax(1).clamp_min(torch.finfo(torch.float32).tiny) / 127
    return (w.float() / scale[:, None]).round().clamp(-127, 127).to(dtype), scale.to(w.dtype)


# A kernel's inputs as its C++ parameters (then `float* Y`, `const int64_t M`, `const int64_t N`).
_TWO = ["const float* X", "const float* W"]


@torch.library.custom_op("specfx::tiled_linear", mutates_args=())
def tiled_linear(x: torch.Tensor, w: torch.Tensor, version: int) -> torch.Tensor:
    """x [M, K] @ w[N, K].T -> [M, N]; batched: x [B, M, K], w [B, N, K] -> [B, M, N]. A 2-D
    weight may be bfloat16, which the kernel widens as it loads, or int8, against which x's rows
    are quantized too (`quantized_reference`); x and the result stay float32."""
    if w.dtype == torch.int8:
        return quantized_reference(x, w)
    if w.dim() == 2:
        return F.linear(x, w.to(x.dtype))
    return torch.matmul(x, w.transpose(-1, -2))


def quantized_reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`tiled_linear` of float32 rows x [..., K] and an int8 weight w [N, K], as the kernel
    computes it, to the last bit (see `linear_q8` in the header): each row quantized to integers
    in [-127, 127] (x / s rounded half to even, s its largest magnitude over 127, or 1), the
    products with w summed exactly (float64 holds every such sum), then rounded to float32 and
    scaled by s."""
    top = x.abs().amax(-1, keepdim=True)
    s = torch.where(top > 0, top / 127, torch.ones_like(top))
    q = (x * (1 / s)).round().clamp(-127, 127)
    return (q.double() @ w.double().T).float() * s


@tiled_linear.register_fake
def _(x, w, version):
    return x.new_empty(*x.shape[:-1], w.shape[-2])


@torch.library.custom_op("specfx::tiled_linears", mutates_args=())
def tiled_linears(x: torch.Tensor, ws: list[torch.Tensor], version: int) -> torch.Tensor:
    """x [M, K] @ [w_0; w_1; ...].T -> [M, N_0 + N_1 + ...]: `tiled_linear` of several 2-D weights
    of one dtype, all read by one kernel (`linears` in the header); each output is the one
    `tiled_linear` gives."""
    return torch.cat([tiled_linear(x, w, version) for w in ws], -1)


@tiled_linears.register_fake
def _(x, ws, version):
    return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in ws))


@torch.library.custom_op("specfx::tiled_glu", mutates_args=())
def tiled_glu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, version: int) -> torch.Tensor:
    """silu(x [M, K] @ w_gate[N, K].T) * (x @ w_up[N, K].T) -> [M, N], float32 or bfloat16
    weights of one dtype (each product as `tiled_linear` computes it; the kernel's exponential
    is within a few ulp of torch's)."""
    return F.silu(tiled_linear(x, w_gate, version)) * tiled_linear(x, w_up, version)


@tiled_glu.register_fake
def _(x, w_gate, w_up, version):
    return x.new_empty(*x.shape[:-1], w_gate.shape[0])


@torch.library.custom_op("specfx::tiled_mix", mutates_args=())
def tiled_mix(p: torch.Tensor, v: torch.Tensor, version: int) -> torch.Tensor:
    """p [B, M, L] @ v [B, L, D] -> [B, M, D]."""
    return torch.matmul(p, v)


@tiled_mix.register_fake
def _(p, v, version):
    return p.new_empty(*p.shape[:-1], v.shape[-1])


@torch.library.custom_op("specfx::tiled_attend", mutates_args=())
def tiled_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float,
                 version: int) -> torch.Tensor:
    """Attention of q [B * Hkv, R, D] over k, v [B * Hkv, L, D]: row r of head (b, h) adds row
    r % W of bias [B, W, L] to its scaled scores (0 where it sees a slot, -inf where not; R =
    G * W: a kv head's G query heads)."""
    return attend_reference(q, k, v, bias, scale)


@tiled_attend.register_fake
def _(q, k, v, bias, scale, version):
    return q.new_empty(q.shape)


def attend_reference(q, k, v, bias, scale: float) -> torch.Tensor:
    """`tiled_attend` in torch ops: the scores, their masked softmax and the weighted values."""
    B, W, L = bias.shape
    heads, R, D = q.shape
    bias = bias[:, None].expand(B, heads // B, W, L).repeat(1, 1, R // W, 1).reshape(heads, R, L)
    return (q @ k.transpose(-1, -2) * scale + bias).softmax(-1) @ v


def attend_rows(R: int, D: int) -> int:
    """Query rows per task of `tiled_attend` (4, 2 or 1): the most that the mix's accumulators
    allow (`mix`'s rule), up to R. Fewer rows split pycoder's 5 heads more evenly between two
    threads but read each head's keys and values once per tile: at 4 rows, 5 tasks of 4 rows
    took 11.7 us a layer where 10 tasks of 2 took 14.4 (a 192-slot span, a C++ loop over 12
    layers' caches)."""
    lanes = 16
    most = 4 if D // lanes < 8 else 2 if D // lanes < 16 else 1
    return next(rm for rm in (4, 2, 1) if rm <= most and rm <= R)


def mix_fits(v_shape, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `tiled_mix` compiles for values of this shape: float32 CPU rows of whole vectors
    (a multiple of 16 elements covers AVX-512's and AVX2's), at most 256 of them."""
    D = v_shape[-1]
    return dtype == torch.float32 and device.type == "cpu" and isinstance(D, int) and D % 16 == 0 and D <= 256


@cache
def register() -> None:
    """Register the Inductor lowerings (once per process): each op becomes a `Tiled` buffer."""
    from torch._inductor import ir, lowering
    from torch._inductor.utils import parallel_num_threads
    from torch._inductor.virtualized import V

    def contiguous(t):
        """t as a contiguous buffer that starts at its storage's first element."""
        t = ir.ExternKernel.require_contiguous(t)
        return ir.ExternKernel.copy_input(t) if t.get_layout().offset != 0 else t

    def rows(t):
        """t [B, R, C] as the kernels read it, R the span they are handed: (buffer, the C++ expression
        of its batch stride, its offset). A KV buffer's span is a view whose rows are whole and static
        apart; anything else is copied contiguous, its batches then R * C apart (N * C in the call)."""
        t = ir.ExternKernel.realize_input(t)
        stride, offset = t.get_stride(), t.get_layout().offset
        C = t.get_size()[-1]
        static = all(getattr(e, "is_Integer", isinstance(e, int)) for e in (*stride, offset, C))
        if static and stride[-1] == 1 and stride[-2] == C:
            return t, str(int(stride[0])), int(offset)
        return contiguous(t), f"N * {int(C)}", 0

    class Tiled(ir.ExternKernelOut):
        """One of the header's kernels, defined in and called from the graph's code. `call`
        is the C++ statement in the kernel's body (its inputs by the names in `params`, X and W
        unless given; Y the output; M: the rows, N: the span, each a size that may be symbolic,
        passed at each call)."""

        def __init__(self, layout, inputs, call: str, rows, span, params=_TWO):
            super().__init__(layout, inputs)
            self.call, self.rows, self.span, self.params = call, rows, span, params

        def codegen(self, wrapper) -> None:
            params = [*self.params, "float* Y", "const int64_t M", "const int64_t N"]
            name = _define(wrapper, self.call.replace("THREADS", str(parallel_num_threads())), params)
            args = [t.get_name() for t in self.inputs] + [self.get_name(), wrapper.codegen_sizevar(self.rows),
                                                          wrapper.codegen_sizevar(self.span)]
            wrapper.generate_kernel_call(name, args, triton=False,
                                         arg_types=[p.rsplit(" ", 1)[0] for p in params])

    def _define(wrapper, call: str, params: list[str]) -> str:
        """The kernel for this call, defined once per graph (as Inductor defines its own)."""
        from torch._inductor import config

        marker = "SPECFX_TILED_KERNEL"
        record = ""
        if config.cpp.enable_kernel_profile:        # as Inductor's kernels: an event named by the call
            record = f'torch::aot_inductor::RAIIAtenRecordFunctionHandle record_("{call}", nullptr); '
        src = (f"#include <torch/csrc/inductor/cpp_prefix.h>\n"
               + ("#include <torch/csrc/inductor/aoti_runtime/utils.h>\n" if record else "")
               + f"#define SPECFX_AHEAD_LOCALITY {AHEAD_LOCALITY}\n"
               + f"{SOURCE}\n" + (f"{ATTEND_SOURCE}\n" if "attend" in call else "")
               + f'extern "C" void {marker}({", ".join(params)})\n'
               f"{{ {record}{call}; }}\n")
        if src in wrapper.src_to_kernel:
            return wrapper.src_to_kernel[src]
        name = f"cpp_specfx_tiled_{wrapper.next_kernel_suffix()}"
        wrapper.src_to_kernel[src] = name
        code = src.replace(marker, name if V.graph.cpp_wrapper else "kernel")
        first = code.rfind('extern "C"')
        definition = code[first:code.find(")", first) + 1] + ";\n"
        arg_types = [p.rsplit(" ", 1)[0] for p in params]
        body = code if V.graph.cpp_wrapper else f"async_compile.cpp_pybinding({arg_types!r}, r'''\n{code}''')"
        wrapper.define_kernel(name, body, gpu=False, cpp_definition=definition)
        return name

    @lowering.register_lowering(torch.ops.specfx.tiled_linear.default, type_promotion_kind=None)   # w as stored
    def _lower_linear(x, w, version):
        x = contiguous(x)
        *lead, M, K = x.get_size()
        if len(lead) > 1 or len(w.get_size()) != len(lead) + 2:
            raise NotImplementedError(f"tiled_linear takes x [M, K] and w [N, K], or x [B, M, K] and w [B, N, K]; "
                                      f"got x {list(x.get_size())}, w {list(w.get_size())}")
        if len(w.get_size()) == 2:
            w, wb, offset = contiguous(w), 0, 0
        else:
            w, wb, offset = rows(w)
        N, batches = w.get_size()[-2], (int(lead[0]) if lead else 1)
        layout = ir.FixedLayout(x.get_device(), torch.float32, [*lead, M, N])
        call = f"specfx_tiled::linear(M, X, W + {offset}, Y, {batches}, N, {int(K)}, {wb}, THREADS)"
        params = ["const float* X", WEIGHT_DTYPES[w.get_dtype()]]
        return ir.TensorBox.create(Tiled(layout, [x, w], call, M, N, params))

    @lowering.register_lowering(torch.ops.specfx.tiled_linears.default, type_promotion_kind=None)
    def _lower_linears(x, ws, version):
        x, ws = contiguous(x), [contiguous(w) for w in ws]
        dtypes = {w.get_dtype() for w in ws}
        if len(x.get_size()) != 2 or any(len(w.get_size()) != 2 for w in ws) or len(dtypes) != 1:
            raise NotImplementedError(f"tiled_linears takes x [M, K] and 2-D weights of one dtype; got x "
                                      f"{list(x.get_size())}, weights {[list(w.get_size()) for w in ws]} of {dtypes}")
        M, K = x.get_size()
        ns = [int(w.get_size()[0]) for w in ws]
        weight = WEIGHT_DTYPES[dtypes.pop()].rsplit(" ", 1)[0]
        names = [f"W{g}" for g in range(len(ws))]
        call = (f"{weight} ws[] = {{{', '.join(names)}}}; const long ns[] = {{{', '.join(map(str, ns))}}}; "
                f"specfx_tiled::linears<{len(ws)}>(M, X, ws, ns, Y, {int(K)}, THREADS)")
        layout = ir.FixedLayout(x.get_device(), torch.float32, [M, sum(ns)])
        params = ["const float* X", *(f"{weight} {name}" for name in names)]
        return ir.TensorBox.create(Tiled(layout, [x, *ws], call, M, sum(ns), params))

    @lowering.register_lowering(torch.ops.specfx.tiled_glu.default, type_promotion_kind=None)
    def _lower_glu(x, w_gate, w_up, version):
        x, w_gate, w_up = contiguous(x), contiguous(w_gate), contiguous(w_up)
        dtypes = {w_gate.get_dtype(), w_up.get_dtype()}
        if len(x.get_size()) != 2 or w_gate.get_size() != w_up.get_size() or len(dtypes) != 1 \
                or torch.int8 in dtypes:
            raise NotImplementedError(f"tiled_glu takes x [M, K] and two float32 or bfloat16 weights [N, K] of one "
                                      f"dtype; got x {list(x.get_size())}, weights {list(w_gate.get_size())} and "
                                      f"{list(w_up.get_size())} of {dtypes}")
        (M, K), N = x.get_size(), int(w_gate.get_size()[0])
        weight = WEIGHT_DTYPES[dtypes.pop()].rsplit(" ", 1)[0]
        call = f"specfx_tiled::glu(M, X, W0, W1, Y, N, {int(K)}, THREADS)"
        layout = ir.FixedLayout(x.get_device(), torch.float32, [M, N])
        params = ["const float* X", f"{weight} W0", f"{weight} W1"]
        return ir.TensorBox.create(Tiled(layout, [x, w_gate, w_up], call, M, N, params))

    @lowering.register_lowering(torch.ops.specfx.tiled_mix.default)
    def _lower_mix(p, v, version):
        p = contiguous(p)
        if len(p.get_size()) != 3 or len(v.get_size()) != 3:
            raise NotImplementedError(f"tiled_mix takes p [B, M, L] and v [B, L, D]; "
                                      f"got p {list(p.get_size())}, v {list(v.get_size())}")
        B, M, L = p.get_size()
        v, vb, offset = rows(v)
        D = int(v.get_size()[-1])
        layout = ir.FixedLayout(p.get_device(), torch.float32, [B, M, D])
        call = f"specfx_tiled::mix<{int(M)}, {D}>(X, W + {offset}, Y, {int(B)}, N, {vb}, THREADS)"
        return ir.TensorBox.create(Tiled(layout, [p, v], call, M, L))

    @lowering.register_lowering(torch.ops.specfx.tiled_attend.default)
    def _lower_attend(q, k, v, bias, scale, version):
        bias.realize()            # one buffer for every layer that reads this mask, not a copy each
        q, bias = contiguous(q), contiguous(bias)
        (heads, R, D), W = q.get_size(), bias.get_size()[1]
        heads, D, B = int(heads), int(D), int(bias.get_size()[0])
        G = V.graph.sizevars.simplify(R / W)           # R = G * W rows, W symbolic in a prefill
        k, kb, koff = rows(k)
        v, vb, voff = rows(v)
        L = k.get_size()[1]
        RM = attend_rows(R if isinstance(R, int) or getattr(R, "is_Integer", False) else 4, D)
        layout = ir.FixedLayout(q.get_device(), torch.float32, [heads, R, D])
        call = (f"specfx_tiled::attend<{RM}, {D}>(Q, K + {koff}, {kb}, Vv + {voff}, {vb}, S, Y, {heads}, "
                f"{heads // B}, M, M / {int(G)}, N, (float){float(scale)!r}, THREADS)")      # rounded as torch rounds it
        params = ["const float* Q", "const float* K", "const float* Vv", "const float* S"]
        return ir.TensorBox.create(Tiled(layout, [q, k, v, bias], call, R, L, params))


@cache
def available() -> tuple[bool, str]:
    """(whether Inductor here compiles the tiled kernels and they compute what they should,
    why not otherwise). Compiles a small graph once per process."""
    from torch import fx

    from specfx.runtime.compile import compile_graph

    def probe(x, w, kv, span):
        keys = kv[:, :span.shape[0]]                            # a span of a cache, of any length
        scores = torch.ops.specfx.tiled_linear(x[None], keys, VERSION)
        bias = torch.zeros(1, 3, span.shape[0])
        return (torch.ops.specfx.tiled_linear(x, w, VERSION) + 1, torch.ops.specfx.tiled_mix(scores, keys, VERSION),
                torch.ops.specfx.tiled_attend(x[None], keys, keys, bias, 0.5, VERSION))

    try:
        register()
        x, w, kv = torch.randn(3, 32), torch.randn(37, 32), torch.randn(1, 40, 32)   # partial blocks
        fn = compile_graph(fx.symbolic_trace(probe), "inductor", dynamic={"span": (0,)})
        for L in (20, 36):
            out = fn(x, w, kv, torch.empty(L))
            keys = kv[0, :L]
            want = F.linear(x, w) + 1, (x @ keys.T) @ keys, (x @ keys.T * 0.5).softmax(-1) @ keys
            for got, want in zip(out, want):
                torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-4, atol=1e-4)
    except Exception as e:                                      # noqa: BLE001 - any failure: not offered
        return False, f"the tiled kernels do not compile here ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    return True, "compiled and checked"


@cache
def _probes():
    """The header's probes (`stream_sum`, `fma_peak`, `handoff`) as ctypes calls, compiled once per process
    by Inductor's C++ code cache with the flags of the kernels it compiles into a graph."""
    from torch._inductor.codecache import CppCodeCache

    lib = CppCodeCache.load(f"{SOURCE}\n"
                            'extern "C" float specfx_stream_sum(const float* p, long n, int threads)\n'
                            "{ return specfx_tiled::stream_sum(p, n, threads); }\n"
                            'extern "C" float specfx_fma_peak(long iters, int threads)\n'
                            "{ return specfx_tiled::fma_peak(iters, threads); }\n"
                            'extern "C" int specfx_fma_lanes()\n'
                            "{ return specfx_tiled::FMA_ACCUMULATORS * specfx_tiled::V; }\n"
                            'extern "C" double specfx_handoff(long trips, int threads)\n'
                            "{ return specfx_tiled::handoff(trips, threads); }\n")
    lib.specfx_stream_sum.restype = lib.specfx_fma_peak.restype = ctypes.c_float
    lib.specfx_stream_sum.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    lib.specfx_fma_peak.argtypes = [ctypes.c_long, ctypes.c_int]
    lib.specfx_handoff.restype = ctypes.c_double
    lib.specfx_handoff.argtypes = [ctypes.c_long, ctypes.c_int]
    return lib


def stream_sum():
    """A call `f(t) -> float` that sums a contiguous float32 CPU tensor with the header's
    `stream_sum`, on Inductor's thread count at the call."""
    from torch._inductor.utils import parallel_num_threads

    fn = _probes().specfx_stream_sum

    def call(t: torch.Tensor) -> float:
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"stream_sum reads a contiguous float32 CPU tensor, got {t.dtype} on {t.device}")
        return fn(t.data_ptr(), t.numel(), parallel_num_threads())

    return call


def fma_peak(iters: int = 100_000):
    """(`f() -> float`, flops): a call that runs the header's `fma_peak` (`iters` rounds of
    register-only FMAs on Inductor's thread count) and the float32 operations it performs (a
    multiply-add counts two)."""
    from torch._inductor.utils import parallel_num_threads

    lib, threads = _probes(), parallel_num_threads()
    flops = 2 * iters * lib.specfx_fma_lanes() * threads            # accumulators x lanes a thread
    return (lambda: lib.specfx_fma_peak(iters, threads)), flops


def handoff(trips: int = 2000):
    """A call `f() -> float | None`: the mean nanoseconds of a round trip of one cache line
    between threads 0 and 1 of Inductor's thread count (the header's `handoff`, `trips` of them),
    or None on one thread. Tens of nanoseconds where the two share a last-level cache, several
    times that across chiplets: what each value a kernel's thread reads from the other's writes
    costs in a step."""
    from torch._inductor.utils import parallel_num_threads

    lib, threads = _probes(), parallel_num_threads()

    def call() -> float | None:
        ns = lib.specfx_handoff(trips, threads) if threads >= 2 else -1.0
        return ns if ns > 0 else None

    return call
