"""Per-GPU memory of a layout: the estimator of Fujii et al. (arXiv 2411.06465), pure arithmetic.

For every pipeline stage it counts the parameters on one GPU of that stage (matrices split
by TP, norms replicated, embedding on the first stage, LM head / tied embedding copy on the
last), turns them into bytes of weights, gradients and Adam state (sharded across DP x CP
with the distributed optimizer), and adds the activations of the micro-batches 1F1B keeps in
flight on that stage. See docs/memory.md for the derivation of every term.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from ..errors import ConfigError, LayoutError
from ..layout.config import MAX_WORLD_SIZE, ParallelConfig
from ..layout.models import ModelSpec, model_spec
from ..layout.ptc import PTC
from ..options import with_overrides

__all__ = [
    "GiB",
    "PRECISIONS",
    "RECOMPUTE",
    "StageMemory",
    "MemoryEstimate",
    "MemoryOptions",
    "estimate_memory",
    "layer_params",
    "recompute_flops",
    "resolve_model",
    "parse_size",
]

log = logging.getLogger(__name__)

GiB = 2**30

# precision -> (weight bytes, gradient bytes, optimizer bytes per parameter, activation bytes per element)
# bf16/fp16: 2-byte weights, fp32 gradients, fp32 master copy + Adam m, v (12 B).
# fp32: 4-byte weights and gradients, Adam m, v (8 B), no master copy.
PRECISIONS: dict[str, tuple[int, int, int, int]] = {
    "bf16": (2, 4, 12, 2),
    "fp16": (2, 4, 12, 2),
    "fp32": (4, 4, 8, 4),
}


#: Activation recomputation modes, cheapest in compute first: ``none`` keeps every tensor the
#: backward pass needs; ``selective`` recomputes the norms and the MLP's activation function
#: (elementwise work) from their inputs; ``full`` keeps only each layer's input and
#: recomputes the whole layer's forward pass before its backward pass. See docs/memory.md.
RECOMPUTE = ("none", "selective", "full")


def _ceil(x: Fraction | int) -> int:
    return math.ceil(x)


@dataclass(frozen=True, slots=True)
class StageMemory:
    """Memory of the most loaded GPU of one pipeline stage, in bytes.

    ``params``: parameters held by that GPU (padded vocabulary included). ``in_flight``:
    micro-batches whose activations 1F1B keeps alive on the stage; ``activation_bytes`` =
    ``in_flight * layers * activation_bytes_per_layer``. ``recompute_bytes``: under full
    recomputation, the activations of the one layer being recomputed for its backward pass.
    """

    stage: int
    layers: int
    params: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes_per_layer: int
    in_flight: int
    activation_bytes: int
    recompute_bytes: int = 0

    def __post_init__(self) -> None:
        expected = self.in_flight * self.layers * self.activation_bytes_per_layer
        if self.activation_bytes != expected:
            raise ConfigError(
                f"stage {self.stage}: activation_bytes={self.activation_bytes} but in_flight*layers*per_layer = "
                f"{self.in_flight}*{self.layers}*{self.activation_bytes_per_layer} = {expected}"
            )

    @property
    def model_state_bytes(self) -> int:
        """Weights, gradients and optimizer state."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def total_bytes(self) -> int:
        return self.model_state_bytes + self.activation_bytes + self.recompute_bytes

    def to_json(self) -> dict[str, Any]:
        d = {f: getattr(self, f) for f in self.__dataclass_fields__}
        d["model_state_bytes"] = self.model_state_bytes
        d["total_bytes"] = self.total_bytes
        return d


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """Per-stage memory of a layout; ``peak_bytes`` is what the most loaded GPU needs."""

    model: ModelSpec
    cfg: ParallelConfig
    stages: tuple[StageMemory, ...]
    seq_len: int
    micro_batch: int
    cp: int
    num_microbatches: int
    distributed_optimizer: bool
    precision: str
    recompute: str = "none"
    _peak: tuple[int, int] = field(init=False, repr=False, compare=False, default=(0, 0))

    def __post_init__(self) -> None:
        object.__setattr__(self, "stages", tuple(self.stages))
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if len(self.stages) != self.cfg.pp:
            raise ConfigError(f"{len(self.stages)} stage estimates for pp={self.cfg.pp}")
        totals = [st.total_bytes for st in self.stages]
        peak = max(totals)
        object.__setattr__(self, "_peak", (peak, totals.index(peak)))  # the first stage on ties

    @property
    def peak_bytes(self) -> int:
        return self._peak[0]

    @property
    def peak_stage(self) -> int:
        """Index of the stage with the largest total (the first one on ties)."""
        return self._peak[1]

    def fits(self, gpu_mem_bytes: int | float | str, fraction: float = 0.8) -> bool:
        """True when every stage needs at most ``fraction`` of the GPU memory (the paper's 80 % rule)."""
        if not 0 < fraction <= 1:  # NaN fails too
            raise ConfigError(f"the usable memory fraction must be in (0, 1], got {fraction}")
        return self.peak_bytes <= fraction * parse_size(gpu_mem_bytes)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model.to_json(),
            "layout": str(self.cfg),
            "cp": self.cp,
            "seq_len": self.seq_len,
            "micro_batch": self.micro_batch,
            "num_microbatches": self.num_microbatches,
            "distributed_optimizer": self.distributed_optimizer,
            "precision": self.precision,
            "recompute": self.recompute,
            "peak_bytes": self.peak_bytes,
            "peak_stage": self.peak_stage,
            "stages": [s.to_json() for s in self.stages],
        }


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_BINARY = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}
_DECIMAL = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "pb": 10**15}


def parse_size(text: str | int | float) -> int:
    """Bytes in a size: ``80GiB`` / ``40G`` / ``40g`` (binary), ``80GB`` (decimal), ``1.5TiB``, or a number.

    Binary suffixes: K, M, G, T, P alone or with ``iB``; decimal: KB, MB, GB, TB, PB; ``B`` or
    nothing means bytes.
    """
    if isinstance(text, bool):
        raise ConfigError(f"cannot parse size {text!r}")
    if isinstance(text, (int, float)):
        if not 0 < text < math.inf:  # NaN fails too
            raise ConfigError(f"a size must be positive and finite, got {text}")
        return int(text)
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else ""
    if m and unit.endswith("ib") and len(unit) == 3:
        mult: int | None = _BINARY.get(unit[0])
    elif m:
        mult = _DECIMAL.get(unit, _BINARY.get(unit))
    else:
        mult = None
    if mult is None or m is None:
        raise ConfigError(f"cannot parse size {text!r}: use e.g. 80GiB, 80GB, 40G, 1.5TiB or a byte count")
    number = float(m.group(1)) * mult
    if not number < math.inf:
        raise ConfigError(f"size {text!r} is not finite: use e.g. 80GiB")
    value = int(number)
    if value <= 0:
        raise ConfigError(f"a size must be positive, got {text!r}")
    return value


def resolve_model(model: ModelSpec | str | PTC) -> ModelSpec:
    """A ModelSpec from a spec, a preset name, or a PTC built by ``model_ptc`` (its ``meta['model']``)."""
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        try:
            return model_spec(model)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if isinstance(model, PTC):
        obj = model.meta.get("model")
        if obj is None:
            raise ConfigError("the PTC has no model description (meta['model']); build it with model_ptc")
        return ModelSpec.from_json(obj)
    raise ConfigError(f"model must be a ModelSpec, a preset name or a PTC, got {type(model).__name__}")


def layer_params(model: ModelSpec, tp: int) -> tuple[int, int]:
    """Parameters of one transformer layer on one GPU: (TP-split part / tp, replicated part).

    Llama: q, o 2h^2; k, v 2h^2 k/a; SwiGLU 3hf; two RMSNorms 2h (replicated).
    GPT: qkv 3h^2 + 3h, proj h^2, fc1 hf + f, fc2 fh (split); proj and fc2 biases 2h and two
    LayerNorms 4h (replicated).
    """
    assert model.kv_heads is not None and model.ffn_hidden is not None
    model.check_tp(tp)
    h, f = model.hidden, model.ffn_hidden
    if model.arch == "llama":
        kv_dim = model.kv_heads * model.head_dim  # = h k / a
        split = 2 * h * h + 2 * h * kv_dim + 3 * h * f  # = 2h^2 (1 + k/a + 1.5 f/h)
        replicated = 2 * h
    else:
        split = 3 * h * h + 3 * h + h * h + h * f + f + f * h
        replicated = h + h + 4 * h
    if split % tp:
        raise LayoutError(
            f"tp={tp} does not divide the {split} split parameters of a layer ({split} % {tp} = {split % tp})"
        )
    return split // tp, replicated


def _activation_per_layer(model: ModelSpec, seq_len: int, micro_batch: int, tp: int, cp: int, act_bytes: int,
                          recompute: str = "none") -> int:
    """Activation bytes one layer keeps per micro-batch on one GPU (flash attention, SP, no dropout,
    fused norms) under ``recompute``: all it saves (``none``), without SiLU(gate), which the
    SwiGLU recomputes from the saved gate and up (``selective``; a GELU MLP saves the same as
    without), its input only (``full``)."""
    assert model.kv_heads is not None and model.ffn_hidden is not None
    h, f = model.hidden, model.ffn_hidden
    if recompute == "full":
        base: Fraction | int = 2
    else:
        gqa = Fraction(4 * model.kv_heads, model.heads)
        if model.arch == "llama":
            base = 12 + gqa + Fraction((6 if recompute == "selective" else 8) * f, h)
        else:
            base = 12 + gqa + Fraction(4 * f, h)
    per = seq_len * micro_batch * h * base / (tp * cp)  # bytes at 2 bytes per element
    return _ceil(per * act_bytes / 2)


def recompute_flops(model: ModelSpec, tokens: int, recompute: str) -> int:
    """FLOPs a step spends recomputing activations over ``tokens`` tokens (all layers, all GPUs).

    ``full``: one more forward pass of every layer, 2 x (layer parameters) per token;
    ``selective``: the two norms (about 4 FLOPs per element of h each) and the MLP activation
    (SiLU and product: about 6 per element of f; GELU: about 8), as the reference trainer's
    ``--recompute selective`` does; elementwise work that is memory-bound on a GPU, so this FLOP
    count understates its time (see docs/memory.md).
    """
    if recompute not in RECOMPUTE:
        raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    assert model.ffn_hidden is not None
    if recompute == "none":
        return 0
    if recompute == "full":
        split, replicated = layer_params(model, 1)
        return 2 * (split + replicated) * model.num_layers * tokens
    act = 6 if model.arch == "llama" else 8
    return (8 * model.hidden + act * model.ffn_hidden) * model.num_layers * tokens


#: Upper bounds of the estimator's counts: far beyond any real job, they catch typos (10**30) that
#: would otherwise print astronomical estimates.
MAX_COUNTS = {"seq_len": 1 << 24, "micro_batch": 1 << 20, "num_microbatches": 1 << 20, "gpus_per_host": 1 << 18}


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    hi = MAX_COUNTS.get(name)
    if hi is not None and value > hi:
        raise ConfigError(f"{name}={value} is more than {hi}: check the value")
    return value


@dataclass(frozen=True, slots=True)
class MemoryOptions:
    """How a layout runs, as far as its memory goes (:func:`estimate_memory`).

    ``seq_len`` and ``micro_batch``: tokens per sequence and sequences per micro-batch; ``cp``:
    context-parallel size; ``distributed_optimizer``: optimizer state sharded across DP (and
    CP); ``num_microbatches`` (default ``cfg.pp``) bounds the 1F1B in-flight count: stage i
    keeps ``min(pp - i, m)`` micro-batches; ``precision``: one of ``PRECISIONS``; with
    ``gpus_per_host``, a TP group larger than a host is rejected (TP traffic must stay on the
    intra-host links); ``recompute``: activation recomputation, one of ``RECOMPUTE``.
    """

    seq_len: int
    micro_batch: int
    cp: int = 1
    distributed_optimizer: bool = True
    num_microbatches: int | None = None
    precision: str = "bf16"
    gpus_per_host: int | None = None
    recompute: str = "none"

    def __post_init__(self) -> None:
        _positive("seq_len", self.seq_len)
        _positive("micro_batch", self.micro_batch)
        _positive("cp", self.cp)
        if self.num_microbatches is not None:
            _positive("num_microbatches", self.num_microbatches)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")
        if self.gpus_per_host is not None:
            _positive("gpus_per_host", self.gpus_per_host)


def estimate_memory(model: ModelSpec | str | PTC, cfg: ParallelConfig, options: MemoryOptions | None = None,
                    **settings: Any) -> MemoryEstimate:
    """Memory of the most loaded GPU of every pipeline stage of ``cfg`` (Fujii et al.'s estimator).

    ``options`` (:class:`MemoryOptions`), or its fields as keywords (which override single
    fields of ``options`` when both are given): ``estimate_memory(m, cfg, seq_len=4096,
    micro_batch=1)``. Raises LayoutError when the layout cannot split the model and ConfigError
    for malformed arguments.
    """
    opts = with_overrides(options if options is not None else MemoryOptions, settings, "estimate_memory")
    spec = resolve_model(model)
    cp, recompute = opts.cp, opts.recompute
    seq_len, micro_batch = opts.seq_len, opts.micro_batch
    if cfg.world_size * cp > MAX_WORLD_SIZE:
        raise ConfigError(f"dp*tp*pp*cp = {cfg.world_size}*{cp} = {cfg.world_size * cp} GPUs, more than the "
                          f"{MAX_WORLD_SIZE} a layout may have: check cp")
    m = cfg.pp if opts.num_microbatches is None else opts.num_microbatches
    if opts.gpus_per_host is not None and cfg.tp > opts.gpus_per_host:
        raise LayoutError(f"tp={cfg.tp} is larger than a host's {opts.gpus_per_host} GPUs; keep TP within a host")
    t, p = cfg.tp, cfg.pp
    layers = cfg.layers_per_stage(spec.num_layers)
    split, replicated = layer_params(spec, t)
    per_layer = split + replicated
    h = spec.hidden
    vocab_shard = spec.padded_vocab(t) * h // t
    embedding = vocab_shard + (spec.seq_len * h if spec.arch == "gpt" else 0)
    final_norm = 2 * h if spec.arch == "gpt" else h
    head = 0 if spec.tied_embeddings else vocab_shard
    w_b, g_b, o_b, a_b = PRECISIONS[opts.precision]
    shards = cfg.dp * cp if opts.distributed_optimizer else 1
    act_layer = _activation_per_layer(spec, seq_len, micro_batch, t, cp, a_b, recompute)
    workspace = _activation_per_layer(spec, seq_len, micro_batch, t, cp, a_b) if recompute == "full" else 0

    stages = []
    for i, n in enumerate(layers):
        params = n * per_layer
        if i == 0:
            params += embedding
        if i == p - 1:
            params += head + final_norm
            if spec.tied_embeddings and p > 1:
                params += vocab_shard  # the tied word embedding's copy that computes the logits
        in_flight = min(p - i, m)
        stages.append(StageMemory(
            stage=i,
            layers=n,
            params=params,
            param_bytes=w_b * params,
            grad_bytes=g_b * params,
            optimizer_bytes=-(-(o_b * params) // shards),
            activation_bytes_per_layer=act_layer,
            in_flight=in_flight,
            activation_bytes=in_flight * n * act_layer,
            recompute_bytes=workspace if n else 0,
        ))
    est = MemoryEstimate(spec, cfg, tuple(stages), seq_len, micro_batch, cp, m, opts.distributed_optimizer,
                         opts.precision, recompute)
    log.debug("memory of %s (cp=%d): peak %.2f GiB on stage %d", cfg, cp, est.peak_bytes / GiB, est.peak_stage)
    return est
