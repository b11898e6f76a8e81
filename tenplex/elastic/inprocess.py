"""In-process recovery and scale up: agree on the members, then move the state live (issue #18).

Every worker watches its peers through a :class:`~tenplex.elastic.membership_runtime.Membership` on the
job's long-lived store and keeps its last consistent states in a :class:`~tenplex.elastic.ring.StateRing`.
On a peer failure (or at a step boundary the members agreed to admit joiners at)
:func:`recover_in_process` runs on every member and joiner: the members agree on the new group
(``Membership.recover``; a joiner: ``Membership.admit``), the job builds what the state goes into
for the new group (its PTC as it is, or a torch-native job's model and state dict for the new
mesh), and ``rescale(live=...)`` moves the state from the newest step every survivor holds,
reading only pieces no survivor holds from ``RecoveryConfig.sources``. The reference trainer
(``tenplex.train``) and ``examples/train_native.py`` both recover through it. A failure during a
recovery is the caller's to end with :data:`RECOVERY_FAILED` (a joiner not admitted:
:data:`JOIN_FAILED`), so that the launcher's restart path takes over.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from ..errors import ConfigError, TenplexError
from ..layout.config import ParallelConfig
from ..layout.ptc import PTC
from ..layout.state_layout import StateLayout
from ..planning.choose import Chooser, MeshChooser, check_fits
from .live import LiveState, live_order
from .rescale import rescale
from .result import RescaleResult
from .latency import RecoveryTimes, full_replica_bytes
from .membership import NewMembership
from .membership_runtime import Membership
from .ring import StateRing

__all__ = ["RECOVERY_FAILED", "JOIN_FAILED", "DIE_POINTS", "DieAt", "layout_fits", "warm_up", "LiveRecovery",
           "RecoveryConfig", "recover_in_process", "summarized"]

log = logging.getLogger(__name__)

RECOVERY_FAILED = 75  # exit code of a worker whose in-process recovery failed: the launcher restarts it
JOIN_FAILED = 76  # exit code of a joiner that was not admitted (no job found, none took it in within its timeout)
DIE_POINTS = ("forward", "backward", "optimizer", "save", "slow-save", "migrate")


@dataclass(frozen=True)
class DieAt:
    """Testing: SIGKILL this process at ``point`` of step ``step`` when its first-group rank is ``rank``
    (``slow-save``: its background write of step ``step`` hangs instead, the rank trains on). With
    ``TENPLEX_DIE_RECORD`` set, the kill's wall time is appended there first (a JSON line), for
    benchmarks that time the kill to the next step."""

    rank: int
    step: int
    point: str

    @staticmethod
    def parse(text: str | None) -> tuple[DieAt, ...]:
        """``RANK:STEP:POINT[,RANK:STEP:POINT...]``."""
        out = []
        for item in (text or "").split(","):
            if not item.strip():
                continue
            try:
                r, s, p = item.strip().split(":")
                d = DieAt(int(r), int(s), p)
            except ValueError:
                raise ConfigError(f"--die-at {item!r}: use RANK:STEP:POINT, POINT one of {', '.join(DIE_POINTS)}") \
                    from None
            if d.point not in DIE_POINTS:
                raise ConfigError(f"--die-at {item!r}: POINT must be one of {', '.join(DIE_POINTS)}")
            out.append(d)
        return tuple(out)

    @staticmethod
    def hook(items: Sequence[DieAt], rank: int) -> Callable[[str, int], None] | None:
        """``die(point, step)``, killing this process when ``(rank, step, point)`` is listed; None
        when nothing is listed (for any rank: ranks must agree on whether it exists, the
        ``migrate`` point runs after a barrier)."""
        if not items:
            return None
        mine = {(d.step, d.point) for d in items if d.rank == rank}

        def die(point: str, step: int) -> None:
            if (step, point) in mine and point == "slow-save":  # the write never finishes; the rank goes on
                log.error("rank %d: --die-at: the write of step %d hangs", rank, step)
                threading.Event().wait()
            if (step, point) in mine:
                log.error("rank %d: --die-at: SIGKILL at %s of step %d", rank, point, step)
                if os.environ.get("TENPLEX_DIE_RECORD"):  # the kill's wall time, for benchmarks (kill -> next step)
                    with open(os.environ["TENPLEX_DIE_RECORD"], "a") as f:
                        f.write(json.dumps({"event": "die", "rank": rank, "step": step, "point": point,
                                            "wall": time.time()}) + "\n")
                logging.shutdown()
                os.kill(os.getpid(), signal.SIGKILL)

        return die


def layout_fits(ptc: PTC, cfg: ParallelConfig, choose: Chooser) -> Callable[[int], bool]:
    """``Membership(fits=...)``: whether the chooser finds a layout for a group of n (cached), so
    that a joiner that would make the world size unusable is not admitted (it waits) instead of
    failing the round."""
    known: dict[int, bool] = {}

    def fits(n: int) -> bool:
        if n not in known:
            try:
                new = choose(ptc, n, cfg)
                check_fits(new, n)
                ptc.check(new)
                known[n] = True
            except TenplexError as e:
                log.warning("no layout for %d workers (%s): joiners that would make %d wait", n, e, n)
                known[n] = False
        return known[n]

    return fits


def warm_up(ptc: PTC, cfg: ParallelConfig | StateLayout, choose: Chooser | MeshChooser,
            members: Sequence[int]) -> float:
    """Run what a recovery runs first once at start-up (the chooser, ``locality_order`` and its
    scipy import, the holder tables) for one member fewer, so that a failure does not pay for it
    (measured: ~1 s of a recovery on a loaded 2-CPU VM was the first scipy.optimize import).
    Returns the seconds it took; a world size no layout fits is skipped. A torch-native job passes
    its ``StateLayout`` and mesh rule, as to ``live_order``."""
    t0 = time.perf_counter()
    if len(members) < 2:
        return 0.0
    try:
        live_order(ptc, cfg, choose, members)(list(members[:-1]))
    except TenplexError as e:
        log.info("warm-up for %d members skipped: %s", len(members) - 1, e)
    return time.perf_counter() - t0


@dataclass(frozen=True)
class LiveRecovery:
    """One in-process recovery as this rank saw it: the new membership, the rescale result and
    seconds of ``recover`` (agreement and regroup), ``rebuild`` (what ``build`` made for
    the new group) and ``rescale`` (choose, plan, step, migrate)."""

    membership: NewMembership
    result: RescaleResult
    recover_s: float
    rescale_s: float
    slowest: Mapping[str, float]  # the rescale timings, each the slowest rank's
    bytes: Mapping[str, int]  # summed over the new group: "live", "storage", "local"
    newest: int  # the newest step any survivor had completed (``result.step`` is the one moved)
    storage_urls: tuple[str, ...] = ()  # where survivors read pieces no survivor held
    rebuild_s: float = 0.0  # seconds of ``build`` (a torch-native job's model for the new group)
    full_replica: int = 0  # bytes a full-replica copy (torchft's heal) would move for this failure
    rescaled_at: float = 0.0  # time.time() when rescale returned, before the group-wide sums above
    times: RecoveryTimes | None = None  # the latency table (its first step: the caller's to add)
    unwind_s: float = 0.0  # learning of the failure to the recovery's start (the latency table's detection)
    summed: bool = True  # False: ``bytes``, ``slowest``, ``newest``, ``storage_urls`` are this rank's (``summarized``)


@dataclass(frozen=True)
class RecoveryConfig:
    """How :func:`recover_in_process` runs. ``url``: the checkpoints ``rescale`` falls back to;
    ``sources``: where pieces no survivor holds are read, cheapest first (default: ``url``);
    ``choose``: a ParallelConfig job's layout chooser (a torch-native job chose its mesh when it
    built its state dict: None); ``tiers``: host-store tiers for the fallback load; ``gpus_per_host``:
    of the topology the move is planned on; ``join_timeout``: seconds a joiner waits to be
    admitted; ``before_migrate``: testing, called on every member after the regroup; ``placed``: a
    torch-native job with spares: after ``build``, the process group of the mesh's ranks (None: every
    rank), as ``rescale(process_group=)`` takes it."""

    url: str | None
    sources: tuple[str, ...] = ()
    choose: Chooser | None = None
    tiers: tuple[Any, ...] | None = None
    gpus_per_host: int = 8
    join_timeout: float = 60.0
    before_migrate: Callable[[], None] | None = None
    placed: Callable[[], Any] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "sources", tuple(self.sources) or ((self.url,) if self.url else ()))
        if self.tiers is not None:
            object.__setattr__(self, "tiers", tuple(self.tiers))
        if not all(isinstance(s, str) and s for s in self.sources):
            raise ConfigError(f"sources must be non-empty URL strings, got {list(self.sources)!r}")
        if type(self.gpus_per_host) is not int or self.gpus_per_host < 1:
            raise ConfigError(f"gpus_per_host must be an integer >= 1, got {self.gpus_per_host!r}")
        if not self.join_timeout > 0:
            raise ConfigError(f"join_timeout must be > 0 seconds, got {self.join_timeout}")


def recover_in_process(m: Membership, ring: StateRing, build: Callable[[NewMembership], PTC | MutableMapping[str, Any]],
                       config: RecoveryConfig, *, join: bool = False, spare: bool = False,
                       summarize: bool = True) -> LiveRecovery:
    """Agree on the members (the survivors, ordered by ``m.order``, then the live joiners; at the
    boundary ``Membership.join_due`` agreed when ``join``), call ``build(new_membership)`` for what
    ``rescale`` fills (a ParallelConfig job's PTC, or a torch-native job's state dict of the model
    built for the new group), then ``rescale(live=...)`` from the states in ``ring`` (taken as
    ``ring.held_as`` says). A joiner (``m.joining``: an empty ring) waits up to
    ``config.join_timeout`` s to be admitted and receives its state. Every member and joiner of
    the new group calls it; it raises on any failure (the caller exits with RECOVERY_FAILED). A
    ``spare`` (a member the old layout left out: an empty ring) agrees as a member and receives its
    state as a joiner does. ``summarize`` False: the result holds this rank's figures and no collective
    sums them here (the caller runs :func:`summarized` on every rank of the group later, e.g. after the
    first step, whose start the sums would otherwise hold up)."""
    t0, wall0 = time.perf_counter(), time.time()
    held = ring.held_as
    if m.joining:
        nm = m.admit(config.join_timeout)
    else:
        if held is None and not spare:
            raise TenplexError("no consistent state is held yet (a failure before the first step)")
        nm = m.recover(join=join)
    t1 = time.perf_counter()
    if config.before_migrate is not None:  # testing: every survivor is past the regroup when this one dies
        dist.barrier()
        config.before_migrate()
    # the survivors that held state come first (live_order); spares of the layout after them hold nothing,
    # nor do joiners (a joiner or a spare knows neither: rescale gives it the layout and the holders of group rank 0)
    holders = [] if held is None else [a for a in nm.alive if a < held.layout.world_size]
    if list(nm.alive[: len(holders)]) != holders:
        raise TenplexError(f"the new group's order {list(nm.alive)} puts a spare of {held.layout if held else None} "
                           "before a rank holding state (order the members with live_order)")
    target = build(nm)
    t2 = time.perf_counter()
    live = LiveState(held.layout if held else None, ring.states(), holders, config.sources,
                     ptc=held.ptc if held else None)
    res = rescale(config.url, target, choose=config.choose, gpus_per_host=config.gpus_per_host, tiers=config.tiers,
                  live=live, process_group=config.placed() if config.placed is not None else None)
    t3, rescaled_at = time.perf_counter(), time.time()
    ptc = held.ptc if held is not None and held.ptc is not None else target if isinstance(target, PTC) else None
    b = res.bytes_by_tier
    own = LiveRecovery(nm, res, t1 - t0, t3 - t2, dict(res.timings), {k: int(b.get(k, 0)) for k in _BYTES},
                       max(ring.states(), default=-1), (res.storage_url,) if res.storage_url else (), rebuild_s=t2 - t1,
                       full_replica=full_replica_bytes(ptc) if ptc is not None else 0, rescaled_at=rescaled_at,
                       unwind_s=wall0 - nm.failed_at, summed=False)
    own = dataclasses.replace(own, times=_times(own))
    return summarized(own) if summarize else own


_BYTES = ("live", "storage", "local")


def _times(rec: LiveRecovery) -> RecoveryTimes:
    nm = rec.membership
    return RecoveryTimes.in_process(detect_s=nm.detect_s, unwind_s=rec.unwind_s, agree_s=nm.agree_s,
                                    regroup_s=nm.regroup_s, rebuild_s=rec.rebuild_s, timings=rec.slowest,
                                    bytes_moved=rec.bytes, full_replica=rec.full_replica)


def summarized(rec: LiveRecovery) -> LiveRecovery:
    """The recovery as the whole new group saw it (one ``all_gather_object`` over the default group,
    which every rank of it calls): bytes summed, the newest step any survivor held, the slowest
    rank's timings (the recovery waits for the slowest), the storage URLs read, and the latency
    table of those. ``rec``: this rank's (``recover_in_process(summarize=False)``); returned as it
    is when summed already."""
    if rec.summed:
        return rec
    views: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(views, (rec.storage_urls, rec.slowest, rec.full_replica, rec.newest,
                                   [rec.bytes[k] for k in _BYTES]))
    slowest = {k: max(v[1].get(k, 0.0) for v in views) for k in rec.slowest}
    summed = dataclasses.replace(rec, slowest=slowest,
                                 bytes={k: sum(v[4][i] for v in views) for i, k in enumerate(_BYTES)},
                                 newest=max(v[3] for v in views),
                                 storage_urls=tuple(sorted({u for v in views for u in v[0]})),
                                 full_replica=max(v[2] for v in views), summed=True)
    return dataclasses.replace(summed, times=_times(summed))
