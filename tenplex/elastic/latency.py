"""What one recovery cost, per component, and the bytes a full-replica copy would have moved (issue #31 item 4).

:class:`RecoveryTimes` is the latency table the elastic runtime (``tenplex.elastic.runtime``) and the
reference trainer log at every recovery and put in the recover record the benchmarks read: for the
in-process path detection, agreement, regroup, rebuild, choose + plan, transfer and the first step;
for the restart fallback teardown, restart and load. Beside it, the bytes the recovery moved
between survivors and read from storage, and what a torchft-style heal would have copied for the
same failure (:func:`full_replica_bytes`: one whole replica of the state). Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..layout.ptc import PTC

__all__ = ["RecoveryTimes", "full_replica_bytes", "IN_PROCESS", "RESTART"]

IN_PROCESS = "in-process"
RESTART = "restart"
_IN_PROCESS_PARTS = ("detection", "agreement", "regroup", "rebuild", "choose_plan", "transfer", "first_step")
_RESTART_PARTS = ("teardown", "restart", "load", "first_step")


def full_replica_bytes(ptc: PTC) -> int:
    """Bytes a torchft-style heal copies for one dead rank: the dead rank's replica group is
    restarted and receives a whole replica of the model and optimizer state from a healthy group,
    whatever part of it the dead rank held (pure: the collection's total bytes)."""
    return ptc.nbytes


@dataclass(frozen=True)
class RecoveryTimes:
    """One recovery's latency per component, in seconds (the slowest rank's where the group waits
    for it), and its bytes.

    ``path`` ``"in-process"``: ``detection`` (the dead peer last seen alive, its heartbeat moving
    or a link to it open, or the first failed collective, to the start of the recovery),
    ``agreement`` (the members' decision and the step every survivor holds), ``regroup`` (the
    broken groups released, the new one formed), ``rebuild`` (the job's ``build`` for the new
    mesh), ``choose_plan`` (the layout and the move's plan), ``transfer`` (the move and filling
    the state in), ``first_step`` (the first training step after it; None until it ran).
    ``path`` ``"restart"``: ``teardown`` (the worker's exit and the launcher's restart, when the
    launcher reports it; else 0), ``restart`` (process start to the job's state built), ``load``
    (the checkpoint read). ``bytes_live``: sent between survivors; ``bytes_storage``: read from
    storage; ``bytes_full_replica``: a full-replica copy's bytes for the same failure
    (:func:`full_replica_bytes`)."""

    path: str
    detection_s: float = 0.0
    agreement_s: float = 0.0
    regroup_s: float = 0.0
    rebuild_s: float = 0.0
    choose_plan_s: float = 0.0
    transfer_s: float = 0.0
    teardown_s: float = 0.0
    restart_s: float = 0.0
    load_s: float = 0.0
    first_step_s: float | None = None
    bytes_live: int = 0
    bytes_storage: int = 0
    bytes_full_replica: int = 0

    def __post_init__(self) -> None:
        if self.path not in (IN_PROCESS, RESTART):
            raise ConfigError(f"path must be {IN_PROCESS!r} or {RESTART!r}, got {self.path!r}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name.endswith("_s") and v is not None and not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"{f.name} must be a finite number of seconds >= 0, got {v!r}")
            if f.name.startswith("bytes_") and (type(v) is not int or v < 0):
                raise ConfigError(f"{f.name} must be an integer >= 0, got {v!r}")

    @staticmethod
    def in_process(*, detect_s: float, unwind_s: float, agree_s: float, regroup_s: float, rebuild_s: float,
                   timings: Mapping[str, float], bytes_moved: Mapping[str, int], full_replica: int) -> RecoveryTimes:
        """The table of an in-process recovery from the membership's timings (``detect_s``,
        ``agree_s``, ``regroup_s``; ``unwind_s``: learning of the failure to the recovery's start)
        and the rescale's slowest-rank ``timings`` (``choose``, ``plan``, ``agree``, ``migrate``,
        ``fill``)."""
        t = timings
        return RecoveryTimes(IN_PROCESS, detection_s=detect_s + max(0.0, unwind_s),
                             agreement_s=agree_s + t.get("agree", 0.0), regroup_s=regroup_s, rebuild_s=rebuild_s,
                             choose_plan_s=t.get("choose", 0.0) + t.get("plan", 0.0),
                             transfer_s=t.get("migrate", 0.0) + t.get("fill", 0.0),
                             bytes_live=int(bytes_moved.get("live", 0)), bytes_storage=int(bytes_moved.get("storage", 0)),
                             bytes_full_replica=int(full_replica))

    @property
    def parts(self) -> dict[str, float | None]:
        """The components of this path, in the order they happen (seconds)."""
        names = _IN_PROCESS_PARTS if self.path == IN_PROCESS else _RESTART_PARTS
        return {n: getattr(self, f"{n}_s") for n in names}

    @property
    def total_s(self) -> float:
        """Failure to the end of the first step (the parts known so far)."""
        return sum(v for v in self.parts.values() if v is not None)

    def with_first_step(self, seconds: float) -> RecoveryTimes:
        return dataclasses.replace(self, first_step_s=seconds)

    def with_extra(self, **seconds: float) -> RecoveryTimes:
        """Seconds the caller spent around ``recover_in_process`` added to their components
        (e.g. ``regroup_s=`` the broken mesh released, ``transfer_s=`` the state set into the optimizer)."""
        return dataclasses.replace(self, **{k: getattr(self, k) + v for k, v in seconds.items()})

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "total_s": self.total_s}

    def table(self) -> str:
        """The table the runtime logs: one row per component, then the bytes."""
        total = self.total_s
        rows = [f"recovery ({self.path}) latency"]
        for name, v in self.parts.items():
            share = f"{100 * v / total:5.1f}%" if v is not None and total > 0 else "     -"
            rows.append(f"  {name:<12} {'-' if v is None else f'{v:8.3f} s'}  {share}")
        rows.append(f"  {'total':<12} {total:8.3f} s")
        rows.append(f"  bytes live {self.bytes_live:,}  from storage {self.bytes_storage:,}  "
                    f"full-replica copy would move {self.bytes_full_replica:,}")
        return "\n".join(rows)
