"""Heads in the field's layouts (EAGLE-1, EAGLE-3, DeepSeek-V3 MTP): the layouts against a
reference written from the serving engines' math, exactness in the fused step, round trips,
and refused heads."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import specfx
from helpers import ARCHS, assert_greedy_equal, hf_greedy, tiny_model, unpadded
from specfx.capture import position_mask
from specfx.heads import HeadLayoutError, detect_layout, load_layout, new_layout_head, write_layout
from specfx.mtp import final_hidden, target_parts

LAYOUTS = ("eagle", "eagle3", "deepseek-mtp")
H, V = 64, 96


# ---------------------------------------------------------------------------------------------
# Published-layout folders, written from raw weight names (not by specfx's writer)


def _rand(*shape, g):
    return torch.randn(*shape, generator=g) * 0.3


def _llama_layer(prefix: str, g, *, qkv_in: int = H, input_norm: bool = True) -> dict:
    """One Llama layer of the tiny models' sizes (4 heads of 16, 2 KV heads), raw names."""
    w = {f"{prefix}self_attn.q_proj.weight": _rand(64, qkv_in, g=g),
         f"{prefix}self_attn.k_proj.weight": _rand(32, qkv_in, g=g),
         f"{prefix}self_attn.v_proj.weight": _rand(32, qkv_in, g=g),
         f"{prefix}self_attn.o_proj.weight": _rand(H, 64, g=g),
         f"{prefix}mlp.gate_proj.weight": _rand(128, H, g=g),
         f"{prefix}mlp.up_proj.weight": _rand(128, H, g=g),
         f"{prefix}mlp.down_proj.weight": _rand(H, 128, g=g),
         f"{prefix}post_attention_layernorm.weight": 1 + _rand(H, g=g)}
    if input_norm:
        w[f"{prefix}input_layernorm.weight"] = 1 + _rand(H, g=g)
    return w


def _head_config(model, arch: str, **extra) -> dict:
    c = model.config
    return {"architectures": [arch], "model_type": "llama", "hidden_size": H, "intermediate_size": 128,
            "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": c.vocab_size,
            "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": 512, "hidden_act": "silu",
            "rope_theta": 10000.0, **extra}


def published_folder(path, model, layout: str, *, seed: int = 0, draft_vocab: int | None = None):
    """A random head for `model` in `layout`, as its authors publish it; returns (path, weights)."""
    g = torch.Generator().manual_seed(seed)
    path.mkdir(parents=True, exist_ok=True)
    Vt = model.config.vocab_size
    if layout == "eagle":
        w = {"fc.weight": _rand(H, 2 * H, g=g), "fc.bias": _rand(H, g=g),
             **_llama_layer("layers.0.", g, input_norm=False)}
        config = _head_config(model, "LlamaForCausalLM")
    elif layout == "eagle3":
        Vd = draft_vocab or Vt
        ids = torch.sort(torch.randperm(Vt, generator=g)[:Vd]).values
        w = {"fc.weight": _rand(H, 3 * H, g=g), "norm.weight": 1 + _rand(H, g=g),
             "lm_head.weight": _rand(Vd, H, g=g) * 3, "d2t": ids - torch.arange(Vd),
             "t2d": torch.zeros(Vt, dtype=torch.bool).index_fill(0, ids, True),
             "midlayer.hidden_norm.weight": 1 + _rand(H, g=g),
             **_llama_layer("midlayer.", g, qkv_in=2 * H)}
        config = _head_config(model, "LlamaForCausalLMEagle3", draft_vocab_size=Vd, target_hidden_size=H)
    else:
        L = model.config.num_hidden_layers
        p = f"model.layers.{L}."
        w = {p + "enorm.weight": 1 + _rand(H, g=g), p + "hnorm.weight": 1 + _rand(H, g=g),
             p + "eh_proj.weight": _rand(H, 2 * H, g=g), p + "shared_head.norm.weight": 1 + _rand(H, g=g),
             p + "shared_head.head.weight": model.lm_head.weight.detach().clone(),
             p + "embed_tokens.weight": model.get_input_embeddings().weight.detach().clone(),
             # The block is a layer of the target's own class (its names, its biases).
             **{p + k: t + _rand(*t.shape, g=g) for k, t in target_parts(model).layers[-1].state_dict().items()}}
        config = {**model.config.to_dict(), "num_nextn_predict_layers": 1}
        config = {k: v for k, v in config.items() if not k.startswith("_")}
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config, default=str))
    return path, w


# ---------------------------------------------------------------------------------------------
# The reference: each layout's math as vLLM's model files write it, over raw weights


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _ref_layer(x, w, p, cos, sin, *, residual=None, input_norm=True):
    """A Llama layer: attention over x (its input norm applied if `input_norm`), residual
    `residual` (x where None), then the MLP."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    T = x.shape[1]
    a = _rms(x, w[p + "input_layernorm.weight"]) if input_norm else x
    heads = lambda t, n: t.view(1, T, n, 16).transpose(1, 2)  # noqa: E731
    q = heads(a @ w[p + "self_attn.q_proj.weight"].T, 4)
    k = heads(a @ w[p + "self_attn.k_proj.weight"].T, 2)
    v = heads(a @ w[p + "self_attn.v_proj.weight"].T, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    o = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    x = (x if residual is None else residual) + o.transpose(1, 2).reshape(1, T, 64) @ w[p + "self_attn.o_proj.weight"].T
    m = _rms(x, w[p + "post_attention_layernorm.weight"])
    m = (F.silu(m @ w[p + "mlp.gate_proj.weight"].T) * (m @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return x + m


def _layer_inputs(model, ids) -> list[torch.Tensor]:
    """The input of every decoder layer of `model` over `ids`."""
    seen, hooks = {}, []
    for i, layer in enumerate(target_parts(model).layers):
        hooks.append(layer.register_forward_pre_hook(lambda _m, args, i=i: seen.setdefault(i, args[0])))
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    return [seen[i] for i in range(len(seen))]


def reference_logits(model, layout: str, w: dict, seq) -> torch.Tensor:
    """[1, n-1, V]: position q drafts the token at q + 2 from the token at q + 1 and the
    target's state at q."""
    parts = target_parts(model)
    T = seq.shape[1] - 1
    pos = torch.arange(T)[None]
    e = parts.embed(seq[:, 1:])
    post = parts.norm(final_hidden(model, seq))[:, :T]           # the engines pass the normed state
    if layout == "eagle":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        cos, sin = LlamaRotaryEmbedding(load_config(model, "eagle"))(e, pos)
        x = torch.cat([e, post], -1) @ w["fc.weight"].T + w["fc.bias"]
        return parts.lm_head(_ref_layer(x, w, "layers.0.", cos, sin, input_norm=False))
    if layout == "eagle3":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        cos, sin = LlamaRotaryEmbedding(load_config(model, "eagle3"))(e, pos)
        L = model.config.num_hidden_layers
        inputs = _layer_inputs(model, seq)
        aux = torch.cat([inputs[i] for i in (2, L // 2, L - 3)], -1)[:, :T]    # vLLM's default layers
        h = aux @ w["fc.weight"].T
        x = torch.cat([_rms(e, w["midlayer.input_layernorm.weight"]), _rms(h, w["midlayer.hidden_norm.weight"])], -1)
        g = _ref_layer(x, w, "midlayer.", cos, sin, residual=h, input_norm=False)
        draft = _rms(g, w["norm.weight"]) @ w["lm_head.weight"].T
        full = torch.full((1, T, model.config.vocab_size), float("-inf"))
        full[..., torch.arange(draft.shape[-1]) + w["d2t"]] = draft
        return full
    p = f"model.layers.{model.config.num_hidden_layers}."
    cos, sin = parts.rotary(e, pos)
    e = torch.where(pos[..., None] == 0, 0.0, e)                  # vLLM zeroes position 0's embedding
    x = torch.cat([_rms(e, w[p + "enorm.weight"]), _rms(post, w[p + "hnorm.weight"])], -1) @ w[p + "eh_proj.weight"].T
    g = _ref_layer(x, w, p, cos, sin)
    return _rms(g, w[p + "shared_head.norm.weight"]) @ w[p + "shared_head.head.weight"].T


def load_config(model, layout):
    from specfx.heads import _eagle_dict, _llama_config

    return _llama_config(_eagle_dict(model.config, layout))


def head_logits(head, model, seq) -> torch.Tensor:
    """What specfx's head computes over `seq`, through the interface the fused step runs."""
    parts = target_parts(model)
    T = seq.shape[1] - 1
    seen, hooks = {}, []
    for i in head.taps(len(parts.layers)):
        hooks.append(parts.layers[i].register_forward_hook(lambda _m, _a, out, i=i: seen.setdefault(
            i, out[0] if isinstance(out, tuple) else out)))
    try:
        model(seq)
    finally:
        for h in hooks:
            h.remove()
    features = torch.cat([seen[i] for i in head.taps(len(parts.layers))], -1)
    combiner = head.combiner(parts)
    h = (combiner(features) if combiner is not None else features)[:, :T]
    e = parts.embed(seq[:, 1:])
    pos = torch.arange(T)[None]
    g = head(e, h, position_ids=pos, position_embeddings=head.position_embeddings(parts, e, pos),
             attention_mask=position_mask(pos, T, e.dtype))
    return head.logits(parts, g)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_computes_what_the_serving_engines_compute(tmp_path, layout):
    model = tiny_model("llama", layers=4, seed=7)
    path, w = published_folder(tmp_path / layout, model, layout, draft_vocab=80 if layout == "eagle3" else None)
    head = load_layout(path, model)
    assert head.layout == layout
    seq = torch.randint(3, V, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, ref = head_logits(head, model, seq), reference_logits(model, layout, w, seq)
    finite = ref.isfinite()
    assert torch.equal(ours.isfinite(), finite)
    torch.testing.assert_close(ours[finite], ref[finite], atol=2e-4, rtol=1e-4)
    assert ours.argmax(-1).unique().numel() > 3                       # not a degenerate head


def test_the_reference_catches_a_miswired_head(tmp_path):
    """The comparison above has teeth: the EAGLE-3 head reading the wrong target layers fails it."""
    model = tiny_model("llama", layers=4, seed=7)
    path, w = published_folder(tmp_path / "e3", model, "eagle3")
    head = load_layout(path, model)
    head.taps = lambda L: (L - 1, L - 1, L - 1)
    seq = torch.randint(3, V, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert not torch.allclose(head_logits(head, model, seq), reference_logits(model, "eagle3", w, seq), atol=1e-2)


# ---------------------------------------------------------------------------------------------
# Exactness in the fused step


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_equals_model_generate(tmp_path, layout, arch):
    model = tiny_model(arch, layers=4, seed=11)
    path, _ = published_folder(tmp_path / layout, model, layout, draft_vocab=64 if layout == "eagle3" else None)
    fast = specfx.compile(model, draft=specfx.MTPHead(path), num_speculative_tokens=3, max_seq_len=96,
                          batch_size=2, backend="eager", prefill_chunk=64)
    g = torch.Generator().manual_seed(3)
    for prompt_len in (1, 70):                                        # 70 > one prefill chunk of 64
        ids = torch.randint(3, V, (1, prompt_len), generator=g)
        assert_greedy_equal(model, fast.generate(ids, max_new_tokens=16, eos_token_id=[]),
                            hf_greedy(model, ids, 16), prompt_len)
    ids = torch.randint(3, V, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ours = fast.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[])
    for b in range(2):
        row, n = unpadded(ours, ids, mask, b), int(mask[b].sum())
        assert_greedy_equal(model, row, hf_greedy(model, row[:, :n], 12), n)


# ---------------------------------------------------------------------------------------------
# Round trips, detection and refusals


@pytest.mark.parametrize("layout", LAYOUTS)
def test_write_then_load_round_trips(tmp_path, layout):
    model = tiny_model("llama", layers=4, seed=2)
    head = new_layout_head(model, layout, **({"draft_vocab_size": 70} if layout == "eagle3" else {}))
    if layout == "eagle3":
        head.d2t.copy_(torch.sort(torch.randperm(V)[:70]).values - torch.arange(70))
    out = write_layout(head, tmp_path / layout, model, layout)
    loaded = load_layout(out, model, layout)
    own = head.state_dict()
    for name, t in loaded.state_dict().items():
        assert torch.equal(t, own[name]), name
    seq = torch.randint(3, V, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(head_logits(loaded, model, seq), head_logits(head, model, seq))


def test_specfx_head_cannot_be_written_in_another_layout(tmp_path):
    from specfx.mtp import new_head

    model = tiny_model("llama", layers=4)
    for layout in ("eagle3", "deepseek-mtp"):
        with pytest.raises(HeadLayoutError, match=f"cannot be written in the {layout} layout exactly.*--arch {layout}"):
            write_layout(new_head(model), tmp_path / layout, model, layout)


def test_layouts_are_detected():
    assert detect_layout({"format": "specfx-mtp-head"}, []) == "specfx"
    assert detect_layout({"architectures": ["LlamaForCausalLMEagle3"]}, ["fc.weight"]) == "eagle3"
    assert detect_layout({"architectures": ["LlamaForCausalLM"]}, ["midlayer.mlp.up_proj.weight"]) == "eagle3"
    assert detect_layout({"num_nextn_predict_layers": 1}, ["model.layers.4.enorm.weight"]) == "deepseek-mtp"
    assert detect_layout({"architectures": ["LlamaForCausalLM"]}, ["fc.weight", "layers.0.mlp.up_proj.weight"]) == "eagle"
    with pytest.raises(HeadLayoutError, match="not a head in a known layout"):
        detect_layout({"architectures": ["LlamaForCausalLM"]}, ["model.embed_tokens.weight"])


def test_heads_that_do_not_fit_are_refused(tmp_path):
    model = tiny_model("llama", layers=4, seed=7)
    for layout in LAYOUTS:
        path, _ = published_folder(tmp_path / layout, model, layout)
        with pytest.raises(HeadLayoutError, match="hidden size is 64, the target's is 32"):
            load_layout(path, tiny_model("llama", layers=4, hidden_size=32))
        with pytest.raises(HeadLayoutError, match="vocabulary size is 96, the target's is 128"):
            load_layout(path, tiny_model("llama", layers=4, vocab=128))
        with pytest.raises(HeadLayoutError, match=f"is in the {layout} layout, not specfx"):
            load_layout(path, model, "specfx")
    # EAGLE-3's default layers (2, L/2, L-3) do not exist in a 3-layer target.
    path, _ = published_folder(tmp_path / "e3", tiny_model("llama", layers=3), "eagle3")
    with pytest.raises(HeadLayoutError, match=r"inputs of target layers \[2, 1, 0\]"):
        specfx.compile(tiny_model("llama", layers=3), draft=specfx.MTPHead(path), backend="eager")
    # A draft vocabulary mapped outside the target's.
    path, w = published_folder(tmp_path / "bad", model, "eagle3", draft_vocab=80)
    w["d2t"][-1] = 500
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    with pytest.raises(HeadLayoutError, match="d2t maps draft ids outside"):
        load_layout(path, model)
    # A weight missing, and a weight of the wrong shape.
    path, w = published_folder(tmp_path / "missing", model, "eagle")
    del w["layers.0.mlp.up_proj.weight"]
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    with pytest.raises(HeadLayoutError, match="missing.*layers.0.mlp.up_proj.weight"):
        load_layout(path, model)
    path, w = published_folder(tmp_path / "shape", model, "eagle")
    w["fc.weight"] = torch.zeros(H, 3 * H)
    save_file({k: v.contiguous() for k, v in w.items()}, str(path / "model.safetensors"))
    with pytest.raises(HeadLayoutError, match=r"fc.weight is \(64, 192\), the target needs \(64, 128\)"):
        load_layout(path, model)
    (path / "model.safetensors").write_bytes(b"junk")
    with pytest.raises(HeadLayoutError, match="model.safetensors is corrupt"):
        load_layout(path, model)
    with pytest.raises(ValueError, match="layout='medusa'.*expected one of specfx, eagle, eagle3, deepseek-mtp"):
        specfx.MTPHead(path, layout="medusa")


def test_eagle3_step_exports_and_loads(tmp_path):
    model = tiny_model("llama", layers=4, seed=5)
    path, _ = published_folder(tmp_path / "e3", model, "eagle3", draft_vocab=64)
    fast = specfx.compile(model, draft=specfx.MTPHead(path), num_speculative_tokens=2, max_seq_len=48,
                          backend="eager")
    fast.export(tmp_path / "art", formats=("pt2",))
    loaded = specfx.load(tmp_path / "art")
    ids = torch.randint(3, V, (1, 7))
    assert torch.equal(loaded.generate(ids, max_new_tokens=16, eos_token_id=[]),
                       fast.generate(ids, max_new_tokens=16, eos_token_id=[]))


def test_export_head_cli_round_trip(tmp_path, capsys):
    """`specfx export-head` writes a trained-format head in its serving layout; loaded back, it
    drafts the same tokens; a head of another layout is refused with the command to train one."""
    from helpers import tiny_checkpoint
    from specfx.cli.main import main
    from specfx.mtp import new_head, save_head

    ckpt = tmp_path / "target"
    model = tiny_checkpoint(ckpt, layers=4).eval()
    head = new_layout_head(model, "eagle3", draft_vocab_size=64)
    save_head(head, tmp_path / "head", model)
    assert specfx.MTPHead(tmp_path / "head", layout="eagle3").load(model).d2t.dtype == torch.long
    assert main(["export-head", str(tmp_path / "head"), "--format", "eagle3", "--target", str(ckpt),
                 "-o", str(tmp_path / "served")]) == 0
    config = json.loads((tmp_path / "served" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 64
    ids = torch.randint(3, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    runs = [specfx.compile(model, draft=specfx.MTPHead(p), num_speculative_tokens=2, max_seq_len=64,
                           backend="eager") for p in (tmp_path / "head", tmp_path / "served")]
    outs = [fast.generate(ids, max_new_tokens=12, eos_token_id=[]) for fast in runs]
    assert torch.equal(outs[0], outs[1])
    assert runs[0].last_stats.acceptance_by_position == runs[1].last_stats.acceptance_by_position
    save_head(new_head(model), tmp_path / "native", model)
    assert main(["export-head", str(tmp_path / "native"), "--format", "deepseek-mtp", "--target", str(ckpt),
                 "-o", str(tmp_path / "no")]) == 2
    assert "--arch deepseek-mtp" in capsys.readouterr().err.replace("\n", " ")
