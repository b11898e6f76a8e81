"""Hugging Face Llama and GPT-2 in tenplex's terms (pure): configs and tensor names both ways.

``hf_config_to_spec`` / ``spec_to_hf_config``: a ``config.json`` as a ``ModelSpec`` and back (the source's
own config kept through a round trip); ``hf_to_tenplex`` / ``tenplex_to_hf``: the tensors under the other
side's names (docs/interop.md).

Llama: ``model.embed_tokens`` -> ``embedding.word``;
``model.layers.{i}.input_layernorm`` -> ``layers.{i}.attn_norm``; ``self_attn.{q,k,v}_proj``
-> rows of ``attn.qkv`` ([q; k; v]); ``self_attn.o_proj`` -> ``attn.proj``;
``post_attention_layernorm`` -> ``mlp_norm``; ``mlp.{gate,up}_proj`` -> ``mlp.gate_up``
([gate; up]); ``mlp.down_proj`` -> ``mlp.down``; ``model.norm`` -> ``final_norm``;
``lm_head`` -> ``lm_head``. HF's q/k rows are kept as they are: tenplex's trainer uses
rotate-half RoPE like HF, so no rotary permutation is applied (Meta's original checkpoints
interleave; convert those with HF's script first). GPT-2 (``transformer.`` prefix optional):
``wte``/``wpe`` -> ``embedding.word``/``embedding.position``; ``h.{i}.ln_1``/``ln_2`` ->
``layers.{i}.ln1``/``ln2``; Conv1D weights are stored (in, out) and are transposed:
``attn.c_attn`` -> ``attn.qkv`` (already [q; k; v]), ``attn.c_proj`` -> ``attn.proj``,
``mlp.c_fc`` -> ``mlp.fc1``, ``mlp.c_proj`` -> ``mlp.fc2``; ``ln_f`` -> ``final_norm``;
``lm_head`` is tied to ``wte``. Every mapping is a reshuffle of whole rows or a transpose,
so import followed by export returns the original tensors bit for bit.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..errors import CheckpointError, ConfigError
from ..layout.models import ModelSpec
from ..layout.ptc import dtype_to_str

__all__ = ["hf_config_to_spec", "spec_to_hf_config", "hf_to_tenplex", "tenplex_to_hf", "has_hf_names"]

log = logging.getLogger(__name__)

_IGNORED_HF = re.compile(r"(rotary_emb\.inv_freq|\.attn\.bias|\.attn\.masked_bias)$")

# transformers' defaults for keys a config.json may leave out (LlamaConfig, GPT2Config)
_HF_LLAMA_EPS, _HF_GPT2_EPS, _HF_ROPE_THETA = 1e-6, 1e-5, 10000.0


def _hf_rope(config: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """RoPE base and scaling of a Llama config.json: ``rope_parameters`` (transformers 5) or
    ``rope_theta`` / ``rope_scaling`` (before); the scaling without its base, None when default."""
    params = config.get("rope_parameters")
    params = dict(params) if isinstance(params, Mapping) else {}
    theta = params.get("rope_theta", config.get("rope_theta", _HF_ROPE_THETA))
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if not scaling or scaling.get("rope_type", "default") == "default":
        old = config.get("rope_scaling")
        scaling = dict(old) if isinstance(old, Mapping) else {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    return float(theta), (scaling if kind != "default" else None)


def hf_config_to_spec(config: Mapping[str, Any], dtype: torch.dtype, *, vocab_pad: int = 128) -> ModelSpec:
    """The tenplex ModelSpec of a Hugging Face Llama or GPT-2 ``config.json``: dimensions and
    the hyperparameters that change logits (norm epsilon, RoPE base and scaling; transformers'
    defaults where the config leaves them out). The config itself is not included: ``import_hf``
    adds it as ``source_config``, which ``export_hf`` writes back (token ids and all).
    """
    mtype = config.get("model_type")
    if mtype == "llama":
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise ConfigError("Llama checkpoints with attention or MLP biases have no tenplex equivalent")
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        head_dim = config.get("head_dim")
        if head_dim is not None and int(head_dim) * heads != hidden:
            raise ConfigError(f"head_dim={head_dim} times num_attention_heads={heads} is not hidden_size={hidden}: "
                              "tenplex's Llama has head_dim = hidden_size / num_attention_heads")
        theta, scaling = _hf_rope(config)
        return ModelSpec(
            arch="llama", num_layers=int(config["num_hidden_layers"]), hidden=hidden, heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            ffn_hidden=int(config["intermediate_size"]), vocab=int(config["vocab_size"]),
            seq_len=int(config.get("max_position_embeddings", 2048)),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)), dtype=dtype, vocab_pad=vocab_pad,
            norm_eps=float(config.get("rms_norm_eps", _HF_LLAMA_EPS)), rope_theta=theta, rope_scaling=scaling,
        )
    if mtype == "gpt2":
        h = int(config["n_embd"])
        return ModelSpec(
            arch="gpt", num_layers=int(config["n_layer"]), hidden=h, heads=int(config["n_head"]),
            ffn_hidden=int(config.get("n_inner") or 4 * h), vocab=int(config["vocab_size"]),
            seq_len=int(config["n_positions"]), tied_embeddings=True, dtype=dtype, vocab_pad=vocab_pad,
            norm_eps=float(config.get("layer_norm_epsilon", _HF_GPT2_EPS)),
        )
    raise ConfigError(f"unsupported Hugging Face model_type {mtype!r}: tenplex imports 'llama' and 'gpt2'")


def _spec_fields(spec: ModelSpec) -> dict[str, Any]:
    """The ``config.json`` fields that ``spec`` determines (dimensions, vocabulary without padding,
    and its hyperparameters, unstated ones resolved to what tenplex's model computes with)."""
    r = spec.resolved()
    if spec.arch == "llama":
        rope = {"rope_type": "default", **(r.rope_scaling or {}), "rope_theta": r.rope_theta}
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": spec.hidden,
            "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.heads,
            "num_key_value_heads": spec.kv_heads, "head_dim": spec.head_dim, "intermediate_size": spec.ffn_hidden,
            "vocab_size": spec.vocab, "max_position_embeddings": spec.seq_len,
            "tie_word_embeddings": bool(spec.tied_embeddings), "rms_norm_eps": r.norm_eps,
            "rope_theta": r.rope_theta, "rope_parameters": rope,
        }
    if not spec.tied_embeddings:
        raise ConfigError("GPT-2 ties its LM head to the word embedding; this GPT has an untied head")
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": spec.hidden,
        "n_layer": spec.num_layers, "n_head": spec.heads, "n_inner": spec.ffn_hidden, "vocab_size": spec.vocab,
        "n_positions": spec.seq_len, "n_ctx": spec.seq_len, "tie_word_embeddings": True,
        "layer_norm_epsilon": r.norm_eps,
    }


# What tenplex's models compute with besides the ModelSpec (norm epsilon and RoPE come from the
# spec, ModelSpec.resolved). No token ids are known: they are written as null so that transformers'
# defaults (1/2 for Llama, 50256 for GPT-2) are not mistaken for this model's.
_TENPLEX_LLAMA = {
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
    "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
}
_TENPLEX_GPT = {
    "activation_function": "gelu_new", "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
    "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
}


def _with_dtype(config: dict[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """``config`` with its dtype set to ``dtype`` (the key(s) it uses: ``dtype`` since transformers 5,
    ``torch_dtype`` before; both when it has neither)."""
    keys = [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype", "dtype"]
    return {**config, **dict.fromkeys(keys, dtype_to_str(dtype))}


def spec_to_hf_config(spec: ModelSpec, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A Hugging Face ``config.json`` for ``spec`` (the inverse of ``hf_config_to_spec``).

    ``base`` (default: ``spec.source_config``, the config the model was imported with): returned
    as it is but for the dtype (and ``architectures`` / ``model_type`` when missing), so norm
    epsilon, RoPE parameters, token ids and the rest survive a round trip. A ``base`` that
    describes another model than ``spec`` (dimensions, or a hyperparameter ``spec`` states) gets
    ``spec``'s fields (logged, with what differs). Without either: every field transformers'
    ``LlamaConfig`` / ``GPT2Config`` needs to compute what tenplex's model computes (norm epsilon
    and RoPE of ``spec.resolved()``: ``tenplex.layout.models.NORM_EPS`` / ``ROPE_THETA`` unless stated,
    head_dim, KV heads, tying, the vocabulary without tenplex's padding, dtype), no token ids.
    """
    base = spec.source_config if base is None else base
    fields = _spec_fields(spec)
    if base is None:
        defaults = _TENPLEX_LLAMA if spec.arch == "llama" else _TENPLEX_GPT
        return _with_dtype({**defaults, **fields}, spec.dtype)
    out = dict(base)
    try:
        diffs = spec.differences(hf_config_to_spec(base, spec.dtype, vocab_pad=spec.vocab_pad),
                                 tuple(f for f in ModelSpec.__dataclass_fields__ if f != "source_config"))
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        diffs = [f"it cannot be read ({type(e).__name__}: {e})"]
    if not diffs:
        for k in ("architectures", "model_type"):
            if not out.get(k):
                out[k] = fields[k]
    else:
        if spec.arch == "llama" and "rope_parameters" not in base:  # the source's form: before transformers 5
            fields.pop("rope_parameters")
            fields["rope_scaling"] = spec.resolved().rope_scaling
        keys = _changed_keys(spec, diffs, base, fields)
        log.warning("the Hugging Face config kept from the import describes another model than the checkpoint "
                    "(%s); writing the checkpoint's values into it: %s", "; ".join(diffs), ", ".join(sorted(keys)))
        out.update({k: fields[k] for k in keys})
    return _with_dtype(out, spec.dtype)


# The config.json keys (of _spec_fields) that each ModelSpec field sets.
_HF_KEYS = {
    "llama": {"num_layers": ("num_hidden_layers",), "hidden": ("hidden_size", "head_dim"),
              "heads": ("num_attention_heads", "head_dim"), "kv_heads": ("num_key_value_heads",),
              "ffn_hidden": ("intermediate_size",), "vocab": ("vocab_size",), "seq_len": ("max_position_embeddings",),
              "tied_embeddings": ("tie_word_embeddings",), "norm_eps": ("rms_norm_eps",),
              "rope_theta": ("rope_theta", "rope_parameters"), "rope_scaling": ("rope_scaling", "rope_parameters")},
    "gpt": {"num_layers": ("n_layer",), "hidden": ("n_embd",), "heads": ("n_head",), "ffn_hidden": ("n_inner",),
            "vocab": ("vocab_size",), "seq_len": ("n_positions", "n_ctx"), "tied_embeddings": ("tie_word_embeddings",),
            "norm_eps": ("layer_norm_epsilon",)},
}


def _changed_keys(spec: ModelSpec, diffs: list[str], base: Mapping[str, Any], fields: Mapping[str, Any]) -> set[str]:
    """The keys of ``fields`` to write into ``base`` for the ModelSpec fields ``diffs`` names: those
    fields' keys (RoPE in the form ``base`` uses), every key when the architecture differs or ``base``
    cannot be read."""
    names = {d.split(":", 1)[0] for d in diffs}
    known = _HF_KEYS[spec.arch]
    if not names <= set(known) | {"dtype", "vocab_pad"}:
        return set(fields)
    v5 = "rope_parameters" in base  # then RoPE is written there only, not also as top-level keys
    return {k for n in names for k in known.get(n, ())
            if k in fields and not (v5 and k in ("rope_theta", "rope_scaling") and k not in base)}


def _take(state: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    try:
        return state.pop(key)
    except KeyError:
        raise CheckpointError(f"the Hugging Face checkpoint lacks {key!r}") from None


def hf_to_tenplex(state: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Hugging Face tensors of a Llama or GPT-2 model under tenplex names (see the module doc)."""
    st = {k: v for k, v in state.items() if not _IGNORED_HF.search(k)}
    out: dict[str, torch.Tensor] = {}
    if spec.arch == "llama":
        out["embedding.word"] = _take(st, "model.embed_tokens.weight")
        for i in range(spec.num_layers):
            p, q = f"model.layers.{i}.", f"layers.{i}."
            out[q + "attn_norm.weight"] = _take(st, p + "input_layernorm.weight")
            out[q + "attn.qkv.weight"] = torch.cat(
                [_take(st, p + f"self_attn.{x}_proj.weight") for x in "qkv"], dim=0)
            out[q + "attn.proj.weight"] = _take(st, p + "self_attn.o_proj.weight")
            out[q + "mlp_norm.weight"] = _take(st, p + "post_attention_layernorm.weight")
            out[q + "mlp.gate_up.weight"] = torch.cat(
                [_take(st, p + "mlp.gate_proj.weight"), _take(st, p + "mlp.up_proj.weight")], dim=0)
            out[q + "mlp.down.weight"] = _take(st, p + "mlp.down_proj.weight")
        out["final_norm.weight"] = _take(st, "model.norm.weight")
        if spec.tied_embeddings:
            st.pop("lm_head.weight", None)
        else:
            out["lm_head.weight"] = _take(st, "lm_head.weight")
    else:
        pre = "transformer." if any(k.startswith("transformer.") for k in st) else ""
        out["embedding.word"] = _take(st, pre + "wte.weight")
        out["embedding.position"] = _take(st, pre + "wpe.weight")
        for i in range(spec.num_layers):
            p, q = f"{pre}h.{i}.", f"layers.{i}."
            for hf, tx in (("ln_1", "ln1"), ("ln_2", "ln2")):
                out[q + tx + ".weight"] = _take(st, p + hf + ".weight")
                out[q + tx + ".bias"] = _take(st, p + hf + ".bias")
            for hf, tx in (("attn.c_attn", "attn.qkv"), ("attn.c_proj", "attn.proj"),
                           ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
                out[q + tx + ".weight"] = _take(st, p + hf + ".weight").t().contiguous()  # Conv1D: (in, out)
                out[q + tx + ".bias"] = _take(st, p + hf + ".bias")
        out["final_norm.weight"] = _take(st, pre + "ln_f.weight")
        out["final_norm.bias"] = _take(st, pre + "ln_f.bias")
        st.pop("lm_head.weight", None)  # tied to wte
    if st:
        raise CheckpointError(f"the Hugging Face checkpoint has {len(st)} tensors tenplex does not know, "
                              f"e.g. {sorted(st)[:3]}")
    return out


def tenplex_to_hf(state: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Tenplex GPT/Llama parameters under Hugging Face names (inverse of ``hf_to_tenplex``)."""
    out: dict[str, torch.Tensor] = {}
    if spec.arch == "llama":
        q_rows = spec.heads * spec.head_dim
        kv_rows = (spec.kv_heads or spec.heads) * spec.head_dim
        out["model.embed_tokens.weight"] = state["embedding.word"]
        for i in range(spec.num_layers):
            p, q = f"model.layers.{i}.", f"layers.{i}."
            out[p + "input_layernorm.weight"] = state[q + "attn_norm.weight"]
            qw, kw, vw = torch.split(state[q + "attn.qkv.weight"], [q_rows, kv_rows, kv_rows], dim=0)
            out[p + "self_attn.q_proj.weight"] = qw.contiguous()
            out[p + "self_attn.k_proj.weight"] = kw.contiguous()
            out[p + "self_attn.v_proj.weight"] = vw.contiguous()
            out[p + "self_attn.o_proj.weight"] = state[q + "attn.proj.weight"]
            out[p + "post_attention_layernorm.weight"] = state[q + "mlp_norm.weight"]
            g, u = torch.split(state[q + "mlp.gate_up.weight"], [spec.ffn_hidden, spec.ffn_hidden], dim=0)
            out[p + "mlp.gate_proj.weight"] = g.contiguous()
            out[p + "mlp.up_proj.weight"] = u.contiguous()
            out[p + "mlp.down_proj.weight"] = state[q + "mlp.down.weight"]
        out["model.norm.weight"] = state["final_norm.weight"]
        if not spec.tied_embeddings:
            out["lm_head.weight"] = state["lm_head.weight"]
    else:
        pre = "transformer."
        out[pre + "wte.weight"] = state["embedding.word"]
        out[pre + "wpe.weight"] = state["embedding.position"]
        for i in range(spec.num_layers):
            p, q = f"{pre}h.{i}.", f"layers.{i}."
            for hf, tx in (("ln_1", "ln1"), ("ln_2", "ln2")):
                out[p + hf + ".weight"] = state[q + tx + ".weight"]
                out[p + hf + ".bias"] = state[q + tx + ".bias"]
            for hf, tx in (("attn.c_attn", "attn.qkv"), ("attn.c_proj", "attn.proj"),
                           ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
                out[p + hf + ".weight"] = state[q + tx + ".weight"].t().contiguous()
                out[p + hf + ".bias"] = state[q + tx + ".bias"]
        out[pre + "ln_f.weight"] = state["final_norm.weight"]
        out[pre + "ln_f.bias"] = state["final_norm.bias"]
    return out


def has_hf_names(names: Iterable[str]) -> bool:
    """Whether tensor names are Hugging Face Llama / GPT-2 ones (``model.layers.``, ``transformer.h.`` ...)."""
    return any(n.startswith(("model.layers.", "model.embed_tokens", "transformer.h.", "transformer.wte")) for n in names)
