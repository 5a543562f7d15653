"""Capture: a decoder-only model as plain FX graphs over static KV buffers.

- `StaticDecoder` wraps a Hugging Face causal LM with a static KV cache that writes each row's
  keys/values at that row's own positions (an in-place `index_put_`), and an attention mask
  built from positions alone: query at position p sees slots <= p. Rows may sit at different
  lengths, and slots beyond a row's length (rejected drafts) are masked without ever being
  cropped.
- `capture(model, width=W, ...)` runs `torch.export` at one fixed query width and returns the
  unlifted `fx.GraphModule` (`forward(input_ids [B, W], positions [B, W], span [L]) -> logits
  [B, W, V]`) with its `StructureMap` (see `specfx.passes.find_structure`). Attention reads
  cache slots 0..L-1; L, the length of `span`, is the graph's one dynamic size (see
  `specfx.attention`). Each export is kept, and a later capture of the same shapes gets a copy:
  of the same model, or of another of the same structure (class, config, modules' settings,
  tensors' names, shapes and dtypes; the copy reads that model's own tensors).

Any model whose forward accepts `input_ids, position_ids, attention_mask (4-D, additive),
past_key_values, use_cache`, calls `cache.update(k, v, layer_idx)` and runs its attention through
transformers' `AttentionInterface` can be captured; that is every transformers decoder with a
static-cache path (Llama, Qwen2/3, Mistral, Gemma, GPT-2, OPT, Phi, ...: tests/helpers.py
FAMILIES). A model whose attention bypasses the interface (BLOOM; Falcon before transformers
5.25) is refused by name, and so is one whose position bias (ALiBi) rides in the attention mask.
Eval-mode dropouts are removed from the graphs (identities that FX would keep as random ops).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import sys
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import fx, nn
from transformers import GenerationConfig
from transformers.cache_utils import Cache

from specfx import attention
from specfx.passes.find_structure import StructureError, StructureMap, find_structure

KV_PREFIX = "kv_"


def kv_name(kind: str, layer: int) -> str:
    """Attribute name of a KV buffer: `kv_k_3`, `kv_v_3`."""
    return f"{KV_PREFIX}{kind}_{layer}"


def kv_shape(config, batch_size: int, max_seq_len: int) -> tuple[int, int, int, int]:
    """[B, H_kv, S, D] of one layer's key (or value) buffer.

    Head-major, the layout attention reads: the slots of one head that an attention span reads
    are one contiguous block (a position-major [B, S, H, D] buffer interleaves the heads, and
    on the CPU the decode step's attention read it about 7% slower, measured on pycoder).
    """
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (batch_size, heads, max_seq_len, head_dim)


class _ScatterCache(Cache):
    """transformers `Cache` that writes k/v of every row at its own positions, in place.

    States whose shape is not the buffers' (a config that misstates the KV heads) are not
    written: the first such layer is kept in `mismatch`, for the decoder to raise once the
    forward shows whether the model's attention reads this cache at all."""

    def __init__(self, owner: StaticDecoder, positions: torch.Tensor):
        self.owner, self.positions, self.layers = owner, positions, []
        self.mismatch: StructureError | None = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.owner.kv(layer_idx)                                 # [B, H, S, D]
        if key_states.shape[1::2] != keys.shape[1::2] or value_states.shape[1::2] != values.shape[1::2]:
            self.mismatch = self.mismatch or StructureError(
                f"{architecture(self.owner.model)}: layer {layer_idx}'s attention gives keys of "
                f"{key_states.shape[1]} heads x {key_states.shape[3]}, but its config says {keys.shape[1]} KV "
                f"heads x {keys.shape[3]} (num_key_value_heads, head_dim): the config does not describe the model")
            return key_states, value_states
        # keys[b, :, positions[b, w]] = key_states[b, :, w]: an index_put_, which Inductor
        # writes in place (a scatter_ would copy the whole buffer and copy it back). The indexed
        # view is [B, W, H, D] (indexed dims first), so the states go in as [B, W, H, D].
        rows = torch.arange(keys.shape[0], device=keys.device)[:, None]        # [B, 1]
        keys[rows, :, self.positions] = key_states.transpose(1, 2).to(keys.dtype)
        values[rows, :, self.positions] = value_states.transpose(1, 2).to(values.dtype)
        return keys, values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    @property
    def is_compileable(self) -> bool:
        return True


def text_config(model: nn.Module):
    """The config of the model's language part (the model's own config for a text-only model)."""
    return model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config


def position_mask(positions: torch.Tensor, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask [B, 1, W, S]: the query at position p sees cache slots <= p."""
    slots = torch.arange(seq_len, device=positions.device)
    visible = slots[None, None, :] <= positions[:, :, None]  # [B, W, S]
    mask = torch.zeros(visible.shape, dtype=dtype, device=positions.device)
    return mask.masked_fill(~visible, torch.finfo(dtype).min)[:, None]


def architecture(model: nn.Module) -> str:
    """How errors name a model: its class and `model_type`."""
    model_type = getattr(text_config(model), "model_type", None)
    return f"{type(model).__name__} ({model_type})" if model_type else type(model).__name__


class StaticDecoder(nn.Module):
    """A causal LM over static KV buffers; `forward(input_ids, positions, span) -> logits`.

    Positions run up to `max_seq_len - 1`. Attention is computed as products and sums on the
    CPU and by SDPA elsewhere (`reduce_attention`; see `specfx.attention`).
    """

    def __init__(self, model: nn.Module, batch_size: int, max_seq_len: int, dtype=None,
                 reduce_attention: bool | None = None):
        super().__init__()
        self.model = model
        config = text_config(model)
        self.num_layers = config.num_hidden_layers
        self.max_seq_len = max_seq_len
        dtype = dtype or next(model.parameters()).dtype
        device = next(model.parameters()).device
        self.reduce_attention = device.type == "cpu" if reduce_attention is None else reduce_attention
        self.tiled_attention = self.reduce_attention and attention.tiled_available(dtype, device)
        shape = kv_shape(config, batch_size, kv_slots(max_seq_len))
        for i in range(self.num_layers):
            for kind in "kv":
                self.register_buffer(kv_name(kind, i), torch.zeros(shape, dtype=dtype, device=device),
                                     persistent=False)

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, kv_name("k", layer)), getattr(self, kv_name("v", layer))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, span: torch.Tensor,
                slots: torch.Tensor | None = None, visible: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of `input_ids` [B, W] at `positions` [B, W], reading cache slots 0..len(span)-1.

        By default query w writes its KV at slot `positions[:, w]` and sees the slots up to it;
        a verify graph of a draft tree gets both explicitly: `slots` [B, W] to write and
        `visible` [B, 1, W, kv_slots(max_seq_len)] bool (see `specfx.runtime.tree.Tree`).
        """
        if getattr(text_config(self.model), "alibi", False):
            raise StructureError(
                f"{architecture(self.model)}: ALiBi position bias (config.alibi) is not supported: the model "
                "builds it from a padding mask of its own, which specfx's position mask replaces")
        mask = position_mask(positions, self.max_seq_len, self.kv(0)[0].dtype)
        with attention.bind(self.model.config, positions, span, reduce=self.reduce_attention,
                            tiled=self.tiled_attention, visible=visible) as bound:
            cache = _ScatterCache(self, positions if slots is None else slots)
            try:
                out = self.model(input_ids=input_ids, position_ids=positions, attention_mask=mask,
                                 past_key_values=cache, use_cache=True)
            except Exception as e:
                if not bound.calls:
                    raise _no_attention(self.model) from e
                raise cache.mismatch or e
        if not bound.calls:
            raise _no_attention(self.model)
        if cache.mismatch:
            raise cache.mismatch
        return out.logits


def _no_attention(model: nn.Module) -> StructureError:
    return StructureError(
        f"{architecture(model)}: attention not found: its layers compute attention themselves instead of "
        "through transformers' AttentionInterface, so they would not see specfx's static KV cache and "
        "position mask; this architecture is not supported")


@dataclass
class CapturedGraph:
    """One exported graph at a fixed query width, with the map of its structure."""

    gm: fx.GraphModule
    structure: StructureMap
    width: int
    batch_size: int
    max_seq_len: int


def capture(model: nn.Module, *, width: int, batch_size: int = 1, max_seq_len: int = 2048,
            decoder: StaticDecoder | None = None, dynamic_width: bool = False,
            explicit_mask: bool = False) -> CapturedGraph:
    """`torch.export` the model at query width `width` into a plain GraphModule.

    With `dynamic_width` the width is symbolic, 2..`width` (a prefill of any chunk size). With
    `explicit_mask` the graph takes the KV slots to write and the visibility mask as inputs
    (`forward(input_ids, positions, span, slots, visible)`, as a verify graph does)."""
    decoder = decoder or StaticDecoder(model, batch_size, max_seq_len)
    kv = decoder.kv(0)[0]
    device = kv.device
    ids = torch.zeros(batch_size, width, dtype=torch.long, device=device)
    pos = static_positions(batch_size, width, device)
    args = (ids, pos, example_span(max_seq_len, device))
    if explicit_mask:
        args += (pos.clone(), position_mask(pos, kv_slots(decoder.max_seq_len), torch.float32) == 0)
    gm = export_cached(model, decoder, args, span_arg=2, width_args=(0, 1) if dynamic_width else (),
                       key=(max_seq_len, decoder.reduce_attention, decoder.tiled_attention, kv.dtype))
    try:
        structure = find_structure(gm)
    except StructureError as e:
        raise StructureError(f"{architecture(model)}: {e}") from e
    gm.meta["structure"] = structure          # each graph is mapped itself: passes read this one
    return CapturedGraph(gm, structure, width, batch_size, max_seq_len)


def export_cached(owner: nn.Module, root: nn.Module, args: tuple, *, key: tuple = (), modules: tuple = (),
                  span_arg: int | None = None, width_args: tuple[int, ...] = ()) -> fx.GraphModule:
    """`export_graph(root, args, ...)`, or a copy of the graph it gave before, over `root`'s
    tensors: the graphs of `owner` (the model whose weights `root` reads), looked up by `key`
    (the settings of `root` its forward reads), the fingerprints of `modules` (those `root`
    holds beside `owner`'s) and of `owner`, the shapes of `args` and the dynamic sizes. A graph
    that reads a tensor of `owner` or `root` as a constant (from a module outside `root`) is
    not kept: a copy would read the old tensor."""
    key = (*key, *(_fingerprint(m) for m in modules), attention.TILED_PREFILL, span_arg, tuple(width_args),
           tuple((tuple(a.shape), a.dtype, a.device) for a in args), _fingerprint(owner))
    models = _captures.setdefault(owner, {})
    if key not in models:
        for stale in [k for k in models if k[-1] != key[-1]]:     # the model as it was before
            del models[stale]
    if key not in models and key in _shared:                     # the same structure, another model
        models[key] = _shared[key]
        _shared.move_to_end(key)
    if key in models:
        return _copy(models[key], root)
    exported = export_graph(root, args, span_arg=span_arg, width_args=width_args)
    captured = _Captured(_bare(exported.graph), {t: _attr(exported, t) for t in _targets(exported.graph)
                                                 if _attr(root, t) is None})
    held = {_storage(t) for m in (owner, root) for t in (*m.parameters(), *m.buffers())} - {0}
    if not any(_storage(t) in held for t in captured.constants.values()):
        models[key] = _shared[key] = captured
        while len(_shared) > _SHARED_MAX:
            _shared.popitem(last=False)
    return _copy(captured, root)


def _storage(t) -> int:
    """Where a tensor's memory starts (an export's constant read from a parameter is another
    tensor over the parameter's memory)."""
    return t.untyped_storage().data_ptr() if isinstance(t, torch.Tensor) else 0


# The graphs `export_cached` exported (the captures of `capture`, an MTP head's graphs), per
# model (gone with it) and key: compiling one model for several drafters, exit layers or tree
# shapes exports the same graphs again (about a second each on a tiny model, several on a large
# one), and the passes only ever rewrite a copy (over the parameters of the model and the KV
# buffers of the capture's decoder or head: the cache keeps no tensor of the model's, so nothing
# it holds can keep the weights alive). A key holds the export's arguments and settings and the
# model's fingerprint (`_fingerprint`: its structure where another model can share it, else its
# modules and tensors by identity): a model changed since is exported anew.
_captures: weakref.WeakKeyDictionary[nn.Module, dict[tuple, _Captured]] = weakref.WeakKeyDictionary()

# The same graphs, shared between models of one structure (`_structure`): a graph reads every
# parameter and buffer by its path, so a model that differs only in its tensors' values (another
# checkpoint of the architecture, another seed) gets a copy over its own tensors. The most
# recent `_SHARED_MAX` keys.
_shared: OrderedDict[tuple, _Captured] = OrderedDict()
_SHARED_MAX = 64


def _fingerprint(model: nn.Module) -> tuple:
    """The model's structure (`_structure`), where it has one that another model can share;
    else its tensors and modules by identity, and its config."""
    shared = _structure(model)
    if shared is not None:
        return shared
    tensors = tuple((name, id(t), t.data_ptr(), t.shape, t.dtype, t.device)
                    for name, t in (*model.named_parameters(remove_duplicate=False),
                                    *model.named_buffers(remove_duplicate=False)))
    modules = tuple((name, id(m), m.training, id(m.__dict__.get("forward")), tuple(m._forward_pre_hooks),
                     tuple(m._forward_hooks)) for name, m in model.named_modules(remove_duplicate=False))
    config = getattr(model, "config", None)
    return tensors, modules, config.to_json_string() if hasattr(config, "to_json_string") else None


_SIMPLE = (bool, int, float, str, type(None), enum.Enum, torch.dtype, torch.device)
_MODULE_STATE = frozenset(vars(nn.Module()))         # nn.Module's own bookkeeping (hooks: below)


_UNKNOWN = object()


def _plain(value):
    """A module setting as a comparable value, or `_UNKNOWN`: plain values, configs (as JSON),
    containers and partials of those, modules without tensors or hooks kept outside the module
    tree (by class and settings), and functions and classes that their module's namespace holds
    by their name (not a lambda or closure made per model, whose captured values a name would
    not tell apart)."""
    if isinstance(value, _SIMPLE):
        return value
    if hasattr(value, "to_json_string"):
        return value.to_json_string()
    if isinstance(value, (tuple, list, set, frozenset)):
        items = tuple(_plain(v) for v in value)
        return _UNKNOWN if _UNKNOWN in items else (type(value).__name__, tuple(sorted(items, key=repr))
                                                   if isinstance(value, (set, frozenset)) else items)
    if isinstance(value, dict):
        items = tuple((_plain(k), _plain(v)) for k, v in value.items())
        return _UNKNOWN if any(_UNKNOWN in kv for kv in items) else ("dict", tuple(sorted(items, key=repr)))
    if isinstance(value, nn.Module):      # held outside the module tree: a stateless one only
        if value._parameters or value._buffers or value._modules:
            return _UNKNOWN
        settings = _settings(value)
        return _UNKNOWN if settings is _UNKNOWN else (type(value), value.training, settings)
    if isinstance(value, functools.partial):
        parts = (_plain(value.func), _plain(value.args), _plain(value.keywords))
        return _UNKNOWN if _UNKNOWN in parts else ("partial", parts)
    module, name = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if callable(value) and isinstance(module, str) and isinstance(name, str):
        found = sys.modules.get(module)
        for part in name.split("."):
            found = getattr(found, part, None)
        if found is value:
            return f"{module}.{name}"
    return _UNKNOWN


def _settings(m: nn.Module):
    """A module's own settings (its attributes past nn.Module's bookkeeping) as `_plain`
    values, or `_UNKNOWN` where one is not plain or the module has a hook or a forward of its
    own (which no other module can match)."""
    if m._forward_pre_hooks or m._forward_hooks or "forward" in vars(m):
        return _UNKNOWN
    settings = tuple((attr, _plain(value)) for attr, value in vars(m).items()
                     if attr not in _MODULE_STATE and not isinstance(value, GenerationConfig))
    return _UNKNOWN if any(v is _UNKNOWN for _, v in settings) else settings


def _structure(model: nn.Module) -> tuple | None:
    """All that an export of `model` depends on but its tensors' values: its class, config (with
    the private settings `to_json_string` leaves out, such as the attention implementation),
    every module's class, mode and plain settings, every parameter's and buffer's name, shape,
    stride, dtype and device, and which names are one tensor (tied weights share a path in the
    graph). None where a model has what no other model can match: a hook, a forward set on an
    instance, or a setting that is not a plain value (a tensor outside the parameters and
    buffers, an arbitrary object)."""
    config = getattr(model, "config", None)
    if config is not None and not hasattr(config, "to_json_string"):
        return None
    first: dict[int, int] = {}
    tensors = tuple((name, tuple(t.shape), t.stride(), t.dtype, t.device, first.setdefault(id(t), i))
                    for i, (name, t) in enumerate((*model.named_parameters(remove_duplicate=False),
                                                   *model.named_buffers(remove_duplicate=False))))
    modules = []
    for name, m in model.named_modules(remove_duplicate=False):
        settings = _settings(m)
        if settings is _UNKNOWN:
            return None
        modules.append((name, type(m), m.training, settings))
    private = () if config is None else tuple(sorted((k, _plain(v)) for k, v in vars(config).items()
                                                     if k.startswith("_")))
    if any(v is _UNKNOWN for _, v in private):
        return None
    return (type(model), config.to_json_string() if config is not None else None, private,
            tensors, tuple(modules))


@dataclass
class _Captured:
    """An exported graph as cached: its nodes, and the constants it reads that are not the
    decoder's (parameters and KV buffers are taken from the decoder of each copy, so that the
    cache holds none of the model's tensors)."""

    graph: fx.Graph
    constants: dict[str, torch.Tensor]


def _targets(graph: fx.Graph) -> list[str]:
    return [n.target for n in graph.nodes if n.op == "get_attr"]


def _attr(module: nn.Module, target: str):
    """The attribute at dotted path `target` of `module`, or None."""
    for part in target.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def _bare(graph: fx.Graph) -> fx.Graph:
    """A copy of `graph`'s nodes in a graph that no module owns (an owned graph keeps its
    module, and so the module's tensors, alive)."""
    copy = fx.Graph()
    copy.output(copy.graph_copy(graph, {}))
    return copy


def _copy(cached: _Captured, decoder: StaticDecoder) -> fx.GraphModule:
    """A copy of a cached graph over this decoder's parameters and KV buffers."""
    graph = _bare(cached.graph)
    attrs = {t: cached.constants[t] if t in cached.constants else _attr(decoder, t) for t in _targets(graph)}
    return fx.GraphModule(attrs, graph, "CapturedDecoder")


def static_positions(batch_size: int, width: int, device) -> torch.Tensor:
    """Example positions [B, W] for capture: 0..W-1 in every row."""
    return torch.arange(width, device=device).expand(batch_size, width).contiguous()


def kv_slots(seq_len: int) -> int:
    """Slots of a KV buffer for positions 0..seq_len-1: one spare, so that no attention span
    (at most seq_len) is the whole buffer, a case torch.export would specialize."""
    return seq_len + 1


def example_span(seq_len: int, device) -> torch.Tensor:
    """An example `span` input for capture; its length is made dynamic, 2..seq_len."""
    return torch.zeros(max(2, seq_len // 2), dtype=torch.uint8, device=device)


def export_graph(module: nn.Module, args: tuple, *, span_arg: int | None = None,
                 width_args: tuple[int, ...] = ()) -> fx.GraphModule:
    """`torch.export` `module` at the shapes of `args` into a plain GraphModule; the length of
    `args[span_arg]` stays symbolic (2..seq_len), and so does dim 1 (the query width, 2..its
    size in `args`) of each of `width_args`; every other size is static."""
    import warnings

    dynamic = None
    if span_arg is not None or width_args:
        # DYNAMIC, not a named Dim: a guard that holds over the whole range but that the solver
        # cannot prove (e.g. w * min(16, 32 w) == 16 w) is kept as a guard instead of refused.
        span = torch.export.Dim.DYNAMIC(min=2, max=_span_max(module)) if span_arg is not None else None
        width = torch.export.Dim.DYNAMIC(min=2, max=args[width_args[0]].shape[1]) if width_args else None
        dynamic = tuple({0: span} if i == span_arg else {1: width} if i in width_args else None
                        for i in range(len(args)))
    with warnings.catch_warnings(), torch.no_grad(), without_stack_traces():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values -> cache rename
        ep = torch.export.export(module, args, dynamic_shapes=dynamic, strict=False)
    return _plain_graph(ep.module())


@contextlib.contextmanager
def without_stack_traces():
    """Tracing that records no Python stack trace per node (collected and symbolized for every
    traced op: about a sixth of an export's time); nothing specfx runs reads them."""
    traces = getattr(fx.config, "do_not_emit_stack_traces", False)
    fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        fx.config.do_not_emit_stack_traces = traces


def _span_max(module: nn.Module) -> int:
    return module.max_seq_len


def _is_eval_dropout(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is torch.ops.aten.dropout.default
            and (len(node.args) < 3 or node.args[2] is False))


def _plain_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """Make the unlifted module a plain graph: flat positional inputs, a tuple of outputs.

    `ep.module()` adds an input-guard call, dtype assertions and pytree (un)flattening; shapes
    and dtypes are fixed by construction here, and passes are simpler over flat inputs and
    outputs and without side-effect-only nodes hanging off the values they rewrite.
    """
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
            delattr(gm, "_guards_fn")
        elif node.op == "call_function" and node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
        elif _is_eval_dropout(node):
            # Identity in eval mode, but a random op to FX, so dead-code elimination would keep
            # it (and the embedding it reads) in a graph cut after that embedding.
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.graph._codegen = fx.graph.CodeGen()
    output = next(n for n in gm.graph.nodes if n.op == "output")
    outs = output.args[0]
    output.args = (tuple(outs) if isinstance(outs, (list, tuple)) else (outs,),)
    gm.graph.lint()
    # A plain GraphModule: no input-spec hooks; attributes are shared, not copied.
    return fx.GraphModule(gm, gm.graph, "CapturedDecoder")
