"""Tiered recovery: read each needed piece from the cheapest place that holds it.

Tiers, cheapest first: this host's store, peer hosts' stores (their own ranks' snapshots or
replicas of others'), then persistent storage. A step is usable when every rank part of one
save attempt exists in some tier and a copy of its manifest verifies; usable attempts are
tried newest first, and steps are never mixed. Any part (manifest, objects, rank index,
data block) that fails a check in one tier is read from the next tier that has it; when no
tier holds an intact copy, the next older usable attempt is tried, and the result reports
the attempts passed over (``LoadResult.skipped``).

Reads between hosts follow a transfer schedule (``tenplex.schedule``) computed alike on every
rank from the repartition plan and the stores' contents: this rank's peer reads run round by
round in the schedule's order (see docs/store.md, "Reads in rounds").
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import re
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import fsspec
import numpy as np
import torch

from ..checkpoint import (
    _REUSED_PREFIX,
    Binding,
    LoadResult,
    Manifest,
    ReadRequest,
    _read_manifest,
    _Reader,
    load_with_reader,
    writer_assignment,
)
from ..config import ParallelConfig
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, ConfigError
from ..planner import Plan
from ..planner import plan as plan_moves
from ..ptc import PTC
from ..schedule import Demands, Schedule, schedule
from ..topology import Topology

__all__ = ["Tier", "TieredLoad", "UsableStep", "TierScan", "scan_tiers", "find_usable", "usable_steps", "load_tiered",
           "RECOVERY_LINKS", "RecoveryPlan", "plan_recovery", "PeerRead", "RecoveryRounds"]

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{12})-([0-9a-f]{8})$")
_RANK_JSON = re.compile(r"^rank-(\d{5})\.json$")


@dataclass(frozen=True)
class Tier:
    """One place state can come from. ``kind``: "local" (this host's store), "peer" (another
    host's store) or "storage" (persistent checkpoints)."""

    name: str
    url: str
    kind: str = "storage"
    storage_options: Mapping[str, Any] | None = None

    def fs(self) -> tuple[fsspec.AbstractFileSystem, str]:
        fs, root = fsspec.core.url_to_fs(self.url, **dict(self.storage_options or {}))
        return fs, root.rstrip("/")


@dataclass(frozen=True)
class _Attempt:
    step: int
    save_id: str
    dirs: dict[str, str]  # tier name -> step dir
    ranks: dict[str, set[int]]  # tier name -> complete rank parts
    meta_tiers: list[str]  # tiers holding manifest.json and objects.pt
    reused: list[str] = field(default_factory=list)  # tiers where a save marked the save id as used twice


@dataclass(frozen=True)
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


@dataclass(frozen=True)
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


def _scan_tier(tier: Tier) -> dict[tuple[int, str], tuple[str, set[int], bool, bool]]:
    try:
        fs, root = tier.fs()
        entries = fs.ls(root, detail=False)
    except (FileNotFoundError, OSError) as e:
        log.info("tier %s (%s) unavailable: %s", tier.name, tier.url, e)
        return {}
    out = {}
    for entry in entries:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        m = _STEP_DIR.match(name)
        if not m:
            continue
        try:
            files = {f.rstrip("/").rsplit("/", 1)[-1] for f in fs.ls(entry.rstrip("/"), detail=False)}
        except (FileNotFoundError, OSError):
            continue
        ranks = {int(mm.group(1)) for f in files if (mm := _RANK_JSON.match(f))
                 and f"rank-{mm.group(1)}.safetensors" in files}
        out[(int(m.group(1)), m.group(2))] = (entry.rstrip("/"), ranks, {"manifest.json", "objects.pt"} <= files,
                                              any(f.startswith(_REUSED_PREFIX) for f in files))
    return out


def _attempts(tiers: Sequence[Tier]) -> list[_Attempt]:
    merged: dict[tuple[int, str], _Attempt] = {}
    for tier in tiers:
        for key, (path, ranks, meta, reused) in _scan_tier(tier).items():
            a = merged.setdefault(key, _Attempt(key[0], key[1], {}, {}, []))
            a.dirs[tier.name] = path
            a.ranks[tier.name] = ranks
            if meta:
                a.meta_tiers.append(tier.name)
            if reused:
                a.reused.append(tier.name)
    return sorted(merged.values(), key=lambda a: a.step)


@dataclass(frozen=True)
class UsableStep:
    """A save attempt whose parts all exist in some tier, with its manifest (read once and
    verified: ``verified``; ``manifest`` is its JSON object) and the tier it came from."""

    step: int
    save_id: str
    world_size: int
    attempt: _Attempt
    manifest: dict[str, Any]
    manifest_bytes: int
    meta_tier: Tier
    verified: Manifest | None = None


@dataclass(frozen=True)
class TierScan:
    """One scan of the tiers: the usable attempts (oldest first) and, for reports, the attempts
    whose parts all exist but that cannot be used: ``(step, save_id, reason)``."""

    usable: list[UsableStep]
    unusable: list[tuple[int, str, str]] = field(default_factory=list)


def scan_tiers(tiers: Sequence[Tier]) -> TierScan:
    """Every save attempt across ``tiers`` (one listing of every tier): usable when every rank
    part exists in some tier and a copy of its manifest verifies (tiers tried in order)."""
    by_name = {t.name: t for t in tiers}
    usable, unusable = [], []
    for a in _attempts(tiers):
        if not a.meta_tiers:
            continue
        if a.reused:
            unusable.append((a.step, a.save_id, f"save id reused (marker in {', '.join(a.reused)})"))
            continue
        verified, errors = None, []
        for name in a.meta_tiers:
            fs, _ = by_name[name].fs()
            try:
                verified = _read_manifest(fs, a.dirs[name], step=a.step, save_id=a.save_id)
            except (CheckpointError, OSError) as e:
                log.warning("tier %s: the manifest of step %d (save %s) is unusable: %s", name, a.step, a.save_id, e)
                errors.append(f"{name}: {e}")
                continue
            tier = by_name[name]
            break
        if verified is None:
            unusable.append((a.step, a.save_id, "no tier holds a valid manifest: " + "; ".join(errors)))
            continue
        have = set().union(*a.ranks.values()) if a.ranks else set()
        if set(range(verified.world_size)) <= have:
            usable.append(UsableStep(a.step, a.save_id, verified.world_size, a, verified.raw, verified.nbytes, tier,
                                     verified))
    usable.sort(key=lambda u: (u.step, u.verified.created if u.verified else 0.0))
    return TierScan(usable, unusable)


def find_usable(tiers: Sequence[Tier]) -> list[UsableStep]:
    """Every usable save attempt across ``tiers``, oldest first (one scan of every tier)."""
    return scan_tiers(tiers).usable


def usable_steps(tiers: Sequence[Tier]) -> list[tuple[int, str, int]]:
    """``(step, save_id, world_size)`` of every save attempt whose parts all exist somewhere, oldest first."""
    return [(u.step, u.save_id, u.world_size) for u in find_usable(tiers)]


# ---------------------------------------------------------------------------------------------
# the schedule of reads between hosts
# ---------------------------------------------------------------------------------------------
RECOVERY_LINKS = "nvlink=300GB/s,pcie=32GB/s,nic=50GB/s"
"""Links of the default recovery topology (``hosts`` and ``gpus`` are derived; see ``plan_recovery``)."""


@dataclass(frozen=True)
class RecoveryPlan:
    """The schedule of every new rank's reads between host stores, seen from one rank.

    ``hosts[h]``: the tier name of host h's store ("" for a host without one). ``gpu``: this
    rank's GPU node. ``deliveries[k]``: the ``(tensor, start, length)`` element intervals that
    round k of ``schedule.rounds()`` delivers to this rank (empty tuple where none).
    ``schedule`` is None when no rank reads from a peer store.
    """

    schedule: Schedule | None
    topology: Topology
    hosts: tuple[str, ...]
    gpu: str
    deliveries: tuple[tuple[tuple[str, int, int], ...], ...]
    seconds: float


def _host_stores(tiers: Sequence[Tier], topology: Topology, my_host: int) -> tuple[str, ...]:
    """Tier name of each host's store: the local tier on this rank's host, peers on the others in order."""
    hosts = sorted({d["host"] for _, d in topology.graph.nodes(data=True) if d.get("kind") == "host"})
    if hosts != list(range(len(hosts))):
        raise ConfigError(f"the recovery topology's host memories must be numbered 0..n-1, got {hosts}")
    out = [""] * len(hosts)
    local = [t for t in tiers if t.kind == "local"]
    peers = [t for t in tiers if t.kind == "peer"]
    if local:
        out[my_host] = local[0].name
    free = [h for h in range(len(hosts)) if h != my_host]
    if len(peers) > len(free):
        raise ConfigError(f"the recovery topology has {len(hosts)} hosts but the tiers name {len(peers)} peer "
                          f"stores besides this host's; pass a topology with more hosts")
    for h, t in zip(free, peers):
        out[h] = t.name
    return tuple(out)


def plan_recovery(found: UsableStep, tiers: Sequence[Tier], cfg: ParallelConfig, rank: int, *,
                  gpus_per_host: int = 8, topology: Topology | None = None, method: str = "greedy",
                  time_limit: float = 2.0, moves: Plan | None = None) -> RecoveryPlan:
    """Schedule the reads between host stores that loading ``found`` under ``cfg`` needs.

    Every rank computes the same schedule (with the deterministic ``greedy`` method), so the
    rounds coordinate the whole cluster without messages. The model: new rank i runs on the
    topology's GPU of device i (by default host ``i // gpus_per_host``, the order torchrun
    places ranks in); this host's store is the memory of this rank's host and the peer tiers
    are the other hosts' memories in tier order (list the stores in the same order on every
    host, as ``TENPLEX_STORES`` does). The repartition plan gives the pieces every new rank
    needs; a piece whose writer rank's part is not in its host's store is read from the first
    other store holding the part (the tier order of the reads), a flow from that host's
    memory to the GPUs of the new ranks that need it (one flow for all of them: multicast).
    ``topology``: default ``Topology.from_spec("hosts=H,gpus=G," + RECOVERY_LINKS)`` with G =
    ``gpus_per_host`` and H the number of stores or of hosts the new world needs, whichever
    is larger. ``moves``: the repartition plan when the caller has it (used when it is the plan
    of ``found``'s layout to ``cfg`` on the topology's hosts; otherwise computed here).
    """
    t0 = time.perf_counter()
    manifest = found.manifest
    saved = PTC.from_json(manifest["ptc"])
    old = ParallelConfig.parse(manifest["layout"])
    stores = [t for t in tiers if t.kind in ("local", "peer")]
    if topology is None:
        hosts_needed = max(len(stores) + (not any(t.kind == "local" for t in stores)),
                           math.ceil(cfg.world_size / gpus_per_host))
        topology = Topology.from_spec(f"hosts={hosts_needed},gpus={gpus_per_host},{RECOVERY_LINKS}")
    if moves is None or (moves.old, moves.new, moves.gpus_per_host) != (old, cfg, topology.gpus_per_host):
        moves = plan_moves(saved, old, cfg, gpus_per_host=topology.gpus_per_host)
    gpu_of = [topology.gpu(int(d)) for d in moves.devices]
    host_of = [int(topology.host_of(g)) for g in gpu_of]
    hosts = _host_stores(tiers, topology, host_of[rank])
    mem = {int(d["host"]): str(n) for n, d in topology.graph.nodes(data=True) if d.get("kind") == "host"}
    holds = [found.attempt.ranks.get(name, set()) if name else set() for name in hosts]

    # writer rank of every chunk, per tensor, sorted by start (chunks are the old layout's holder classes)
    chunk_starts: dict[int, np.ndarray] = {}
    chunk_writers: dict[int, np.ndarray] = {}
    tindex = {n: i for i, n in enumerate(moves.tensor_names)}
    rows: dict[int, list[tuple[int, int]]] = {}
    for w, chunks in writer_assignment(saved, old).items():
        for name, _, start, _ in chunks:
            rows.setdefault(tindex[name], []).append((start, w))
    for ti, r in rows.items():
        arr = np.array(sorted(r), dtype=np.int64)
        chunk_starts[ti], chunk_writers[ti] = arr[:, 0], arr[:, 1]

    source: dict[tuple[int, int], int] = {}  # (destination host, writer) -> source host, -1: none

    def source_host(h: int, w: int) -> int:
        if (h, w) not in source:
            source[(h, w)] = -1 if w in holds[h] else next(
                (o for o in range(len(hosts)) if o != h and w in holds[o]), -1)
        return source[(h, w)]

    c = moves.columns
    pieces: dict[tuple[int, int, int, int], set[str]] = {}  # (source host, tensor, start, length) -> GPUs
    for ti in np.unique(c["tensor"]).tolist():
        sel = np.flatnonzero(c["tensor"] == ti)
        starts = c["start"][sel]
        writers = chunk_writers[ti][np.searchsorted(chunk_starts[ti], starts, side="right") - 1]
        for i, s, ln, w in zip(c["new_rank"][sel].tolist(), starts.tolist(), c["length"][sel].tolist(),
                               writers.tolist()):
            src = source_host(host_of[i], w)
            if src >= 0:
                pieces.setdefault((src, ti, s, ln), set()).add(gpu_of[i])
    # one flow per (source host, destination GPUs): its pieces back to back, in a fixed order
    flows: dict[tuple[str, tuple[str, ...]], list[tuple[int, int, int]]] = {}
    for (src, ti, s, ln), dests in sorted(pieces.items()):
        flows.setdefault((mem[src], tuple(sorted(dests))), []).append((ti, s, ln))
    keys = sorted(flows)
    my_gpu = gpu_of[rank]
    if not keys:
        return RecoveryPlan(None, topology, hosts, my_gpu, (), time.perf_counter() - t0)
    itemsize = [saved.tensors[n].itemsize for n in moves.tensor_names]
    offsets = []  # per flow: byte offset of each piece
    sizes = []
    for k in keys:
        off = np.cumsum([0] + [ln * itemsize[ti] for ti, _, ln in flows[k]])
        offsets.append(off.tolist())
        sizes.append(int(off[-1]))
    dem = Demands.of([((src,), dests, n) for (src, dests), n in zip(keys, sizes)])
    sched = schedule(dem, topology, method=method, time_limit=time_limit)
    deliveries = []
    for rnd in sched.rounds():
        got = []
        for x in rnd:  # Demands.of: transfer "tensor" i is flow i, start/length in bytes
            f = int(x.tensor)
            if x.dst != my_gpu or my_gpu not in keys[f][1]:
                continue
            lo, hi = x.start, x.start + x.length
            off = offsets[f]
            p = bisect.bisect_right(off, lo) - 1
            while p < len(flows[keys[f]]) and off[p] < hi:
                ti, s, _ = flows[keys[f]][p]
                a, b = max(lo, off[p]) - off[p], min(hi, off[p + 1]) - off[p]
                if b > a:
                    sz = itemsize[ti]
                    got.append((moves.tensor_names[ti], s + a // sz, -(-b // sz) - a // sz))
                p += 1
        deliveries.append(tuple(got))
    seconds = time.perf_counter() - t0
    log.info("recovery schedule for rank %d: %d flows between %d hosts, %d rounds (%s, %.3fs)", rank, len(keys),
             len(hosts), len(deliveries), sched.method, seconds)
    return RecoveryPlan(sched, topology, hosts, my_gpu, tuple(deliveries), seconds)


_Index = dict[str, tuple[list[int], list[int], list[int]]]


def _first_rounds(deliveries: Sequence[Sequence[tuple[str, int, int]]]) -> _Index:
    """Per tensor: starts, ends and round of every interval delivered, sorted by start."""
    by: dict[str, list[tuple[int, int, int]]] = {}
    for k, rnd in enumerate(deliveries):
        for name, s, ln in rnd:
            by.setdefault(name, []).append((s, s + ln, k))
    out = {}
    for name, iv in by.items():
        iv.sort()
        out[name] = ([a for a, _, _ in iv], [b for _, b, _ in iv], [k for _, _, k in iv])
    return out


def _round_of(index: _Index, name: str, lo: int, hi: int) -> int:
    """The first round delivering any element of ``name[lo:hi]`` (-1: none)."""
    if name not in index:
        return -1
    starts, ends, rnds = index[name]
    best = -1
    i = max(bisect.bisect_right(starts, lo) - 1, 0)  # delivered intervals are disjoint
    while i < len(starts) and starts[i] < hi:
        if ends[i] > lo and (best < 0 or rnds[i] < best):
            best = rnds[i]
        i += 1
    return best


# ---------------------------------------------------------------------------------------------
# readers
# ---------------------------------------------------------------------------------------------
class _TieredReader:
    """Reads a writer rank's chunks from the first tier that has its part; falls back on corruption.

    Safe to call from several threads: each thread gets its own reader per tier (sharing the
    tier's parsed indexes), and the shared bookkeeping is updated under a lock.
    """

    def __init__(self, tiers: Sequence[Tier], attempt: _Attempt) -> None:
        self.tiers = [t for t in tiers if t.name in attempt.dirs]
        self.attempt = attempt
        self.readers: dict[tuple[str, int], _Reader] = {}  # (tier, thread) -> reader
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

    def _reader(self, tier: Tier) -> _Reader:
        key = (tier.name, threading.get_ident())
        reader = self.readers.get(key)
        if reader is None:
            fs, _ = tier.fs()
            reader = _Reader(fs, self.attempt.dirs[tier.name], self.binding)
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

    def read_counted(self, rank: int, name: str, chunk_start: int, a: int, b: int, dtype: torch.dtype,
                     itemsize: int, out: torch.Tensor | None = None) -> tuple[torch.Tensor, int, str]:
        """Like ``read``, plus the bytes read (as counted in ``bytes_by_tier``) and the tier that served it."""
        errors = []
        while (tier := self.tier_of(rank)) is not None:
            reader = self._reader(tier)
            before = reader.bytes_read
            try:
                got = reader.read(rank, name, chunk_start, a, b, dtype, itemsize, out=out)
            except (CheckpointCorruptError, CheckpointNotFoundError, OSError) as e:
                log.warning("rank part %d in tier %s is unusable (%s); trying the next copy", rank, tier.name, e)
                errors.append(f"{tier.name}: {e}")
                with self.lock:
                    if self.choice[rank] and self.choice[rank][0] == tier.name:
                        self.choice[rank].pop(0)
                        self.fallbacks += 1
                continue
            n = reader.bytes_read - before
            with self.lock:
                self.bytes_by_tier[tier.name] = self.bytes_by_tier.get(tier.name, 0) + n
            return got, n, tier.name
        raise CheckpointCorruptError(f"no usable copy of rank {rank}'s part of step {self.attempt.step}: "
                                     + "; ".join(errors or ["no tier holds it"]))

    def read(self, rank: int, name: str, chunk_start: int, a: int, b: int, dtype: torch.dtype,
             itemsize: int, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.read_counted(rank, name, chunk_start, a, b, dtype, itemsize, out)[0]

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


class _RoundsReader(_TieredReader):
    """A tiered reader whose peer reads follow the recovery schedule's rounds.

    ``read_shard`` hands it every read of the shard at once (``read_many``): it plans
    (``plan_recovery``) and runs local-store reads first, then peer reads round by round (a
    round's reads at once in a thread pool, the next round when they are all done), then
    storage reads and peer reads the schedule does not cover, each straight into its
    destination. When planning fails it logs why and reads in ``read_shard``'s order.
    """

    def __init__(self, tiers: Sequence[Tier], found: UsableStep, cfg: ParallelConfig, rank: int, *,
                 gpus_per_host: int, topology: Topology | None, method: str, time_limit: float,
                 max_workers: int, barrier: bool, moves: Plan | None = None) -> None:
        super().__init__(tiers, found.attempt)
        self.all_tiers, self.found, self.cfg, self.rank = tiers, found, cfg, rank
        self.options = {"gpus_per_host": gpus_per_host, "topology": topology, "method": method,
                        "time_limit": time_limit, "moves": moves}
        self.max_workers, self.barrier = max_workers, barrier
        self.report = RecoveryRounds(False, "no read")

    def read_many(self, reqs: list[ReadRequest], rank: int = 0) -> None:
        rplan = None
        if not any(t.kind == "peer" for t in self.tiers):
            self.report = RecoveryRounds(False, "no peer store holds a part of this step")
        else:
            rplan = self._plan()
        if rplan is None:
            for r in reqs:
                self._read(r)
            return
        index = _first_rounds(rplan.deliveries)
        local, storage, late = [], [], []
        by_round: dict[int, list[ReadRequest]] = {}
        for q in reqs:
            tier = self.tier_of(q.writer)
            if tier is None or tier.kind == "local":
                local.append(q)  # (no tier: raises in order, as without a schedule)
            elif tier.kind == "storage":
                storage.append(q)
            else:
                k = _round_of(index, q.tensor, q.chunk_start + q.a, q.chunk_start + q.b)
                (by_round.setdefault(k, []) if k >= 0 else late).append(q)
        for q in local:
            self._read(q)
        use_barrier = self.barrier and torch.distributed.is_available() and torch.distributed.is_initialized()
        n_rounds = len(rplan.deliveries)
        executed = []
        with ThreadPoolExecutor(max_workers=self.max_workers, thread_name_prefix="tenplex-recovery") as pool:
            for k in range(n_rounds) if use_barrier else sorted(by_round):
                reads = list(pool.map(lambda q, k=k: self._peer_read(q, k), by_round.get(k, [])))
                if reads:
                    executed.append(tuple(reads))
                if use_barrier:
                    torch.distributed.barrier()
        unscheduled = tuple(self._peer_read(q, -1) for q in late)
        if late:
            log.warning("rank %d: %d peer reads are not in the recovery schedule; read after its rounds", self.rank,
                        len(late))
        for q in storage:
            self._read(q)
        self.report = RecoveryRounds(True, "", rplan.schedule.method if rplan.schedule else "", n_rounds,
                                     rplan.seconds, tuple(executed), unscheduled)
        if executed:
            log.info("rank %d read peers in %d rounds of %d: %s bytes", self.rank, len(executed), n_rounds,
                     list(self.report.bytes_per_round))

    def _read(self, q: ReadRequest) -> tuple[torch.Tensor, int, str]:
        return self.read_counted(q.writer, q.tensor, q.chunk_start, q.a, q.b, q.dtype, q.itemsize, out=q.out)

    def _peer_read(self, q: ReadRequest, k: int) -> PeerRead:
        t0 = time.perf_counter()
        _, n, tier = self._read(q)
        return PeerRead(k, tier, q.writer, q.tensor, q.chunk_start + q.a, q.b - q.a, n, t0, time.perf_counter())

    def _plan(self) -> RecoveryPlan | None:
        """The recovery plan, or None (logged) when scheduling fails or outlasts its time limit."""
        limit = float(self.options["time_limit"])
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["plan"] = plan_recovery(self.found, self.all_tiers, self.cfg, self.rank, **self.options)
            except Exception as e:  # noqa: BLE001 - any failure falls back to unscheduled reads
                box["error"] = e

        th = threading.Thread(target=run, name="tenplex-recovery-schedule", daemon=True)
        th.start()
        th.join(limit + max(1.0, limit))  # the schedule itself returns within about its limit
        if th.is_alive():
            self.report = RecoveryRounds(False, f"scheduling took longer than {limit + max(1.0, limit):.1f}s")
        elif "error" in box:
            e = box["error"]
            self.report = RecoveryRounds(False, f"scheduling failed: {type(e).__name__}: {e}")
        else:
            return box["plan"]
        log.warning("rank %d reads peer stores without a schedule: %s", self.rank, self.report.reason)
        return None


# ---------------------------------------------------------------------------------------------
# load
# ---------------------------------------------------------------------------------------------
def load_tiered(tiers: Sequence[Tier], cfg: ParallelConfig, rank: int, *, ptc: PTC | None = None,
                step: int | None = None, found: UsableStep | None = None, scan: TierScan | None = None,
                allow_meta_change: bool = False, rounds: bool = True, gpus_per_host: int = 8,
                topology: Topology | None = None, method: str = "greedy", time_limit: float = 2.0,
                max_workers: int = 8, barrier: bool = False, moves: Plan | None = None) -> TieredLoad:
    """Load ``rank``'s shard under ``cfg`` from the newest save attempt that verifies across ``tiers``.

    Tiers are tried in the given order for every part (put the cheapest first): a manifest,
    objects file, rank index or data block that fails a check in one tier is read from the
    next tier holding it. When no tier holds an intact copy of some part, the next older
    usable attempt is tried (of ``step`` only, when given); ``result.skipped`` lists the
    attempts passed over. ``scan``: the tiers' scan (``scan_tiers``), when the caller has it;
    ``found``: load exactly this attempt (no fallback to another). ``ptc`` and
    ``allow_meta_change``: as for ``tenplex.checkpoint.load``.

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
    as ``tenplex.checkpoint.load`` reads it: its reader's prefetching ``read_many``.
    """
    t0 = time.perf_counter()
    skipped: list[tuple[int, str, str]] = []
    if found is not None:
        usable = [found]
    else:
        scan = scan or scan_tiers(tiers)
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
        verified = chosen.verified or _read_manifest(chosen.meta_tier.fs()[0], attempt.dirs[chosen.meta_tier.name],
                                                     step=chosen.step, save_id=chosen.save_id)
        holders = [t for t in tiers if t.name in attempt.dirs]
        reader: _TieredReader | _Reader
        if len(holders) == 1 and holders[0].kind == "storage":  # one copy, no fallback: the plain reader
            reader = _Reader(holders[0].fs()[0], attempt.dirs[holders[0].name])
        elif rounds:
            reader = _RoundsReader(tiers, chosen, cfg, rank, gpus_per_host=gpus_per_host, topology=topology,
                                   method=method, time_limit=time_limit, max_workers=max_workers, barrier=barrier,
                                   moves=moves)
        else:
            reader = _TieredReader(tiers, attempt)
        reader.metadata_bytes += chosen.manifest_bytes
        meta = [chosen.meta_tier.name] + [n for n in attempt.meta_tiers if n != chosen.meta_tier.name]
        objects_from = [(by_name[n].fs()[0], attempt.dirs[n]) for n in meta if n in by_name]
        try:
            result = load_with_reader(verified, f"{chosen.meta_tier.url} step {chosen.step}", cfg, rank, reader,
                                      objects_from, ptc=ptc, allow_meta_change=allow_meta_change, t0=t0)
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
        result = dataclasses.replace(result, skipped=tuple(passed))
        if isinstance(reader, _Reader):
            by_tier, fallbacks = {holders[0].name: reader.bytes_read}, 0
            used = {r: holders[0].name for r in reader.indexes}
            report = RecoveryRounds(False, "no peer store holds a part of this step" if rounds
                                    else "disabled (rounds=False)")
        else:
            by_tier, fallbacks = dict(reader.bytes_by_tier), reader.fallbacks
            used = {r: names_[0] for r, names_ in reader.choice.items() if names_}
            report = (reader.report if isinstance(reader, _RoundsReader)
                      else RecoveryRounds(False, "disabled (rounds=False)"))
        by_kind: dict[str, int] = {}
        for t in tiers:
            by_kind[t.kind] = by_kind.get(t.kind, 0) + by_tier.get(t.name, 0)
        return TieredLoad(result, by_tier, by_kind, fallbacks, used, report)
    reasons = sorted([*skipped, *tried], key=lambda x: x[0], reverse=True)
    raise CheckpointCorruptError(f"no step{'' if step is None else f' {step}'} verifies across the tiers {names}: "
                                 + "; ".join(f"step {s} ({sid}): {why}" for s, sid, why in reasons))
