"""Import checkpoints users already have, and export back to Hugging Face format.

* ``import_hf``: a Hugging Face Llama (``LlamaForCausalLM``) or GPT-2 (``GPT2LMHeadModel``)
  checkpoint (``config.json`` plus ``*.safetensors``) becomes a tenplex checkpoint of the
  matching ``model_ptc`` (parameters only), saved under a layout (default ``dp=1,tp=1,pp=1``)
  and loadable under any layout.
* ``import_dcp``: a ``torch.distributed.checkpoint`` directory (any sharding, DTensor or
  plain tensors) becomes a tenplex checkpoint. By default (no ``model`` and no Hugging Face
  names) it keeps the checkpoint's own partitioning: every DCP chunk becomes the box of a
  pseudo writer rank (one per DCP file), the non-tensor entries become objects, and the
  result is a state-dict checkpoint (``StateLayout`` of ``Boxes``) that
  ``tenplex.load_state_dict`` loads under any mesh, reading only what each rank needs. With a
  ``model`` (or ``hf_config``), tensors named like tenplex's GPT/Llama collections
  (``embedding.word``, ``layers.{i}.attn.qkv.weight``, ``optimizer.exp_avg.*``) get their
  TP/PP partitioning under ``layout``; Hugging Face names are mapped first; any other tensor
  is imported replicated on every stage.
* ``export_hf``: a tenplex GPT/Llama checkpoint back to one Hugging Face style
  ``model.safetensors`` plus ``config.json``: the source's own config when the model was
  imported from Hugging Face (kept in the model description, ``ModelSpec.source_config``, which
  every later save of the same model carries; only the dtype is updated), else a complete config
  of the model tenplex describes (``spec_to_hf_config``).

Every URL can carry fsspec ``storage_options``: ``storage_options`` for the tenplex checkpoint,
``source_storage_options`` for an import's source, ``out_storage_options`` for an export's
destination (each may also be a local path).

Name mapping (see docs/interop.md). Llama: ``model.embed_tokens`` -> ``embedding.word``;
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

import dataclasses
import json
import logging
import re
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from .checkpoint import LoadResult, load, save
from .checkpoint.writer import default_save_id
from .checkpoint.catalog import url_fs
from .config import ParallelConfig
from .errors import CheckpointError, CheckpointNotFoundError, ConfigError, TenplexError
from .models import ModelSpec, model_ptc, model_spec, optimizer_names
from .ptc import PTC, Layout, TensorSpec, dtype_to_str
from .state_layout import Boxes, StateLayout, spec_for

__all__ = [
    "ImportResult",
    "hf_config_to_spec",
    "hf_to_tenplex",
    "tenplex_to_hf",
    "spec_to_hf_config",
    "read_hf_state",
    "read_dcp_state",
    "dcp_chunk_layout",
    "import_hf",
    "import_dcp",
    "import_dcp_chunks",
    "import_checkpoint",
    "export_hf",
    "detect_format",
    "source_step",
]

log = logging.getLogger(__name__)

_IGNORED_HF = re.compile(r"(rotary_emb\.inv_freq|\.attn\.bias|\.attn\.masked_bias)$")


@dataclass(frozen=True, slots=True)
class ImportResult:
    """What an import wrote: the collection, the layout it was saved under, the step, bytes."""

    ptc: PTC
    layout: Layout
    step: int
    url: str
    source_format: str
    tensors: int
    nbytes: int


# ---------------------------------------------------------------------------------------------
# Hugging Face configs
# ---------------------------------------------------------------------------------------------
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
    and RoPE of ``spec.resolved()``: ``tenplex.models.NORM_EPS`` / ``ROPE_THETA`` unless stated,
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


def _infer_hf_config(state: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    raise ConfigError("the checkpoint has no config.json; tenplex needs it for the head counts "
                      "(write one with the model's save_pretrained or by hand)")


# ---------------------------------------------------------------------------------------------
# name mapping
# ---------------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------------
# reading sources
# ---------------------------------------------------------------------------------------------
def _options(storage_options: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    if storage_options is None:
        return {}
    if not isinstance(storage_options, Mapping) or not all(isinstance(k, str) for k in storage_options):
        raise ConfigError(f"{what} must map option names (strings) to values, got {storage_options!r}")
    return dict(storage_options)


def _url_fs(src: str | Path, storage_options: Mapping[str, Any] | None,
            what: str = "source_storage_options") -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem and path of a local path or fsspec URL, built with ``storage_options``."""
    return url_fs(str(src), _options(storage_options, what))


def _names(fs: fsspec.AbstractFileSystem, path: str) -> list[str]:
    """Full paths of the entries of directory ``path``."""
    return sorted(fs.ls(path, detail=False))


_SOURCE_STEP = re.compile(r"(?:step|checkpoint|global_step)[-_]?(\d+)")


def source_step(src: str | Path) -> int | None:
    """The training step a source checkpoint's directory name says (pure): torchtitan's ``step-5``,
    Hugging Face Trainer's ``checkpoint-500``, DeepSpeed's ``global_step500`` (``step_5`` too); a
    ``.safetensors`` file: its directory's. None when the name says none."""
    parts = str(src).replace("\\", "/").rstrip("/").rsplit("/", 2)
    name = parts[-2] if parts[-1].endswith(".safetensors") and len(parts) > 1 else parts[-1]
    m = _SOURCE_STEP.fullmatch(name)
    return int(m.group(1)) if m else None


def _import_step(src: str | Path, step: int | None, objects: Mapping[str, Any] | None = None) -> int:
    """``step`` when given, else the source's own: its directory name's (``source_step``), else the
    ``train_state.step`` torchtitan's CheckpointManager saves among a DCP checkpoint's ``objects``, else 0."""
    if step is not None:
        return step
    found = source_step(src)
    if found is None and objects is not None:
        saved = objects.get("train_state.step")
        found = saved if isinstance(saved, int) and not isinstance(saved, bool) and saved >= 0 else None
    return 0 if found is None else found


def detect_format(src: str | Path, *, storage_options: Mapping[str, Any] | None = None) -> str:
    """'dcp' for a directory with DCP's ``.metadata``, 'hf' for safetensors files (local or a URL)."""
    fs, path = _url_fs(src, storage_options)
    if fs.isdir(path):
        names = _names(fs, path)
        if any(n.rsplit("/", 1)[-1] == ".metadata" for n in names):
            return "dcp"
        if any(n.endswith(".safetensors") for n in names):
            return "hf"
    elif path.endswith(".safetensors") and fs.isfile(path):
        return "hf"
    raise CheckpointNotFoundError(
        f"{src} is neither a DCP checkpoint directory (with .metadata) nor a Hugging Face safetensors "
        "checkpoint (a .safetensors file or a directory holding them)")


def read_hf_state(src: str | Path, *, storage_options: Mapping[str, Any] | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """Every tensor of a Hugging Face safetensors checkpoint (all shards) and its config.json."""
    from safetensors.torch import load as load_bytes
    from safetensors.torch import load_file

    fs, path = _url_fs(src, storage_options)
    if fs.isfile(path):
        files, parent = [path], path.rsplit("/", 1)[0]
    else:
        files = [n for n in _names(fs, path) if n.endswith(".safetensors")] if fs.isdir(path) else []
        parent = path.rstrip("/")
    if not files:
        raise CheckpointNotFoundError(f"no .safetensors files in {src}")
    local = isinstance(fs, LocalFileSystem)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        part = load_file(f) if local else load_bytes(fs.cat_file(f))
        dup = set(part) & set(state)
        if dup:
            raise CheckpointError(f"{f} repeats tensors of another shard, e.g. {sorted(dup)[:3]}")
        state.update(part)
    cfg_path = parent + "/config.json"
    if not fs.exists(cfg_path):
        return state, None
    try:
        config = json.loads(fs.cat_file(cfg_path))
    except ValueError as e:
        raise ConfigError(f"{cfg_path} is not JSON ({e}): write the model's config.json again") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{cfg_path} holds a {type(config).__name__}, not a JSON object")
    return state, config


def read_dcp_state(src: str | Path, *, storage_options: Mapping[str, Any] | None = None
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor of a DCP checkpoint as a full (unsharded) tensor, and its non-tensor items.

    Reads in this process without a process group (``no_dist``); whatever sharding the
    checkpoint was saved with, the result holds the global tensors. A URL (or any
    ``storage_options``) is read through fsspec (DCP's ``FsspecReader``).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    reader, md = _dcp_metadata(src, storage_options)
    tensors: dict[str, torch.Tensor] = {}
    objects: dict[str, Any] = {}
    for fqn, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            tensors[fqn] = torch.empty(item.size, dtype=item.properties.dtype)
        elif isinstance(item, BytesStorageMetadata):
            objects[fqn] = None
    want: dict[str, Any] = {**tensors, **objects}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(want, storage_reader=reader, no_dist=True)
    return {k: want[k] for k in tensors}, {k: want[k] for k in objects}


def _dcp_metadata(src: str | Path, storage_options: Mapping[str, Any] | None) -> tuple[Any, Any]:
    """A DCP ``StorageReader`` of ``src`` (``FsspecReader`` for a URL or with options) and its metadata."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # public there (its __all__)

    opts = _options(storage_options, "source_storage_options")
    fs, path = _url_fs(src, opts)
    reader = (dcp.FileSystemReader(path) if isinstance(fs, LocalFileSystem) and not opts
              else FsspecReader(str(src), **opts))
    try:
        md = reader.read_metadata()
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{src} has no DCP .metadata file") from None
    return reader, md


@dataclass(frozen=True, slots=True)
class DcpChunk:
    """One saved DCP chunk: the tensor, its box, the pseudo rank that holds it, DCP's index of it."""

    name: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int
    index: Any  # torch.distributed.checkpoint.metadata.MetadataIndex


def dcp_chunk_layout(md: Any, *, strip_prefix: str = "") -> tuple[PTC, StateLayout, list[DcpChunk], list[Any]]:
    """The collection and layout of a DCP checkpoint's metadata with its partitioning kept (pure).

    Every chunk becomes the box of a pseudo writer rank: rank ``i`` holds the chunks stored in the
    ``i``-th DCP file (sorted by name); a file holding several chunks of one tensor gives the
    extra ones ranks of their own after those. Returns the PTC (tensors in DCP's dtypes, non-tensor
    entries as objects), the ``StateLayout`` of ``Boxes``, every chunk, and the DCP indexes of the
    non-tensor entries. CheckpointError for metadata it cannot place.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    storage = md.storage_data or {}
    files = sorted({info.relative_path for info in storage.values()})
    file_rank = {f: i for i, f in enumerate(files)}
    extra_rank = len(files)
    chunks: list[DcpChunk] = []
    byte_items: list[Any] = []
    specs: list[TensorSpec] = []
    layout: dict[str, Boxes] = {}
    objects: list[str] = []
    by_name: dict[str, list[Any]] = {}
    for index in storage:
        by_name.setdefault(index.fqn, []).append(index)
    for fqn, item in md.state_dict_metadata.items():
        name = fqn.removeprefix(strip_prefix)
        if isinstance(item, BytesStorageMetadata):
            objects.append(name)
            byte_items.extend((name, i) for i in by_name.get(fqn, []))
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointError(f"{fqn}: DCP metadata of type {type(item).__name__} is neither a tensor nor bytes")
        found = {tuple(int(x) for x in i.offset): i for i in by_name.get(fqn, [])}
        held: set[int] = set()
        boxes = []
        for c in item.chunks:
            offsets, sizes = tuple(int(x) for x in c.offsets), tuple(int(x) for x in c.sizes)
            index = found.get(offsets)
            if index is None:
                raise CheckpointError(f"{fqn}: the DCP metadata lists a chunk at offsets {list(offsets)} but no "
                                      "storage entry for it (a damaged .metadata)")
            rank = file_rank[storage[index].relative_path]
            if rank in held:
                rank, extra_rank = extra_rank, extra_rank + 1
            held.add(rank)
            boxes.append((rank, offsets, sizes))
            chunks.append(DcpChunk(name, offsets, sizes, rank, index))
        placed = Boxes(tuple(boxes))
        specs.append(spec_for(name, tuple(int(x) for x in item.size), item.properties.dtype, placed))
        layout[name] = placed
    names = [s.name for s in specs] + objects
    if len(set(names)) != len(names):
        raise CheckpointError(f"names repeat after removing the prefix {strip_prefix!r}: "
                              f"{sorted({n for n in names if names.count(n) > 1})[:5]}")
    ptc = PTC(specs, num_layers=0, objects=objects, meta={"kind": "state_dict", "imported_from": "dcp"})
    state_layout = StateLayout.of(max(extra_rank, 1), layout)
    try:
        state_layout.check(ptc, complete=True)
    except TenplexError as e:
        raise CheckpointError(f"the DCP checkpoint's chunks do not tile its tensors: {e}") from None
    return ptc, state_layout, chunks, byte_items


class _ChunkSink:
    """The three ``LoadPlanner`` calls a DCP ``StorageReader.read_data`` makes: tensors into
    preallocated chunk buffers, byte entries unpickled as DCP's own planner does."""

    def __init__(self, buffers: Mapping[Any, torch.Tensor]) -> None:
        self.buffers = buffers
        self.values: dict[Any, Any] = {}

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        return self.buffers[read_item.dest_index]

    def commit_tensor(self, read_item: Any, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, read_item: Any, value: Any) -> None:
        self.values[read_item.dest_index] = torch.load(value, weights_only=False)  # as DCP's DefaultLoadPlanner


def _read_chunks(reader: Any, md: Any, items: list[tuple[Any, torch.Size | None, torch.dtype | None]]) -> _ChunkSink:
    """Read the DCP entries ``items`` (index, chunk size and dtype, or None for byte entries) with
    ``reader``: each chunk once, into fresh buffers."""
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    buffers: dict[Any, torch.Tensor] = {}
    reads = []
    for index, size, dtype in items:
        if size is None:
            reads.append(ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=torch.Size((0,)),
                                  storage_index=index, storage_offsets=torch.Size((0,)), lengths=torch.Size((0,))))
            continue
        buffers[index] = torch.empty(size, dtype=dtype)
        zero = torch.Size((0,) * len(size))
        reads.append(ReadItem(type=LoadItemType.TENSOR, dest_index=index, dest_offsets=zero, storage_index=index,
                              storage_offsets=zero, lengths=torch.Size(size)))
    sink = _ChunkSink(buffers)
    if reads:
        reader.read_data(LoadPlan(reads), sink).wait()
    return sink


def import_dcp_chunks(src: str | Path, url: str, *, step: int | None = None, strip_prefix: str = "",
                      storage_options: Mapping[str, Any] | None = None,
                      source_storage_options: Mapping[str, Any] | None = None) -> ImportResult:
    """Import a DCP checkpoint keeping its partitioning: each DCP file becomes the part of one pseudo
    writer rank holding the same chunks (``dcp_chunk_layout``), so nothing is duplicated, and the
    result loads with ``tenplex.load_state_dict`` under any mesh (each rank reading only its
    ranges). Streams: one DCP file's chunks in memory at a time, each read once. ``step``: default
    the source's (``_import_step``).
    """
    t0 = time.perf_counter()
    opts = _options(storage_options, "storage_options")
    reader, md = _dcp_metadata(src, source_storage_options)
    reader.set_up_storage_reader(md, True)
    ptc, layout, chunks, byte_items = dcp_chunk_layout(md, strip_prefix=strip_prefix)
    props = {fqn.removeprefix(strip_prefix): item.properties.dtype for fqn, item in md.state_dict_metadata.items()
             if hasattr(item, "chunks")}
    objs = _read_chunks(reader, md, [(i, None, None) for _, i in byte_items]).values
    objects = {name: objs[i] for name, i in byte_items}
    step = _import_step(src, step, objects)
    per_rank: dict[int, list[DcpChunk]] = {r: [] for r in range(layout.world_size)}
    for c in chunks:
        per_rank[c.rank].append(c)
    save_id = default_save_id(layout, ptc)
    extra = {"imported_from": "dcp", "source": str(src)}
    written = 0
    for rank in range(layout.world_size):
        got = _read_chunks(reader, md, [(c.index, torch.Size(c.sizes), props[c.name]) for c in per_rank[rank]])
        shard: dict[str, Any] = {c.name: got.buffers[c.index] for c in per_rank[rank]}
        if rank == 0:
            shard.update(objects)
        written += save(url, ptc, layout, rank, shard, step=step, extra=extra, save_id=save_id,
                        storage_options=opts).bytes_written
        del got, shard
    nbytes = sum(s.nbytes for s in ptc.tensors.values())
    log.info("imported DCP checkpoint %s (%d tensors, %d objects, %d chunks in %d files) into %s keeping its "
             "partitioning: %d tensor bytes, %d written in %.2fs", src, len(ptc), len(objects), len(chunks),
             layout.world_size, url, nbytes, written, time.perf_counter() - t0)
    return ImportResult(ptc, layout, step, url, "dcp", len(ptc), written)


# ---------------------------------------------------------------------------------------------
# building the collection and saving
# ---------------------------------------------------------------------------------------------
def _state_dtype(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    kinds = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(kinds) != 1:
        raise ConfigError(f"the checkpoint mixes dtypes {sorted(map(str, kinds))}: pass dtype= to cast")
    return kinds.pop()


def _save_all(url: str, ptc: PTC, state: Mapping[str, Any], layout: ParallelConfig, step: int,
              extra: Any, storage_options: Mapping[str, Any] | None) -> int:
    """Shard the global state under ``layout`` and save every rank's part (in this process)."""
    opts = _options(storage_options, "storage_options")
    shards = ptc.shard(state, layout)
    written = 0
    for rank in range(layout.world_size):
        written += save(url, ptc, layout, rank, shards[rank], step=step, extra=extra,
                        storage_options=opts).bytes_written
        shards[rank] = {}
    return written


def import_hf(src: str | Path, url: str, *, layout: ParallelConfig | None = None, step: int | None = None,
              dtype: torch.dtype | None = None, vocab_pad: int = 128,
              storage_options: Mapping[str, Any] | None = None,
              source_storage_options: Mapping[str, Any] | None = None) -> ImportResult:
    """Import a Hugging Face Llama or GPT-2 safetensors checkpoint as a tenplex checkpoint.

    The source's ``config.json`` is kept in the model description (``meta["model"]``, the
    ``ModelSpec``'s ``source_config``, with its norm epsilon and RoPE as hyperparameters): a job's
    later saves of the same model carry it (``tenplex.checkpoint.carry_model``), and ``export_hf``
    writes it back. ``step``: default the source's (``source_step``: ``checkpoint-500``), else 0.
    ``storage_options``: fsspec options of the tenplex checkpoint ``url``;
    ``source_storage_options``: of ``src`` when it is a URL.
    """
    step = _import_step(src, step)
    layout = layout or ParallelConfig()
    hf_state, config = read_hf_state(src, storage_options=source_storage_options)
    if config is None:
        _infer_hf_config(hf_state)
    assert config is not None
    dt = _state_dtype(hf_state, dtype)
    spec = dataclasses.replace(hf_config_to_spec(config, dt, vocab_pad=vocab_pad), source_config=config)
    state = {k: v.to(dt) for k, v in hf_to_tenplex(hf_state, spec).items()}
    ptc = model_ptc(spec, optimizer=False)
    _check_shapes(ptc, state)
    n = _save_all(url, ptc, state, layout, step, extra={"imported_from": "hf"}, storage_options=storage_options)
    log.info("imported %s (%s, %d tensors) into %s under %s", src, config.get("model_type"), len(state), url, layout)
    return ImportResult(ptc, layout, step, url, "hf", len(state), n)


def _check_shapes(ptc: PTC, state: Mapping[str, torch.Tensor]) -> None:
    for name, ts in ptc.tensors.items():
        got = tuple(state[name].shape)
        if got != ts.shape:
            raise CheckpointError(f"{name}: the source tensor has shape {got}, the model config implies {ts.shape}")


def _dcp_ptc(tensors: Mapping[str, torch.Tensor], spec: ModelSpec | None) -> PTC:
    """The collection for DCP tensors: the model's PTC (with optimizer state when present)
    plus every other tensor replicated on all stages."""
    if spec is None:
        specs = [TensorSpec(n, tuple(t.shape), t.dtype, placement="all") for n, t in tensors.items()]
        return PTC(specs, meta={"imported_from": "dcp"})
    params = model_ptc(spec, optimizer=False)
    opt_names = [n for p in params for n in optimizer_names(p).values()
                 if not (n.startswith("optimizer.main.") and spec.dtype == torch.float32)]
    have = [n for n in opt_names if n in tensors]
    if have and len(have) != len(opt_names):
        missing = sorted(set(opt_names) - set(have))
        raise CheckpointError(f"the DCP checkpoint has optimizer state for some parameters only; "
                              f"missing e.g. {missing[:3]}")
    base = model_ptc(spec, optimizer=bool(have))
    missing = [n for n in base if n not in tensors]
    if missing:
        raise CheckpointError(f"the DCP checkpoint lacks {len(missing)} tensors of the model, e.g. {missing[:3]}")
    extras = [TensorSpec(n, tuple(t.shape), t.dtype, placement="all") for n, t in tensors.items() if n not in base]
    if extras:
        log.info("importing %d tensors outside the model replicated on every stage", len(extras))
    return PTC(list(base.tensors.values()) + extras, num_layers=base.num_layers, objects=base.objects,
               meta={**base.meta, "imported_from": "dcp"})


def _looks_hf(names: Any) -> bool:
    return any(n.startswith(("model.layers.", "model.embed_tokens", "transformer.h.", "transformer.wte")) for n in names)


def import_dcp(src: str | Path, url: str, *, layout: ParallelConfig | None = None, step: int | None = None,
               model: ModelSpec | str | None = None, hf_config: Mapping[str, Any] | None = None,
               strip_prefix: str = "", keep_partitioning: bool | None = None,
               storage_options: Mapping[str, Any] | None = None,
               source_storage_options: Mapping[str, Any] | None = None) -> ImportResult:
    """Import a torch.distributed.checkpoint directory as a tenplex checkpoint.

    ``keep_partitioning`` (default: when neither ``model`` nor ``hf_config`` is given and the names
    are not Hugging Face's): keep the checkpoint's chunks as they are (``import_dcp_chunks``); the
    result is loaded with ``tenplex.load_state_dict`` under any mesh, and ``layout`` is not used.
    Otherwise the tensors are read whole and saved under ``layout``: ``model``: the ModelSpec (or
    preset name) whose tenplex-named tensors the checkpoint holds; their TP/PP partitioning then
    applies under every layout. ``hf_config``: the checkpoint holds Hugging Face names of this
    config (mapped as in ``import_hf``). Neither (``keep_partitioning=False``): every tensor is
    imported replicated (loadable under any layout, but not TP-split).
    ``strip_prefix`` is removed from every name first (e.g. ``"model."`` of a wrapped module).
    ``step``: default the source's (``source_step``: torchtitan's ``step-5``; else its saved
    ``train_state.step``), else 0.
    ``storage_options``: fsspec options of the tenplex checkpoint ``url``;
    ``source_storage_options``: of ``src`` when it is a URL.
    """
    if keep_partitioning is None:
        keep_partitioning = model is None and hf_config is None and not _looks_hf(
            k.removeprefix(strip_prefix) for k in _dcp_metadata(src, source_storage_options)[1].state_dict_metadata)
    if keep_partitioning:
        if model is not None or hf_config is not None:
            raise ConfigError("keep_partitioning keeps the DCP checkpoint's own names and chunks: it takes no "
                              "model or hf_config")
        if layout is not None and layout != ParallelConfig():
            log.warning("importing %s with its own partitioning: layout %s is not used (load the result with "
                        "tenplex.load_state_dict under any mesh)", src, layout)
        return import_dcp_chunks(src, url, step=step, strip_prefix=strip_prefix, storage_options=storage_options,
                                 source_storage_options=source_storage_options)
    layout = layout or ParallelConfig()
    tensors, objects = read_dcp_state(src, storage_options=source_storage_options)
    step = _import_step(src, step, objects)
    if strip_prefix:
        tensors = {k.removeprefix(strip_prefix): v for k, v in tensors.items()}
    spec: ModelSpec | None
    if hf_config is not None or _looks_hf(tensors):
        if hf_config is None:
            raise ConfigError("the DCP checkpoint holds Hugging Face names: pass the model's config.json (hf_config)")
        spec = dataclasses.replace(hf_config_to_spec(hf_config, _state_dtype(tensors, None)),
                                   source_config=dict(hf_config))
        tensors = hf_to_tenplex(tensors, spec)
    else:
        spec = model_spec(model) if isinstance(model, str) else model
    ptc = _dcp_ptc(tensors, spec)
    _check_shapes(ptc, tensors)
    state: dict[str, Any] = {n: tensors[n].to(ptc.tensors[n].dtype) for n in ptc.tensors}
    for o in ptc.objects:
        if o in objects:
            state[o] = objects[o]
    extra: dict[str, Any] = {"imported_from": "dcp",
                             "objects": {k: v for k, v in objects.items() if k not in ptc.objects}}
    n = _save_all(url, ptc, state, layout, step, extra=extra, storage_options=storage_options)
    log.info("imported DCP checkpoint %s (%d tensors) into %s under %s", src, len(ptc), url, layout)
    return ImportResult(ptc, layout, step, url, "dcp", len(ptc), n)


def import_checkpoint(src: str | Path, url: str, *, fmt: str = "auto", **kw: Any) -> ImportResult:
    """``import_dcp`` or ``import_hf``, chosen by ``fmt`` or by what ``src`` holds (keywords as
    theirs, ``storage_options`` and ``source_storage_options`` included). Without ``step`` the
    result keeps the source's step (``source_step``: torchtitan's ``step-5`` is step 5), else 0."""
    fmt = detect_format(src, storage_options=kw.get("source_storage_options")) if fmt == "auto" else fmt
    if fmt == "dcp":
        return import_dcp(src, url, **kw)
    if fmt == "hf":
        for k in ("model", "strip_prefix", "hf_config", "keep_partitioning"):
            kw.pop(k, None)
        return import_hf(src, url, **kw)
    raise ConfigError(f"unknown import format {fmt!r}: use auto, dcp or hf")


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------
def _load_global(url: str, step: int | None, storage_options: Mapping[str, Any] | None
                 ) -> tuple[LoadResult, dict[str, Any]]:
    one = ParallelConfig()
    res = load(url, one, 0, step=step, storage_options=_options(storage_options, "storage_options"))
    return res, res.ptc.unshard({0: res.shard}, one)


def load_global(url: str, *, step: int | None = None, storage_options: Mapping[str, Any] | None = None
                ) -> tuple[PTC, dict[str, Any], int]:
    """Every tensor of a tenplex checkpoint as a global (unsharded, unpadded) tensor."""
    res, state = _load_global(url, step, storage_options)
    return res.ptc, state, res.step


def _hf_config_of(extra: Any) -> Mapping[str, Any] | None:
    """The Hugging Face config an import by an older tenplex kept in ``extra`` (None for checkpoints
    of other origin, and for newer imports, which keep it in the model description)."""
    cfg = extra.get("hf_config") if isinstance(extra, Mapping) else None
    return cfg if isinstance(cfg, Mapping) else None


def export_hf(url: str, out: str | Path, *, step: int | None = None,
              storage_options: Mapping[str, Any] | None = None,
              out_storage_options: Mapping[str, Any] | None = None) -> Path | str:
    """Write a tenplex GPT/Llama checkpoint as Hugging Face safetensors (parameters only).

    ``out`` ending in ``.safetensors`` is the file written (``config.json`` goes beside it);
    otherwise ``out`` is a directory that receives ``model.safetensors`` and ``config.json``.
    ``config.json`` is the source's own when the model was imported from Hugging Face (its
    ``ModelSpec.source_config``, which the job's later saves of the same model carry; dtype
    updated), else ``spec_to_hf_config`` of the checkpoint's model. ``storage_options``: fsspec
    options of the checkpoint ``url``; ``out_storage_options``: of ``out`` when it is a URL.
    Returns the safetensors path (a URL for a remote ``out``).
    """
    from safetensors.torch import save as save_bytes
    from safetensors.torch import save_file

    res, state = _load_global(url, step, storage_options)
    mj = res.ptc.meta.get("model")
    if not mj:
        raise CheckpointError(f"{url} holds no GPT/Llama model description (meta.model); "
                              "only model_ptc collections can be exported to Hugging Face format")
    spec = ModelSpec.from_json(dict(mj))
    config = spec_to_hf_config(spec, spec.source_config or _hf_config_of(res.extra))
    hf = {k: v.contiguous() for k, v in tenplex_to_hf(state, spec).items()}
    fs, p = _url_fs(out, out_storage_options, "out_storage_options")
    path = p if p.endswith(".safetensors") else p.rstrip("/") + "/model.safetensors"
    parent = path.rsplit("/", 1)[0]
    fs.makedirs(parent, exist_ok=True)
    local = isinstance(fs, LocalFileSystem)
    if local:
        save_file(hf, path, metadata={"format": "pt"})
    else:
        fs.pipe_file(path, save_bytes(hf, metadata={"format": "pt"}))
    fs.pipe_file(parent + "/config.json", (json.dumps(config, indent=2) + "\n").encode())
    log.info("exported %s step %d (%d tensors) to %s", url, res.step, len(hf), path)
    return Path(path) if local else fs.unstrip_protocol(path)
