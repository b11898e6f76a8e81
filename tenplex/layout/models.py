"""PTC builders for the GPT and Llama model families, and named presets."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import LayoutError, SpecError
from .ptc import PTC, Placement, Replicated, Split, TensorSpec, dtype_from_str, dtype_to_str

__all__ = ["ModelSpec", "PRESETS", "NORM_EPS", "ROPE_THETA", "HPARAMS", "model_spec", "model_ptc", "optimizer_names",
           "model_differences"]

# What tenplex's models compute with beyond the ModelSpec dimensions (tenplex.train.model's Llama uses
# these values; hf_export.export_hf writes them into the config.json of a checkpoint not imported from
# Hugging Face): the epsilon of RMSNorm (Llama) and LayerNorm (GPT), and the RoPE base (rotate-half
# RoPE, no scaling, head_dim = hidden / heads).
NORM_EPS = 1e-5
ROPE_THETA = 10000.0

# The ModelSpec fields beyond the dimensions: None means "not stated" (tenplex's own model computes
# with NORM_EPS / ROPE_THETA / no scaling; a load accepts the checkpoint's; a save carries the
# checkpoint's, see ``ModelSpec.carried``).
HPARAMS = ("norm_eps", "rope_theta", "rope_scaling")
_OPEN = (*HPARAMS, "source_config")
# What a model's tensors and computation depend on (not the dtype, padding or training context).
_IDENTITY = ("arch", "num_layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab", "tied_embeddings")


def _json_copy(value: Any, what: str) -> dict[str, Any] | None:
    """A deep copy of a JSON object (None stays None); SpecError for anything JSON cannot hold."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise SpecError(f"{what} must be a JSON object (a dict), got {type(value).__name__}")
    try:
        return json.loads(json.dumps(dict(value), allow_nan=False))
    except (TypeError, ValueError) as e:
        raise SpecError(f"{what} must be plain JSON (str, number, bool, null, lists, dicts): {e}") from None


def _canon(value: Any) -> Any:
    return json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else value


@functools.lru_cache(maxsize=256)
def _num_params(spec: ModelSpec) -> int:
    return sum(s.numel for s in spec.param_specs())


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Dimensions of a decoder-only transformer.

    GPT: LayerNorm with bias, GELU MLP of ``ffn_hidden`` (default 4h), learned positions,
    tied embedding by default. Llama: RMSNorm, SwiGLU MLP ([gate; up] fused), GQA with
    ``kv_heads``, RoPE (no position table), untied LM head by default. The vocabulary is
    padded to a multiple of ``vocab_pad * tp`` as Megatron does.

    Beyond the dimensions (``HPARAMS``; None: not stated, see ``resolved``): ``norm_eps`` (RMSNorm /
    LayerNorm epsilon), ``rope_theta`` (RoPE base, Llama) and ``rope_scaling`` (Hugging Face's
    RoPE scaling parameters, e.g. ``{"rope_type": "llama3", "factor": 8.0, ...}``, Llama), and
    ``source_config``: the configuration the model was imported with, verbatim (Hugging Face's
    ``config.json``), which ``export_hf`` writes back. A checkpoint keeps all of them in its
    manifest (``meta["model"]``), and a save whose spec leaves them unstated carries the ones of
    the newest step under its URL (``carried``), so a job's own saves keep an imported model's
    configuration.
    """

    arch: str
    num_layers: int
    hidden: int
    heads: int
    vocab: int
    kv_heads: int | None = None
    ffn_hidden: int | None = None
    seq_len: int = 2048
    tied_embeddings: bool | None = None
    dtype: torch.dtype = torch.bfloat16
    vocab_pad: int = 128
    norm_eps: float | None = None
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    source_config: dict[str, Any] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        if self.arch not in ("gpt", "llama"):
            raise SpecError(f"arch must be 'gpt' or 'llama', got {self.arch!r}")
        for name in ("num_layers", "hidden", "heads", "vocab", "seq_len", "vocab_pad"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise SpecError(f"{name} must be a positive integer, got {v!r}")
        if self.hidden % self.heads:
            raise SpecError(
                f"hidden={self.hidden} is not divisible by heads={self.heads} "
                f"({self.hidden} % {self.heads} = {self.hidden % self.heads})"
            )
        if self.kv_heads is None:
            object.__setattr__(self, "kv_heads", self.heads)
        assert self.kv_heads is not None
        if self.kv_heads < 1 or self.heads % self.kv_heads:
            raise SpecError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.arch == "gpt" and self.kv_heads != self.heads:
            raise SpecError(f"the GPT family has no grouped-query attention: kv_heads must equal heads, got "
                            f"kv_heads={self.kv_heads}, heads={self.heads}")
        if self.ffn_hidden is None:
            object.__setattr__(self, "ffn_hidden", 4 * self.hidden)
        if self.tied_embeddings is None:
            object.__setattr__(self, "tied_embeddings", self.arch == "gpt")
        if isinstance(self.dtype, str):
            object.__setattr__(self, "dtype", dtype_from_str(self.dtype))
        for name in ("norm_eps", "rope_theta"):
            v = getattr(self, name)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise SpecError(f"{name} must be a positive finite number or None, got {v!r}")
            object.__setattr__(self, name, float(v))
        for name in ("rope_scaling", "source_config"):
            object.__setattr__(self, name, _json_copy(getattr(self, name), name))
        if self.arch == "gpt" and (self.rope_theta is not None or self.rope_scaling is not None):
            raise SpecError(f"the GPT family has learned positions, no RoPE: rope_theta={self.rope_theta!r} and "
                            f"rope_scaling={self.rope_scaling!r} must be None")

    def resolved(self) -> ModelSpec:
        """This spec with every unstated hyperparameter set to what tenplex's own model computes
        with (``NORM_EPS``; Llama: ``ROPE_THETA``, no scaling)."""
        return dataclasses.replace(
            self, norm_eps=NORM_EPS if self.norm_eps is None else self.norm_eps,
            rope_theta=(ROPE_THETA if self.rope_theta is None else self.rope_theta) if self.arch == "llama" else None)

    def differences(self, saved: ModelSpec, names: tuple[str, ...] | None = None) -> list[str]:
        """Where this spec (a request, or a save's) states another model than ``saved`` (a
        checkpoint's, its unstated hyperparameters resolved), over the fields ``names`` (default:
        all); this spec's unstated hyperparameters and source config accept ``saved``'s."""
        theirs = saved.resolved()
        out = []
        for name in names or tuple(f.name for f in dataclasses.fields(self)):
            mine, other = getattr(self, name), getattr(theirs, name)
            if (name in _OPEN and mine is None) or _canon(mine) == _canon(other):
                continue
            if name == "source_config":
                other = other or {}
                keys = sorted(k for k in set(mine) | set(other) if _canon(mine.get(k)) != _canon(other.get(k)))
                out.append(f"source_config: differs in {keys[:5]}")
            else:
                if name == "dtype":  # as the manifest records it
                    mine, other = dtype_to_str(mine), dtype_to_str(other)
                out.append(f"{name}: saved {other!r}, requested {mine!r}")
        return out

    def carried(self, previous: ModelSpec) -> ModelSpec | None:
        """This spec completed by ``previous`` (the newest saved step's): its unstated hyperparameters
        and source config taken from there, when both have the same dimensions; None when they do
        not (nothing is carried). What this spec states stays: a job that changed the RoPE base
        keeps the source config, and ``export_hf`` writes the new base into it."""
        if self.differences(previous, _IDENTITY):
            return None
        return dataclasses.replace(self, **{n: getattr(previous, n) for n in _OPEN if getattr(self, n) is None})

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def padded_vocab(self, tp: int) -> int:
        unit = self.vocab_pad * tp
        return -(-self.vocab // unit) * unit

    def check_tp(self, tp: int) -> None:
        """Raise LayoutError naming the constraint when ``tp`` cannot split this model."""
        assert self.kv_heads is not None and self.ffn_hidden is not None
        for what, value in (("heads", self.heads), ("kv_heads", self.kv_heads), ("ffn_hidden", self.ffn_hidden)):
            if value % tp:
                raise LayoutError(f"tp={tp} does not divide {what}={value} ({value} % {tp} = {value % tp})")

    def num_params(self) -> int:
        """Parameters of the model (computed once per spec: the chooser asks for every layout)."""
        return _num_params(self)

    def param_specs(self) -> list[TensorSpec]:
        """The model's parameters (no optimizer state) as tensor specs."""
        assert self.kv_heads is not None and self.ffn_hidden is not None
        h, f, dt = self.hidden, self.ffn_hidden, self.dtype
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        vocab = Split(0, pad_multiple=self.vocab_pad)
        gpt = self.arch == "gpt"
        specs: list[TensorSpec] = []

        def add(name: str, shape: tuple[int, ...], tp: Any, placement: Placement) -> None:
            specs.append(TensorSpec(name, shape, dt, tp, placement))

        add("embedding.word", (self.vocab, h), vocab, "both" if self.tied_embeddings else "first")
        if gpt:
            add("embedding.position", (self.seq_len, h), Replicated(), "first")
        for i in range(self.num_layers):
            p = f"layers.{i}."
            norm = ("ln1", "ln2") if gpt else ("attn_norm", "mlp_norm")
            add(p + norm[0] + ".weight", (h,), Replicated(), i)
            if gpt:
                add(p + norm[0] + ".bias", (h,), Replicated(), i)
            add(p + "attn.qkv.weight", (q + 2 * kv, h), Split(0, blocks=(q, kv, kv)), i)
            if gpt:
                add(p + "attn.qkv.bias", (q + 2 * kv,), Split(0, blocks=(q, kv, kv)), i)
            add(p + "attn.proj.weight", (h, q), Split(1), i)
            if gpt:
                add(p + "attn.proj.bias", (h,), Replicated(), i)
            add(p + norm[1] + ".weight", (h,), Replicated(), i)
            if gpt:
                add(p + norm[1] + ".bias", (h,), Replicated(), i)
                add(p + "mlp.fc1.weight", (f, h), Split(0), i)
                add(p + "mlp.fc1.bias", (f,), Split(0), i)
                add(p + "mlp.fc2.weight", (h, f), Split(1), i)
                add(p + "mlp.fc2.bias", (h,), Replicated(), i)
            else:
                add(p + "mlp.gate_up.weight", (2 * f, h), Split(0, blocks=(f, f)), i)
                add(p + "mlp.down.weight", (h, f), Split(1), i)
        add("final_norm.weight", (h,), Replicated(), "last")
        if gpt:
            add("final_norm.bias", (h,), Replicated(), "last")
        if not self.tied_embeddings:
            add("lm_head.weight", (self.vocab, h), vocab, "last")
        return specs

    def to_json(self) -> dict[str, Any]:
        """The spec as JSON; unstated hyperparameters and source config are left out (so a spec
        without them reads as it did before they existed)."""
        d = dataclasses.asdict(self)
        d["dtype"] = dtype_to_str(self.dtype)
        return {k: v for k, v in d.items() if not (k in _OPEN and v is None)}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ModelSpec:
        return cls(**{**obj, "dtype": dtype_from_str(obj["dtype"])})


def model_differences(saved: Any, requested: Any) -> list[str]:
    """How the model description ``requested`` (a PTC's ``meta["model"]``) differs from the
    checkpoint's ``saved`` (``ModelSpec.differences`` when both are ModelSpecs; else key by key)."""
    try:
        a, b = ModelSpec.from_json(saved), ModelSpec.from_json(requested)
    except (SpecError, TypeError, KeyError):
        a = b = None
    if a is not None and b is not None:
        return b.differences(a)
    x, y = json.loads(json.dumps(saved)), json.loads(json.dumps(requested))  # tuples and lists alike
    return [f"{k}: saved {x.get(k)!r}, requested {y.get(k)!r}" for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]


OPTIMIZER_STATES = ("main", "exp_avg", "exp_avg_sq")


def optimizer_names(param: str) -> dict[str, str]:
    """Names of the optimizer-state tensors that follow parameter ``param``."""
    return {state: f"optimizer.{state}.{param}" for state in OPTIMIZER_STATES}


PRESETS: dict[str, dict[str, Any]] = {
    # A Llama small enough for CPU tests; layers, heads and KV heads allow TP and PP of 1, 2, 4.
    # Byte-level vocabulary (256 bytes + 3 specials), padded under every TP > 0.
    "tiny": dict(arch="llama", num_layers=4, hidden=64, heads=8, kv_heads=4, ffn_hidden=128,
                 vocab=259, seq_len=64, dtype=torch.float32, vocab_pad=8),
    # A Llama of about 8M parameters whose activations dominate, for memory measurements on CPU.
    "llama-small": dict(arch="llama", num_layers=4, hidden=256, heads=8, kv_heads=4, ffn_hidden=688,
                        vocab=259, seq_len=256, dtype=torch.float32, vocab_pad=8),
    # A Llama of about 100M parameters (byte-level vocabulary), for recovery benchmarks.
    "llama-100m": dict(arch="llama", num_layers=12, hidden=768, heads=12, kv_heads=4, ffn_hidden=3072,
                       vocab=259, seq_len=128, dtype=torch.float32, vocab_pad=8),
    # About 100M parameters (GPT-2 small sized), for benchmarks.
    "gpt-100m": dict(arch="gpt", num_layers=12, hidden=768, heads=12, vocab=50257, seq_len=1024,
                     dtype=torch.float32),
    "gpt3-1.3b": dict(arch="gpt", num_layers=24, hidden=2048, heads=16, vocab=50257, seq_len=2048),
    "gpt3-2.7b": dict(arch="gpt", num_layers=32, hidden=2560, heads=32, vocab=50257, seq_len=2048),
    "gpt3-6.7b": dict(arch="gpt", num_layers=32, hidden=4096, heads=32, vocab=50257, seq_len=2048),
    "gpt3-175b": dict(arch="gpt", num_layers=96, hidden=12288, heads=96, vocab=50257, seq_len=2048),
    "llama3-8b": dict(arch="llama", num_layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336,
                      vocab=128256, seq_len=8192),
    "llama3-70b": dict(arch="llama", num_layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672,
                       vocab=128256, seq_len=8192),
    # The Llama 3 report's flagship (arXiv 2407.21783, table 3): trained on 16,384 H100-80GB as
    # TP8 x PP16 x DP128, 2,048 sequences of 8,192 tokens a step.
    "llama3-405b": dict(arch="llama", num_layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248,
                        vocab=128256, seq_len=8192),
}


def model_spec(preset: str | ModelSpec | None = None, **overrides: Any) -> ModelSpec:
    """A ModelSpec from a preset (its name or a ``ModelSpec``) and/or keyword dimensions, ``ModelSpec``'s
    fields (keywords override the preset; None: not given). SpecError naming the fields for any other keyword."""
    known = [f.name for f in dataclasses.fields(ModelSpec)]
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise SpecError(f"unknown model dimensions {unknown}; a ModelSpec has {', '.join(known)}")
    base: dict[str, Any] = {}
    if isinstance(preset, ModelSpec):
        base = {f: getattr(preset, f) for f in known}
    elif preset is not None:
        if preset not in PRESETS:
            raise SpecError(f"unknown model preset {preset!r}; known: {', '.join(PRESETS)}")
        base = dict(PRESETS[preset])
    base.update({k: v for k, v in overrides.items() if v is not None})
    if "arch" not in base:
        base["arch"] = "gpt"
    missing = [k for k in ("num_layers", "hidden", "heads", "vocab") if k not in base]
    if missing:
        raise SpecError(f"model_ptc needs a preset or the dimensions {missing}")
    return ModelSpec(**base)


def model_ptc(preset: str | ModelSpec | None = None, *, optimizer: bool = True, distributed_optimizer: bool = False,
              **dims: Any) -> PTC:
    """The PTC of a GPT or Llama model, with Adam state unless ``optimizer=False``.

    ``preset``: a preset's name or a ``ModelSpec``; ``dims``: ``ModelSpec``'s fields (dimensions and
    hyperparameters, e.g. ``num_layers=4``) that override it (:func:`model_spec`).

    Optimizer state (``optimizer.main.*`` fp32 master copy when the model dtype is not fp32,
    ``optimizer.exp_avg.*``, ``optimizer.exp_avg_sq.*``) follows each parameter's TP/PP
    layout; with ``distributed_optimizer`` it is sharded across DP ranks as flat fragments.
    The step counter is carried as the object ``optimizer.step``.
    """
    spec = model_spec(preset, **dims)
    if isinstance(preset, ModelSpec):
        preset = None
    params = spec.param_specs()
    tensors = list(params)
    if optimizer:
        for p in params:
            names = optimizer_names(p.name)
            for state in OPTIMIZER_STATES:
                if state == "main" and p.dtype == torch.float32:
                    continue
                tensors.append(dataclasses.replace(
                    p, name=names[state], dtype=torch.float32, dp_sharded=distributed_optimizer))
    meta = {
        "model": spec.to_json(),
        "preset": preset,
        "tp_divides": {"heads": spec.heads, "kv_heads": spec.kv_heads, "ffn_hidden": spec.ffn_hidden},
        "optimizer": optimizer,
        "distributed_optimizer": distributed_optimizer,
    }
    return PTC(tensors, num_layers=spec.num_layers, objects=("optimizer.step",) if optimizer else (), meta=meta)
