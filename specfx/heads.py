"""Draft heads in the layouts the field publishes: EAGLE-1, EAGLE-3 and DeepSeek-V3's MTP.

Each layout is a module with the interface `specfx.mtp.StaticHead` runs (the one specfx's own
`DraftHead` has), so a published head drafts in the same fused step, over its own static KV
buffer, as a head trained here:

- `taps(num_layers)`: the target layers whose outputs (residual stream, before the final norm)
  the head reads; the verify and prefill graphs return them (`passes.ExposeHidden`);
- `combiner(parts)`: a module mapping those outputs, concatenated, to the h the head's first
  draft reads (None: h is the one tap itself); later drafts read the head's own output g;
- `forward(embeds, hidden, ...) -> g` and `logits(parts, g)` over the target's vocabulary;
- `layer_config(parts)` and `position_embeddings(parts, embeds, positions)`: the config its
  layer was built from (KV shape, attention) and that layer's rotary.

The layouts, as vLLM and SGLang load them (weight names and config keys; cited per class):

- EAGLE-1 (`eagle`): `fc` over `cat(emb, h)`, one Llama decoder layer without its input norm,
  then the target's lm_head on the layer's output; h is the target's final hidden state after
  its final norm (what the serving engines pass).
- EAGLE-3 (`eagle3`): `fc` over the concatenated outputs of three target layers, a `midlayer`
  whose attention reads `cat(input_layernorm(emb), hidden_norm(h))` (2H wide) with h as its
  residual, a final `norm`, and its own `lm_head` over a reduced draft vocabulary mapped back to
  the target's ids with `d2t` (target id = draft id + d2t[draft id]).
- DeepSeek-V3 MTP (`deepseek-mtp`): `enorm`, `hnorm`, `eh_proj`, one decoder block of the
  target's own architecture, then `shared_head.norm` and `shared_head.head`; stored inside the
  target's checkpoint as layer `num_hidden_layers` (`model.layers.{N}.*`); h is the target's
  hidden state after its final norm, and the embedding is zeroed at position 0.

`load_layout(path, target, layout=None)` reads a folder in any of these layouts (found from
its config and weight names when `layout` is None); `write_layout(head, path, target, layout)`
writes one, refusing a head the layout cannot hold exactly.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from specfx.mtp import DraftHead, cache_arg

LAYOUTS = ("specfx", "eagle", "eagle3", "deepseek-mtp")
EAGLE3_ARCHITECTURE = "LlamaForCausalLMEagle3"
EAGLE_ARCHITECTURE = "LlamaForCausalLM"


class HeadLayoutError(ValueError):
    """A head folder that is not in the layout asked for, or does not fit the target."""


# ---------------------------------------------------------------------------------------------
# The modules


def _llama_config(cfg: dict | object):
    """A LlamaConfig for a published head's `config.json` (EAGLE heads are Llama layers)."""
    from transformers import LlamaConfig

    if isinstance(cfg, LlamaConfig):
        return cfg
    known = {k: v for k, v in dict(cfg).items() if k not in ("architectures", "model_type", "auto_map")}
    config = LlamaConfig(**known)
    config._attn_implementation = "sdpa"            # outside capture (training); capture binds specfx's
    return config


class _LlamaHeadBase(nn.Module):
    """What the two EAGLE layouts share: a Llama config of their own and its rotary."""

    layout = "?"

    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.config = config
        self.rotary = LlamaRotaryEmbedding(config)

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def layer_config(self, parts):
        return self.config

    def position_embeddings(self, parts, embeds, positions):
        return self.rotary(embeds, positions)

    def taps(self, num_layers: int) -> tuple[int, ...]:
        return (num_layers - 1,)


class EagleHead(_LlamaHeadBase):
    """EAGLE-1: `g = Layer(fc(cat(emb, h)))` with the layer's input norm dropped; logits are the
    target's lm_head on g. h is the target's normed final hidden state.

    Layout: vLLM `model_executor/models/llama_eagle.py` (`EagleLlamaForCausalLM`: `fc`
    [H, 2H] (a bias where the checkpoint has one), `layers.0.*` with `input_layernorm` an
    identity, no norm before the lm_head) and SGLang `models/llama_eagle.py`; the original is
    SafeAILab/EAGLE `eagle/model/cnets.py`.
    """

    layout = "eagle"

    def __init__(self, config, *, fc_bias: bool = False):
        super().__init__(config)
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        H = config.hidden_size
        self.fc = nn.Linear(2 * H, H, bias=fc_bias)
        layer = LlamaDecoderLayer(config, layer_idx=0)
        layer.input_layernorm = nn.Identity()
        self.layers = nn.ModuleList([layer])

    def combiner(self, parts):
        return parts.norm                               # the engines pass the normed hidden state

    def forward(self, embeds, hidden, *, position_ids, position_embeddings, attention_mask=None, cache=None):
        x = self.fc(torch.cat([embeds, hidden], -1))
        layer = self.layers[0]
        return layer(x, attention_mask=attention_mask, position_ids=position_ids, use_cache=cache is not None,
                     position_embeddings=position_embeddings, **{cache_arg(type(layer)): cache})

    def logits(self, parts, g):
        return parts.lm_head(g)


class Eagle3Layer(nn.Module):
    """EAGLE-3's `midlayer`: attention over `cat(input_layernorm(emb), hidden_norm(h))` (2H
    wide) with residual h (or `hidden_norm(h)` where `norm_before_residual`), then the MLP."""

    def __init__(self, config):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

        H, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = LlamaAttention(config, layer_idx=0)
        D, bias = self.self_attn.head_dim, config.attention_bias
        for name, heads in (("q_proj", config.num_attention_heads), ("k_proj", config.num_key_value_heads),
                            ("v_proj", config.num_key_value_heads)):
            setattr(self.self_attn, name, nn.Linear(2 * H, heads * D, bias=bias))
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(H, eps=eps)
        self.hidden_norm = LlamaRMSNorm(H, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(H, eps=eps)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))

    def forward(self, embeds, hidden, *, position_embeddings, attention_mask, cache, position_ids):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], -1)
        attn, _ = self.self_attn(x, position_embeddings=position_embeddings, attention_mask=attention_mask,
                                 position_ids=position_ids, **{cache_arg(type(self.self_attn)): cache})
        x = residual + attn
        return x + self.mlp(self.post_attention_layernorm(x))


def eagle3_aux_layers(config, num_layers: int) -> tuple[int, ...]:
    """The target layers whose *inputs* EAGLE-3 reads: `eagle_config.eagle_aux_hidden_state_layer_ids`
    where the head names them, else vLLM's default (2, L // 2, L - 3)."""
    ids = (getattr(config, "eagle_config", None) or {}).get("eagle_aux_hidden_state_layer_ids")
    return tuple(int(i) for i in ids) if ids else (2, num_layers // 2, num_layers - 3)


class Eagle3Head(_LlamaHeadBase):
    """EAGLE-3: `h = fc(cat(x_a, x_b, x_c))` over the inputs of three target layers, then
    `g = midlayer(emb, h)`, logits `lm_head(norm(g))` over `draft_vocab_size` tokens scattered to
    the target's ids `arange + d2t` (-inf elsewhere). Later drafts feed g in place of h.

    Layout: vLLM `model_executor/models/llama_eagle3.py` (`Eagle3LlamaForCausalLM`:
    `midlayer.*` -> `layers.0.*`, `fc` [H, 3H], `norm`, `lm_head` [Vd, H], `d2t` [Vd];
    aux layers from `get_eagle3_aux_hidden_state_layers`, the layer's input, i.e. the
    residual before it) and SGLang `models/llama_eagle3.py`; `t2d` is read and ignored.
    """

    layout = "eagle3"

    def __init__(self, config, *, target_vocab: int):
        super().__init__(config)
        H = config.hidden_size
        Vd = getattr(config, "draft_vocab_size", None) or config.vocab_size
        self.fc = nn.Linear(3 * getattr(config, "target_hidden_size", H), H, bias=False)
        self.midlayer = Eagle3Layer(config)
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        self.norm = LlamaRMSNorm(H, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.register_buffer("d2t", torch.zeros(Vd, dtype=torch.long))
        self.target_vocab = target_vocab

    def taps(self, num_layers: int) -> tuple[int, ...]:
        ids = eagle3_aux_layers(self.config, num_layers)
        bad = [i for i in ids if not 1 <= i < num_layers]
        if bad:
            raise HeadLayoutError(
                f"EAGLE-3 head reads the inputs of target layers {list(ids)}; a {num_layers}-layer target has "
                f"no layer input {bad} that is a layer output (set eagle_config.eagle_aux_hidden_state_layer_ids "
                f"to layers in 1..{num_layers - 1})")
        return tuple(i - 1 for i in ids)

    def combiner(self, parts):
        return self.fc

    def forward(self, embeds, hidden, *, position_ids, position_embeddings, attention_mask=None, cache=None):
        return self.midlayer(embeds, hidden, position_embeddings=position_embeddings,
                             attention_mask=attention_mask, cache=cache, position_ids=position_ids)

    def logits(self, parts, g):
        draft = self.lm_head(self.norm(g))                                          # [..., Vd]
        ids = torch.arange(draft.shape[-1], device=draft.device) + self.d2t        # target ids
        full = draft.new_full((*draft.shape[:-1], self.target_vocab), float("-inf"))
        return full.index_copy(-1, ids, draft)


class DeepSeekMTPHead(DraftHead):
    """DeepSeek-V3's MTP module: `g = Block(eh_proj(cat(enorm(emb), hnorm(h))))`, logits
    `shared_head.head(shared_head.norm(g))`; h is the target's normed final hidden state, and
    the embedding is zeroed at position 0.

    Layout: vLLM `model_executor/models/deepseek_mtp.py` (`DeepSeekMultiTokenPredictorLayer`;
    weights `model.layers.{num_hidden_layers}.{enorm,hnorm,eh_proj,shared_head.*}` and the block's
    own names under the same prefix) and SGLang `models/deepseek_nextn.py`. The block is one
    decoder layer of the target's class.

    The modules are specfx's `DraftHead`'s (the block is `layers.0`, `shared_head.norm` is `norm`;
    `_from_deepseek` / `_to_deepseek` map the names), with its own lm_head `head` where the
    checkpoint's differs from the target's (None: the target's).
    """

    layout = "deepseek-mtp"

    def __init__(self, parts):
        super().__init__(parts.config, type(parts.layers[0]), type(parts.norm))
        self.head = None

    def combiner(self, parts):
        return parts.norm

    def forward(self, embeds, hidden, *, position_ids, **kwargs):
        embeds = torch.where(position_ids[..., None] == 0, torch.zeros_like(embeds), embeds)
        return super().forward(embeds, hidden, position_ids=position_ids, **kwargs)

    def logits(self, parts, g):
        return (self.head if self.head is not None else parts.lm_head)(self.norm(g))


_DEEPSEEK_OWN = ("enorm.", "hnorm.", "eh_proj.")


def _from_deepseek(name: str) -> str:
    """A DeepSeek MTP weight name (its layer prefix stripped) -> `DeepSeekMTPHead`'s."""
    if name.startswith(_DEEPSEEK_OWN):
        return name
    if name.startswith("shared_head."):
        return name[len("shared_head."):]
    return "layers.0." + name


def _to_deepseek(name: str) -> str:
    """`DeepSeekMTPHead`'s weight name -> the DeepSeek MTP layout's (without the layer prefix)."""
    if name.startswith(_DEEPSEEK_OWN):
        return name
    if name.startswith(("norm.", "head.")):
        return "shared_head." + name
    return name[len("layers.0."):]


# ---------------------------------------------------------------------------------------------
# Reading and writing the layouts


def _read_folder(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json and every safetensors file of a folder (sharded or not)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_dir():
        raise FileNotFoundError(f"head {str(path)!r} not found (expected a folder with config.json and safetensors)")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"head {str(path)!r} is missing config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"head {str(path)!r} has no .safetensors file")
    try:
        config = json.loads((path / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HeadLayoutError(f"head {str(path)!r}: config.json is corrupt ({e})") from None
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise HeadLayoutError(f"head {str(path)!r}: {f.name} is corrupt ({e})") from None
    return config, state


def detect_layout(config: dict, names) -> str:
    """Which layout a head folder is in, from its config.json and weight names."""
    names = list(names)
    if config.get("format") == "specfx-mtp-head":
        return "specfx"
    archs = " ".join(config.get("architectures") or [])
    if "Eagle3" in archs or "eagle3" in archs.lower() or any(n.startswith("midlayer.") for n in names):
        return "eagle3"
    if config.get("num_nextn_predict_layers"):
        return "deepseek-mtp"
    if "fc.weight" in names and any(n.startswith("layers.0.") for n in names):
        return "eagle"
    raise HeadLayoutError("not a head in a known layout (specfx, eagle, eagle3, deepseek-mtp): "
                          f"architectures {config.get('architectures')}, weights {names[:4]}...")


def _check_fit(path, what: str, head_value, target_value):
    if head_value != target_value:
        raise HeadLayoutError(f"head {str(path)!r} does not fit this target: its {what} is {head_value}, "
                              f"the target's is {target_value}")


def _load_strict(module: nn.Module, state: dict, path, layout: str) -> None:
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise HeadLayoutError(f"{layout} head {str(path)!r}: weights do not match the layout "
                              f"(missing {missing[:6]}, unexpected {unexpected[:6]})")
    for name, t in state.items():
        if tuple(t.shape) != tuple(own[name].shape):
            raise HeadLayoutError(f"{layout} head {str(path)!r} does not fit this target: {name} is "
                                  f"{tuple(t.shape)}, the target needs {tuple(own[name].shape)}")
    module.load_state_dict(state, strict=True)


def _eagle_config(config: dict, parts, path):
    cfg = _llama_config(config)
    t = parts.config
    _check_fit(path, "hidden size", cfg.hidden_size, t.hidden_size)
    _check_fit(path, "vocabulary size", cfg.vocab_size, t.vocab_size)
    if getattr(cfg, "target_hidden_size", None) is not None:
        _check_fit(path, "target_hidden_size", cfg.target_hidden_size, t.hidden_size)
    return cfg


def _load_eagle(config, state, parts, path) -> EagleHead:
    cfg = _eagle_config(config, parts, path)
    state = {k: v for k, v in state.items() if not k.startswith(("embed_tokens.", "lm_head."))}  # the target's
    head = EagleHead(cfg, fc_bias="fc.bias" in state)
    _load_strict(head, state, path, "eagle")
    return head


def _load_eagle3(config, state, parts, path) -> Eagle3Head:
    cfg = _eagle_config(config, parts, path)
    state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v for k, v in state.items()}
    state = {k: v for k, v in state.items() if k != "t2d" and not k.startswith("embed_tokens.")}
    if "d2t" not in state:                              # a draft vocabulary equal to the target's
        Vd = getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size
        state["d2t"] = torch.zeros(Vd, dtype=torch.long)
    head = Eagle3Head(cfg, target_vocab=parts.config.vocab_size)
    _load_strict(head, state, path, "eagle3")
    ids = torch.arange(head.d2t.numel()) + head.d2t
    if ids.min() < 0 or ids.max() >= parts.config.vocab_size or ids.unique().numel() != ids.numel():
        raise HeadLayoutError(f"eagle3 head {str(path)!r}: d2t maps draft ids outside the target's "
                              f"{parts.config.vocab_size} tokens or onto one id twice")
    return head


def deepseek_prefix(config: dict) -> str:
    return f"model.layers.{config['num_hidden_layers']}."


def _load_deepseek(config, state, parts, path) -> DeepSeekMTPHead:
    t = parts.config
    for key, what in (("hidden_size", "hidden size"), ("vocab_size", "vocabulary size")):
        if key in config:
            _check_fit(path, what, config[key], getattr(t, key))
    if "num_hidden_layers" not in config:
        raise HeadLayoutError(f"deepseek-mtp head {str(path)!r}: config.json has no num_hidden_layers "
                              "(the MTP layer is stored as layer num_hidden_layers)")
    prefix = deepseek_prefix(config)
    mine = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
    if not mine:
        raise HeadLayoutError(f"deepseek-mtp head {str(path)!r} has no weights under {prefix}* "
                              f"(num_nextn_predict_layers={config.get('num_nextn_predict_layers')})")
    mine.pop("embed_tokens.weight", None)                # the target's, shared
    head = DeepSeekMTPHead(parts)
    own_head = mine.pop("shared_head.head.weight", None)
    _load_strict(head, {_from_deepseek(k): v for k, v in mine.items()}, path, "deepseek-mtp")
    if own_head is not None and not torch.equal(own_head.to(parts.lm_head.weight.dtype),
                                                parts.lm_head.weight.detach().cpu()):
        _check_fit(path, "shared_head.head shape", tuple(own_head.shape), tuple(parts.lm_head.weight.shape))
        head.head = nn.Linear(own_head.shape[1], own_head.shape[0], bias=False)
        head.head.weight.data.copy_(own_head)
    return head


def load_layout(path: str | Path, target: nn.Module, layout: str | None = None) -> nn.Module:
    """A head in any published layout, for `target` (on its device and dtype, in eval mode)."""
    from specfx.mtp import load_head, target_parts

    path = Path(path)
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"unknown head layout {layout!r}; expected one of {', '.join(LAYOUTS)}")
    config, state = _read_folder(path)
    found = detect_layout(config, state)
    if found == "specfx" and layout not in (None, "specfx"):
        found = config.get("layout", "specfx")           # specfx's checkpoint of a head of that layout
    if layout is not None and found != layout:
        raise HeadLayoutError(f"head {str(path)!r} is in the {found} layout, not {layout}")
    if config.get("format") == "specfx-mtp-head":
        return load_head(path, target)
    parts = target_parts(target)
    head = {"eagle": _load_eagle, "eagle3": _load_eagle3, "deepseek-mtp": _load_deepseek}[found](
        config, state, parts, path)
    param = next(target.parameters())
    return head.to(param.device, param.dtype).eval()


def empty_head(parts, layout: str, head_config: dict | None = None, state: dict | None = None) -> nn.Module:
    """An uninitialised head of `layout` for the target `parts` (`head_config`: an EAGLE
    head's config.json; None: a Llama layer of the target's sizes), with room for the weights
    in `state` (a DeepSeek head with its own lm_head, `head`)."""
    if layout == "deepseek-mtp":
        head = DeepSeekMTPHead(parts)
        own = (state or {}).get("head.weight")
        if own is not None:
            head.head = nn.Linear(own.shape[1], own.shape[0], bias=False)
        return head
    if layout in ("eagle", "eagle3"):
        cfg = _llama_config(head_config if head_config is not None else _eagle_dict(parts.config, layout))
        if layout == "eagle":
            return EagleHead(cfg, fc_bias=bool((head_config or {}).get("specfx_fc_bias", False)))
        return Eagle3Head(cfg, target_vocab=parts.config.vocab_size)
    raise ValueError(f"layout must be eagle, eagle3 or deepseek-mtp, got {layout!r}")


def new_layout_head(target: nn.Module, layout: str, **config) -> nn.Module:
    """A fresh head of `layout` shaped for `target` (random init; EAGLE heads copy the target's
    Llama sizes, `config` overrides them: e.g. `draft_vocab_size`; a DeepSeek block starts as a
    copy of the target's last layer)."""
    from specfx.mtp import target_parts

    parts = target_parts(target)
    head = empty_head(parts, layout, _eagle_dict(parts.config, layout, **config) if layout != "deepseek-mtp" else None)
    if layout == "deepseek-mtp":
        head.layers[0].load_state_dict(parts.layers[-1].state_dict())
    param = next(target.parameters())
    return head.to(param.device, param.dtype)


def head_config(head: nn.Module) -> dict | None:
    """What `empty_head` needs to rebuild `head` besides its layout (an EAGLE head's config)."""
    if isinstance(head, (EagleHead, Eagle3Head)):
        d = {k: v for k, v in head.config.to_dict().items() if not k.startswith("_")}
        if isinstance(head, EagleHead) and head.fc.bias is not None:
            d["specfx_fc_bias"] = True
        return d
    return None


def _eagle_dict(t, layout: str, **over) -> dict:
    """The config.json of an EAGLE head for target config `t` (a Llama layer of its sizes)."""
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "vocab_size", "max_position_embeddings", "hidden_act", "attention_bias",
            "mlp_bias", "rope_parameters", "bos_token_id", "eos_token_id", "pad_token_id")
    d = {k: copy.deepcopy(getattr(t, k)) for k in keys if getattr(t, k, None) is not None}
    d.update(num_hidden_layers=1, model_type="llama", tie_word_embeddings=False,
             architectures=[EAGLE3_ARCHITECTURE if layout == "eagle3" else EAGLE_ARCHITECTURE])
    if layout == "eagle3":
        d["draft_vocab_size"] = t.vocab_size
        d["target_hidden_size"] = t.hidden_size
    d.update(over)
    return d


def write_layout(head: nn.Module, out: str | Path, target: nn.Module, layout: str) -> Path:
    """Write `head` to `out` in `layout`, with the weight names and config keys vLLM and SGLang
    read. Refuses a head of another layout: the layouts differ in what the head reads and
    computes, so a conversion would not draft the same tokens."""
    from safetensors.torch import save_file

    from specfx.mtp import target_parts

    if layout not in ("eagle", "eagle3", "deepseek-mtp"):
        raise ValueError(f"write_layout: layout must be eagle, eagle3 or deepseek-mtp, got {layout!r}")
    have = getattr(head, "layout", "specfx")
    if have != layout:
        name = Path(getattr(target.config, "_name_or_path", "") or "").name or "TARGET"
        raise HeadLayoutError(cannot_hold(have, layout, name))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    parts = target_parts(target)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    if layout == "eagle3":
        state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in state.items()}
        Vd = head.d2t.numel()
        t2d = torch.zeros(parts.config.vocab_size, dtype=torch.bool)
        t2d[torch.arange(Vd) + head.d2t.cpu()] = True
        state["t2d"] = t2d
        config = head.config.to_dict()
        config.update(architectures=[EAGLE3_ARCHITECTURE], draft_vocab_size=Vd)
    elif layout == "eagle":
        config = head.config.to_dict()
        config.update(architectures=[EAGLE_ARCHITECTURE])
    else:
        t = parts.config
        prefix = f"model.layers.{t.num_hidden_layers}."
        renamed = {prefix + _to_deepseek(k): v for k, v in state.items()}
        if head.head is None:                            # the layout stores the lm_head it uses
            renamed[prefix + "shared_head.head.weight"] = parts.lm_head.weight.detach().contiguous().cpu().clone()
        renamed[prefix + "embed_tokens.weight"] = parts.embed.weight.detach().contiguous().cpu().clone()
        state = renamed
        config = t.to_dict()
        config.update(num_nextn_predict_layers=1)
    config = {k: v for k, v in config.items() if not k.startswith("_") and k != "specfx_mtp_head"}
    config["torch_dtype"] = str(next(iter(state.values())).dtype).removeprefix("torch.")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=1, default=str) + "\n")
    return out


def cannot_hold(have: str, layout: str, target: str = "TARGET") -> str:
    """Why a head of layout `have` cannot be written as `layout`, and what to do instead."""
    reads = {"specfx": "the target's last hidden state before its final norm, through eh_proj over enorm(emb), hnorm(h)",
             "eagle": "the normed last hidden state through fc over (emb, h), with no norm before the lm_head",
             "eagle3": "three target layers through fc, with its own reduced-vocabulary lm_head",
             "deepseek-mtp": "the target's normed last hidden state through eh_proj over enorm(emb), hnorm(h)"}
    return (f"a {have} head cannot be written in the {layout} layout exactly: it reads {reads[have]}, "
            f"while the {layout} layout reads {reads[layout]}. Train a head of that shape instead: "
            f"specfx train mtp --target {target} --arch {layout} --out DIR")
