"""The (DP, TP, PP) layout of a job and Megatron's mapping between ranks and coordinates.

``ParallelConfig`` is a ``ptc.Layout``: it derives which ranks hold every tensor of a collection,
and which segments of its canonical flat order, from (DP, TP, PP) and the tensors' specs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch

from ..errors import ConfigError, LayoutError
from .ptc import PAD, PTC, Placement, SegmentTable, TensorSpec

__all__ = ["Coords", "ParallelConfig", "MAX_WORLD_SIZE"]

#: Largest world (dp * tp * pp ranks) a layout may have: 2**18 = 262,144 ranks, beyond any single
#: job so far (Llama 3 405B trained on 16,384 GPUs). Larger sizes are typos; planning them would
#: allocate per-rank tables of that size (a plan to 2**18 ranks of even the tiny model takes GBs).
MAX_WORLD_SIZE = 1 << 18


class Coords(NamedTuple):
    """Position of a rank in the layout: pipeline stage, data-parallel and tensor-parallel index."""

    pp: int
    dp: int
    tp: int


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """A (DP, TP, PP) layout (a ``ptc.Layout``).

    Ranks follow Megatron's default order: the TP index varies fastest, then DP, then PP,
    so ``rank = tp + TP * (dp + DP * pp)``. ``stages`` optionally pins the number of
    transformer layers of each pipeline stage (uneven stages); by default layers are split
    evenly, earlier stages taking one extra layer when the count does not divide.
    """

    dp: int = 1
    tp: int = 1
    pp: int = 1
    stages: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "pp"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.dp * self.tp * self.pp > MAX_WORLD_SIZE:
            raise ConfigError(
                f"layout dp={self.dp},tp={self.tp},pp={self.pp} needs dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = "
                f"{self.dp * self.tp * self.pp} ranks, more than the {MAX_WORLD_SIZE} (2**18) a layout may have: "
                "check the sizes"
            )
        if self.stages is not None:
            stages = tuple(self.stages)
            object.__setattr__(self, "stages", stages)
            if len(stages) != self.pp:
                raise ConfigError(
                    f"stages lists {len(stages)} layer counts but pp={self.pp}; give one count per stage"
                )
            if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in stages):
                raise ConfigError(f"stages must be non-negative integers, got {stages}")

    # -- sizes and rank arithmetic -------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def check_world_size(self, world_size: int) -> None:
        """Raise ConfigError unless this layout uses exactly ``world_size`` ranks."""
        if self.world_size != world_size:
            raise ConfigError(
                f"layout {self} needs dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = {self.world_size} "
                f"ranks but the world size is {world_size}"
            )

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside [0, {self.world_size}) for layout {self}")
        tp = rank % self.tp
        dp = (rank // self.tp) % self.dp
        pp = rank // (self.tp * self.dp)
        return Coords(pp=pp, dp=dp, tp=tp)

    def rank(self, *, pp: int = 0, dp: int = 0, tp: int = 0) -> int:
        for name, value, size in (("pp", pp, self.pp), ("dp", dp, self.dp), ("tp", tp, self.tp)):
            if not 0 <= value < size:
                raise ConfigError(f"{name}={value} is outside [0, {size}) for layout {self}")
        return tp + self.tp * (dp + self.dp * pp)

    # -- pipeline stages ------------------------------------------------------------------
    def layers_per_stage(self, num_layers: int) -> tuple[int, ...]:
        """Number of transformer layers on each stage."""
        if self.stages is not None:
            if sum(self.stages) != num_layers:
                raise ConfigError(
                    f"stages {'+'.join(map(str, self.stages))} = {sum(self.stages)} layers "
                    f"but the model has {num_layers}"
                )
            return self.stages
        if self.pp > num_layers:
            raise ConfigError(
                f"pp={self.pp} is larger than the model's {num_layers} layers; "
                "every pipeline stage needs at least one layer"
            )
        base, extra = divmod(num_layers, self.pp)
        return tuple(base + (1 if s < extra else 0) for s in range(self.pp))

    def stage_of_layers(self, num_layers: int) -> tuple[int, ...]:
        """The pipeline stage of every layer, indexed by layer."""
        out: list[int] = []
        for stage, count in enumerate(self.layers_per_stage(num_layers)):
            out.extend([stage] * count)
        return tuple(out)

    def stages_of(self, placement: Placement, num_layers: int) -> tuple[int, ...]:
        """The stages holding a tensor placed at ``placement`` (a layer index or first/last/both/all)
        of a ``num_layers``-layer model."""
        if isinstance(placement, int):
            return (_stage_map(self, num_layers)[placement],)
        if placement == "first":
            return (0,)
        if placement == "last":
            return (self.pp - 1,)
        if placement == "both":
            return (0,) if self.pp == 1 else (0, self.pp - 1)
        return tuple(range(self.pp))

    # -- the Layout protocol (what a PTC asks) ---------------------------------------------
    def check(self, ptc: PTC) -> None:
        """LayoutError / ConfigError unless TP divides what it splits and every stage gets a layer."""
        for what, value in ptc.meta.get("tp_divides", {}).items():
            if value % self.tp:
                raise LayoutError(f"tp={self.tp} does not divide {what}={value} ({value} % {self.tp} = "
                                  f"{value % self.tp})")
        if ptc.num_layers:
            self.layers_per_stage(ptc.num_layers)
        for spec in ptc.distinct_specs():
            spec.check_tp(self.tp)

    def rank_tensors(self, ptc: PTC, rank: int) -> list[str]:
        stage = self.coords(rank).pp
        return [n for n, s in ptc.tensors.items() if stage in self.stages_of(s.placement, ptc.num_layers)]

    def holder_table(self, spec: TensorSpec, num_layers: int = 0) -> SegmentTable:
        return _holder_table(_spec_key(spec), self.stages_of(spec.placement, num_layers), self)

    def segments(self, spec: TensorSpec, rank: int) -> list[tuple[int, int, int]]:
        c = self.coords(rank)
        return spec.segments(self, c.tp, c.dp)

    def local_shape(self, spec: TensorSpec, rank: int = 0) -> tuple[int, ...]:
        """The same for every rank: TP and DP split evenly (with padding)."""
        return spec.local_shape(self)

    def to_local_flat(self, spec: TensorSpec, rank: int, local: torch.Tensor) -> torch.Tensor:
        return spec.local_to_flat(local)

    def from_local_flat(self, spec: TensorSpec, rank: int, flat: torch.Tensor,
                        out: torch.Tensor | None = None) -> torch.Tensor:
        local = spec.local_from_flat(flat, spec.local_shape(self))
        return local if out is None else out.copy_(local)

    # -- text form --------------------------------------------------------------------------
    def __str__(self) -> str:
        text = f"dp={self.dp},tp={self.tp},pp={self.pp}"
        if self.stages is not None:
            text += ",stages=" + "+".join(map(str, self.stages))
        return text

    @classmethod
    def parse(cls, text: str) -> ParallelConfig:
        """Parse ``dp=2,tp=4,pp=2`` (any order; missing sizes default to 1; ``stages=3+5`` optional)."""
        values: dict[str, object] = {}
        for part in text.replace(" ", "").split(","):
            if not part:
                continue
            key, sep, raw = part.partition("=")
            if not sep or key not in ("dp", "tp", "pp", "stages"):
                raise ConfigError(
                    f"cannot parse layout {text!r}: expected comma-separated dp=N,tp=N,pp=N[,stages=A+B+..]"
                )
            if key in values:
                raise ConfigError(f"cannot parse layout {text!r}: {key} given twice")
            try:
                values[key] = tuple(int(x) for x in raw.split("+")) if key == "stages" else int(raw)
            except ValueError:
                raise ConfigError(f"cannot parse layout {text!r}: {key}={raw!r} is not an integer") from None
        if not values:
            raise ConfigError(f"cannot parse layout {text!r}: expected dp=N,tp=N,pp=N")
        return cls(**values)  # type: ignore[arg-type]


@lru_cache(maxsize=4096)
def _stage_map(cfg: ParallelConfig, num_layers: int) -> tuple[int, ...]:
    if num_layers == 0:
        raise ConfigError("the PTC has no layers, so no tensor can belong to a layer")
    return cfg.stage_of_layers(num_layers)


@lru_cache(maxsize=65536)
def _holder_table(spec_key: tuple, stages: tuple[int, ...], cfg: ParallelConfig) -> SegmentTable:
    spec = _spec_from_key(spec_key)
    # rows in the order (TP index, DP index, stage, segment), vectorised over all four: every TP
    # index's segments padded to the longest list with empty ones (dropped with the others)
    per_t = [np.array([s for s in spec.tp_segments(cfg.tp, t) if s[1] != PAD], dtype=np.int64).reshape(-1, 3)
             for t in range(cfg.tp)]
    width = max(len(x) for x in per_t)
    if not width:
        return SegmentTable.from_columns((), (), (), ())
    segs = np.zeros((cfg.tp, width, 3), dtype=np.int64)
    for t, x in enumerate(per_t):
        segs[t, : len(x)] = x
    lo, g, ln = (segs[:, None, None, :, i] for i in range(3))
    t_idx = np.arange(cfg.tp, dtype=np.int64)[:, None, None, None]
    d = np.arange(cfg.dp, dtype=np.int64)[None, :, None, None]
    st = np.asarray(stages, dtype=np.int64)[None, None, :, None]
    if spec.dp_sharded:  # a DP rank's fragment [f0, f1) of the TP shard's flat order
        c = -(-spec.tp_local_numel(cfg.tp) // cfg.dp)
        f0 = d * c
        s0, e0 = np.maximum(lo, f0), np.minimum(lo + ln, f0 + c)
        lo, g, ln = s0 - f0, g + (s0 - lo), e0 - s0
    shape = (cfg.tp, cfg.dp, len(stages), width)
    keep = np.broadcast_to(ln > 0, shape)
    rank = t_idx + cfg.tp * (d + cfg.dp * st)
    return SegmentTable.from_columns(*(np.broadcast_to(x, shape)[keep] for x in (rank, lo, g, ln)))


def _spec_key(spec: TensorSpec) -> tuple:
    return (spec.shape, spec.dtype, spec.tp, spec.dp_sharded)


def _spec_from_key(key: tuple) -> TensorSpec:
    shape, dtype, tp, dp_sharded = key
    return TensorSpec("_", shape, dtype, tp, "all", dp_sharded)
