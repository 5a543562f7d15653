"""The tiled few-row kernel: compiled into a graph, it computes x @ w.T for every shape class
(partial blocks, partial vectors, rows in tiles of 4, 2 and 1), as C++ the wrapper calls directly."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from specfx.kernels import tiled_linear
from specfx.runtime.compile import compile_graph

# (M, N, K): every query-row remainder (tiles of 4, 2, 1), weight rows in whole blocks of 16 and
# past them (and fewer than a block), K in whole vectors and not; a verify's 3 or 4 rows over
# short weight rows (read one after another under AVX2) and long ones (side by side); 5 to 16
# rows read as one stream, padded to whole tiles of four (5, 7 and 10 rows) or not (8, 16).
SHAPES = [(1, 64, 64), (2, 37, 40), (3, 8, 16), (4, 96, 33), (5, 100, 333), (7, 48, 320), (16, 160, 80), (17, 20, 24),
          (4, 40, 524), (3, 21, 864), (8, 64, 48), (10, 50, 96)]


def _graph(n: int) -> fx.GraphModule:
    """(x_0, w_0, x_1, w_1, ...) -> [tiled_linear(x_i, w_i) ...]."""
    graph = fx.Graph()
    outs = []
    for i in range(n):
        x, w = graph.placeholder(f"x{i}"), graph.placeholder(f"w{i}")
        outs.append(graph.call_function(torch.ops.specfx.tiled_linear.default, (x, w, tiled_linear.VERSION)))
    graph.output(outs)
    return fx.GraphModule(torch.nn.Module(), graph)


def test_eager_ops_are_the_products():
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    torch.testing.assert_close(torch.ops.specfx.tiled_linear(x, w, tiled_linear.VERSION), x @ w.T)
    xb, wb, v = torch.randn(2, 3, 8), torch.randn(2, 5, 8), torch.randn(2, 5, 16)
    torch.testing.assert_close(torch.ops.specfx.tiled_linear(xb, wb, tiled_linear.VERSION), xb @ wb.transpose(1, 2))
    torch.testing.assert_close(torch.ops.specfx.tiled_mix(wb.transpose(1, 2), v, tiled_linear.VERSION),
                               wb.transpose(1, 2) @ v)


@pytest.mark.slow
def test_attention_kernels_read_a_span_of_a_cache_in_place():
    """Scores of queries against the first L slots of a [B, S, D] cache, and the weighted sum of
    its values, for spans of several lengths through one compiled graph (L is symbolic): every
    query-row tile, whole and partial blocks of slots, rows of 1 to 16 vectors."""
    from torch._inductor.utils import run_and_get_code

    def attend(q, p, k, v, span):
        L = span.shape[0]
        return (torch.ops.specfx.tiled_linear(q, k[:, :L], tiled_linear.VERSION),
                torch.ops.specfx.tiled_mix(p[:, :, :L], v[:, :L], tiled_linear.VERSION))

    gen = torch.Generator().manual_seed(1)
    for M, D in ((1, 64), (5, 16), (6, 128), (16, 64), (3, 256)):          # 256: the widest head mix_fits takes
        q, p = torch.randn(3, M, D, generator=gen), torch.randn(3, M, 90, generator=gen)
        k, v = torch.randn(3, 90, D, generator=gen), torch.randn(3, 90, D, generator=gen)
        fn = compile_graph(fx.symbolic_trace(attend), "inductor", dynamic={"span": (0,)})
        _, codes = run_and_get_code(lambda: fn(q, p, k, v, torch.empty(5)))      # compiled here, once
        code = max(codes, key=len)
        assert "specfx_tiled::mix<" in code and "specfx_tiled::linear(" in code
        for L in (17, 64, 90):
            scores, mixed = fn(q, p, k, v, torch.empty(L))
            torch.testing.assert_close(scores, q @ k[:, :L].transpose(1, 2), rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(mixed, p[:, :, :L] @ v[:, :L], rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_compiled_kernel_matches_float64_on_every_shape_class():
    from torch._inductor.utils import run_and_get_code

    assert tiled_linear.available() == (True, "compiled and checked")
    gen = torch.Generator().manual_seed(0)
    args = [t for M, N, K in SHAPES for t in (torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen))]
    fn = compile_graph(_graph(len(SHAPES)), "inductor")
    outs, codes = run_and_get_code(lambda: fn(*args))
    code = max(codes, key=len)
    # The kernel is compiled into the graph and called from its C++ wrapper: no dispatcher call.
    assert code.count("specfx_tiled::linear(M,") == len(SHAPES) and "aoti_torch_call_dispatcher" not in code
    for (M, N, K), x, w, y in zip(SHAPES, args[::2], args[1::2], outs):
        ref = x.double() @ w.double().T
        err = ((y.double() - ref).abs() / (ref.abs() + 1)).max().item()
        assert y.shape == (M, N) and err < 1e-5, (M, N, K, err)


@pytest.mark.slow
def test_python_wrapper_compiles_it_too():
    """Inductor's Python wrapper (no cpp_wrapper) binds the kernel as it binds its own."""
    tiled_linear.register()
    x, w = torch.randn(6, 48), torch.randn(40, 48)
    gm = fx.symbolic_trace(lambda x, w: torch.ops.specfx.tiled_linear(x, w, tiled_linear.VERSION) * 2)
    out = torch._inductor.compile(gm, [x, w])(x, w)
    torch.testing.assert_close(out[0] if isinstance(out, (list, tuple)) else out, (x @ w.T) * 2,
                               rtol=1e-4, atol=1e-4)


def test_the_weight_stream_prefetches_into_l1_only_where_the_l1_is_large(monkeypatch):
    monkeypatch.delenv(tiled_linear.PREFETCH_ENV, raising=False)
    for size, level in ((48 * 1024, 3), (64 * 1024, 3), (32 * 1024, 2), (None, 2)):
        monkeypatch.setattr(tiled_linear, "l1_data_cache", lambda size=size: size)
        assert tiled_linear.ahead_locality() == level, size
    monkeypatch.setenv(tiled_linear.PREFETCH_ENV, "l1")
    assert tiled_linear.ahead_locality() == 3
    monkeypatch.setenv(tiled_linear.PREFETCH_ENV, "L2")
    assert tiled_linear.ahead_locality() == 2
    monkeypatch.setenv(tiled_linear.PREFETCH_ENV, "l3")
    with pytest.raises(ValueError, match="l1 or l2"):
        tiled_linear.ahead_locality()


def test_kernel_timings_and_graphs_are_kept_per_prefetch_level(monkeypatch):
    from torch._inductor import config

    from specfx.matmul_choice import _kernel_flags

    assert tiled_linear._version(2) != tiled_linear._version(3)     # Inductor's cache: another graph
    flags = {}
    for locality in (3, 2):
        monkeypatch.setattr(tiled_linear, "AHEAD_LOCALITY", locality)
        flags[locality] = _kernel_flags()
    assert "ahead=3" in flags[3] and "ahead=2" in flags[2]
    with config.patch({"cpp.enable_kernel_profile": True}):
        assert _kernel_flags() != flags[2]           # each kernel's event slows it: not a machine's timing


@pytest.mark.slow
def test_either_prefetch_level_compiles_into_the_graph_and_computes_the_same(monkeypatch):
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    shapes = [(4, 96, 320), (8, 64, 864)]             # tiles of four reading the weights as one stream
    gen = torch.Generator().manual_seed(0)
    args = [t for M, N, K in shapes for t in (torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen))]
    outs = {}
    for locality in (3, 2):
        monkeypatch.setattr(tiled_linear, "AHEAD_LOCALITY", locality)
        fn = compile_graph(_graph(len(shapes)), "inductor")
        with config.patch({"fx_graph_cache": False}):            # compiled at the first call
            outs[locality], codes = run_and_get_code(lambda fn=fn: fn(*args))
        assert f"#define SPECFX_AHEAD_LOCALITY {locality}" in max(codes, key=len)
    for a, b in zip(outs[3], outs[2]):
        assert torch.equal(a, b)
