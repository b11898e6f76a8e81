"""The entry point: :func:`schedule` builds the greedy schedule, tries the LP and the MILP in the
time left and returns the best by simulated completion."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from typing import Any

import numpy as np

from ...errors import PlanError
from ..planner import LOCAL, Plan
from ..topology import Topology
from .arrays import Columns
from .bounds import lower_bound
from .commodities import Demands, commodity_nbytes, demands
from .listsched import Chunks, list_schedule, split_chunks
from .naive import NaiveFlows, naive_flows
from .result import HOP_COLUMNS, Schedule
from .routes import Option, Routes, greedy_choices, greedy_routes, net_of, route_options
from .simulator import simulate, store_and_forward
from .solvers import assign_greedy, assign_lp, solve_milp, static_lp

log = logging.getLogger(__name__)

METHODS = ("auto", "milp", "lp", "greedy")
_MAX_CHUNKS = 20000
_TARGET_CHUNKS = 2000
_TARGET_EPOCHS = 128
_PACE = 0.9  # sources release chunks at this fraction of the lower bound's pace (see _schedule_demands)
_GOOD_ENOUGH = 1.03  # auto stops at the greedy schedule when it is this close to the lower bound
_NET_CELLS = 2500**2  # topology nodes^2 up to which auto builds greedy routes (routes.net_of's tables)
_TOO_LARGE = "topology too large for its tables"
_DEMANDS_S_PER_MOVE = 1e-6  # seconds `demands` takes per non-local move at least (1.2-1.4 us measured), to skip it
_RESERVE = 0.05  # share of the limit kept back after the naive bounds (building the schedule object)
# costs of the naive-only path's optional steps, as multiples of the steps it has just timed (so that
# they scale with the machine's load; issue #20, measured at 16,384 and 131,072 GPUs under load 6):
_LB_PER_FLOWS = 4.0  # demands + lower bound over naive_flows: 1.5x to 2.6x of CPU (16,384 GPUs, ZeRO-1)
_LB_ONLY_PER_FLOWS = 0.6  # the lower bound of given demands over naive_flows: 0.1x to 0.5x
_SF_PER_RENDER = 0.5  # store_and_forward over the rendering: 0.31 to 0.38
_BOUNDS_PER_RENDER = 0.35  # the naive bounds' set-up and cut-short over the rendering: 0.26 to 0.27
_BOUNDS_PER_FLOOR = 5.5  # the same over the naive floor (the flows' links): 4.2 to 5.5 at 131,072 GPUs
_CUT_PER_FLOOR = 1.5  # the cut-short alone (bounds from the filling's state, after its deadline): 1.3
_RENDER_PER_FLOOR = 10.0  # the rendering of a hop over the floor's time a link: 9.4 to 10 at 131,072 GPUs
_LATE = 0.5  # auto goes straight to the naive schedule when grouping the demands took this share of the limit


def schedule(plan: Plan | Demands, topology: Topology, *, method: str = "auto", time_limit: float = 10.0,
             chunk_bytes: int | None = None, epochs: int = _TARGET_EPOCHS,
             dem: Demands | None = None) -> Schedule:
    """Schedule a plan's transfers (or bare :class:`Demands`) over ``topology``.

    Returns within about ``time_limit`` seconds: the greedy schedule is built first, the
    solvers get what time remains. ``method="auto"`` keeps the greedy schedule when it is
    within 3 % of the lower bound and otherwise tries the LP, then the MILP, for no longer than
    they could save (the greedy completion minus the lower bound), and only when that budget
    is at least twice what the greedy schedule took (the LP costs more): it never solves for
    seconds to shorten a transfer by milliseconds. Nor does it return a schedule slower than
    the naive baseline (:func:`naive_completion`): where the best one is, it returns the naive
    schedule itself (method ``"naive"``). Where routing cannot fit the limit (a topology beyond
    the greedy routes' tables, or grouping the plan into demands took half the limit) ``auto``
    returns the naive schedule at once: built from the plan's flows (no demands), then the
    lower bound when there is time for it and the naive completion, or its bounds when the
    limit cuts it short (:meth:`Schedule.completion_bounds`). ``chunk_bytes``: size pieces are
    split into (default: total bytes / 2000 as a power of two, at least 4 KiB; fewer chunks
    under a limit below 0.5 s). ``epochs``: target number of epochs of the list-scheduled methods. ``dem``:
    demands computed before by :func:`demands`.
    """
    if isinstance(plan, Demands):
        dem, plan = plan, None
    if method not in METHODS:
        raise PlanError(f"unknown schedule method {method!r}: use one of {', '.join(METHODS)}")
    if time_limit <= 0:
        raise PlanError(f"time_limit must be positive, got {time_limit}")
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    if dem is None and plan is not None and method == "auto" and _too_large(topology):
        # the naive schedule straight from the plan: grouping millions of moves into demands takes
        # longer than the limit (issue #20: 8 s at 16,384 GPUs); they give the lower bound when
        # there is time left for them
        return _naive_only(plan, topology, None, t0, deadline, chunk_bytes, epochs, _TOO_LARGE)
    if dem is None:
        assert plan is not None
        dem = demands(plan, topology)
    return _schedule_demands(plan, topology, dem, method, t0, deadline, chunk_bytes, epochs)


def _empty(plan: Plan | None, topology: Topology, dem: Demands, method: str, chunk_bytes: int, t0: float) -> Schedule:
    """The schedule of nothing to move."""
    empty = np.zeros(0, dtype=np.int64)
    cols = {k: np.zeros(0) if k == "slice_nbytes" else empty for k in HOP_COLUMNS}
    return Schedule(plan, topology, dem, method, 1.0, chunk_bytes, empty, empty, empty, Columns(HOP_COLUMNS, cols),
                    solve_seconds=time.perf_counter() - t0, info={"lower_bound_s": 0.0})


def _too_large(topology: Topology) -> bool:
    """Beyond the greedy routes' tables: fastest paths of nodes^2 x path length (issue #20: 64 s
    and GBs at 512 hosts), where the naive flows need a Dijkstra per source portal."""
    return len(topology.node_names) ** 2 > _NET_CELLS


def _naive_only(plan: Plan | None, topology: Topology, dem: Demands | None, t0: float, limit_at: float,
                chunk_bytes: int | None, epochs: int, why: str) -> Schedule:
    """The naive schedule without trying the solvers (``why``: the reason, ``info["greedy_skipped"]``):
    its flows first, then, in the time left, the steps whose cost (predicted from the flows, their
    floor and the rendering just timed) fits before the naive bounds' fixed cost: the rendering of
    its hops (else they are rendered on first read: ``s.hops.built``), the store-and-forward
    figure, the lower bound (grouping the plan into demands first where ``dem`` is not given), and
    the naive completion or its bounds. ``info["skipped"]`` / ``info["lower_bound_skipped"]`` name
    what did not fit."""
    source: Plan | Demands = plan if plan is not None else dem  # type: ignore[assignment]
    t_flows = time.perf_counter()
    flows = naive_flows(source, topology)
    t_flows = time.perf_counter() - t_flows
    if not len(flows.nbytes):
        return _empty(plan, topology, flows.demands, "naive", chunk_bytes or 4096, t0)
    t_floor = time.perf_counter()
    floor = flows.floor(topology)
    t_floor = time.perf_counter() - t_floor
    info: dict[str, Any] = {"lower_bound_s": None, "candidates": {}, "greedy_skipped": why, "naive_floor_s": floor}
    chunk_bytes = _chunk_bytes(chunk_bytes, flows.demands.bytes_unique, limit_at)
    end = limit_at - _RESERVE * (limit_at - t0)
    # the naive bounds' set-up and cut-short, and the rendering, scale with the flows' links (the
    # floor's work) and the hops (a flow's links per chunk)
    per_chunk = -(-commodity_nbytes(flows.demands) // _capped(flows.demands, chunk_bytes))
    n_hops = int((np.maximum(per_chunk, 1) * np.diff(flows.ptr)).sum())
    per_link = t_floor / max(len(flows.links), 1)
    keep = _BOUNDS_PER_FLOOR * t_floor
    render_s = _RENDER_PER_FLOOR * per_link * n_hops
    skipped: dict[str, str] = {}
    lazy = time.perf_counter() + render_s + keep >= end
    t_render = time.perf_counter()
    s = _naive_render(plan, topology, flows, floor, chunk_bytes, epochs, lazy=lazy)
    t_render = time.perf_counter() - t_render
    # what is left goes, in this order, to the steps that fit before the naive bounds' own fixed cost:
    # the store-and-forward figure, the demands and lower bound, then the naive filling itself
    if lazy:
        skipped["render"] = f"{n_hops} hops, about {render_s:.1f} s: rendered when read"
        skipped["store_and_forward"] = f"about {(1 + _SF_PER_RENDER) * render_s:.1f} s with the rendering"
    else:
        keep = max(keep, _BOUNDS_PER_RENDER * t_render)
        need = _SF_PER_RENDER * t_render
        if time.perf_counter() + need + keep < end:
            s = dataclasses.replace(s, info={"store_and_forward_s": store_and_forward(s)})
        else:
            skipped["store_and_forward"] = f"about {need:.1f} s"
    if dem is None and plan is not None:
        need = max(_LB_PER_FLOWS * t_flows, _DEMANDS_S_PER_MOVE * int(np.count_nonzero(plan.columns["kind"] != LOCAL)))
        if time.perf_counter() + need + keep < end:
            dem = demands(plan, topology)
        else:
            info["lower_bound_skipped"] = f"grouping the plan into demands would take about {need:.1f} s"
    elif dem is not None and time.perf_counter() + _LB_ONLY_PER_FLOWS * t_flows + keep >= end:
        info["lower_bound_skipped"] = f"the lower bound would take about {_LB_ONLY_PER_FLOWS * t_flows:.1f} s"
        dem = None
    if dem is not None:
        info["lower_bound_s"] = lower_bound(dem, topology)
    if skipped:
        info["skipped"] = skipped
    # the progressive filling, where its set-up leaves it time before the cut-short's share; else
    # its bounds at once (an event of millions of flows takes seconds, and the set-up too)
    cut = _CUT_PER_FLOOR * t_floor
    by = end - cut if time.perf_counter() + keep < end else -math.inf
    lo, hi = flows.bounds(topology, deadline=by)
    return _naive_done(s, lo, hi, t0, info)


def _chunk_bytes(chunk_bytes: int | None, total: int, deadline: float) -> int:
    """``chunk_bytes`` as given, or by default fewer chunks when the time limit is short (list
    scheduling is ~50 us a chunk): ``total`` / the target count as a power of two, at least 4 KiB."""
    if chunk_bytes is None:
        target = min(_TARGET_CHUNKS, max(200, int((deadline - time.perf_counter()) * 4000)))
        chunk_bytes = max(4096, 1 << max(0, math.ceil(math.log2(max(total, 1) / target))))
    if chunk_bytes < 1:
        raise PlanError(f"chunk_bytes must be positive, got {chunk_bytes}")
    return chunk_bytes


def _schedule_demands(plan: Plan | None, topology: Topology, dem: Demands, method: str, t0: float,
                      deadline: float, chunk_bytes: int | None, epochs: int) -> Schedule:
    """The demands' chunks list-scheduled by ``method`` (auto: the best of greedy, LP and MILP in the
    time left, never slower than the naive schedule; see :func:`schedule`)."""
    chunk_bytes = _capped(dem, _chunk_bytes(chunk_bytes, dem.bytes_unique, deadline))
    chunks = Chunks.split(dem, chunk_bytes)
    if not len(chunks.commodity):
        return _empty(plan, topology, dem, method, chunk_bytes, t0)
    if method == "auto" and _too_large(topology):
        log.info("%d topology nodes: beyond the greedy routes' tables (%d^2 > %d); the naive schedule",
                 len(topology.node_names), len(topology.node_names), _NET_CELLS)
        return _naive_only(plan, topology, dem, t0, deadline, chunk_bytes, epochs, _TOO_LARGE)
    if method == "auto" and time.perf_counter() - t0 > _LATE * (deadline - t0):
        log.info("%.2fs of the %.2fs limit gone before routing: the naive schedule", time.perf_counter() - t0,
                 deadline - t0)
        return _naive_only(plan, topology, dem, t0, deadline, chunk_bytes, epochs, "time limit")
    run = _Candidates(plan, topology, dem, chunks, epochs)
    t_greedy = run.greedy()
    lp_t = run.improve(method, t0, deadline)
    comp, name, arrays, tau = run.pick(method)
    info: dict[str, Any] = {"lower_bound_s": run.lb, "candidates": {c[1]: c[0] for c in run.candidates}}
    if lp_t is not None:
        info["lp_s"] = lp_t
    if method == "auto":  # never slower than the naive baseline
        naive = run.naive_if_faster(comp, info, t0, deadline - 2 * t_greedy - 0.05 * (deadline - t0), deadline)
        if naive is not None:
            return naive
    s = Schedule(plan, topology, dem, name, tau, chunk_bytes, chunks.commodity, chunks.offset, chunks.nbytes,
                 Columns(HOP_COLUMNS, arrays), solve_seconds=time.perf_counter() - t0, info=info)
    log.info("scheduled %d chunks with %s in %.3fs: %.4fs (lower bound %.4fs)", len(chunks.commodity), name,
             s.solve_seconds, comp, run.lb)
    return s


class _Candidates:
    """The list-scheduled schedules of one set of demands' chunks: greedy always (the fallback),
    then LP and MILP where the method and the time left allow; ``candidates``: (completion, method,
    hop columns, epoch length)."""

    def __init__(self, plan: Plan | None, topology: Topology, dem: Demands, chunks: Chunks, epochs: int) -> None:
        self.plan, self.topology, self.dem, self.chunks, self.epochs = plan, topology, dem, chunks, epochs
        self.chunk_com, self.chunk_nb, self.chunk_idx = chunks.commodity, chunks.nbytes, chunks.index
        self.ref = float(chunks.chunk_bytes)
        small = len(dem.commodities) * max(len(c.sources) for c in dem.commodities) <= 64
        self.opts: list[list[Option]] | None = None
        if small:  # greedy may also take a second, link-avoiding path
            self.opts = route_options(topology, dem, self.ref, alt=True)
            choices = greedy_choices(dem, self.opts, topology, self.ref)
            self.cands = Routes.of([(o.hop_link, o.hop_parent) for cs in choices for o in cs],
                                   np.zeros(0, dtype=np.int64))
            self.cand = np.concatenate([[0], np.cumsum([len(cs) for cs in choices])])
        else:
            self.cands, self.cand = greedy_routes(dem, net_of(topology, self.ref))
        self.lb = lower_bound(dem, topology)
        self.key = _progress(self.chunk_com, self.chunk_idx)
        self.order = np.lexsort((self.chunk_com, self.key))
        # release: chunk j of n leaves its source no earlier than j / n of the way through a slightly
        # faster-than-bound fluid schedule, so queues at shared links fill in priority order, not per source
        self.release = np.floor(self.chunk_idx / np.bincount(self.chunk_com)[self.chunk_com] * _PACE
                                * epochs).astype(np.int64)
        self.tau = max(self.lb, 1e-9) / max(epochs, 1)
        self.candidates: list[tuple[float, str, dict[str, Any], float]] = []

    def finish(self, name: str, arrays: dict[str, Any], tau: float) -> None:
        c = self.chunks
        s = Schedule(self.plan, self.topology, self.dem, name, tau, c.chunk_bytes, c.commodity, c.offset, c.nbytes,
                     Columns(HOP_COLUMNS, arrays))
        self.candidates.append((simulate(s), name, arrays, tau))

    def greedy(self) -> float:
        """The greedy schedule; returns the seconds it took."""
        t = time.perf_counter()
        routes = assign_greedy(self.cands, self.cand, self.chunk_com, self.chunk_nb, self.key, self.order,
                               self.topology)
        self.finish("greedy", list_schedule(self.topology, routes, self.chunk_nb, self.order, self.tau, self.release),
                    self.tau)
        return time.perf_counter() - t

    def improve(self, method: str, t0: float, deadline: float) -> float | None:
        """The LP, then the MILP schedule, as ``method`` asks and by ``deadline``; auto stops as soon
        as one is close enough to the lower bound and never spends longer improving a schedule than
        the improvement could save. Returns the LP schedule's completion (None: none)."""
        done = method == "auto" and self.candidates[0][0] <= _GOOD_ENOUGH * self.lb  # auto: stop improving
        if method == "auto":
            now = time.perf_counter()
            deadline = min(deadline, now + max(self.candidates[0][0] - self.lb, 0.0))
            # the LP takes 3 to 6 times as long as the greedy schedule (benchmark): a budget below
            # twice the time spent so far would be spent without a result
            done = done or deadline - now < 2 * (now - t0)
        lp_t = None
        if method in ("auto", "lp", "milp") and not done and time.perf_counter() < deadline:
            lp_t = self.lp(deadline)
        done = done or (method == "auto" and lp_t is not None and lp_t <= _GOOD_ENOUGH * self.lb)
        if method in ("auto", "milp") and not done and time.perf_counter() < deadline:
            horizon = 1.5 * min(c[0] for c in self.candidates)
            arr = solve_milp(self.topology, self.dem, self.opts, self.chunks, horizon, deadline)
            if arr is not None:
                self.finish("milp", arr, float(arr["tau"]))
        return lp_t

    def lp(self, deadline: float) -> float | None:
        """The fluid LP's routes, list-scheduled; its completion, or None when it did not finish in time."""
        if self.opts is None:
            self.opts = route_options(self.topology, self.dem, self.ref, alt=False)
        frac = static_lp(self.topology, self.dem, self.opts, deadline - time.perf_counter())
        if frac is None or time.perf_counter() >= deadline:
            return None
        routes = assign_lp(self.dem, self.opts, frac, self.chunk_com, self.chunk_idx, self.topology)
        arr = list_schedule(self.topology, routes, self.chunk_nb, self.order, self.tau, self.release)
        if time.perf_counter() >= deadline:
            return None
        self.finish("lp", arr, self.tau)
        return self.candidates[-1][0]

    def pick(self, method: str) -> tuple[float, str, dict[str, Any], float]:
        """The candidate of ``method`` (the fastest where it gave none), or auto's fastest."""
        if method == "auto":
            return min(self.candidates, key=lambda c: (c[0], -len(c[1])))
        wanted = [c for c in self.candidates if c[1] == method]
        pick = wanted[0] if wanted else min(self.candidates, key=lambda c: c[0])
        if not wanted:
            log.warning("method %s gave no schedule in time; falling back to %s", method, pick[1])
        return pick

    def naive_if_faster(self, comp: float, info: dict[str, Any], t0: float, bounds_by: float,
                        limit_at: float) -> Schedule | None:
        """The naive schedule where it may be faster than ``comp`` (the best solved completion), else
        None; ``info`` gains the naive floor and the naive completion (exact where it finishes by
        ``bounds_by``, else its bounds)."""
        flows = naive_flows(self.plan if self.plan is not None else self.dem, self.topology)
        floor = flows.floor(self.topology)
        info["naive_floor_s"] = floor
        if comp <= floor * (1 - 1e-6):  # faster than anything naive can be
            return None
        lo, hi = flows.bounds(self.topology, deadline=bounds_by)
        if lo == hi:
            info["naive_s"] = lo
        else:
            info["naive_bounds_s"] = [lo, hi]
        if comp <= lo:
            return None
        s = _naive_render(self.plan, self.topology, flows, lo, self.chunks.chunk_bytes, self.epochs, deadline=limit_at)
        return _naive_done(s, lo, hi, t0, info)


def _progress(chunk_com: np.ndarray, chunk_idx: np.ndarray) -> np.ndarray:
    """List-scheduling priority of every chunk: chunk j of n of its commodity at (j + 1/2) / n, so
    every commodity is spread evenly over time (fluid rates); ties go by commodity."""
    return (chunk_idx + 0.5) / np.bincount(chunk_com)[chunk_com]


def _capped(dem: Demands, chunk_bytes: int) -> int:
    """``chunk_bytes``, or a larger power of two where it would cut ``dem`` into too many chunks."""
    nb = commodity_nbytes(dem)
    n_chunks = int(np.maximum(1, -(-nb // chunk_bytes)).sum())
    if n_chunks <= _MAX_CHUNKS:
        return chunk_bytes
    new = 1 << math.ceil(math.log2(dem.bytes_unique / _MAX_CHUNKS + 1))
    # a chunk per commodity at least: the naive flows of a large plan (307,783 at 16,384 GPUs) are many
    say = log.info if len(nb) >= _MAX_CHUNKS else log.warning
    say("chunk_bytes=%d gives %d chunks (> %d); using %d", chunk_bytes, n_chunks, _MAX_CHUNKS, new)
    return new


def _naive_render(plan: Plan | None, topology: Topology, flows: NaiveFlows, basis: float, chunk_bytes: int,
                  epochs: int, deadline: float = -math.inf, lazy: bool = False) -> Schedule:
    """The naive baseline as a schedule (method ``"naive"``): its flows' chunks on their shortest
    paths, all released at once and list-scheduled in epochs of ``basis / epochs`` seconds, a
    store-and-forward rendering that :func:`validate` checks and :meth:`Schedule.rounds` orders
    for a transport. Its completion is the naive model's (see :func:`simulate`);
    ``info["store_and_forward_s"]``: that of its epochs (when it is likely to end before ``deadline``;
    the default: never, the caller decides). ``lazy``: the hops are list-scheduled on first read
    (the same ones), not here."""
    dem = flows.demands
    chunk_bytes = _capped(dem, chunk_bytes)
    chunk_com, chunk_off, chunk_nb, chunk_idx = split_chunks(dem, chunk_bytes)
    tau = max(basis, 1e-9) / max(epochs, 1)
    render = functools.partial(_naive_hops, topology, flows, chunk_com, chunk_idx, chunk_nb, tau)
    if lazy:
        return Schedule(plan, topology, dem, "naive", tau, chunk_bytes, chunk_com, chunk_off, chunk_nb,
                        Columns(HOP_COLUMNS, build=render))
    t = time.perf_counter()
    s = Schedule(plan, topology, dem, "naive", tau, chunk_bytes, chunk_com, chunk_off, chunk_nb,
                 Columns(HOP_COLUMNS, render()))
    if time.perf_counter() + _SF_PER_RENDER * (time.perf_counter() - t) >= deadline:
        return s
    return dataclasses.replace(s, info={"store_and_forward_s": store_and_forward(s)})


def _naive_hops(topology: Topology, flows: NaiveFlows, chunk_com: np.ndarray, chunk_idx: np.ndarray,
                chunk_nb: np.ndarray, tau: float) -> dict[str, np.ndarray]:
    """The hop and slice columns of the naive schedule (see :func:`_naive_render`)."""
    n = np.diff(flows.ptr)
    parent = np.arange(len(flows.links)) - np.repeat(flows.ptr[:-1], n) - 1  # one path per flow
    routes = Routes(flows.links, parent, flows.ptr, chunk_com)
    order = np.lexsort((chunk_com, _progress(chunk_com, chunk_idx)))
    return list_schedule(topology, routes, chunk_nb, order, tau, np.zeros(len(chunk_com), dtype=np.int64))


def _naive_done(s: Schedule, lo: float, hi: float, t0: float, info: dict[str, Any]) -> Schedule:
    """The rendered naive schedule with its completion's bounds ``lo`` and ``hi`` (equal: its
    value, ``info["naive_s"]``; else ``info["naive_bounds_s"]``) and the solve time."""
    naive = {"naive": lo} if lo == hi else {}
    info = {**info, **({"naive_s": lo} if lo == hi else {"naive_bounds_s": [lo, hi]}),
            "candidates": {**info["candidates"], **naive}, **s.info}
    s = dataclasses.replace(s, solve_seconds=time.perf_counter() - t0, info=info)
    log.info("scheduled %d chunks with naive in %.3fs: %.4f to %.4fs; the solved ones took longer, or may (%s)",
             len(s.chunk_commodity), s.solve_seconds, lo, hi, info["candidates"])
    return s
