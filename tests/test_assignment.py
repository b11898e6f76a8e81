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
    for limit in (assignment.DENSE_LIMIT, 0):  # 0: every mixed component through the flow LP
        with mock.patch.object(assignment, "DENSE_LIMIT", limit):
            order = locality_order(ptc, old, new, survivors)
        assert sorted(order) == sorted(survivors) and len(order) == len(survivors)
        assert kept(held, survivors, order) == best, (limit, order)
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
