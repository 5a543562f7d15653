"""Compile a captured graph for the runtime, without Dynamo in the call path.

The runtime's graphs are always called with the same state tensors, so nothing needs checking
per call. `compile_graph(gm, "inductor")` hands the FX graph to Inductor directly (on the first
call's arguments) and later calls run the compiled code with no guard evaluation; on the CPU
the compiled code's wrapper is C++ too (`cpp_wrapper`), so a step costs no Python per kernel,
and it keeps the graph's intermediate buffers on the caller's stack (`_stack_buffers`).
Every size is static except those named in `dynamic` (input name -> dims): the attention
span's length (`span`, see `specfx.attention`) and a prefill's width (dim 1 of `input_ids`,
`positions`, `hidden`) stay symbolic, so one compiled graph serves every span and width. A graph input that is a list of tensors (the step's `kv`) becomes one input
per tensor. Other backends go through `torch.compile`; "eager" runs the graph as it is.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.utils._pytree as pytree
from torch import fx

from specfx.runtime.memory import huge_pages

SPAN = {"span": (0,)}
WIDTH = {"input_ids": (1,), "positions": (1,), "hidden": (1,)}
# Inductor's C++ kernels with a multiply and an add fused into one FMA instruction. Inductor
# turns contraction off by default; the step's kernels are products and sums (the skinny
# matmuls, attention), which then issue twice the floating-point instructions. The rounding
# differs from an unfused product and sum as a different summation order does.
#
# Loops of fewer than `cpp.min_chunk_size` elements a thread run on one thread (Inductor's
# default: 512). A few-row step is full of loops over a few rows of the hidden size (norms,
# residuals, rotary, SiLU: 4 x 320 elements in pycoder's verify), each of which then opened a
# parallel region of its own, whose fork and join cost more than the loop; serial, the other
# thread waits for the next tiled kernel instead. pycoder (one process, round-robin, 30
# rounds), 512 against 4096: 4-row verify 2.187 -> 2.082 ms, MTP step 3.198 -> 3.134, decode
# 1.782 -> 1.770 (an earlier pair of runs: verify 2.084 -> 1.928 at 2048, 1.925 at 32768). A
# prefill's loops (128 rows) stay parallel: its first token took 18.04 / 18.09 ms.
CPU_INDUCTOR = {"cpp.enable_floating_point_contract_flag": "fast", "cpp.min_chunk_size": 4096}
# The compiled graph's wrapper on the CPU: C++, with the intermediate buffers of a static size
# (a few hundred per step) as arrays on the caller's stack, Inductor's AOTInductor option
# `allow_stack_allocation`, which its C++ wrapper honours in this process too. Heap buffers cost
# a tensor object each, created and destroyed at every call: about 0.5-1 ms of a pycoder decode
# step, whose weights have pushed those objects out of the caches by the next call. Buffers of a
# symbolic size (the span, a prefill's width) stay on the heap, and so do all of a graph's
# when their elements add up to more than STACK_ELEMENTS, or when the graph calls a library
# kernel (Inductor's rule). Kernels and numerics are unchanged.
CPU_WRAPPER = {"cpp_wrapper": True, "memory_planning": False, "aot_inductor.allow_stack_allocation": True}
# 4 MiB of float32 on the calling thread's stack, which on Linux has 8 MiB by default (the main
# thread and Python's threads alike). pycoder's MTP step holds 2.3 MiB there, its decode 0.3 MiB.
STACK_ELEMENTS = 1 << 20


def compile_graph(gm: fx.GraphModule, backend: str, *, dynamic: dict[str, tuple[int, ...]] | None = None):
    """The callable that runs `gm`: itself for "eager", Inductor without Dynamo for "inductor"."""
    if backend == "eager":
        return gm
    if backend == "inductor":
        return InductorGraph(gm, dynamic=dynamic or {})
    return torch.compile(gm, backend=backend, fullgraph=True, dynamic=bool(dynamic))


class InductorGraph:
    """`gm` compiled by Inductor on its first call; later calls go straight to the compiled code
    (on the CPU past AOTAutograd's runtime wrappers too, where they have nothing to do: `_direct`)."""

    def __init__(self, gm: fx.GraphModule, *, dynamic: dict[str, tuple[int, ...]]):
        self.gm, self.dynamic, self.fn, self.direct = gm, dynamic, None, None

    def __call__(self, *args):
        flat = _flatten(args)
        if self.direct is not None:
            return self.direct(flat)
        if self.fn is None:
            self.fn, self.direct = _inductor(flat_inputs(self.gm, args), flat, self.dynamic)
            huge_pages([*self.gm.parameters(), *self.gm.buffers(), *flat])    # weights, KV, state (CPU)
        return self.fn(*flat)


def _inductor(gm: fx.GraphModule, args: list, dynamic: dict[str, tuple[int, ...]]):
    from torch._functorch import config as functorch_config
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from specfx.kernels import tiled_linear

    tiled_linear.register()
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    mode = FakeTensorMode(shape_env=ShapeEnv())

    def fake(t: torch.Tensor, name: str) -> torch.Tensor:
        dims = [DimDynamic.DYNAMIC if d in dynamic.get(name, ()) else DimDynamic.STATIC for d in range(t.dim())]
        return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dims))

    cpu = all(t.device.type == "cpu" for t in args if isinstance(t, torch.Tensor))
    compiled = []
    leaves, spec = pytree.tree_flatten(next(n for n in gm.graph.nodes if n.op == "output").args[0])

    def inner(graph, example_inputs, **kwargs):
        out = compile_fx_inner(graph, example_inputs, **kwargs)
        ctx = torch._guards.TracingContext.try_get()
        compiled.append((out, len(example_inputs), getattr(ctx, "fw_metadata", None)))
        return out

    # AOTAutograd's own cache would hand back its wrapped graph without Inductor's compile (whose
    # FX-graph cache still spares the C++ compile): the direct call needs the compile's metadata.
    with torch.no_grad(), config.patch({**CPU_WRAPPER, **CPU_INDUCTOR} if cpu else {}), \
            (functorch_config.patch(enable_autograd_cache=False) if cpu else contextlib.nullcontext()), \
            (_stack_buffers(STACK_ELEMENTS) if cpu else contextlib.nullcontext()):
        fn = compile_fx(gm, [fake(t, name) for t, name in zip(args, names)], inner_compile=inner)
    return fn, (_direct(gm, compiled, len(args), len(leaves), spec) if cpu else None)


def _direct(gm: fx.GraphModule, compiled: list, n_args: int, n_outputs: int, spec):
    """The compiled code called without AOTAutograd's runtime wrappers, or None where they do
    something: `call(flat) -> outputs`.

    Every call of a compiled graph passes through AOTAutograd's wrappers (its parameters prepended,
    the mutated inputs' version counters bumped, the outputs handed back through a pytree) and
    then Inductor's Python wrapper: tens of microseconds a call, which on the CPU is time the
    other threads wait (pycoder's fused steps, one process, shuffled round-robin, three repeats
    of 60 rounds, wrapped -> direct: decode 1.756/2.071/1.797 -> 1.669/1.911/1.727 ms, MTP chain
    2.333/1.787/1.807 -> 2.251/1.723/1.746, 2x2x2x1 tree 2.592/2.244/2.614 -> 2.486/2.209/2.546;
    `benchmarks/direct_call.py` times it). Where the graph was compiled as one inference graph
    whose input mutations all happen inside it, with no outputs that alias an input or an
    intermediate, and no tensor subclasses, the wrappers only bump
    version counters (which no autograd graph here reads) and the call is the compiled code's
    own on the parameters and the inputs, in AOTAutograd's order, its flat outputs returned as
    the graph returns them (`spec`: a tensor, or a tuple of them; taken before compiling, which
    rewrites a graph's lone output as a tuple)."""
    if len(compiled) != 1:
        return None
    out, n_inputs, meta = compiled[0]
    call = getattr(out, "current_callable", None)
    params = [*dict(gm.named_parameters(remove_duplicate=False)).values(),
              *dict(gm.named_buffers(remove_duplicate=False)).values()]
    if call is None or meta is None or n_inputs != len(params) + n_args:
        return None
    try:
        from torch._functorch._aot_autograd.schemas import SubclassCreationMeta

        plain = not any(isinstance(m, SubclassCreationMeta)
                        for m in (*meta.subclass_inp_meta, *meta.subclass_fw_graph_out_meta))
        quiet = not (meta.num_mutated_inp_runtime_indices or meta.num_outputs_aliased or meta.num_intermediate_bases)
    except (ImportError, AttributeError):  # another torch's metadata: keep its wrappers
        return None
    if not (plain and quiet) or n_outputs != meta.num_outputs:
        return None
    return lambda flat: pytree.tree_unflatten(call([*params, *flat]), spec)


@contextlib.contextmanager
def _stack_buffers(limit: int):
    """For one compilation: the CPU's C++ wrapper that can place buffers on the stack (Inductor
    registers it for the CPU only when `allow_stack_allocation` is set at its first use in the
    process), with room for `limit` elements of them. Where this torch lacks it, the heap is used."""
    try:
        from torch._inductor.codegen import common
        from torch._inductor.codegen import cpp_wrapper_cpu_array_ref as arrayref
        common.init_backend_registration()
        codegen = common.device_codegens["cpu"]
        saved = codegen.cpp_wrapper_codegen, arrayref.MAX_STACK_ALLOCATION_SIZE
    except (ImportError, AttributeError, KeyError):
        yield
        return
    codegen.cpp_wrapper_codegen, arrayref.MAX_STACK_ALLOCATION_SIZE = arrayref.CppWrapperCpuArrayRef, limit
    try:
        yield
    finally:
        codegen.cpp_wrapper_codegen, arrayref.MAX_STACK_ALLOCATION_SIZE = saved


def _flatten(args) -> list:
    out = []
    for a in args:
        out.extend(a) if isinstance(a, (list, tuple)) else out.append(a)
    return out


def flat_inputs(gm: fx.GraphModule, args) -> fx.GraphModule:
    """A copy of `gm` in which each list-of-tensors input is one input per tensor."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if placeholders and str(placeholders[-1].target).startswith("*"):       # forward(..., *kv)
        args = (*args[:len(placeholders) - 1], tuple(args[len(placeholders) - 1:]))
    if len(placeholders) != len(args):
        raise ValueError(f"graph takes {len(placeholders)} inputs, called with {len(args)}")
    if not any(isinstance(a, (list, tuple)) for a in args):
        return gm
    graph = fx.Graph()
    env: dict[fx.Node, object] = {}
    for ph, a in zip(placeholders, args):
        if isinstance(a, (list, tuple)):
            env[ph] = [graph.placeholder(f"{ph.name}_{i}") for i in range(len(a))]
        else:
            env[ph] = graph.node_copy(ph)
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "call_function" and n.target is operator.getitem and isinstance(env.get(n.args[0]), list):
            env[n] = env[n.args[0]][n.args[1]]
            continue
        if any(isinstance(env.get(a), list) for a in n.all_input_nodes):
            raise ValueError(f"list input used by {n.format_node()}: only indexing is supported")
        env[n] = graph.node_copy(n, lambda x: env[x])
    return fx.GraphModule(gm, graph, gm.__class__.__name__)
