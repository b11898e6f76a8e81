"""The outcome of ``rescale``: the layout to run, the step reached and this rank's state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..checkpoint import LoadStats
from ..layout.config import ParallelConfig
from ..layout.ptc import PTC
from ..layout.state_layout import StateLayout
from ..planning.planner import PlanStats

__all__ = ["RescaleResult"]


@dataclass(frozen=True)
class RescaleResult:
    """Outcome of ``rescale``: the layout to run, the step reached and this rank's state (for a
    torch-native state dict: ``cfg`` its ``StateLayout`` and ``ptc`` its collection, as
    ``describe_state_dict`` gives them, the state filled into the caller's dict)."""

    cfg: ParallelConfig | StateLayout
    rank: int
    world_size: int
    step: int
    fresh: bool
    shard: dict[str, Any] | None = None
    extra: Any = None
    previous: ParallelConfig | StateLayout | None = None
    plan_stats: PlanStats | None = None
    load_stats: LoadStats | None = None
    timings: dict[str, float] = field(default_factory=dict)
    bytes_by_tier: dict[str, int] = field(default_factory=dict)  # "local", "peer", "storage"
    skipped: tuple[tuple[int, str, str], ...] = ()  # (step, save id, reason) of newer attempts passed over
    live: bool = False  # True: moved live between survivors (``bytes_by_tier``: "local", "live", "storage")
    storage_url: str | None = None  # live: where this rank read the pieces no survivor holds (None: nothing read)
    ptc: PTC | None = None  # a torch-native state dict's collection under ``cfg`` (None for a ParallelConfig job)

    @property
    def idle(self) -> bool:
        """True when this rank has no place in the layout: a spare (holds and trains nothing, takes
        part in the job's collectives and the next rescale)."""
        return self.rank >= self.cfg.world_size

    @property
    def idle_ranks(self) -> tuple[int, ...]:
        """The ranks of the world the layout leaves as spares: ``cfg.world_size`` .. ``world_size - 1``."""
        return tuple(range(self.cfg.world_size, self.world_size))

    def _spares(self) -> str:
        n = len(self.idle_ranks)
        return f", {n} spare{'s' * (n != 1)}" if n else ""

    def summary(self) -> str:
        if self.fresh:
            return f"fresh start under {self.cfg} ({self.world_size} ranks{self._spares()})"
        t = self.timings
        if self.live:
            b = self.bytes_by_tier
            return (f"moved live at step {self.step}: {self.previous} -> {self.cfg} ({self.world_size} ranks"
                    f"{self._spares()}); "
                    f"choose {t.get('choose', 0):.3f}s plan {t.get('plan', 0):.3f}s agree {t.get('agree', 0):.3f}s "
                    f"migrate {t.get('migrate', 0):.3f}s; received {b.get('live', 0)} B live, "
                    f"{b.get('storage', 0)} B from storage")
        parts = [f"resumed step {self.step}: {self.previous} -> {self.cfg} ({self.world_size} ranks{self._spares()})",
                 f"choose {t.get('choose', 0):.3f}s plan {t.get('plan', 0):.3f}s load {t.get('load', 0):.3f}s"]
        if self.load_stats:
            parts.append(f"read {self.load_stats.bytes_read} B for {self.load_stats.bytes_needed} B needed")
        if self.skipped:
            parts.append("passed over " + ", ".join(f"step {s} ({sid}): {why}" for s, sid, why in self.skipped))
        return "; ".join(parts)