"""What a schedule is: chunks on links per epoch (:class:`Schedule`), and one hop of it as a
transport runs it (:class:`Transfer`, from :meth:`Schedule.rounds`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import PlanError
from ..planner import Plan
from ..topology import Topology
from .arrays import Columns
from .commodities import Demands
from .simulator import simulate

HOP_COLUMNS = ("hop_chunk", "hop_link", "hop_parent", "hop_first", "hop_last", "hop_arrival", "slice_hop",
               "slice_epoch", "slice_nbytes")


@dataclass(frozen=True, slots=True)
class Transfer:
    """One hop of one chunk: ``nbytes`` of ``tensor`` elements ``[start, start + length)`` over ``src -> dst``.

    ``round``: the epoch the hop starts in. ``src_rank``: the old rank sending it when ``src``
    is its GPU (-1 for host memory, storage or relays). ``new_ranks``: the new ranks on
    ``dst`` that keep the piece (empty when ``dst`` only forwards it).
    """

    round: int
    src: str
    dst: str
    tensor: str
    start: int
    length: int
    nbytes: int
    chunk: int
    src_rank: int
    new_ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True, eq=False)  # numpy fields: identity, not value, equality
class Schedule:
    """Chunks assigned to links per epoch.

    Hop columns (one row per chunk and link): ``hop_chunk``, ``hop_link``, ``hop_parent``
    (the hop that brought the chunk to this link's tail, -1 at a source), ``hop_first`` /
    ``hop_last`` (epochs the chunk is on the link), ``hop_arrival`` (first epoch it can leave
    the link's head). Slice columns (``slice_hop``, ``slice_epoch``, ``slice_nbytes``): bytes
    a hop sends in each epoch. Both are ``hops`` (:data:`HOP_COLUMNS`, read as attributes),
    which a naive schedule too large to render within the time limit renders on first read
    (``hops.built``). A chunk is ``chunk_nbytes`` bytes of commodity
    ``chunk_commodity`` starting at byte ``chunk_offset`` of the commodity's pieces.
    ``method``: the one that made it; ``"naive"``: the naive baseline's transfers, one commodity
    per (source, destination) pair, which :func:`simulate` runs as the naive model does.
    """

    plan: Plan | None
    topology: Topology
    demands: Demands
    method: str
    tau: float
    chunk_bytes: int
    chunk_commodity: np.ndarray
    chunk_offset: np.ndarray
    chunk_nbytes: np.ndarray
    hops: Columns
    solve_seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.hops.names != HOP_COLUMNS:
            raise PlanError(f"a schedule needs the hop columns {HOP_COLUMNS}, got {self.hops.names}")

    @property
    def hop_chunk(self) -> np.ndarray:
        return self.hops["hop_chunk"]

    @property
    def hop_link(self) -> np.ndarray:
        return self.hops["hop_link"]

    @property
    def hop_parent(self) -> np.ndarray:
        return self.hops["hop_parent"]

    @property
    def hop_first(self) -> np.ndarray:
        return self.hops["hop_first"]

    @property
    def hop_last(self) -> np.ndarray:
        return self.hops["hop_last"]

    @property
    def hop_arrival(self) -> np.ndarray:
        return self.hops["hop_arrival"]

    @property
    def slice_hop(self) -> np.ndarray:
        return self.hops["slice_hop"]

    @property
    def slice_epoch(self) -> np.ndarray:
        return self.hops["slice_epoch"]

    @property
    def slice_nbytes(self) -> np.ndarray:
        return self.hops["slice_nbytes"]

    def with_hops(self, **cols: np.ndarray) -> Schedule:
        """This schedule with the hop columns ``cols`` (names of :data:`HOP_COLUMNS`) replaced."""
        bad = sorted(set(cols) - set(HOP_COLUMNS))
        if bad:
            raise PlanError(f"{bad} are not hop columns ({HOP_COLUMNS})")
        hops = Columns(HOP_COLUMNS, {n: cols.get(n, self.hops[n]) for n in HOP_COLUMNS})
        return dataclasses.replace(self, hops=hops)

    @property
    def num_epochs(self) -> int:
        return int(self.hop_arrival.max()) if len(self.hop_arrival) else 0

    @property
    def makespan_s(self) -> float:
        """Completion in whole epochs (``num_epochs * tau``)."""
        return self.num_epochs * self.tau

    @property
    def completion_s(self) -> float:
        """Completion when every link runs its chunks as soon as possible in schedule order (:func:`simulate`)."""
        return simulate(self)

    def completion_bounds(self) -> tuple[float, float]:
        """``(low, high)`` of :attr:`completion_s` without computing what the scheduler could not:
        a naive schedule whose max-min fair completion was cut short at the time limit
        (``info["naive_bounds_s"]``, at 16,384 GPUs: hundreds of thousands of flow ends) gives
        those bounds, one with ``info["naive_s"]`` that value, any other its simulated completion
        twice."""
        if self.method == "naive" and "naive_bounds_s" in self.info:
            lo, hi = self.info["naive_bounds_s"]
            return float(lo), float(hi)
        if self.method == "naive" and "naive_s" in self.info:
            return float(self.info["naive_s"]), float(self.info["naive_s"])
        c = self.completion_s
        return c, c

    def __repr__(self) -> str:
        if not self.hops.built:  # (rendering them takes seconds at 131,072 GPUs)
            return (f"Schedule({self.method}: {len(self.chunk_nbytes)} chunks of <= {self.chunk_bytes} B, "
                    f"hops rendered when read, epochs of {self.tau * 1e3:.3f} ms)")
        return (f"Schedule({self.method}: {len(self.chunk_nbytes)} chunks of <= {self.chunk_bytes} B, "
                f"{len(self.hop_chunk)} hops, {self.num_epochs} epochs of {self.tau * 1e3:.3f} ms)")

    def rounds(self) -> list[list[Transfer]]:
        """The hops grouped by starting epoch, epochs in order (empty ones skipped).

        A transport runs the rounds one after another; inside a round it may run every
        transfer at once. A transfer's data is at its ``src`` before its round starts.
        """
        d = self.demands
        names = self.plan.tensor_names if self.plan is not None else ()
        itemsize = np.where(d.piece_length > 0, d.piece_nbytes // np.maximum(d.piece_length, 1), 1)
        starts = [np.concatenate([[0], np.cumsum(d.piece_nbytes[c.pieces])]) for c in d.commodities]
        dev_ranks: dict[str, list[int]] = {}
        if self.plan is not None:
            for r, dev in enumerate(self.plan.devices):
                dev_ranks.setdefault(f"gpu{int(dev)}", []).append(r)
        by_epoch: dict[int, list[Transfer]] = {}
        lk = self.topology.links
        order = np.lexsort((self.hop_chunk, self.hop_first))
        for h in order:
            c = int(self.hop_chunk[h])
            k = int(self.chunk_commodity[c])
            com = d.commodities[k]
            a = int(self.chunk_offset[c])
            b = a + int(self.chunk_nbytes[c])
            link = lk[int(self.hop_link[h])]
            src_rank = -1
            if self.hop_parent[h] < 0 and link.src.startswith("gpu"):
                src_rank = int(link.src[3:])
            keep = tuple(dev_ranks.get(link.dst, ())) if link.dst in com.dests else ()
            pre = starts[k]
            i0 = int(np.searchsorted(pre, a, side="right")) - 1
            while i0 < len(com.pieces) and pre[i0] < b:
                p = int(com.pieces[i0])
                sz = int(itemsize[p])
                # chunk bounds need not fall between elements (pieces of other item sizes come
                # first): an element goes with the chunk that holds its first byte
                e0 = -(-(max(a, int(pre[i0])) - int(pre[i0])) // sz)
                e1 = -(-(min(b, int(pre[i0 + 1])) - int(pre[i0])) // sz)
                if e1 > e0:
                    tensor = names[int(d.piece_tensor[p])] if names else str(int(d.piece_tensor[p]))
                    by_epoch.setdefault(int(self.hop_first[h]), []).append(Transfer(
                        int(self.hop_first[h]), link.src, link.dst, tensor, int(d.piece_start[p]) + e0, e1 - e0,
                        (e1 - e0) * sz, c, src_rank, tuple(r for r in keep if self._rank_needs(r, p))))
                i0 += 1
        return [by_epoch[e] for e in sorted(by_epoch)]

    def _rank_needs(self, new_rank: int, piece: int) -> bool:
        if self.plan is None:
            return True
        return bool(np.any(self.plan.columns["new_rank"][self.demands.rows_of(piece)] == new_rank))

    def to_json(self) -> dict[str, Any]:
        return {"method": self.method, "tau_s": self.tau, "chunk_bytes": self.chunk_bytes,
                "chunks": len(self.chunk_nbytes), "hops": len(self.hop_chunk), "epochs": self.num_epochs,
                "commodities": len(self.demands.commodities), "solve_s": self.solve_seconds, **self.info}
