"""The scheduler at scale (issue #20, item 5): the lower bound's host cuts without dense tables,
the packed sorts, the naive rendering within the limit (or on first read: the lazy columns).
Cheap by default (a few seconds in all);
TENPLEX_SCALE_TESTS=1 adds a full re-layout on 2,048 GPUs (about 5 s)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from conftest import examples, failure_plans
from hypothesis import given, settings
from hypothesis import strategies as st

import tenplex
from tenplex import ParallelConfig, PlanError
from tenplex.planning.planner import LOCAL, STORAGE, Plan
from tenplex.planning.schedule import Demands, demands, lower_bound, naive_completion, schedule, validate
from tenplex.planning.schedule.arrays import Columns, sort_order
from tenplex.planning.schedule.result import HOP_COLUMNS
from tenplex.planning.topology import Topology

_NO_LAT = ",".join(f"{k}_lat=0us" for k in ("nvlink", "pcie", "mem", "nic", "storage"))


def _reference_bound(dem: Demands, t: Topology) -> float:
    """The cut bound of :func:`lower_bound` beyond 10 hosts, from sets: every GPU and storage alone,
    every host, and the pairs of hosts joined by a link or holding every source of a commodity."""
    host = {n: t.host_of(n) for n in t.node_names}
    coms = [(set(c.sources), set(c.dests), c.nbytes) for c in dem.commodities]
    cuts = [{n} for n in t.node_names if t.graph.nodes[n]["kind"] in ("gpu", "storage")]
    hosts = sorted({h for h in host.values() if h is not None})
    unions = [{h} for h in hosts]
    linked = {frozenset((host[lk.src], host[lk.dst])) for lk in t.links
              if host[lk.src] is not None and host[lk.dst] is not None and host[lk.src] != host[lk.dst]}
    two = {frozenset(host[x] for x in s) for s, _, _ in coms if None not in {host[x] for x in s}}
    unions += [set(p) for p in linked | two if len(p) == 2]
    cuts += [{n for n in t.node_names if host[n] in u} for u in unions]
    best = 0.0
    for cut in cuts:
        bw_in = sum(lk.bandwidth for lk in t.links if lk.dst in cut and lk.src not in cut)
        bw_out = sum(lk.bandwidth for lk in t.links if lk.src in cut and lk.dst not in cut)
        inn = sum(nb for s, d, nb in coms if not s & cut and d & cut)
        out = sum(nb for s, d, nb in coms if s <= cut and d - cut)
        best = max(best, inn / bw_in if inn else 0.0, out / bw_out if out else 0.0)
    return best


@settings(max_examples=examples(15))
@given(st.data())
def test_host_cuts_equal_the_reference_beyond_ten_hosts(data: st.DataObject) -> None:
    """Issue #20: beyond 10 hosts the lower bound's host cuts come from (set, host) incidences, not
    a (sets, unions) table (13 GB at 16,384 hosts); on random demands over 11 to 16 hosts (sources
    of one, two or more hosts, storage) they equal the cut bound computed from sets. ~2 s."""
    hosts = data.draw(st.integers(11, 16))
    gpus = data.draw(st.sampled_from([1, 2, 4]))
    t = Topology.from_spec(f"hosts={hosts},gpus={gpus},storage=10GB/s,{_NO_LAT}")
    n = hosts * gpus
    flows = []
    for _ in range(data.draw(st.integers(1, 40))):
        nodes = data.draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=6, unique=True))
        k = data.draw(st.integers(1, len(nodes) - 1))
        srcs = ("storage",) if data.draw(st.integers(0, 9)) == 0 else tuple(f"gpu{x}" for x in nodes[:k])
        flows.append((srcs, tuple(f"gpu{x}" for x in nodes[k:]), data.draw(st.integers(1, 10**9))))
    dem = Demands.of(flows)
    assert lower_bound(dem, t) == pytest.approx(_reference_bound(dem, t), rel=1e-12)


def test_sort_order_is_lexsort() -> None:
    """The packed sort orders as ``np.lexsort`` with ties by index, also where the keys do not
    fit one int64 (then it is lexsort)."""
    rng = np.random.default_rng(0)
    for n in (0, 1, 7, 5000):
        a, b, c = rng.integers(0, 5, n), rng.integers(0, 2**20, n), rng.integers(0, 2**45, n)
        for keys in ((a,), (a, b), (b, a, a), (c, b), (c, c)):
            assert np.array_equal(sort_order(*keys), np.lexsort((np.arange(n), *keys[::-1])))


def _relayout(model: str, old: str, new: str, gph: int) -> tuple[Plan, Topology]:
    """``model`` with Adam state re-laid out from ``old`` to ``new``, every GPU alive."""
    ptc = tenplex.model_ptc(model, optimizer=True, distributed_optimizer=True)
    a, b = ParallelConfig.parse(old), ParallelConfig.parse(new)
    w = max(a.world_size, b.world_size)
    return tenplex.plan(ptc, a, b, gpus_per_host=gph), Topology.from_spec(f"hosts={w // gph},gpus={gph}")


@pytest.mark.parametrize("limit", [0.001, 0.3])
def test_naive_only_fits_what_is_left_of_its_limit(monkeypatch: pytest.MonkeyPatch, limit: float) -> None:
    """Issue #20: beyond the greedy tables the scheduler renders the naive schedule, then runs only
    the steps whose predicted cost fits what is left (store-and-forward figure, demands and lower
    bound, the naive filling): under a limit shorter than the rendering it skips them, says so,
    and still returns a valid schedule whose bounds hold the exact naive completion. ~1 s."""
    from tenplex.planning.schedule import scheduler as scheduler_module

    p, t = _relayout("llama-100m", "dp=4,tp=2,pp=4", "dp=8,tp=2,pp=2", 4)
    monkeypatch.setattr(scheduler_module, "_NET_CELLS", 0)
    start = time.perf_counter()
    s = schedule(p, t, time_limit=limit)
    took = time.perf_counter() - start
    assert s.method == "naive"
    validate(s)
    lo, hi = s.completion_bounds()
    naive = naive_completion(p, t)
    assert lo * (1 - 1e-6) <= naive <= hi * (1 + 1e-6)
    if limit < 0.01:  # shorter than the rendering: the optional steps are skipped, named
        assert s.info["lower_bound_s"] is None and "would take about" in s.info["lower_bound_skipped"]
        assert "store_and_forward" in s.info["skipped"] and "store_and_forward_s" not in s.info
    else:
        assert took <= limit + 0.3  # a loaded 2-CPU machine
        assert s.info["lower_bound_s"] == lower_bound(demands(p, t), t) <= naive * (1 + 1e-9)


@pytest.mark.skipif(not os.environ.get("TENPLEX_SCALE_TESTS"), reason="opt-in: TENPLEX_SCALE_TESTS=1 (about 5 s)")
def test_full_relayout_on_2048_gpus_in_its_limit() -> None:
    """A re-layout that moves every byte on 2,048 GPUs (256 hosts, beyond the greedy tables: the
    naive schedule) returns within its 3 s limit plus 1 s, valid, its bounds around its floor."""
    p, t = _relayout("gpt3-2.7b", "dp=16,tp=8,pp=16", "dp=32,tp=8,pp=8", 8)
    start = time.perf_counter()
    s = schedule(p, t, time_limit=3.0)
    assert time.perf_counter() - start <= 4.0
    assert s.method == "naive"
    validate(s)
    lo, hi = s.completion_bounds()
    assert s.info["naive_floor_s"] * (1 - 1e-6) <= lo <= hi


def test_columns_are_built_once_on_first_read() -> None:
    """:class:`Columns`: given values as they are; a build function runs once, on the first read of
    any column, and must give every name; neither or both is an error."""
    calls = []

    def build() -> dict[str, np.ndarray]:
        calls.append(1)
        return {"a": np.arange(3), "b": np.ones(2), "extra": np.zeros(1)}

    cols = Columns(("a", "b"), build=build)
    assert not cols.built and not calls and cols.names == ("a", "b")
    assert cols["b"].tolist() == [1.0, 1.0] and cols.built and cols["a"].tolist() == [0, 1, 2] and len(calls) == 1
    given_ = Columns(("a",), {"a": np.arange(2)})
    assert given_.built and given_["a"].tolist() == [0, 1]
    with pytest.raises(PlanError, match="not neither"):
        Columns(("a",))
    with pytest.raises(PlanError, match="not both"):
        Columns(("a",), {"a": np.arange(2)}, build=build)
    with pytest.raises(PlanError, match=r"\['c'\] missing"):
        Columns(("a", "c"), build=build)["a"]


@settings(max_examples=examples(12), deadline=None)
@given(st.data())
def test_lazy_naive_schedule_equals_the_eager_one(data: st.DataObject) -> None:
    """Issue #20: the naive schedule whose hops are rendered on first read (and whose flows' piece
    columns, the plan's non-local rows, are built on first read) is the one rendered at once: the
    same hop and slice columns, rounds and completion; each flow carries the non-local rows of its
    (source, destination) pair in plan order, with their columns (small random plans, failures and
    clusters beyond the greedy tables). About 2 s."""
    from tenplex.planning.schedule import naive as naive_module
    from tenplex.planning.schedule import scheduler as scheduler_module

    p, gph, gpus = data.draw(failure_plans(max_layers=2, max_world=8))
    t = Topology.from_spec(f"hosts={-(-gpus // gph)},gpus={gph}")
    chunk = data.draw(st.sampled_from([4096, 1 << 16, 1 << 20]))
    made = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(scheduler_module, "_NET_CELLS", 0)  # the naive schedule straight from the plan
        for lazy, cost in ((False, 0.0), (True, 1e12)):  # the rendering predicted to take no time / forever
            mp.setattr(scheduler_module, "_RENDER_PER_FLOOR", cost)
            if lazy:  # the plan's rows keyed in blocks of a few rows; sorted as packed values, or not
                mp.setattr(naive_module, "_BLOCK", data.draw(st.sampled_from([1, 2, 5, 1 << 22])))
                mp.setattr(naive_module, "_PACK_BITS", data.draw(st.sampled_from([0, 63])))
            made[lazy] = schedule(p, t, chunk_bytes=chunk)
        eager, lazy = made[False], made[True]
        if not len(eager.chunk_commodity):
            return
        assert not lazy.hops.built and not lazy.demands.pieces.built and "hops rendered when read" in repr(lazy)
        lazy_rows = lazy.demands.rows  # (built under the drawn blocks)
    assert eager.method == lazy.method == "naive" and eager.hops.built
    assert "render" in lazy.info["skipped"] and "render" not in eager.info.get("skipped", {})
    assert lazy.completion_bounds() == eager.completion_bounds()
    for name in HOP_COLUMNS:
        assert np.array_equal(getattr(lazy, name), getattr(eager, name)), name
    assert lazy.hops.built
    assert lazy.rounds() == eager.rounds() and lazy.completion_s == eager.completion_s
    validate(lazy)
    # the flows' pieces: the non-local rows by (source, destination), plan order within a pair
    c = p.columns
    rows = np.flatnonzero(c["kind"] != LOCAL)
    src = [t.storage() if c["kind"][r] == STORAGE else t.gpu(int(c["src_rank"][r])) for r in rows]
    dst = [t.gpu(int(p.devices[c["new_rank"][r]])) for r in rows]
    rank = [(-1 if c["kind"][r] == STORAGE else int(c["src_rank"][r]), int(p.devices[c["new_rank"][r]]), i)
            for i, r in enumerate(rows)]
    want = rows[[i for _, _, i in sorted(rank)]]
    d = lazy.demands
    assert np.array_equal(lazy_rows, want) and d.pieces.built
    for name, col in (("piece_tensor", "tensor"), ("piece_start", "start"), ("piece_length", "length"),
                      ("piece_nbytes", "nbytes")):
        assert np.array_equal(getattr(d, name), c[col][want]), name
    flows = [(k.sources[0], k.dests[0], k.nbytes, [int(r) for q in k.pieces for r in d.rows_of(int(q))])
             for k in d.commodities]
    pairs: dict[tuple[str, str], list[int]] = {}
    for s_, t_, r in zip(src, dst, rows.tolist()):
        pairs.setdefault((s_, t_), []).append(r)
    assert sorted((a, b, rs) for a, b, _, rs in flows) == sorted((a, b, rs) for (a, b), rs in pairs.items())
    assert all(nb == int(c["nbytes"][rs].sum()) for _, _, nb, rs in flows)
    assert d.bytes_unique == int(c["nbytes"][rows].sum()) == d.bytes_moved
