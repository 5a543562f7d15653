"""The tiled kernels compiled by Inductor (`specfx.kernels.tiled_linear`): rows that vary per
call, batched operands that are not a view of a static buffer, and shapes they do not take."""

import pytest
import torch
import torch.nn.functional as F
from torch import fx

from specfx.kernels import tiled_linear
from specfx.runtime.compile import compile_graph

pytestmark = pytest.mark.skipif(not tiled_linear.available()[0], reason=tiled_linear.available()[1])


def test_rows_that_vary_per_call_through_one_compiled_graph():
    """A prefill's width is symbolic: one graph serves every row count, each tile shape (4, 2
    and 1 rows, and 3 rows left over as a padded tile of 4) and a partial block of weight rows
    (N = 40 is two blocks of 16 and 8 more)."""
    V = tiled_linear.VERSION
    fn = compile_graph(fx.symbolic_trace(lambda x, w: torch.ops.specfx.tiled_linear(x, w, V)), "inductor",
                       dynamic={"x": (0,)})
    w = torch.randn(40, 24)
    for M in (64, 7, 2, 1, 33, 3, 11):
        x = torch.randn(M, 24)
        torch.testing.assert_close(fn(x, w), x @ w.T, rtol=1e-4, atol=1e-4)


def test_batched_operands_that_are_not_whole_rows_of_a_static_buffer():
    """Keys that are not whole rows of a static buffer (here a cache laid out [B, D, S], read
    transposed over a span) are copied, their batches then a span apart; two batches check it."""
    V = tiled_linear.VERSION

    def f(x, kv, span):
        keys = kv[:, :, : span.shape[0]].transpose(1, 2)        # [B, L, D], L symbolic, columns apart
        scores = torch.ops.specfx.tiled_linear(x, keys, V)      # [B, M, L]
        return scores, torch.ops.specfx.tiled_mix(scores, keys, V)

    fn = compile_graph(fx.symbolic_trace(f), "inductor", dynamic={"span": (0,)})
    x, kv = torch.randn(2, 3, 32), torch.randn(2, 32, 40)
    for L in (20, 36):
        scores, mixed = fn(x, kv, torch.empty(L))
        keys = kv[:, :, :L].transpose(1, 2)
        torch.testing.assert_close(scores, x @ keys.transpose(1, 2), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(mixed, (x @ keys.transpose(1, 2)) @ keys, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("B,Hkv,G,W,D", [(1, 5, 1, 4, 64), (2, 2, 2, 3, 64), (1, 5, 1, 1, 64), (1, 3, 1, 8, 128)])
def test_fused_attention_equals_its_torch_form(B, Hkv, G, W, D):
    """`tiled_attend` compiled (scores, masked softmax and weighted values in one kernel) against
    the same math in torch ops, over spans of one compiled graph (a partial block of slots: 37,
    70; whole blocks: 64), grouped query heads (row r of a kv head reads mask row r % W), two
    batches (each its own mask), tiles of 4, 2 and 1 query rows, and masks with holes (a tree's)."""
    def f(q, kv, vv, bias, span):
        L = span.shape[0]
        return torch.ops.specfx.tiled_attend(q, kv[:, :L], vv[:, :L], bias[:, :, :L], 0.125, tiled_linear.VERSION)

    fn = compile_graph(fx.symbolic_trace(f), "inductor", dynamic={"span": (0,), "bias": (2,)})
    S = 100
    q = torch.randn(B * Hkv, G * W, D)
    kv, vv = torch.randn(B * Hkv, S, D), torch.randn(B * Hkv, S, D)
    for L in (37, 64, 70):
        seen = torch.rand(B, W, S) < 0.7
        seen[..., 0] = True
        bias = torch.where(seen, 0.0, float("-inf"))
        want = tiled_linear.attend_reference(q, kv[:, :L], vv[:, :L], bias[:, :, :L], 0.125)
        torch.testing.assert_close(fn(q, kv, vv, bias, torch.empty(L)), want, rtol=1e-5, atol=1e-5)


def test_fused_attention_at_a_symbolic_width_equals_its_torch_form():
    """A prefill chunk's attention: one compiled graph whose query width is symbolic (rows and
    mask rows passed at each call), causal over a span of the cache, against the torch form at
    several widths (whole tiles of 4 query rows and a remainder)."""
    def f(q, kv, vv, span):
        L, W = span.shape[0], q.shape[1]
        pos = torch.arange(W) + (L - W)
        bias = torch.where(torch.arange(L) <= pos[:, None], 0.0, float("-inf"))[None]      # [1, W, L]
        return torch.ops.specfx.tiled_attend(q, kv[:, :L], vv[:, :L], bias, 0.125, tiled_linear.VERSION)

    fn = compile_graph(fx.symbolic_trace(f), "inductor", dynamic={"span": (0,), "q": (1,)})
    S, heads, D = 80, 3, 32
    kv, vv = torch.randn(heads, S, D), torch.randn(heads, S, D)
    for W, L in ((13, 40), (8, 64), (30, 70)):
        q = torch.randn(heads, W, D)
        pos = torch.arange(L - W, L)
        bias = torch.where(torch.arange(L) <= pos[:, None], 0.0, float("-inf"))[None]
        want = tiled_linear.attend_reference(q, kv[:, :L], vv[:, :L], bias, 0.125)
        torch.testing.assert_close(fn(q, kv, vv, torch.empty(L)), want, rtol=1e-5, atol=1e-5)


def test_layers_that_share_a_mask_read_one_buffer_of_it():
    """Three layers' `tiled_attend` over one mask (a tree's visibility over a span, as a verify
    graph's layers read it): the bias is computed into one buffer, not a copy for each kernel
    (a step's mask is as wide as the span: a copy a layer cost a kernel and an allocation each)."""
    from torch._inductor.utils import run_and_get_code

    def f(q, kv, visible, span):
        L = span.shape[0]
        bias = torch.where(visible[:, :, :L], 0.0, float("-inf"))
        out = q
        for layer in range(3):
            out = torch.ops.specfx.tiled_attend(out, kv[layer, :, :L], kv[layer, :, :L], bias, 0.125,
                                                tiled_linear.VERSION)
        return out

    fn = compile_graph(fx.symbolic_trace(f), "inductor", dynamic={"span": (0,)})
    q, kv = torch.randn(2, 4, 64), torch.randn(3, 2, 40, 64)
    visible = torch.rand(1, 4, 40) < 0.7
    visible[..., 0] = True
    out, code = run_and_get_code(fn, q, kv, visible, torch.empty(33))
    bias = torch.where(visible[:, :, :33], 0.0, float("-inf"))
    want = q
    for layer in range(3):
        want = tiled_linear.attend_reference(want, kv[layer, :, :33], kv[layer, :, :33], bias, 0.125)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    wrapper = "".join(code)
    assert wrapper.count("empty_strided") == 1, "each layer computed its own copy of the mask"


@pytest.mark.parametrize("dtype, param", [(torch.bfloat16, "const uint16_t* W"), (torch.int8, "const int8_t* W")])
def test_stored_weights_are_widened_as_they_load(dtype, param):
    """A bfloat16 or int8 weight (a draft's, stored at half or a quarter of the bytes) reaches the
    kernel as stored, not converted to float32 in a kernel before it: the result is float32 rows
    times the widened weight, over each tile shape, a partial vector (K = 24) and rows past the
    last block; against int8, rows quantized as `quantized_reference` says, to the last bit."""
    from torch._inductor.utils import run_and_get_code

    V = tiled_linear.VERSION
    w = torch.randn(40, 24).bfloat16() if dtype == torch.bfloat16 else torch.randint(-127, 128, (40, 24), dtype=dtype)
    for M in (1, 4, 5):
        x = torch.randn(M, 24)
        fn = compile_graph(fx.symbolic_trace(lambda x, w: torch.ops.specfx.tiled_linear(x, w, V)), "inductor")
        out, code = run_and_get_code(fn, x, w)
        if dtype == torch.int8:
            torch.testing.assert_close(out, tiled_linear.quantized_reference(x, w), rtol=0, atol=0)
        else:
            torch.testing.assert_close(out, x @ w.float().T, rtol=1e-5, atol=1e-4)
        assert param in "".join(code), "the weight was widened before the kernel"
    want = tiled_linear.quantized_reference(x, w) if dtype == torch.int8 else x @ w.float().T
    torch.testing.assert_close(torch.ops.specfx.tiled_linear(x, w, V), want)                     # eager


@pytest.mark.parametrize("K", [24, 37, 96, 320])
def test_int8_weights_take_quantized_rows_summed_exactly(K):
    """Against an int8 weight each row of x is quantized (scale: its largest magnitude over 127)
    and the integer products summed exactly: the kernel equals `quantized_reference` to the last
    bit (whole 32-wide steps and a remainder), a row of zeros gives zeros, and the result stays
    within the rounding of x's integers of the product with the widened weight."""
    V = tiled_linear.VERSION
    w = torch.randint(-127, 128, (67, K), dtype=torch.int8)
    x = torch.randn(4, K) * torch.tensor([[1.0], [1e-3], [0.0], [50.0]])
    fn = compile_graph(fx.symbolic_trace(lambda x, w: torch.ops.specfx.tiled_linear(x, w, V)), "inductor")
    out = fn(x, w)
    torch.testing.assert_close(out, tiled_linear.quantized_reference(x, w), rtol=0, atol=0)
    assert (out[2] == 0).all()
    bound = (x.abs().amax(-1, keepdim=True) / 127 / 2) * w.float().abs().sum(-1)     # half a step a product
    assert ((out - x @ w.float().T).abs() <= bound + 1e-4).all()


def test_shapes_the_kernels_do_not_take_are_refused():
    V = tiled_linear.VERSION
    fn = compile_graph(fx.symbolic_trace(lambda x, w: torch.ops.specfx.tiled_linear(x, w, V)), "inductor")
    x, w = torch.randn(2, 2, 3, 16), torch.randn(2, 2, 5, 16)
    torch.testing.assert_close(torch.ops.specfx.tiled_linear(x, w, V), x @ w.transpose(-1, -2))   # eager: any batch
    with pytest.raises(Exception, match="tiled_linear takes x"):
        fn(x, w)


def test_the_fma_probe_runs_the_multiply_adds_it_counts():
    """The roofline's compute probe (`fma_peak`): each accumulator lane runs acc = 0.999 acc + 1e-4
    `iters` times, which settles at 0.1, so the sum over every lane of every thread says how many
    lanes it ran; its flop count is two per lane per round; the table shows each step against it."""
    from specfx.roofline import Roofline, StepRoof, render

    iters = 20_000
    fn, flops = tiled_linear.fma_peak(iters)
    lanes = flops / (2 * iters)                                    # accumulators x lanes x threads
    assert lanes % 12 == 0 and fn() == pytest.approx(0.1 * lanes, rel=1e-3)
    r = Roofline("cpu", 2, 200, {"flat": 50.0}, [StepRoof("verify", 8, 10**8, 0, 2.0, flops=2 * 8 * 25 * 10**6)],
                 fma_gflops=100.0)
    assert r.steps[0].gflops == pytest.approx(200.0) and r.to_dict()["steps"][0]["fraction_of_fma_peak"] == 2.0
    assert render(r).columns[-1].header == "of FMA peak"


def test_the_roofline_stream_sums_what_torch_sums():
    """The roofline's hand-written stream (`stream_sum`): every element once, whole chunks of
    eight vectors and a tail, and a clear error for what it does not read."""
    stream = tiled_linear.stream_sum()
    for n in (0, 5, 128, 1000, 4099 * 37):
        x = torch.randn(n, dtype=torch.float64).float()
        assert stream(x) == pytest.approx(x.double().sum().item(), abs=1e-3 * max(1, n) ** 0.5)
    with pytest.raises(ValueError, match="contiguous float32"):
        stream(torch.randn(8, 8).T)


def test_the_handoff_probe_times_round_trips_between_two_threads():
    """`handoff`: on two threads, the mean round trip of a cache line between them, a positive
    number of nanoseconds, the fastest of a few calls under a millisecond (the threads
    alternated; a call while the other thread waits out a time slice, as under a parallel test
    run, takes a slice's worth, and one that outwaits the spin limit gives None); on one thread
    there is no round trip to time."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        trips = [tiled_linear.handoff(500)() for _ in range(5)]
        timed = [ns for ns in trips if ns is not None]
        assert all(ns > 0 for ns in timed) and timed and min(timed) < 1e6, trips
        torch.set_num_threads(1)
        assert tiled_linear.handoff(500)() is None
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gated_mlp_kernel_gates_what_the_linears_give(dtype):
    """`tiled_glu` is silu(gate) * up over what `tiled_linear` gives each weight, its exponential
    within a few ulp of torch's: over every tile shape, whole blocks and the columns past them
    (N = 40: AVX-512's two blocks of 16 and 8 columns past them; AVX2's five blocks of 8), gates
    far into both tails of the silu, and rows symbolic, as in a prefill."""
    V = tiled_linear.VERSION
    wg, wu = (tiled_linear.store_rows(torch.randn(40, 24), dtype)[0] for _ in range(2))
    one = compile_graph(fx.symbolic_trace(lambda x, a, b: [torch.ops.specfx.tiled_linear(x, w, V) for w in (a, b)]),
                        "inductor", dynamic={"x": (0,)})
    glu = compile_graph(fx.symbolic_trace(lambda x, a, b: torch.ops.specfx.tiled_glu(x, a, b, V)),
                        "inductor", dynamic={"x": (0,)})
    for M in (8, 1, 2, 3, 4, 5, 16):                    # the first call's rows compile it: not 1
        x = torch.randn(M, 24) * 8                       # gates of std ~40: some past exp's clamps (+-88)
        gate, up = one(x, wg, wu)
        out = glu(x, wg, wu)
        want = F.silu(gate) * up
        assert out.shape == (M, 40)
        torch.testing.assert_close(out, want, rtol=3e-6, atol=1e-6 * want.abs().max().item())
    eager = torch.ops.specfx.tiled_glu(x, wg, wu, V)                     # F.linear's sums: another order
    torch.testing.assert_close(eager, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_linears_of_one_input_equal_each_linear_to_the_bit(dtype):
    """`tiled_linears` (a layer's q, k and v as one kernel) gives each weight's columns exactly
    what `tiled_linear` gives it alone, over every tile shape and weights with a partial block
    (N = 37, 21) and a partial vector (K = 24), with its rows symbolic, as in a prefill; against
    int8 weights, what `quantized_reference` gives the rows stacked."""
    V = tiled_linear.VERSION
    ws = [tiled_linear.store_rows(torch.randn(n, 24), dtype)[0] for n in (40, 37, 21)]
    one = compile_graph(fx.symbolic_trace(lambda x, a, b, c: [torch.ops.specfx.tiled_linear(x, w, V) for w in (a, b, c)]),
                        "inductor", dynamic={"x": (0,)})
    group = compile_graph(fx.symbolic_trace(lambda x, a, b, c: torch.ops.specfx.tiled_linears(x, [a, b, c], V)),
                          "inductor", dynamic={"x": (0,)})
    for M in (8, 1, 2, 3, 4, 5):                        # the first call's rows compile it: not 1
        x = torch.randn(M, 24)
        out = group(x, *ws)
        assert out.shape == (M, 98)
        assert torch.equal(out, torch.cat(one(x, *ws), -1))
        if dtype == torch.int8:                         # every weight's rows past its whole tiles too
            assert torch.equal(out, tiled_linear.quantized_reference(x, torch.cat(ws)))
    torch.testing.assert_close(torch.ops.specfx.tiled_linears(x, ws, V), out, rtol=1e-5, atol=1e-4)   # eager
