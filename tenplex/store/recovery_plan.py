"""The recovery schedule: which reads between host stores run in which round, as data.

Computed alike on every rank from the repartition plan and the stores' contents
(``plan_recovery``), before any read starts; ``order_reads`` then sorts a shard's read plan
(``tenplex.checkpoint.read_plan.plan_reads``) into the schedule's rounds. Pure apart from the
clock (see docs/store.md, "Reads in rounds").
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ..checkpoint.format import writer_assignment
from ..checkpoint.read_plan import ReadItem
from ..config import ParallelConfig
from ..errors import ConfigError
from ..planner import Plan
from ..planner import plan as plan_moves
from ..ptc import PTC
from ..schedule import Demands, Schedule, schedule
from ..topology import Topology
from .tiers import Tier, UsableStep

__all__ = ["RECOVERY_LINKS", "RecoveryPlan", "plan_recovery", "schedule_recovery", "ReadOrder", "order_reads"]

log = logging.getLogger(__name__)

RECOVERY_LINKS = "nvlink=300GB/s,pcie=32GB/s,nic=50GB/s"
"""Links of the default recovery topology (``hosts`` and ``gpus`` are derived; see ``plan_recovery``)."""


@dataclass(frozen=True, slots=True)
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



def schedule_recovery(found: UsableStep, tiers: Sequence[Tier], cfg: ParallelConfig, rank: int, *,
                      gpus_per_host: int = 8, topology: Topology | None = None, method: str = "greedy",
                      time_limit: float = 2.0, moves: Plan | None = None) -> tuple[RecoveryPlan | None, str]:
    """``plan_recovery`` bounded in time, run before any read: the plan and "", or None and why
    there is none (no peer store holds a part of ``found``, scheduling failed, or it outlasted
    ``time_limit`` plus a grace period; failures are logged). The schedule runs in a daemon
    thread so that an overrun can be abandoned: the loader then reads without rounds."""
    if not any(t.kind == "peer" and t.name in found.attempt.dirs for t in tiers):
        return None, "no peer store holds a part of this step"
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["plan"] = plan_recovery(found, tiers, cfg, rank, gpus_per_host=gpus_per_host, topology=topology,
                                        method=method, time_limit=time_limit, moves=moves)
        except Exception as e:  # noqa: BLE001 - any failure falls back to unscheduled reads
            box["error"] = e

    wait = time_limit + max(1.0, time_limit)  # the schedule itself returns within about its limit
    th = threading.Thread(target=run, name="tenplex-recovery-schedule", daemon=True)
    th.start()
    th.join(wait)
    if th.is_alive():
        reason = f"scheduling took longer than {wait:.1f}s"
    elif "error" in box:
        e = box["error"]
        reason = f"scheduling failed: {type(e).__name__}: {e}"
    else:
        return box["plan"], ""  # type: ignore[return-value]
    log.warning("rank %d reads peer stores without a schedule: %s", rank, reason)
    return None, reason


@dataclass(frozen=True, slots=True)
class ReadOrder:
    """A shard's read plan sorted for execution, as indices into the plan: reads from this
    host's store first (and reads no tier holds, which raise in plan order), then the peer
    reads of each schedule round (``rounds[k]``: round k's, one entry per round of the
    schedule), then peer reads no round delivers (``late``), then reads from storage."""

    local: tuple[int, ...]
    rounds: tuple[tuple[int, ...], ...]
    late: tuple[int, ...]
    storage: tuple[int, ...]


def order_reads(items: Sequence[ReadItem], plan: RecoveryPlan, kinds: Mapping[int, str | None]) -> ReadOrder:
    """Sort ``items`` into ``plan``'s rounds. ``kinds[writer]``: the kind of the tier a writer
    rank's part is read from ("local", "peer", "storage"; None: no tier holds it). Pure: no read
    starts before the order is complete."""
    index = _first_rounds(plan.deliveries)
    local: list[int] = []
    storage: list[int] = []
    late: list[int] = []
    rounds: list[list[int]] = [[] for _ in plan.deliveries]
    for i, q in enumerate(items):
        kind = kinds[q.writer]
        if kind is None or kind == "local":
            local.append(i)
        elif kind == "storage":
            storage.append(i)
        else:
            k = _round_of(index, q.tensor, q.chunk_start + q.a, q.chunk_start + q.b)
            (rounds[k] if k >= 0 else late).append(i)
    return ReadOrder(tuple(local), tuple(tuple(r) for r in rounds), tuple(late), tuple(storage))
