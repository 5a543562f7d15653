"""MTP / EAGLE-style draft heads: the head module, its checkpoint, and its static form.

A head drafts token t_{i+2} from the target's hidden state h_i at position i and the
embedding of the token t_{i+1} that followed (DeepSeek-V3's multi-token-prediction module,
EAGLE's feature-level draft):

    g_i    = Layer(eh_proj([enorm(emb(t_{i+1})); hnorm(h_i)]))
    logits = lm_head(norm(g_i))

`Layer` is one decoder layer of the target's own architecture; `emb` and `lm_head` are the
target's, frozen, and never stored with the head. h_i is the residual stream after the
target's last layer (the input of its final norm). The two input norms matter: the embedding
and the residual stream live at very different scales. For a second draft the head feeds its
own g in place of h, so training also regresses g_i onto h_{i+1}.

Checkpoints are a folder with `model.safetensors` (parameter names follow DeepSeek-V3's MTP
layer: `enorm`, `hnorm`, `eh_proj`, `layers.0.*`, `norm`) and `config.json`, which records
the target it was trained for (architecture, sizes and a signature of its weights);
`load_head` refuses a head trained for another target.

- `new_head(target)`, `load_head(path, target)`, `save_head(head, path, target, info)`;
- `StaticHead(target, head, batch_size, seq_len, weights_dtype=None)`: the head over its own
  static KV buffer, `forward(input_ids, hidden, positions) -> (logits, g)`, ready for
  `torch.export`; with `weights_dtype` its linears and its copy of the lm_head keep their
  weights in that dtype (`store_weights`), read widened (drafting only);
- `final_hidden(target, input_ids)`: h for every position (tests); `layer_outputs(target,
  input_ids, layers)`: the outputs of the layers a head taps (training);
- `target_signature(target)`: names, shapes and sampled values of its weights, recorded in
  the head's config and compared (with a half-precision tolerance) at load.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specfx import attention
from specfx.capture import _ScatterCache, kv_name, kv_shape, kv_slots, position_mask, text_config

FORMAT = "specfx-mtp-head"
FORMAT_VERSION = 1
SAMPLES_PER_TENSOR = 4
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


@dataclass
class TargetParts:
    """The parts of a target a head is built from and shares."""

    config: object
    embed: nn.Module
    lm_head: nn.Module
    rotary: nn.Module | None       # None where positions are learned embeddings (GPT-2, OPT)
    layers: nn.ModuleList
    norm: nn.Module

    def position_embeddings(self, embeds: torch.Tensor, positions: torch.Tensor):
        """What the decoder passes its layers as `position_embeddings`: the rotary (cos, sin) of
        the head layer's attention type, or None for a family without a rotary module."""
        if self.rotary is None:
            return None
        if "layer_type" in inspect.signature(self.rotary.forward).parameters:   # one rotary per layer type
            return self.rotary(embeds, positions, layer_type=self.config.layer_types[0])
        return self.rotary(embeds, positions)


_NORM_NAMES = ("norm", "final_layernorm", "final_layer_norm", "ln_f")


def target_parts(model: nn.Module) -> TargetParts:
    """Find the embedding, lm_head, rotary embedding, decoder layers and final norm of `model`."""
    config = text_config(model)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    children = dict(decoder.named_children()) if isinstance(decoder, nn.Module) else {}
    stacks = [m for m in children.values() if isinstance(m, nn.ModuleList)]
    found = {
        "embedding (get_input_embeddings)": model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None,
        "lm_head (get_output_embeddings)": model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None,
        "rotary embedding (decoder.rotary_emb)": children.get("rotary_emb"),
        "decoder layers (a ModuleList in the decoder)": max(stacks, key=len) if stacks else None,
        f"final norm (decoder.{'/'.join(_NORM_NAMES)})": next((children[n] for n in _NORM_NAMES if n in children), None),
    }
    missing = [name for name, part in found.items() if part is None and not name.startswith("rotary")]
    if missing:
        raise ValueError(f"cannot attach an MTP head to {type(model).__name__}: not found: {', '.join(missing)}")
    parts = TargetParts(config, *found.values())
    width = getattr(parts.embed, "embedding_dim", config.hidden_size)
    if width != config.hidden_size:
        raise ValueError(
            f"cannot attach an MTP head to {type(model).__name__}: its token embeddings ({width} wide) are "
            f"projected to the hidden size ({config.hidden_size}) (an embedding projection), which the head "
            "does not model; use another drafter")
    return parts


def _norm_eps(config) -> float:
    for key in ("rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps"):
        if isinstance(getattr(config, key, None), float):
            return getattr(config, key)
    return 1e-6


def cache_arg(module_cls: type) -> str:
    """What a layer or attention class names its cache argument (GPT-NeoX: layer_past)."""
    params = inspect.signature(module_cls.forward).parameters
    return next((a for a in ("cache", "layer_past", "past_key_values") if a in params), "past_key_values")


class DraftHead(nn.Module):
    """`Layer(eh_proj([enorm(e); hnorm(h)]))` with one decoder layer of the target's type.

    The interface `StaticHead` runs (shared with the published layouts in `specfx.heads`):
    `taps`, `combiner`, `layer_config`, `position_embeddings`, `forward` and `logits`.
    """

    layout = "specfx"

    def __init__(self, config, layer_cls: type, norm_cls: type):
        super().__init__()
        H, eps = config.hidden_size, _norm_eps(config)
        self.enorm, self.hnorm, self.norm = norm_cls(H, eps=eps), norm_cls(H, eps=eps), norm_cls(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.layers = nn.ModuleList([layer_cls(config, layer_idx=0)])
        self._cache_arg = cache_arg(layer_cls)

    def forward(self, embeds, hidden, *, position_ids, position_embeddings, attention_mask=None, cache=None):
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], -1))
        kwargs = {self._cache_arg: cache} if cache is not None else {}
        if position_embeddings is not None:
            kwargs["position_embeddings"] = position_embeddings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # past_key_values -> cache rename
            out = self.layers[0](x, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=cache is not None, **kwargs)
        return out[0] if isinstance(out, tuple) else out

    @property
    def hidden_size(self) -> int:
        return self.eh_proj.out_features

    def taps(self, num_layers: int) -> tuple[int, ...]:
        """The target layers whose outputs the head reads: the last one's (h)."""
        return (num_layers - 1,)

    def combiner(self, parts: TargetParts):
        """What maps the tapped outputs to the head's h: nothing, h is the last layer's output."""
        return None

    def layer_config(self, parts: TargetParts):
        return parts.config

    def position_embeddings(self, parts: TargetParts, embeds, positions):
        return parts.position_embeddings(embeds, positions)

    def logits(self, parts: TargetParts, g):
        return parts.lm_head(self.norm(g))


def _empty_head(parts: TargetParts) -> DraftHead:
    """A head shaped for the target: its decoder layer and norms of the target's own classes."""
    return DraftHead(parts.config, type(parts.layers[0]), type(parts.norm))


def new_head(target: nn.Module) -> DraftHead:
    """A fresh head for `target`; its layer starts as a copy of the target's last layer."""
    parts = target_parts(target)
    head = _empty_head(parts)
    head.layers[0].load_state_dict(parts.layers[-1].state_dict())
    param = next(target.parameters())
    return head.to(param.device, param.dtype)


def target_signature(model: nn.Module) -> dict:
    """What identifies the target's weights: a hash of parameter names and shapes, and a few
    values sampled from every tensor (compared with a tolerance, so the same model in float32,
    bfloat16 or float16 matches and another model does not)."""
    names, sample = hashlib.sha256(), []
    for name, t in sorted(model.state_dict().items()):
        flat = t.detach().flatten()
        names.update(f"{name}:{tuple(t.shape)};".encode())
        idx = torch.linspace(0, flat.numel() - 1, SAMPLES_PER_TENSOR, device=flat.device).long()
        sample.extend(round(v, 5) for v in flat[idx].float().tolist())
    return {"shapes": names.hexdigest()[:16], "sample": sample}


def same_weights(recorded: dict, actual: dict) -> bool:
    """Whether two `target_signature`s are of the same weights, up to half-precision rounding."""
    if recorded.get("shapes") != actual["shapes"] or len(recorded.get("sample", [])) != len(actual["sample"]):
        return False
    a, b = torch.tensor(recorded["sample"]), torch.tensor(actual["sample"])
    return bool(torch.allclose(a, b, rtol=1e-2, atol=1e-3))


def _target_record(target: nn.Module) -> dict:
    parts = target_parts(target)
    c = parts.config
    name = getattr(c, "_name_or_path", "") or ""
    return {"model_type": getattr(c, "model_type", type(target).__name__), "hidden_size": c.hidden_size,
            "vocab_size": c.vocab_size, "num_hidden_layers": c.num_hidden_layers,
            "layer_type": type(parts.layers[0]).__name__, "name": Path(name).name if name else "",
            "weights": target_signature(target)}


def save_head(head: nn.Module, out: str | Path, target: nn.Module, info: dict | None = None) -> Path:
    """Write `model.safetensors` and `config.json` (with the target's record) to `out`."""
    from safetensors.torch import save_file

    from specfx.heads import head_config

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: (v.detach().to(torch.float32) if v.is_floating_point() else v.detach()).contiguous().cpu()
             for k, v in head.state_dict().items()}                  # integer buffers (d2t) stay integer
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt"})
    layout = getattr(head, "layout", "specfx")
    config = {"format": FORMAT, "format_version": FORMAT_VERSION, "architecture": type(head).__name__,
              "layout": layout, **({"head_config": head_config(head)} if head_config(head) else {}),
              "target": _target_record(target), **({"train": info} if info else {})}
    (out / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    return out


def read_head_config(path: str | Path) -> dict:
    """The head's config.json, checked to be a specfx head checkpoint."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"MTP head {str(path)!r} not found (expected a folder with {CONFIG} and {WEIGHTS})")
    for name in (CONFIG, WEIGHTS):
        if not (path / name).is_file():
            raise FileNotFoundError(f"MTP head {str(path)!r} is missing {name}")
    try:
        config = json.loads((path / CONFIG).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"MTP head {str(path)!r}: {CONFIG} is corrupt ({e})") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not an MTP head checkpoint ({CONFIG} has no format={FORMAT!r})")
    if config.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"MTP head {str(path)!r} has format version {config.get('format_version')}; "
                         f"this specfx reads version {FORMAT_VERSION}")
    return config


def load_head(path: str | Path, target: nn.Module) -> nn.Module:
    """Load the head at `path` for `target`; refuses a head trained for another target.

    A specfx head checkpoint may hold a head of any layout in `specfx.heads` (`layout` in its
    config; `specfx train mtp --arch eagle3` writes one): the target record guards them all.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config = read_head_config(path)
    recorded, actual = config.get("target", {}), _target_record(target)
    who = actual["name"] or type(target).__name__
    for key in ("model_type", "hidden_size", "vocab_size", "num_hidden_layers", "layer_type"):
        if recorded.get(key) != actual[key]:
            raise ValueError(
                f"MTP head {str(path)!r} was trained for another target: {key} is {recorded.get(key)!r} "
                f"in the head, {actual[key]!r} in this model ({who})")
    if not same_weights(recorded.get("weights", {}), actual["weights"]):
        raise ValueError(f"MTP head {str(path)!r} was trained for another target: the weights of this model "
                         f"({who}) differ from those recorded in the head (trained for {recorded.get('name') or '?'})")
    try:
        state = load_file(str(Path(path) / WEIGHTS))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"MTP head {str(path)!r}: {WEIGHTS} is corrupt ({e})") from None
    layout = config.get("layout", "specfx")
    if layout == "specfx":
        head = _empty_head(target_parts(target))
    else:
        from specfx.heads import LAYOUTS, empty_head

        if layout not in LAYOUTS:
            raise ValueError(f"MTP head {str(path)!r} has layout {layout!r}; this specfx reads {', '.join(LAYOUTS)}")
        head = empty_head(target_parts(target), layout, config.get("head_config"), state)
    try:
        head.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ValueError(f"MTP head {str(path)!r}: weights do not fit this target ({e})") from None
    param = next(target.parameters())
    return head.to(param.device, param.dtype).eval()


class StoredLinear(nn.Module):
    """A linear whose weight is stored in another dtype (a draft's weights at half or a quarter
    of the bytes) and widened to its input's dtype where it is read: the skinny-matmul pass hands
    the stored weight to the tiled kernel, which widens a bfloat16 weight as it loads and, against
    int8, quantizes its rows too (`tiled_linear.quantized_reference`).

    bfloat16 keeps the weight rounded; int8 keeps each row as integers in [-127, 127] times the
    row's scale (its largest magnitude over 127), applied to the product's columns."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype):
        super().__init__()
        from specfx.kernels.tiled_linear import store_rows

        w, scale = store_rows(linear.weight.detach(), dtype)
        self.register_buffer("scale", scale)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.bias = linear.bias
        self.out_features, self.in_features = self.weight.shape

    def forward(self, x):
        y = F.linear(x, self.weight.to(x.dtype))
        if self.scale is not None:
            y = y * self.scale
        return y if self.bias is None else y + self.bias


def store_weights(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`module` with every `nn.Linear` in it a `StoredLinear` of `dtype` (in place)."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, StoredLinear(child, dtype))
        else:
            store_weights(child, dtype)
    return module


class StaticHead(nn.Module):
    """The head over its own static KV buffer, sharing the target's embedding and lm_head.

    `forward(input_ids [B, W], hidden [B, W, H], positions [B, W], span [L]) -> (logits [B, W, V], g [B, W, H])`
    (just `(g,)` with `with_logits = False`): row b's query j sits at head position
    `positions[b, j]` (the position of the hidden state it reads) and sees the head's cache
    slots up to it. Given `keep` [B, 1] too, the outputs are those of query `keep[b]` alone
    (logits [B, 1, V], g [B, 1, H]): the refill writes the KV of every query but only one row
    becomes a draft, and the lm_head over one row reads its weight once for a quarter of the
    multiply-adds of four.
    """

    def __init__(self, target: nn.Module, head: nn.Module, batch_size: int, max_seq_len: int,
                 weights_dtype: torch.dtype | None = None):
        super().__init__()
        parts = target_parts(target)
        if weights_dtype is not None:        # drafting reads its own copy of the target's lm_head
            store_weights(head, weights_dtype)
            if isinstance(parts.lm_head, nn.Linear):
                parts = dataclasses.replace(parts, lm_head=StoredLinear(parts.lm_head, weights_dtype))
        self.embed, self.lm_head, self.rotary, self.head = parts.embed, parts.lm_head, parts.rotary, head
        self.parts = parts    # its modules are the ones registered here
        self.max_seq_len, self.with_logits = max_seq_len, True
        param = next(target.parameters())
        self.config, self.reduce_attention = head.layer_config(parts), param.device.type == "cpu"
        self.tiled_attention = self.reduce_attention and attention.tiled_available(param.dtype, param.device)
        shape = kv_shape(self.config, batch_size, kv_slots(max_seq_len))
        for kind in "kv":
            self.register_buffer(kv_name(kind, 0), torch.zeros(shape, dtype=param.dtype, device=param.device),
                                 persistent=False)

    def kv(self, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, kv_name("k", 0)), getattr(self, kv_name("v", 0))

    def settings(self) -> tuple:
        """What `forward` reads besides its modules and tensors (a key of `capture.export_cached`)."""
        return (type(self), self.max_seq_len, self.with_logits, self.reduce_attention, self.tiled_attention,
                self.config.to_json_string())

    @staticmethod
    def kv_names() -> list[str]:
        """The head's KV buffers, as its graphs name them (`passes.ShareKVBuffers`)."""
        return [kv_name("k", 0), kv_name("v", 0)]

    def forward(self, input_ids, hidden, positions, span, keep=None):
        embeds = self.embed(input_ids)
        with attention.bind(self.config, positions, span, reduce=self.reduce_attention, tiled=self.tiled_attention):
            g = self.head(embeds, hidden.to(embeds.dtype), position_ids=positions,
                          position_embeddings=self.head.position_embeddings(self.parts, embeds, positions),
                          attention_mask=position_mask(positions, self.max_seq_len, embeds.dtype),
                          cache=_ScatterCache(self, positions))
        if not self.with_logits:             # the prefill only writes the head's KV
            return (g,)
        if keep is not None:
            g = g.gather(1, keep[:, :, None].expand(-1, -1, g.shape[-1]))
        return self.head.logits(self.parts, g), g


class Combine(nn.Module):
    """The head's map from the target layers' outputs it taps, concatenated, to its h
    (`forward(features [B, W, n H]) -> (h [B, W, H],)`), captured as its own graph."""

    def __init__(self, fn: nn.Module):
        super().__init__()
        self.fn = fn

    def forward(self, features):
        return (self.fn(features),)


def final_hidden(target: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """h [B, T, H]: the residual stream after the last layer (input of the final norm)."""
    norm = target_parts(target).norm
    seen = []
    handle = norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        target(input_ids)
    finally:
        handle.remove()
    return seen[-1]


def layer_outputs(target: nn.Module, input_ids: torch.Tensor, layers: tuple[int, ...]) -> list[torch.Tensor]:
    """The residual-stream outputs [B, T, H] of the target's decoder `layers` (indices, in that
    order): what the verify graph returns for a head that taps them (`passes.ExposeHidden`)."""
    stack, seen = target_parts(target).layers, {}

    def keep(i):
        return lambda _m, _args, out: seen.__setitem__(i, out[0] if isinstance(out, tuple) else out)

    handles = [stack[i].register_forward_hook(keep(i)) for i in set(layers)]
    try:
        target(input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return [seen[i] for i in layers]
