"""specfx's few-row matmul on the CPU, as an op that Inductor compiles into the step.

- `tiled_linear(x [M, K], w [N, K]) -> [M, N]` (`torch.ops.specfx.tiled_linear`): x @ w.T. Run
  eagerly (the eager backend, torch.export) it is `F.linear`; compiled by Inductor it is
  `tiled_linear.h`, a register-tiled C++ kernel that reads each weight row once for all M rows
  and sums a tile's accumulators across lanes together (see the header).
- The kernel is defined in the compiled graph's own C++ source and called from its wrapper like
  Inductor's generated kernels: no dispatcher call, no Python, and the graph keeps its buffers
  on the stack (`runtime.compile`).
- `register()` gives Inductor the lowering (`runtime.compile` calls it before compiling);
  `available()` says whether this torch's Inductor compiles it (a small graph, compiled and
  checked once per process); where it does not, the skinny-matmul plan does not offer it.

Its third argument is `VERSION`, a hash of the header, so that a changed kernel is a changed
graph for Inductor's cache. fp32 on the CPU only; the skinny-matmul pass inserts it nowhere else.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

SOURCE = Path(__file__).with_name("tiled_linear.h").read_text()
VERSION = int(hashlib.sha256(SOURCE.encode()).hexdigest()[:7], 16)
_ARG_TYPES = ["const float*", "const float*", "float*"]


@torch.library.custom_op("specfx::tiled_linear", mutates_args=())
def tiled_linear(x: torch.Tensor, w: torch.Tensor, version: int) -> torch.Tensor:
    """x [M, K] @ w[N, K].T -> [M, N]."""
    return F.linear(x, w)


@tiled_linear.register_fake
def _(x, w, version):
    return x.new_empty(x.shape[0], w.shape[0])


@cache
def register() -> None:
    """Register the Inductor lowering (once per process): the op becomes a `TiledLinear` buffer."""
    from torch._inductor import ir, lowering
    from torch._inductor.utils import parallel_num_threads
    from torch._inductor.virtualized import V

    def plain(t):
        """t as a contiguous buffer that starts at its storage's first element."""
        t = ir.ExternKernel.require_contiguous(t)
        return ir.ExternKernel.copy_input(t) if t.get_layout().offset != 0 else t

    class TiledLinear(ir.ExternKernelOut):
        """y = x @ w.T through `tiled_linear.h`, defined in and called from the graph's code."""

        def codegen(self, wrapper) -> None:
            x, w = self.inputs
            M, K = (int(s) for s in x.get_size())
            N = int(w.get_size()[0])
            name = _define(wrapper, M, N, K, parallel_num_threads())
            wrapper.generate_kernel_call(name, [x.get_name(), w.get_name(), self.get_name()],
                                         triton=False, arg_types=_ARG_TYPES)

    def _define(wrapper, M: int, N: int, K: int, threads: int) -> str:
        """The kernel for this shape, defined once per graph (as Inductor defines its own)."""
        marker = "SPECFX_TILED_LINEAR_KERNEL"
        src = (f"#include <torch/csrc/inductor/cpp_prefix.h>\n{SOURCE}\n"
               f'extern "C" void {marker}(const float* X, const float* W, float* Y)\n'
               f"{{ specfx_tiled::linear<{M}>(X, W, Y, {N}, {K}, {threads}); }}\n")
        if src in wrapper.src_to_kernel:
            return wrapper.src_to_kernel[src]
        name = f"cpp_specfx_tiled_linear_{wrapper.next_kernel_suffix()}"
        wrapper.src_to_kernel[src] = name
        code = src.replace(marker, name if V.graph.cpp_wrapper else "kernel")
        first = code.rfind('extern "C"')
        definition = code[first:code.find(")", first) + 1] + ";\n"
        body = code if V.graph.cpp_wrapper else f"async_compile.cpp_pybinding({_ARG_TYPES!r}, r'''\n{code}''')"
        wrapper.define_kernel(name, body, gpu=False, cpp_definition=definition)
        return name

    @lowering.register_lowering(torch.ops.specfx.tiled_linear.default)
    def _lower(x, w, version):
        x, w = plain(x), plain(w)
        M, K = x.get_size()
        layout = ir.FixedLayout(x.get_device(), torch.float32, [M, w.get_size()[0]])
        return ir.TensorBox.create(TiledLinear(layout, [x, w]))


@cache
def available() -> tuple[bool, str]:
    """(whether Inductor here compiles `tiled_linear` to the kernel and it computes x @ w.T,
    why not otherwise). Compiles a small graph once per process."""
    from torch import fx

    from specfx.runtime.compile import compile_graph

    try:
        register()
        gm = fx.symbolic_trace(lambda x, w: torch.ops.specfx.tiled_linear(x, w, VERSION) + 1)
        x, w = torch.randn(3, 40), torch.randn(37, 40)          # a partial block, a partial vector
        out = compile_graph(gm, "inductor")(x, w)
        torch.testing.assert_close(out, F.linear(x, w) + 1, rtol=1e-4, atol=1e-4)
    except Exception as e:                                      # noqa: BLE001 - any failure: not offered
        return False, f"the tiled kernel does not compile here ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    return True, "compiled and checked"
