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
from typing import Any

import numpy as np

from ..checkpoint.format import writer_assignment
from ..checkpoint.read_plan import ReadItem
from ..errors import ConfigError
from ..layout.ptc import PTC, Layout
from ..options import with_overrides
from ..planning.planner import Plan
from ..planning.planner import plan as plan_moves
from ..planning.schedule import METHODS, Demands, Schedule, schedule
from ..planning.topology import Topology
from .tiers import Tier, UsableStep

__all__ = ["RECOVERY_LINKS", "RecoveryOptions", "RecoveryPlan", "plan_recovery", "schedule_recovery", "ReadOrder", "order_reads"]

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


@dataclass(frozen=True, slots=True, eq=False)
class RecoveryOptions:
    """How the recovery schedule is computed (``plan_recovery``, ``schedule_recovery``).

    ``gpus_per_host``: new rank i runs on host ``i // gpus_per_host`` of the default topology.
    ``topology``: default ``Topology.from_spec("hosts=H,gpus=G," + RECOVERY_LINKS)`` with G =
    ``gpus_per_host`` and H the number of stores or of hosts the new world needs, whichever is
    larger. ``method`` and ``time_limit``: as for ``tenplex.planning.schedule.schedule`` (the default
    ``greedy`` is deterministic: every rank computes the same schedule). ``moves``: the
    repartition plan when the caller has it (used when it is the plan of the saved layout to
    the new one on the topology's hosts; otherwise computed).
    """

    gpus_per_host: int = 8
    topology: Topology | None = None
    method: str = "greedy"
    time_limit: float = 2.0
    moves: Plan | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.gpus_per_host, int) or self.gpus_per_host < 1:
            raise ConfigError(f"RecoveryOptions.gpus_per_host must be an integer >= 1, got {self.gpus_per_host!r}")
        if self.method not in METHODS:
            raise ConfigError(f"RecoveryOptions.method {self.method!r} is not one of {', '.join(METHODS)}")
        if not (math.isfinite(self.time_limit) and self.time_limit > 0):
            raise ConfigError(f"RecoveryOptions.time_limit must be a finite number > 0, got {self.time_limit!r}")

    def topology_for(self, stores: Sequence[Tier], cfg: Layout) -> Topology:
        """``topology``, or the default one for ``stores`` and the new world (see above)."""
        if self.topology is not None:
            return self.topology
        g = self.gpus_per_host
        hosts_needed = max(len(stores) + (not any(t.kind == "local" for t in stores)), math.ceil(cfg.world_size / g))
        return Topology.from_spec(f"hosts={hosts_needed},gpus={g},{RECOVERY_LINKS}")


def plan_recovery(found: UsableStep, tiers: Sequence[Tier], cfg: Layout, rank: int,
                  options: RecoveryOptions | None = None, **settings: Any) -> RecoveryPlan:
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
    ``options`` (:class:`RecoveryOptions`): topology, method, limit, the plan when the caller
    has it; keyword ``settings`` override single fields of it.
    """
    t0 = time.perf_counter()
    opts = with_overrides(options or RecoveryOptions(), settings, "plan_recovery")
    manifest = found.manifest
    saved = PTC.from_json(manifest["ptc"])
    old = found.layout
    topology = opts.topology_for([t for t in tiers if t.kind in ("local", "peer")], cfg)
    moves = opts.moves
    if moves is None or (moves.old, moves.new, moves.gpus_per_host) != (old, cfg, topology.gpus_per_host):
        moves = plan_moves(saved, old, cfg, gpus_per_host=topology.gpus_per_host)
    gpu_of = [topology.gpu(int(d)) for d in moves.devices]
    hosts = _host_stores(tiers, topology, int(topology.host_of(gpu_of[rank])))
    holds = [found.attempt.ranks.get(name, set()) if name else set() for name in hosts]
    pieces = _peer_pieces(moves, _writers(saved, old, moves), [int(topology.host_of(g)) for g in gpu_of], gpu_of,
                          holds)
    mem = {int(d["host"]): str(n) for n, d in topology.graph.nodes(data=True) if d.get("kind") == "host"}
    # one flow per (source host, destination GPUs): its pieces back to back, in a fixed order
    flows: dict[tuple[str, tuple[str, ...]], list[tuple[int, int, int]]] = {}
    for (src, ti, s, ln), dests in sorted(pieces.items()):
        flows.setdefault((mem[src], tuple(sorted(dests))), []).append((ti, s, ln))
    my_gpu = gpu_of[rank]
    if not flows:
        return RecoveryPlan(None, topology, hosts, my_gpu, (), time.perf_counter() - t0)
    flow = _Flows(flows, [saved.tensors[n].itemsize for n in moves.tensor_names], moves.tensor_names)
    sched = schedule(flow.demands(), topology, method=opts.method, time_limit=opts.time_limit)
    deliveries = tuple(flow.delivered(rnd, my_gpu) for rnd in sched.rounds())
    seconds = time.perf_counter() - t0
    log.info("recovery schedule for rank %d: %d flows between %d hosts, %d rounds (%s, %.3fs)", rank, len(flows),
             len(hosts), len(deliveries), sched.method, seconds)
    return RecoveryPlan(sched, topology, hosts, my_gpu, deliveries, seconds)


def _writers(saved: PTC, old: Layout, moves: Plan) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per tensor index of ``moves``: the starts of its chunks (the old layout's holder classes),
    sorted, and the writer rank of each."""
    tindex = {n: i for i, n in enumerate(moves.tensor_names)}
    rows: dict[int, list[tuple[int, int]]] = {}
    for w, chunks in writer_assignment(saved, old).items():
        for name, _, start, _ in chunks:
            rows.setdefault(tindex[name], []).append((start, w))
    out = {}
    for ti, r in rows.items():
        arr = np.array(sorted(r), dtype=np.int64)
        out[ti] = (arr[:, 0], arr[:, 1])
    return out


def _peer_pieces(moves: Plan, writers: Mapping[int, tuple[np.ndarray, np.ndarray]], host_of: Sequence[int],
                 gpu_of: Sequence[str], holds: Sequence[set[int]]) -> dict[tuple[int, int, int, int], set[str]]:
    """(source host, tensor, start, length) -> the GPUs that read the piece from that host's store:
    pieces whose writer's part is not in the reading rank's own host store (``holds[h]``: the
    writer ranks host h's store holds), from the first other store that holds it."""
    source: dict[tuple[int, int], int] = {}  # (destination host, writer) -> source host, -1: none

    def source_host(h: int, w: int) -> int:
        if (h, w) not in source:
            source[(h, w)] = -1 if w in holds[h] else next(
                (o for o in range(len(holds)) if o != h and w in holds[o]), -1)
        return source[(h, w)]

    c = moves.columns
    pieces: dict[tuple[int, int, int, int], set[str]] = {}
    for ti in np.unique(c["tensor"]).tolist():
        sel = np.flatnonzero(c["tensor"] == ti)
        starts = c["start"][sel]
        chunk_starts, chunk_writers = writers[ti]
        who = chunk_writers[np.searchsorted(chunk_starts, starts, side="right") - 1]
        for i, s, ln, w in zip(c["new_rank"][sel].tolist(), starts.tolist(), c["length"][sel].tolist(),
                               who.tolist()):
            src = source_host(host_of[i], w)
            if src >= 0:
                pieces.setdefault((src, ti, s, ln), set()).add(gpu_of[i])
    return pieces


class _Flows:
    """The flows of a recovery (``(source memory, destination GPUs) -> pieces`` back to back) as
    demands in bytes, and the element intervals a schedule round delivers to a GPU."""

    def __init__(self, flows: Mapping[tuple[str, tuple[str, ...]], list[tuple[int, int, int]]],
                 itemsize: Sequence[int], names: Sequence[str]) -> None:
        self.keys = sorted(flows)
        self.flows, self.itemsize, self.names = flows, itemsize, names
        self.offsets = []  # per flow: byte offset of each piece
        for k in self.keys:
            self.offsets.append(np.cumsum([0] + [ln * itemsize[ti] for ti, _, ln in flows[k]]).tolist())

    def demands(self) -> Demands:
        return Demands.of([((src,), dests, off[-1]) for (src, dests), off in zip(self.keys, self.offsets)])

    def delivered(self, rnd: Sequence[Any], gpu: str) -> tuple[tuple[str, int, int], ...]:
        """The ``(tensor, start, length)`` element intervals round ``rnd`` delivers to ``gpu``."""
        got = []
        for x in rnd:  # Demands.of: transfer "tensor" i is flow i, start/length in bytes
            f = int(x.tensor)
            if x.dst != gpu or gpu not in self.keys[f][1]:
                continue
            lo, hi = x.start, x.start + x.length
            off, pieces = self.offsets[f], self.flows[self.keys[f]]
            p = bisect.bisect_right(off, lo) - 1
            while p < len(pieces) and off[p] < hi:
                ti, s, _ = pieces[p]
                a, b = max(lo, off[p]) - off[p], min(hi, off[p + 1]) - off[p]
                if b > a:
                    sz = self.itemsize[ti]
                    got.append((self.names[ti], s + a // sz, -(-b // sz) - a // sz))
                p += 1
        return tuple(got)


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


def schedule_recovery(found: UsableStep, tiers: Sequence[Tier], cfg: Layout, rank: int,
                      options: RecoveryOptions | None = None, **settings: Any) -> tuple[RecoveryPlan | None, str]:
    """``plan_recovery`` bounded in time, run before any read: the plan and "", or None and why
    there is none (no peer store holds a part of ``found``, scheduling failed, or it outlasted
    ``time_limit`` plus a grace period; failures are logged). The schedule runs in a daemon
    thread so that an overrun can be abandoned: the loader then reads without rounds.
    ``options`` and ``settings``: as for ``plan_recovery``."""
    opts = with_overrides(options or RecoveryOptions(), settings, "schedule_recovery")
    if not any(t.kind == "peer" and t.name in found.attempt.dirs for t in tiers):
        return None, "no peer store holds a part of this step"
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["plan"] = plan_recovery(found, tiers, cfg, rank, opts)
        except Exception as e:  # noqa: BLE001 - any failure falls back to unscheduled reads
            box["error"] = e

    wait = opts.time_limit + max(1.0, opts.time_limit)  # the schedule itself returns within about its limit
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
