"""Tiered recovery: read each needed piece from the cheapest place that holds it.

Tiers, cheapest first: this host's store, peer hosts' stores (their own ranks' snapshots or
replicas of others'), then persistent storage. A step is usable when every rank part of one
save attempt exists in some tier and a copy of its manifest verifies; usable attempts are
tried newest first, and steps are never mixed. Any part (manifest, objects, rank index,
data block) that fails a check in one tier is read from the next tier that has it; when no
tier holds an intact copy, the next older usable attempt is tried, and the result reports
the attempts passed over (``LoadResult.skipped``).

Reads between hosts follow a transfer schedule (``tenplex.planning.schedule``) computed alike on every
rank from the repartition plan and the stores' contents, before any read: this rank's peer
reads run round by round in the schedule's order (see docs/store.md, "Reads in rounds").

This module holds the readers that execute a shard's read plan across the tiers and
``load_tiered``; the tiers and their scans are in ``tiers``, the schedule in
``recovery_plan`` (both re-exported here).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ..checkpoint.catalog import read_manifest_at
from ..checkpoint.format import Binding
from ..checkpoint.load import LoadResult, ReadOptions, ShardSink, load_with_reader
from ..checkpoint.part_reader import PartReader
from ..checkpoint.read_plan import ReadItem
from ..errors import CheckpointCorruptError, CheckpointNotFoundError, ConfigError
from ..layout.ptc import PTC, Layout
from ..options import with_overrides
from ..planning.planner import Plan
from ..planning.topology import Topology
from .recovery_plan import RECOVERY_LINKS, RecoveryOptions, RecoveryPlan, order_reads, plan_recovery, schedule_recovery
from .tiers import Attempt, Tier, TierScan, UsableStep, find_usable, scan_tiers, usable_steps

__all__ = ["Tier", "TieredLoad", "TieredLoadOptions", "UsableStep", "TierScan", "scan_tiers", "find_usable", "usable_steps",
           "load_tiered",
           "RECOVERY_LINKS", "RecoveryPlan", "plan_recovery", "PeerRead", "RecoveryRounds", "TieredReader",
           "RoundsReader"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PeerRead:
    """One verified read from a peer store: ``length`` elements of ``tensor`` from global offset
    ``start``, out of writer rank ``writer``'s part; ``nbytes`` read (checksum blocks included);
    ``round``: the schedule round it ran in (-1: after the rounds, not covered by the schedule);
    ``started`` / ``finished``: ``time.perf_counter()`` around the read."""

    round: int
    tier: str
    writer: int
    tensor: str
    start: int
    length: int
    nbytes: int
    started: float
    finished: float


@dataclass(frozen=True, slots=True)
class RecoveryRounds:
    """How a tiered load ordered its reads between hosts.

    ``followed``: the peer reads ran in the schedule's rounds; otherwise ``reason`` says why
    they ran in the order the shard asks for them (as without a schedule). ``executed``: this
    rank's peer reads, one tuple per round run, rounds in execution order. ``schedule_rounds``:
    rounds of the whole schedule (all ranks). ``unscheduled``: peer reads the schedule did not
    cover (fallbacks to a peer copy excluded), run after the rounds.
    """

    followed: bool
    reason: str = ""
    method: str = ""
    schedule_rounds: int = 0
    solve_seconds: float = 0.0
    executed: tuple[tuple[PeerRead, ...], ...] = ()
    unscheduled: tuple[PeerRead, ...] = ()

    @property
    def rounds(self) -> int:
        """Rounds in which this rank read from peers."""
        return len(self.executed)

    @property
    def order(self) -> tuple[int, ...]:
        """Schedule round of each executed round, in execution order."""
        return tuple(rnd[0].round for rnd in self.executed)

    @property
    def bytes_per_round(self) -> tuple[int, ...]:
        return tuple(sum(r.nbytes for r in rnd) for rnd in self.executed)


@dataclass(frozen=True)
class TieredLoad:
    """A tiered load's result plus where the bytes came from and how peer reads were ordered."""

    result: LoadResult
    bytes_by_tier: dict[str, int]
    bytes_by_kind: dict[str, int]
    fallbacks: int
    tiers_used: dict[int, str] = field(default_factory=dict)  # writer rank -> tier read from
    rounds: RecoveryRounds = field(default_factory=lambda: RecoveryRounds(False, "not scheduled"))

# ---------------------------------------------------------------------------------------------
# readers
# ---------------------------------------------------------------------------------------------
class TieredReader:
    """A ``ShardReader`` that reads a writer rank's chunks from the first tier that has its part
    and falls back to the next tier on corruption; reads in plan order.

    Safe to call from several threads: each thread gets its own reader per tier (sharing the
    tier's parsed indexes), and the shared bookkeeping is updated under a lock.
    """

    def __init__(self, tiers: Sequence[Tier], attempt: Attempt) -> None:
        self.tiers = [t for t in tiers if t.name in attempt.dirs]
        self.attempt = attempt
        self.readers: dict[tuple[str, int], PartReader] = {}  # (tier, thread) -> reader
        self.indexes: dict[str, dict[int, Any]] = {}  # tier -> parsed rank indexes, shared by threads
        self.choice: dict[int, list[str]] = {}
        self.bytes_by_tier: dict[str, int] = {}
        self.fallbacks = 0
        self.metadata_bytes = 0
        self.binding: Binding | None = None
        self.lock = threading.Lock()

    def bind(self, binding: Binding) -> None:
        """What every tier's copy of a rank index must agree with (``load_with_reader`` sets it)."""
        with self.lock:
            self.binding = binding
            for r in self.readers.values():
                r.bind(binding)

    def _reader(self, tier: Tier) -> PartReader:
        key = (tier.name, threading.get_ident())
        reader = self.readers.get(key)
        if reader is None:
            fs, _ = tier.fs()
            reader = PartReader(fs, self.attempt.dirs[tier.name], self.binding)
            with self.lock:
                reader.indexes = self.indexes.setdefault(tier.name, {})
                self.readers[key] = reader
        return reader

    def tier_of(self, rank: int) -> Tier | None:
        """The tier ``rank``'s part is read from now (None: no tier left)."""
        with self.lock:
            if rank not in self.choice:
                self.choice[rank] = [t.name for t in self.tiers if rank in self.attempt.ranks.get(t.name, set())]
            names = self.choice[rank]
            return next(t for t in self.tiers if t.name == names[0]) if names else None

    def read_counted(self, item: ReadItem, out: torch.Tensor) -> tuple[int, str]:
        """Read ``item`` into ``out``, verified, from the first tier with an intact copy; returns
        the bytes read (as counted in ``bytes_by_tier``) and the tier that served it."""
        errors = []
        while (tier := self.tier_of(item.writer)) is not None:
            reader = self._reader(tier)
            before = reader.bytes_read
            try:
                reader.read_item(item, out)
            except (CheckpointCorruptError, CheckpointNotFoundError, OSError) as e:
                log.warning("rank part %d in tier %s is unusable (%s); trying the next copy", item.writer, tier.name,
                            e)
                errors.append(f"{tier.name}: {e}")
                with self.lock:
                    if self.choice[item.writer] and self.choice[item.writer][0] == tier.name:
                        self.choice[item.writer].pop(0)
                        self.fallbacks += 1
                continue
            n = reader.bytes_read - before
            with self.lock:
                self.bytes_by_tier[tier.name] = self.bytes_by_tier.get(tier.name, 0) + n
            return n, tier.name
        raise CheckpointCorruptError(f"no usable copy of rank {item.writer}'s part of step {self.attempt.step}: "
                                     + "; ".join(errors or ["no tier holds it"]))

    def read_items(self, items: Sequence[ReadItem], buffers: Mapping[str, torch.Tensor], *, rank: int = 0,
                   on_read: Callable[[int], None] = lambda i: None) -> None:
        """Every item of the plan, in plan order."""
        for i, item in enumerate(items):
            self.read_counted(item, item.into(buffers))
            on_read(i)

    @property
    def bytes_read(self) -> int:
        return sum(self.bytes_by_tier.values())

    @property
    def ranges(self) -> int:
        return sum(r.ranges for r in self.readers.values())

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
        self.metadata_bytes += sum(r.metadata_bytes for r in self.readers.values())


class RoundsReader(TieredReader):
    """A tiered reader whose peer reads follow a recovery schedule computed before it reads.

    ``rplan``: the schedule (``schedule_recovery``), or None with ``reason`` why there is none
    (then it reads in plan order). ``read_items`` first sorts the plan into the rounds
    (``order_reads``: pure, before any read), then runs local-store reads, peer reads round by
    round (a round's reads at once in a thread pool, the next round when they are all done),
    peer reads the schedule does not cover, then storage reads, each straight into its
    destination. ``report`` says how it went.
    """

    def __init__(self, tiers: Sequence[Tier], attempt: Attempt, rplan: RecoveryPlan | None, reason: str, *,
                 max_workers: int, barrier: bool) -> None:
        super().__init__(tiers, attempt)
        self.rplan, self.reason = rplan, reason
        self.max_workers, self.barrier = max_workers, barrier
        self.report = RecoveryRounds(False, "no read")

    def read_items(self, items: Sequence[ReadItem], buffers: Mapping[str, torch.Tensor], *, rank: int = 0,
                   on_read: Callable[[int], None] = lambda i: None) -> None:
        rplan = self.rplan
        if rplan is None:
            self.report = RecoveryRounds(False, self.reason)
            super().read_items(items, buffers, rank=rank, on_read=on_read)
            return
        kinds = {}
        for w in sorted({q.writer for q in items}):
            tier = self.tier_of(w)
            kinds[w] = None if tier is None else tier.kind
        order = order_reads(items, rplan, kinds)

        def read(i: int, k: int | None = None) -> PeerRead | None:
            item = items[i]
            t0 = time.perf_counter()
            n, tier = self.read_counted(item, item.into(buffers))
            on_read(i)
            if k is None:
                return None
            return PeerRead(k, tier, item.writer, item.tensor, item.chunk_start + item.a, item.length, n, t0,
                            time.perf_counter())

        for i in order.local:
            read(i)
        use_barrier = self.barrier and torch.distributed.is_available() and torch.distributed.is_initialized()
        executed = []
        with ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="tenplex-recovery") as pool:
            for k, batch in enumerate(order.rounds):
                if not batch and not use_barrier:
                    continue
                reads = list(pool.map(lambda i, k=k: read(i, k), batch))
                if reads:
                    executed.append(tuple(reads))
                if use_barrier:
                    torch.distributed.barrier()
        unscheduled = tuple(read(i, -1) for i in order.late)
        if order.late:
            log.warning("rank %d: %d peer reads are not in the recovery schedule; read after its rounds", rank,
                        len(order.late))
        for i in order.storage:
            read(i)
        self.report = RecoveryRounds(True, "", rplan.schedule.method if rplan.schedule else "", len(order.rounds),
                                     rplan.seconds, tuple(executed), unscheduled)
        if executed:
            log.info("rank %d read peers in %d rounds of %d: %s bytes", rank, len(executed), len(order.rounds),
                     list(self.report.bytes_per_round))


# ---------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------
def _tiered_load(result: LoadResult, reader: TieredReader | PartReader, tiers: Sequence[Tier], holders: list[Tier],
                 rounds: bool) -> TieredLoad:
    """What ``load_tiered`` reports of a load: the bytes by tier and tier kind, the fallbacks, the tier
    each rank index came from and how the rounds went."""
    if isinstance(reader, PartReader):
        by_tier, fallbacks = {holders[0].name: reader.bytes_read}, 0
        used = {r: holders[0].name for r in reader.indexes}
        report = RecoveryRounds(False, "no peer store holds a part of this step" if rounds
                                else "disabled (rounds=False)")
    else:
        by_tier, fallbacks = dict(reader.bytes_by_tier), reader.fallbacks
        used = {r: names[0] for r, names in reader.choice.items() if names}
        report = reader.report if isinstance(reader, RoundsReader) else RecoveryRounds(False, "disabled (rounds=False)")
    by_kind: dict[str, int] = {}
    for t in tiers:
        by_kind[t.kind] = by_kind.get(t.kind, 0) + by_tier.get(t.name, 0)
    return TieredLoad(result, by_tier, by_kind, fallbacks, used, report)


@dataclass(frozen=True)
class TieredLoadOptions:
    """What ``load_tiered`` loads and how it reads (see there): which attempt (``step``, ``found``,
    ``scan``), the model check (``ptc``, ``allow_meta_change``, ``check``), where the bytes go
    (``sink``), and the recovery schedule (``rounds``, ``gpus_per_host``, ``topology``, ``method``,
    ``time_limit``, ``max_workers``, ``barrier``, ``moves``)."""

    ptc: PTC | None = None
    step: int | None = None
    found: UsableStep | None = None
    scan: TierScan | None = None
    allow_meta_change: bool = False
    rounds: bool = True
    gpus_per_host: int = 8
    topology: Topology | None = None
    method: str = "greedy"
    time_limit: float = 2.0
    max_workers: int = 8
    barrier: bool = False
    moves: Plan | None = None
    sink: ShardSink | None = None
    check: Callable[[PTC], None] | None = None

    def __post_init__(self) -> None:
        if self.max_workers < 1:
            raise ConfigError(f"max_workers must be >= 1, got {self.max_workers}")
        if self.step is not None and self.found is not None and self.found.step != self.step:
            raise ConfigError(f"found= is attempt {self.found.save_id} of step {self.found.step}, but step={self.step}")
        self.recovery_options()  # the schedule's and the reads' fields are checked by their own objects
        self.read_options()

    def recovery_options(self) -> RecoveryOptions:
        """The recovery schedule's part of these options (``schedule_recovery``)."""
        return RecoveryOptions(self.gpus_per_host, self.topology, self.method, self.time_limit, self.moves)

    def read_options(self) -> ReadOptions:
        """The model check and the sink: what every read of the chosen attempt gets (``load_with_reader``)."""
        return ReadOptions(self.ptc, self.allow_meta_change, sink=self.sink, check=self.check)


def load_tiered(tiers: Sequence[Tier], cfg: Layout, rank: int, options: TieredLoadOptions | None = None,
                **overrides: Any) -> TieredLoad:
    """Load ``rank``'s shard under ``cfg`` from the newest save attempt that verifies across ``tiers``.

    Tiers are tried in the given order for every part (put the cheapest first): a manifest,
    objects file, rank index or data block that fails a check in one tier is read from the
    next tier holding it. When no tier holds an intact copy of some part, the next older
    usable attempt is tried (of ``step`` only, when given); ``result.skipped`` lists the
    attempts passed over. ``scan``: the tiers' scan (``scan_tiers``), when the caller has it;
    ``found``: load exactly this attempt (no fallback to another). ``ptc`` and
    ``allow_meta_change``: as for ``tenplex.checkpoint.load``; ``sink`` and ``check``: as for
    ``load_with_reader`` (a torch-native state dict's in-place reads). ``cfg``: a ``ParallelConfig``
    or a state dict's ``StateLayout``. ``options`` (``TieredLoadOptions``) holds every setting
    below; keywords override its fields.

    ``rounds`` (default): reads from peer stores follow the recovery schedule
    (``plan_recovery`` with ``gpus_per_host``, ``topology``, ``method``, ``time_limit``),
    round by round, up to ``max_workers`` reads of a round at once; ``barrier`` adds a
    ``torch.distributed.barrier()`` after every round of the schedule when a process group
    is initialised (every rank must then compute the same schedule and load at the same
    time, and a fallback to another attempt on one rank would leave the others waiting: use
    it only with intact stores). If scheduling fails or takes too long, the reads run
    unscheduled (logged, and ``TieredLoad.rounds.reason`` says why). Bytes read are the same
    either way. ``moves``: the repartition plan from the newest attempt's layout to ``cfg``,
    when the caller has it, for the schedule (``plan_recovery``).

    An attempt that a single storage tier holds (a checkpoint URL as the only tier) is read
    as ``tenplex.checkpoint.load`` reads it: the directory's ``PartReader`` (prefetching,
    checksums in a second thread), as there is no other copy to fall back to.
    """
    o = with_overrides(options or TieredLoadOptions(), overrides, "load_tiered")
    t0 = time.perf_counter()
    skipped: list[tuple[int, str, str]] = []
    step = o.step
    if o.found is not None:
        usable = [o.found]
    else:
        scan = o.scan or scan_tiers(tiers)
        usable = scan.usable
        skipped = [u for u in scan.unusable if step is None or u[0] == step]
    if step is not None:
        usable = [u for u in usable if u.step == step]
    names = ", ".join(f"{t.name}={t.url}" for t in tiers)
    if not usable and not skipped:
        raise CheckpointNotFoundError(f"no step{'' if step is None else f' {step}'} is complete across the tiers "
                                      f"{names}")
    by_name = {t.name: t for t in tiers}
    tried = []
    for chosen in sorted(usable, key=lambda u: (u.step, u.verified.created if u.verified else 0.0), reverse=True):
        attempt = chosen.attempt
        verified = chosen.verified or read_manifest_at(chosen.meta_tier.fs()[0], attempt.dirs[chosen.meta_tier.name],
                                                     step=chosen.step, save_id=chosen.save_id)
        holders = [t for t in tiers if t.name in attempt.dirs]
        reader: TieredReader | PartReader
        if len(holders) == 1 and holders[0].kind == "storage":  # one copy, no fallback: the plain reader
            reader = PartReader(holders[0].fs()[0], attempt.dirs[holders[0].name])
        elif o.rounds:  # the schedule first, then the reads
            rplan, why = schedule_recovery(chosen, tiers, cfg, rank, o.recovery_options())
            reader = RoundsReader(tiers, attempt, rplan, why, max_workers=o.max_workers, barrier=o.barrier)
        else:
            reader = TieredReader(tiers, attempt)
        reader.metadata_bytes += chosen.manifest_bytes
        meta = [chosen.meta_tier.name] + [n for n in attempt.meta_tiers if n != chosen.meta_tier.name]
        objects_from = [(by_name[n].fs()[0], attempt.dirs[n]) for n in meta if n in by_name]
        try:
            result = load_with_reader(verified, f"{chosen.meta_tier.url} step {chosen.step}", cfg, rank, reader,
                                      objects_from, t0=t0, options=o.read_options())
        except CheckpointCorruptError as e:
            log.warning("step %d (save %s) has no intact copy across the tiers, trying an older one: %s", chosen.step,
                        chosen.save_id, e)
            tried.append((chosen.step, chosen.save_id, str(e)))
            continue
        passed = sorted([*skipped, *tried], key=lambda x: x[0], reverse=True)
        passed = [x for x in passed if x[0] >= result.step]
        if passed:
            log.warning("rank %d loaded step %d after passing over %d newer attempts: %s", rank, result.step,
                        len(passed), "; ".join(f"step {s} ({sid}): {why}" for s, sid, why in passed))
        return _tiered_load(dataclasses.replace(result, skipped=tuple(passed)), reader, tiers, holders, o.rounds)
    reasons = sorted([*skipped, *tried], key=lambda x: x[0], reverse=True)
    raise CheckpointCorruptError(f"no step{'' if step is None else f' {step}'} verifies across the tiers {names}: "
                                 + "; ".join(f"step {s} ({sid}): {why}" for s, sid, why in reasons))
