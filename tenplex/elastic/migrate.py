"""Live state migration: survivors move a plan's pieces between them with torch.distributed.

Pure part (:func:`exchange_plan`, no I/O, no messages): from a :class:`~tenplex.planning.planner.Plan`
and optionally the rounds of a :mod:`tenplex.planning.schedule` schedule, every rank computes the same
table of pieces (local copies, peer transfers, storage reads) and the same messages: one per
(round, sender, receiver), its pieces packed back to back in a fixed order. So no rank asks
another what it will send.

Adapter (:func:`migrate`): every process of the survivors' new group calls it with the shard
it holds under the old layout and gets its shard under the new one. Local pieces are copied in
memory; peer pieces travel with ``dist.batch_isend_irecv`` (one uint8 buffer per message: the
same code on gloo with CPU tensors and on nccl with device tensors), round after round; pieces
whose every holder died are read from a checkpoint with the checkpoint reader (``plan_reads``
restricted to those pieces, executed by ``PartReader``), concurrently with the transfers.

Group ranks: the process that ran old rank ``alive[i]`` is group rank ``i``; group ranks
``< new.world_size`` are the new ranks, fresh joiners (``i >= len(alive)``) hold nothing and only
receive, survivors beyond the new world (``i >= new.world_size``) only send.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..checkpoint.catalog import scan_attempts
from ..checkpoint.format import Binding, writer_assignment
from ..checkpoint.load import check_model
from ..checkpoint.part_reader import PartReader
from ..checkpoint.read_plan import ReadItem, plan_reads
from ..errors import CheckpointCorruptError, CheckpointNotFoundError, ConfigError, MigrationError, PlanError
from ..layout.ptc import PAD, PTC, Layout
from ..options import with_overrides
from ..planning.planner import CROSS_HOST, KIND_NAMES, LOCAL, SAME_HOST, STORAGE, Plan, intersect
from ..planning.planner import plan as make_plan
from ..urls import url_fs

if TYPE_CHECKING:
    from ..planning.schedule import Schedule, Transfer

__all__ = ["Message", "ExchangePlan", "exchange_plan", "StorageRead", "storage_items", "read_storage_pieces",
           "MigrateResult", "MigrationInputs", "migrate"]

log = logging.getLogger(__name__)

_PIECE_COLUMNS = ("round", "src", "dst", "tensor", "kind", "src_offset", "dst_offset", "start", "length", "nbytes")


@dataclass(frozen=True, slots=True)
class Message:
    """One buffer from group rank ``src`` to ``dst`` in round ``round``: pieces ``[first, last)``
    of the exchange plan's piece columns, packed in that order (``nbytes`` in all)."""

    round: int
    src: int
    dst: int
    first: int
    last: int
    nbytes: int


@dataclass(frozen=True, slots=True, eq=False)  # numpy fields: identity, not value, equality
class ExchangePlan:
    """Every piece of a plan with the group rank that supplies it, in the order ranks handle them.

    Piece columns (one row per piece; a plan move split where the schedule's rounds split it):
    ``round`` (-1 for local and storage pieces), ``src`` (the group rank sending, the receiver
    itself for local pieces, -1 for storage), ``dst`` (the new rank), ``tensor`` (index into
    ``tensor_names``), ``kind`` (planner kinds), ``src_offset`` / ``dst_offset`` (elements in the
    canonical flat shards; for storage pieces ``src_offset`` is the global start), ``start`` (global
    element), ``length`` (elements), ``nbytes``. Rows are sorted by (round, src, dst, tensor,
    dst_offset), so a message's pieces are contiguous rows.
    """

    plan: Plan
    group_size: int
    num_rounds: int
    tensor_names: tuple[str, ...]
    columns: Mapping[str, np.ndarray]
    messages: tuple[Message, ...]  # sorted by (round, src, dst)
    _sends: Mapping[int, tuple[Message, ...]] = field(repr=False)
    _recvs: Mapping[int, tuple[Message, ...]] = field(repr=False)

    def sends(self, rank: int) -> tuple[Message, ...]:
        """Messages group rank ``rank`` sends, by round, then receiver."""
        return self._sends.get(rank, ())

    def recvs(self, rank: int) -> tuple[Message, ...]:
        """Messages group rank ``rank`` receives, by round, then sender."""
        return self._recvs.get(rank, ())

    def rows(self, rank: int, kind: int) -> np.ndarray:
        """Piece rows of kind ``kind`` (``planner.LOCAL`` ...) that new rank ``rank`` receives."""
        c = self.columns
        return np.flatnonzero((c["dst"] == rank) & (c["kind"] == kind))

    def bytes_by_kind(self) -> dict[str, int]:
        """Bytes of every kind over all ranks (the plan's ``PlanStats`` counts)."""
        c = self.columns
        return {KIND_NAMES[k]: int(c["nbytes"][c["kind"] == k].sum()) for k in range(len(KIND_NAMES))}

    def old_rank_of(self, rank: int) -> int | None:
        """The old rank group rank ``rank`` ran (None for a fresh joiner)."""
        alive = self.plan.alive
        return alive[rank] if rank < len(alive) else None


def exchange_plan(plan: Plan, *, rounds: Schedule | Sequence[Sequence[Transfer]] | None = None) -> ExchangePlan:
    """The exchange every rank computes alike from ``plan`` (pure, deterministic).

    ``rounds``: None sends every peer piece in one round; a :class:`~tenplex.planning.schedule.Schedule`
    of this plan (or its ``rounds()``) sends each piece in the round in which the schedule
    delivers it to its new rank (pieces split where the schedule's chunks split them). Sources
    stay the plan's (the schedule's own source choice and relays are not followed), so the bytes
    sent equal the plan's peer bytes exactly.
    """
    c = plan.columns
    alive = list(plan.alive)
    n_new = plan.new.world_size
    group_size = max(n_new, len(alive))
    proc = np.full(plan.old.world_size + 1, -1, dtype=np.int64)  # last slot: no holder (-1)
    proc[alive] = np.arange(len(alive))
    kind = np.asarray(c["kind"], dtype=np.int64)
    dst = np.asarray(c["new_rank"], dtype=np.int64)
    peer = (kind == SAME_HOST) | (kind == CROSS_HOST)
    src = np.where(kind == STORAGE, -1, np.where(kind == LOCAL, dst, proc[c["src_rank"]]))
    if np.any(peer & ((src < 0) | (src == dst))):
        raise PlanError("a peer move of the plan comes from a dead rank or from its receiver; the plan and its "
                        "alive set disagree")
    if np.any((kind == LOCAL) & (proc[c["src_rank"]] != dst)):
        raise PlanError("a local move of the plan is not on its new rank's device; the plan is inconsistent")
    cols: dict[str, np.ndarray] = {
        "round": np.where(peer, 0, -1), "src": src, "dst": dst, "tensor": np.asarray(c["tensor"], dtype=np.int64),
        "kind": kind, "src_offset": np.asarray(c["src_offset"], dtype=np.int64),
        "dst_offset": np.asarray(c["dst_offset"], dtype=np.int64), "start": np.asarray(c["start"], dtype=np.int64),
        "length": np.asarray(c["length"], dtype=np.int64), "nbytes": np.asarray(c["nbytes"], dtype=np.int64),
    }
    if rounds is not None and peer.any():
        cols = _split_by_rounds(plan, cols, peer, rounds)
    # drop rounds no peer piece uses, renumber the rest 0, 1, ...
    used, inv = np.unique(cols["round"], return_inverse=True)
    cols["round"] = inv - (1 if len(used) and used[0] == -1 else 0)
    num_rounds = int(np.sum(used >= 0))
    order = np.lexsort((cols["dst_offset"], cols["tensor"], cols["dst"], cols["src"], cols["round"]))
    cols = {k: v[order] for k, v in cols.items()}
    for v in cols.values():
        v.setflags(write=False)
    msgs = _messages(cols)
    sends: dict[int, list[Message]] = {}
    recvs: dict[int, list[Message]] = {}
    for m in msgs:
        sends.setdefault(m.src, []).append(m)
        recvs.setdefault(m.dst, []).append(m)
    return ExchangePlan(plan, group_size, num_rounds, plan.tensor_names, cols, tuple(msgs),
                        {k: tuple(v) for k, v in sends.items()}, {k: tuple(v) for k, v in recvs.items()})


def _messages(cols: Mapping[str, np.ndarray]) -> list[Message]:
    """One message per (round, src, dst) of the peer rows (contiguous after the sort)."""
    rows = np.flatnonzero(cols["round"] >= 0)
    if not len(rows):
        return []
    r, s, d = cols["round"][rows], cols["src"][rows], cols["dst"][rows]
    head = np.ones(len(rows), dtype=bool)
    head[1:] = (r[1:] != r[:-1]) | (s[1:] != s[:-1]) | (d[1:] != d[:-1])
    firsts = np.flatnonzero(head)
    bounds = np.append(firsts, len(rows))
    nb = np.add.reduceat(cols["nbytes"][rows], firsts)
    return [Message(int(r[a]), int(s[a]), int(d[a]), int(rows[a]), int(rows[b - 1]) + 1, int(n))
            for a, b, n in zip(firsts.tolist(), bounds[1:].tolist(), nb.tolist())]


def _split_by_rounds(plan: Plan, cols: dict[str, np.ndarray], peer: np.ndarray,
                     rounds: Schedule | Sequence[Sequence[Transfer]]) -> dict[str, np.ndarray]:
    """Peer rows split at the schedule's delivery boundaries, each part in its delivery round."""
    transfers = rounds.rounds() if hasattr(rounds, "rounds") else rounds
    index = {name: i for i, name in enumerate(plan.tensor_names)}
    got: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for i, rnd in enumerate(transfers):
        for t in rnd:
            if not t.new_ranks or t.length <= 0 or t.tensor not in index:
                continue
            for r in t.new_ranks:
                got.setdefault((index[t.tensor], int(r)), []).append((int(t.start), int(t.start) + int(t.length), i))
    deliveries: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    for key, ivs in got.items():  # disjoint intervals, the earliest round winning overlaps
        ivs.sort(key=lambda x: (x[0], x[2]))
        out: list[tuple[int, int, int]] = []
        end = -1
        for a, b, rd in ivs:
            a = max(a, end)
            if b > a:
                out.append((a, b, rd))
                end = b
        arr = np.array(out, dtype=np.int64).reshape(-1, 3)
        deliveries[key] = (arr[:, 0], arr[:, 1], arr[:, 2])
    prow = np.flatnonzero(peer)
    korder = np.lexsort((cols["dst"][prow], cols["tensor"][prow]))
    prow = prow[korder]
    kt, kd = cols["tensor"][prow], cols["dst"][prow]
    head = np.ones(len(prow), dtype=bool)
    head[1:] = (kt[1:] != kt[:-1]) | (kd[1:] != kd[:-1])
    bounds = np.append(np.flatnonzero(head), len(prow))
    parts: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        rows = prow[a:b]
        key = (int(kt[a]), int(kd[a]))
        empty = np.zeros(0, dtype=np.int64)
        d_start, d_end, d_round = deliveries.get(key, (empty, empty, empty))
        qi, ci, ps, pe = intersect(cols["start"][rows], cols["length"][rows], d_start, d_end)
        if int((pe - ps).sum()) != int(cols["length"][rows].sum()):
            raise PlanError(f"the schedule's rounds do not deliver every piece of {plan.tensor_names[key[0]]} that "
                            f"new rank {key[1]} needs; schedule this plan (schedule(plan, topology))")
        parts.append((rows[qi], ps, pe, d_round[ci]))
    rows = np.concatenate([p[0] for p in parts])
    ps = np.concatenate([p[1] for p in parts])
    pe = np.concatenate([p[2] for p in parts])
    rnd = np.concatenate([p[3] for p in parts])
    itemsize = cols["nbytes"][rows] // np.maximum(cols["length"][rows], 1)
    shift = ps - cols["start"][rows]
    split = {k: v[rows] for k, v in cols.items()}
    split.update(round=rnd, start=ps, length=pe - ps, nbytes=(pe - ps) * itemsize,
                 src_offset=split["src_offset"] + shift, dst_offset=split["dst_offset"] + shift)
    rest = ~peer
    return {k: np.concatenate([cols[k][rest], split[k]]) for k in cols}


# ---------------------------------------------------------------------------------------------
# storage: pieces whose every holder died
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class StorageRead:
    """What a rank read from storage: ``bytes_needed`` (the pieces' bytes), ``bytes_read``
    (fetched, checksum blocks included), ``ranges`` and the checkpoint step."""

    bytes_needed: int
    bytes_read: int
    ranges: int
    step: int


def storage_items(saved: PTC, saved_layout: Any, cfg: Layout, rank: int,
                  pieces: Sequence[tuple[str, int, int]], *,
                  writers: Mapping[int, list[Any]] | None = None) -> tuple[ReadItem, ...]:
    """``plan_reads`` of rank ``rank`` under ``cfg`` restricted to ``pieces`` ``(tensor, global
    start, length)`` (pure): the items that read exactly those elements, into the rank's flat buffers."""
    want: dict[str, list[tuple[int, int]]] = {}
    for name, start, length in pieces:
        if length > 0:
            want.setdefault(name, []).append((start, start + length))
    items = plan_reads(saved, saved_layout, cfg, rank, writers=writers)
    out: list[ReadItem] = []
    by_tensor: dict[str, list[ReadItem]] = {}
    for it in items:
        if it.tensor in want:
            by_tensor.setdefault(it.tensor, []).append(it)
    for name, ivs in want.items():
        ivs.sort()
        w_start = np.array([a for a, _ in ivs], dtype=np.int64)
        w_end = np.array([b for _, b in ivs], dtype=np.int64)
        if np.any(w_end[:-1] > w_start[1:]):
            raise PlanError(f"{name}: storage pieces of rank {rank} overlap")
        its = by_tensor.get(name, [])
        q_start = np.array([it.chunk_start + it.a for it in its], dtype=np.int64)
        q_len = np.array([it.length for it in its], dtype=np.int64)
        qi, _, ps, pe = intersect(q_start, q_len, w_start, w_end)
        if int((pe - ps).sum()) != int((w_end - w_start).sum()):
            raise PlanError(f"{name}: rank {rank} under {cfg} does not hold every storage piece it was given")
        for q, s, e in zip(qi.tolist(), ps.tolist(), pe.tolist()):
            it = its[q]
            a = s - it.chunk_start
            out.append(dataclasses.replace(it, dst=it.dst + (a - it.a), a=a, b=e - it.chunk_start))
    return tuple(out)


def read_storage_pieces(url: str, ptc: PTC, cfg: Layout, rank: int,
                        pieces: Sequence[tuple[str, int, int]], buffers: Mapping[str, torch.Tensor], *,
                        step: int | None = None, storage_options: Mapping[str, Any] | None = None) -> StorageRead:
    """Read ``pieces`` ``(tensor, global start, length)`` of rank ``rank``'s shard under ``cfg``
    into its flat CPU ``buffers`` from the newest complete checkpoint under ``url`` that verifies
    (of ``step`` when given), and nothing else. The checkpoint must hold ``ptc``'s model; it is
    the caller's business that it holds the same state as the live ranks."""
    fs, root = url_fs(url, storage_options)
    scan = [(i, m) for i, m in scan_attempts(fs, root) if i.complete and (step is None or i.step == step)]
    problems: list[str] = []
    for info, manifest in reversed(scan):
        try:
            full = manifest.full()  # type: ignore[union-attr]
            saved = full.ptc
            assert saved is not None
            check_model(saved, ptc, f"{url} step {info.step}")
            writers = writer_assignment(saved, full.layout)
            items = storage_items(saved, full.layout, cfg, rank, pieces, writers=writers)
            reader = PartReader(fs, info.path, Binding.of(full, writers))
            try:
                reader.read_items(items, buffers, rank=rank, on_read=lambda i: None)
            finally:
                reader.close()
        except CheckpointCorruptError as e:
            log.warning("checkpoint %s step %d (save %s) does not verify, trying an older one: %s", url, info.step,
                        info.save_id, e)
            problems.append(f"step {info.step} ({info.save_id}): {e}")
            continue
        needed = sum(it.length * it.itemsize for it in items)
        return StorageRead(needed, reader.bytes_read, reader.ranges, info.step)
    what = "" if step is None else f" of step {step}"
    if problems:
        raise CheckpointCorruptError(f"no complete checkpoint{what} under {url} verifies: " + "; ".join(problems))
    raise CheckpointNotFoundError(f"no complete checkpoint{what} under {url} to read the pieces no survivor holds")


# ---------------------------------------------------------------------------------------------
# the torch.distributed adapter
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class MigrateResult:
    """A rank's new shard and what it took.

    ``bytes_sent`` / ``bytes_received``: bytes this rank sent to / received from peers;
    ``bytes_local``: copied in its own memory; ``bytes_storage``: the pieces read from storage
    (``storage_read`` has the bytes fetched). ``timings``: seconds of ``plan``, ``local``,
    ``transfer`` (the rounds), ``storage`` (overlapping the transfer) and ``finish``.
    """

    shard: dict[str, Any]
    new_rank: int | None
    bytes_sent: int
    bytes_received: int
    bytes_local: int
    bytes_storage: int
    rounds: int
    seconds: float
    storage_read: StorageRead | None = None
    timings: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class MigrationInputs:
    """The optional inputs of ``migrate`` (its keywords override these fields).

    ``group``: the migration group (default: the default group); ``old_rank`` / ``new_rank``: this
    process's ranks, checked against the group's; ``storage``: a checkpoint URL for pieces no
    survivor holds (``step``: which one, default the newest complete; ``storage_options``);
    ``device``: where buffers live (default: the current CUDA device under nccl, else the CPU).
    ``into``: this rank's new local tensors by name (a state dict built for the new layout: its local
    shards), which the move writes in place where shape, dtype and device match; the result's shard
    then holds those tensors (a natural-order one receives its pieces straight into its memory, a
    panel-ordered one gets one copy from the flat buffer: no tensor allocated for it and no second copy
    into the state dict).

    What to send, three alternatives: ``exchange`` (an ``exchange_plan`` computed before, with its
    rounds; ``plan``, if given too, must be the one it was computed from), or ``plan`` (computed
    before) sent in ``rounds`` (a schedule of it; default: all at once), or neither: planned here on
    hosts of ``gpus_per_host`` GPUs. Every rank must use the same."""

    group: Any = None
    old_rank: int | None = None
    new_rank: int | None = None
    gpus_per_host: int = 8
    storage: str | None = None
    step: int | None = None
    storage_options: Mapping[str, Any] | None = None
    rounds: Schedule | Sequence[Sequence[Transfer]] | None = None
    plan: Plan | None = None
    exchange: ExchangePlan | None = None
    device: torch.device | str | None = None
    into: Mapping[str, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.gpus_per_host < 1:
            raise ConfigError(f"gpus_per_host must be >= 1, got {self.gpus_per_host}")
        if self.exchange is not None and self.rounds is not None:
            raise ConfigError("exchange= was computed with its rounds (exchange_plan(plan, rounds=...)) and rounds= "
                              "would be ignored: pass one of them")


def _exchange_for(ptc: PTC, old_cfg: Layout, new_cfg: Layout, alive: list[int], o: MigrationInputs,
                  size: int) -> ExchangePlan:
    """The exchange plan of the move (``o``'s, or computed from its plan and rounds, or planned here),
    PlanError unless it moves ``old_cfg`` -> ``new_cfg`` with ``alive`` in a group of ``size``."""
    plan = o.plan
    if plan is None:
        plan = o.exchange.plan if o.exchange is not None else make_plan(ptc, old_cfg, new_cfg, alive=alive,
                                                                        gpus_per_host=o.gpus_per_host)
    if list(plan.alive) != alive or plan.old != old_cfg or plan.new != new_cfg:
        raise PlanError(f"the plan given moves {plan.old} -> {plan.new} with alive {list(plan.alive)}, not "
                        f"{old_cfg} -> {new_cfg} with alive {alive}")
    ex = o.exchange if o.exchange is not None else exchange_plan(plan, rounds=o.rounds)
    if ex.plan is not plan:
        raise PlanError("exchange was computed from another plan than the one given")
    if size != ex.group_size:
        raise PlanError(f"the migration group has {size} ranks but {old_cfg} -> {new_cfg} with {len(alive)} survivors "
                        f"needs {ex.group_size} (max of the new world size and the survivors)")
    return ex


class _Buffers:
    """One rank's side of an exchange: its old shard's bytes (flattened on first use, on
    ``device``), its new shard's flat buffers (padding zeroed; pieces fill the rest; a natural-order
    ``into`` destination's own memory where it is one) and the local copies between them."""

    def __init__(self, ptc: PTC, old_cfg: Layout, new_cfg: Layout, ex: ExchangePlan, rank: int, mine: int | None,
                 held: Mapping[str, Any], device: torch.device, into: Mapping[str, torch.Tensor]) -> None:
        self.ptc, self.old_cfg, self.ex, self.mine, self.held, self.device = ptc, old_cfg, ex, mine, held, device
        self.new_cfg, self.rank = new_cfg, rank
        self.is_new = rank < new_cfg.world_size
        self.flats: dict[str, torch.Tensor] = {}
        self.into: dict[str, torch.Tensor] = {}  # destinations that fit: filled in place (``finish``)
        if self.is_new:
            for name in ptc.rank_tensors(new_cfg, rank):
                segs = ptc.segments(name, new_cfg, rank)
                spec, size = ptc.tensors[name], sum(ln for _, _, ln in segs)
                dst = into.get(name)
                if dst is not None and (tuple(dst.shape) != ptc.local_shape(name, new_cfg, rank)
                                        or dst.dtype != spec.dtype or dst.device != device):
                    dst = None
                if dst is not None:
                    self.into[name] = dst
                if dst is not None and spec.natural and dst.is_contiguous() and size == dst.numel():
                    flat = dst.view(-1)  # its own flat buffer: the pieces go straight into it
                else:
                    flat = torch.empty(size, dtype=spec.dtype, device=device)
                self.flats[name] = flat
                for lo, g, ln in segs:
                    if g == PAD:
                        flat[lo : lo + ln] = 0
        self.dst = {name: f.view(torch.uint8) for name, f in self.flats.items()}
        self.src: dict[str, torch.Tensor] = {}
        self.local_rows = ex.rows(rank, LOCAL) if self.is_new else np.zeros(0, dtype=np.int64)
        self.bytes_local, self.local_s = 0, 0.0

    def name(self, i: int) -> str:
        return self.ex.tensor_names[self.ex.columns["tensor"][i]]

    def byte_range(self, i: int, column: str) -> tuple[int, int]:
        """Bytes of piece ``i`` in its source (``column="src_offset"``) or destination flat."""
        a = int(self.ex.columns[column][i]) * self.ptc.tensors[self.name(i)].itemsize
        return a, a + int(self.ex.columns["nbytes"][i])

    def old_bytes(self, name: str) -> torch.Tensor:
        if name not in self.src:
            if name not in self.held:
                raise PlanError(f"the plan reads {name} from old rank {self.mine}, whose shard lacks it")
            flat = self.ptc.to_local_flat(name, self.held[name].detach(), self.old_cfg, self.mine)
            if flat.device != self.device:
                flat = flat.to(self.device)
            self.src[name] = flat.view(torch.uint8)
        return self.src[name]

    def source(self, i: int) -> torch.Tensor:
        a, b = self.byte_range(i, "src_offset")
        return self.old_bytes(self.name(i))[a:b]

    def destination(self, i: int) -> torch.Tensor:
        x, y = self.byte_range(i, "dst_offset")
        return self.dst[self.name(i)][x:y]

    def finish(self, name: str) -> torch.Tensor:
        """Tensor ``name`` of the new shard, in its natural local shape: its ``into`` destination,
        filled (unless its pieces went straight into it), or a new tensor."""
        flat, dst = self.flats[name], self.into.get(name)
        if dst is None:
            return self.ptc.from_local_flat(name, self.new_cfg, flat, self.rank)
        if flat.data_ptr() != dst.data_ptr():
            self.ptc.from_local_flat(name, self.new_cfg, flat, self.rank, out=dst)
        return dst

    def copy_local(self) -> None:
        t = time.perf_counter()
        for i in self.local_rows.tolist():
            piece = self.source(i)
            self.destination(i).copy_(piece)
            self.bytes_local += piece.numel()
        self.local_s = time.perf_counter() - t


def _run_rounds(dist: Any, buffers: _Buffers, ex: ExchangePlan, rank: int, group: Any,
                gr: Callable[[int], int]) -> tuple[int, int]:
    """The peer rounds (``batch_isend_irecv``, one uint8 buffer per message), local copies during the
    first; bytes (sent, received)."""
    sends, recvs = ex.sends(rank), ex.recvs(rank)
    si = ri = 0
    sent = received = 0
    for rnd in range(ex.num_rounds):
        ops = []
        bufs: list[tuple[Message, torch.Tensor]] = []
        while si < len(sends) and sends[si].round == rnd:
            m = sends[si]
            si += 1
            parts = [buffers.source(i) for i in range(m.first, m.last)]
            ops.append(dist.P2POp(dist.isend, parts[0] if len(parts) == 1 else torch.cat(parts), gr(m.dst), group))
            sent += m.nbytes
        while ri < len(recvs) and recvs[ri].round == rnd:
            m = recvs[ri]
            ri += 1
            if m.last - m.first == 1:  # one piece: straight into its place
                buf = buffers.destination(m.first)
            else:
                buf = torch.empty(m.nbytes, dtype=torch.uint8, device=buffers.device)
                bufs.append((m, buf))
            ops.append(dist.P2POp(dist.irecv, buf, gr(m.src), group))
            received += m.nbytes
        reqs = dist.batch_isend_irecv(ops) if ops else []
        if rnd == 0:
            buffers.copy_local()
        for req in reqs:
            req.wait()
        for m, buf in bufs:
            pos = 0
            for i in range(m.first, m.last):
                dst = buffers.destination(i)
                dst.copy_(buf[pos : pos + dst.numel()])
                pos += dst.numel()
    if ex.num_rounds == 0:
        buffers.copy_local()
    return sent, received


def migrate(ptc: PTC, old_cfg: Layout, new_cfg: Layout, shard: Mapping[str, Any] | None, *, alive: Sequence[int],
            inputs: MigrationInputs | None = None, **overrides: Any) -> MigrateResult:
    """This rank's shard under ``new_cfg``, moved live from the survivors' shards under ``old_cfg``
    (``ParallelConfig`` s, or ``StateLayout`` s of a torch-native state dict over the old and the new
    group's ranks: local tensors by flat key).

    Called by every process of the group (``inputs.group``, default: the default group) together:
    the survivors' new group, group rank i being the process that ran old rank ``alive[i]`` (new
    rank i), fresh joiners after them. ``shard``: what this process holds under ``old_cfg``
    (``{name: local tensor}``, objects included; None or ``{}`` for a fresh joiner). ``inputs``
    (:class:`MigrationInputs`: the group, the storage for pieces no survivor holds, the plan or
    exchange or rounds, the device); keywords override its fields (``migrate(..., alive=a,
    storage=url)``). Objects come from group rank 0's shard (none when no survivor is left).
    A transfer that fails raises MigrationError on that rank; the old shard is never modified.
    """
    import torch.distributed as dist  # lazy: torch.distributed loads its backends at import

    o = with_overrides(inputs or MigrationInputs(), overrides, "migrate")
    t0 = time.perf_counter()
    group = o.group
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    if o.new_rank is not None and o.new_rank != rank:
        raise PlanError(f"new_rank {o.new_rank} is not this process's rank {rank} in the migration group")
    alive = [int(a) for a in alive]
    ex = _exchange_for(ptc, old_cfg, new_cfg, alive, o, size)
    mine = ex.old_rank_of(rank)
    if o.old_rank is not None and o.old_rank != mine:
        raise PlanError(f"group rank {rank} must be the process of old rank alive[{rank}] = {mine}, not {o.old_rank}")
    held: Mapping[str, Any] = (shard or {}) if mine is not None else {}
    if mine is None and shard:
        raise PlanError(f"group rank {rank} is a fresh joiner (beyond the {len(alive)} survivors) but passed a shard")
    c = ex.columns
    if o.storage is None and np.any(c["kind"] == STORAGE):  # every rank sees it: none starts sending
        rows = np.flatnonzero(c["kind"] == STORAGE)
        raise PlanError(f"new ranks {sorted(set(c['dst'][rows].tolist()))} need {int(c['nbytes'][rows].sum())} bytes "
                        f"that no survivor holds (e.g. {ex.tensor_names[c['tensor'][rows[0]]]}); pass storage= a "
                        "checkpoint URL")
    backend = dist.get_backend(group)
    device = o.device
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    device = torch.device(device)
    t_plan = time.perf_counter()

    def gr(r: int) -> int:
        return r if group is None else dist.get_global_rank(group, r)

    # objects first: the first collective every rank joins (nccl's communicator comes up here)
    box = [{k: held[k] for k in ptc.objects if k in held} if rank == 0 else None]
    try:
        dist.broadcast_object_list(box, src=gr(0), group=group, device=device if backend == "nccl" else None)
    except RuntimeError as e:  # gloo/nccl report a dead or broken peer as RuntimeError
        raise MigrationError(f"live migration {old_cfg} -> {new_cfg} failed on group rank {rank} before any "
                             f"transfer: {e}") from e
    objects: dict[str, Any] = dict(box[0] or {})
    buffers = _Buffers(ptc, old_cfg, new_cfg, ex, rank, mine, held, device, o.into or {})

    # storage pieces, read while the rounds run
    t_rounds = time.perf_counter()
    st_rows = ex.rows(rank, STORAGE) if buffers.is_new else np.zeros(0, dtype=np.int64)
    pool: ThreadPoolExecutor | None = None
    st_future = None
    st_seconds = [0.0]
    if len(st_rows):
        pieces = [(buffers.name(i), int(c["start"][i]), int(c["length"][i])) for i in st_rows.tolist()]
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tenplex-migrate-storage")
        st_future = pool.submit(_read_storage, o.storage, ptc, new_cfg, rank, pieces, buffers.flats, st_rows, ex,
                                device, o.step, o.storage_options, st_seconds)
    try:
        sent, received = _run_rounds(dist, buffers, ex, rank, group, gr)
    except RuntimeError as e:  # gloo/nccl report a dead or broken peer as RuntimeError
        raise MigrationError(f"live migration {old_cfg} -> {new_cfg} failed on group rank {rank}: {e}") from e
    finally:
        if pool is not None:
            pool.shutdown(wait=True)
    t_transfer = time.perf_counter()
    storage_read = st_future.result() if st_future is not None else None
    out: dict[str, Any] = {}
    if buffers.is_new:
        out = {name: buffers.finish(name) for name in buffers.flats}
        out.update(objects)
    t_end = time.perf_counter()
    timings = {"plan": t_plan - t0, "local": buffers.local_s, "transfer": t_transfer - t_rounds - buffers.local_s,
               "storage": st_seconds[0], "finish": t_end - t_transfer}
    bytes_storage = int(c["nbytes"][st_rows].sum()) if len(st_rows) else 0
    log.info("migrated rank %d %s -> %s in %.3fs: sent %d B, received %d B, local %d B, storage %d B, %d rounds",
             rank, old_cfg, new_cfg, t_end - t0, sent, received, buffers.bytes_local, bytes_storage, ex.num_rounds)
    return MigrateResult(out, rank if buffers.is_new else None, sent, received, buffers.bytes_local, bytes_storage,
                         ex.num_rounds, t_end - t0, storage_read, timings)


def _read_storage(url: str, ptc: PTC, cfg: Layout, rank: int, pieces: list[tuple[str, int, int]],
                  flats: Mapping[str, torch.Tensor], rows: np.ndarray, ex: ExchangePlan, device: torch.device,
                  step: int | None, storage_options: Mapping[str, Any] | None, seconds: list[float]) -> StorageRead:
    """Read the storage pieces into ``flats`` (through CPU buffers when they live on a device)."""
    t0 = time.perf_counter()
    if device.type == "cpu":
        result = read_storage_pieces(url, ptc, cfg, rank, pieces, flats, step=step, storage_options=storage_options)
    else:
        names = sorted({p[0] for p in pieces})
        host = {n: torch.empty(flats[n].numel(), dtype=flats[n].dtype) for n in names}
        result = read_storage_pieces(url, ptc, cfg, rank, pieces, host, step=step, storage_options=storage_options)
        c = ex.columns
        for i in rows.tolist():
            name = ex.tensor_names[c["tensor"][i]]
            a, n = int(c["dst_offset"][i]), int(c["length"][i])
            flats[name][a : a + n].copy_(host[name][a : a + n])
    if result.bytes_needed != int(ex.columns["nbytes"][rows].sum()):
        raise PlanError(f"rank {rank} read {result.bytes_needed} bytes from storage, the plan says "
                        f"{int(ex.columns['nbytes'][rows].sum())}")
    seconds[0] = time.perf_counter() - t0
    return result
