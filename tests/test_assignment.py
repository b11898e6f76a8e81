"""Survivor assignment (``locality_order``): the bytes kept in place equal the optimum of a dense
``linear_sum_assignment`` over an independently built byte matrix, on every solver path (sparse
matching, dense blocks, the class-hub flow), for random models, layouts (uneven stages, ZeRO),
failure sets, scale-down and scale-up."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from conftest import examples, layouts, model_kwargs
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment

from tenplex import ParallelConfig, PlanError, model_ptc, plan
from tenplex import assignment
from tenplex.planner import locality_order


def held_matrix(ptc, old, new, survivors) -> np.ndarray:
    """Bytes survivor j holds of new rank i's shard, element by element (rows: the new ranks that
    run on survivors), from each rank's segments (no holder tables, no class intervals)."""
    rows = min(new.world_size, len(survivors))
    held = np.zeros((rows, len(survivors)), dtype=np.int64)
    for name, spec in ptc.tensors.items():
        def elements(cfg, rank):
            return {g + k for _, g, ln in ptc.segments(name, cfg, rank) if g >= 0 for k in range(ln)}
        if not ptc.holders(name, new).rank.size:
            continue
        have = [elements(old, s) if s in set(ptc.holders(name, old).rank.tolist()) else set() for s in survivors]
        for i in range(rows):
            if i not in set(ptc.holders(name, new).rank.tolist()):
                continue
            need = elements(new, i)
            for j in range(len(survivors)):
                held[i, j] += len(need & have[j]) * spec.itemsize
    return held


def kept(held: np.ndarray, survivors: list[int], order: list[int]) -> int:
    pos = {s: j for j, s in enumerate(survivors)}
    return int(sum(held[i, pos[order[i]]] for i in range(held.shape[0])))


#: Solver paths for a component that is not one uniform class block: the class-dual construction
#: first (falling back when it cannot certify), dense LSA only, the class-hub flow LP only.
PATHS = ("duals", "dense", "flow")


def solver(path: str):
    """Force one solver path of ``locality_order`` for mixed components."""
    if path == "duals":
        return mock.patch.multiple(assignment, USE_DUALS=True, DUAL_MIN=0)
    return mock.patch.multiple(assignment, USE_DUALS=False, DENSE_LIMIT=assignment.DENSE_LIMIT if path == "dense" else 0)


@st.composite
def cases(draw):
    kw = draw(model_kwargs(max_layers=3))
    old = draw(layouts(kw, max_world=12, max_dp=4))
    new = draw(layouts(kw, max_world=12, max_dp=4))
    perm = draw(st.permutations(range(old.world_size)))
    survivors = list(perm[: draw(st.integers(1, old.world_size))])
    return kw, old, new, survivors


@settings(max_examples=examples(40), deadline=None)
@given(cases())
def test_locality_order_is_optimal(case):
    kw, old, new, survivors = case
    ptc = model_ptc(**kw)
    held = held_matrix(ptc, old, new, survivors)
    r, c = linear_sum_assignment(held, maximize=True)
    best = int(held[r, c].sum())
    for path in PATHS:
        with solver(path):
            order = locality_order(ptc, old, new, survivors)
        assert sorted(order) == sorted(survivors) and len(order) == len(survivors)
        assert kept(held, survivors, order) == best, (path, order)
    p = plan(ptc, old, new, alive=order)
    assert p.stats.bytes_local == best


def test_replica_lost_keeps_everything_in_place():
    """One (stage, replica) lost under replicated Adam: nothing moves, other stages keep coordinates;
    with ZeRO the bytes kept equal the dense optimum."""
    for dist in (False, True):
        ptc = model_ptc("tiny", distributed_optimizer=dist)
        old, new = ParallelConfig(dp=4, tp=2, pp=2), ParallelConfig(dp=3, tp=2, pp=2)
        survivors = [r for r in range(16) if r not in (10, 11)]  # stage 1, replica 1
        order = locality_order(ptc, old, new, survivors)
        p = plan(ptc, old, new, alive=order)
        held = held_matrix(ptc, old, new, survivors)
        r, c = linear_sum_assignment(held, maximize=True)
        assert p.stats.bytes_local == int(held[r, c].sum())
        if not dist:
            assert p.stats.bytes_moved == 0
            assert order[:6] == list(range(6))  # stage 0 keeps its coordinates


def test_scale_up_with_fewer_survivors():
    """More new ranks than survivors: only the first ones run on survivors (the rest on fresh
    devices), and the order is a permutation of the survivors (the dense version returned -1s)."""
    ptc = model_ptc("tiny")
    old, new = ParallelConfig(dp=2, tp=1, pp=2), ParallelConfig(dp=4, tp=1, pp=2)
    order = locality_order(ptc, old, new, [3, 1])
    assert sorted(order) == [1, 3]
    p = plan(ptc, old, new, alive=order)
    held = held_matrix(ptc, old, new, [3, 1])
    r, c = linear_sum_assignment(held, maximize=True)
    assert p.stats.bytes_local == int(held[r, c].sum()) > 0
    with pytest.raises(PlanError):
        locality_order(ptc, old, new, [5])


@st.composite
def weight_matrices(draw):
    """A random ``W = A[row class, column class] + Z`` (classes, class matrix with zeros and
    repeats, sparse part), small enough for a dense LSA."""
    n_rc, n_cc = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    rows, cols = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    rc = np.array(draw(st.lists(st.integers(0, n_rc - 1), min_size=rows, max_size=rows)), dtype=np.int64)
    cc = np.array(draw(st.lists(st.integers(0, n_cc - 1), min_size=cols, max_size=cols)), dtype=np.int64)
    scale = draw(st.sampled_from([1, 10, 1000]))
    a = np.array(draw(st.lists(st.sampled_from([0, 0, 1, 2, 5]), min_size=n_rc * n_cc, max_size=n_rc * n_cc)),
                 dtype=np.int64).reshape(n_rc, n_cc) * scale
    pairs = sorted(set(draw(st.lists(st.tuples(st.integers(0, rows - 1), st.integers(0, cols - 1)),
                                     max_size=rows * cols))))
    zb = np.array(draw(st.lists(st.integers(1, 30), min_size=len(pairs), max_size=len(pairs))), dtype=np.int64)
    zr = np.array([p[0] for p in pairs], dtype=np.int64)
    zc = np.array([p[1] for p in pairs], dtype=np.int64)
    return assignment.SurvivorWeights(rc, cc, a, zr, zc, zb)


@settings(max_examples=examples(150), deadline=None)
@given(weight_matrices())
def test_max_weight_assignment_is_optimal(w):
    """Every solver path (the class duals included, whether they certify or fall back) reaches
    the dense optimum on random class-structured matrices, and returns a matching."""
    d = w.dense()
    r, c = linear_sum_assignment(d, maximize=True)
    best = int(d[r, c].sum())
    for path in PATHS:
        with solver(path):
            mr, mc = assignment.max_weight_assignment(w)
        assert len(np.unique(mr)) == len(mr) and len(np.unique(mc)) == len(mc)
        assert int(d[mr, mc].sum()) == best, path


def test_zero_tp_blocks_solved_by_duals():
    """ZeRO with TP, one (stage, replica) lost: fragments of TP-replicated tensors link every TP
    index of a stage, so each stage is one mixed component; the class duals certify it without
    the dense or flow solvers (both disabled here), and the bytes kept equal the dense optimum."""
    ptc = model_ptc(arch="llama", num_layers=4, hidden=8, heads=4, kv_heads=2, ffn_hidden=8, vocab=16, seq_len=4,
                    optimizer=True, distributed_optimizer=True)
    old, new = ParallelConfig(dp=4, tp=2, pp=2), ParallelConfig(dp=3, tp=2, pp=2)
    survivors = [r for r in range(16) if r not in (10, 11)]
    calls = []
    real = assignment._dual_matching

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    def refuse(*args, **kwargs):
        raise AssertionError("a mixed component left the class-dual path")

    with mock.patch.multiple(assignment, _dual_matching=counted, _flow_matching=refuse, DUAL_MIN=0), \
            mock.patch("scipy.optimize.linear_sum_assignment", refuse):  # imported where it is called
        order = locality_order(ptc, old, new, survivors)
    assert calls and all(calls)
    held = held_matrix(ptc, old, new, survivors)
    r, c = linear_sum_assignment(held, maximize=True)
    assert kept(held, survivors, order) == int(held[r, c].sum())
