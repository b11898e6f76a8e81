"""Survivor assignment (``locality_order``): the bytes kept in place equal the optimum of a dense
``linear_sum_assignment`` over an independently built byte matrix, on every solver path (sparse
matching, dense blocks, the class-hub flow), for random models, layouts (uneven stages, ZeRO),
failure sets, scale-down and scale-up; on torch-native ``StateLayout`` s (FSDP2, TP, HSDP, FSDP2 x
TP, pipeline stages, uneven shards) the best of every permutation, and the same bytes as the
``ParallelConfig`` solver where both apply."""

from __future__ import annotations

import itertools
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import examples, layouts, model_kwargs
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.optimize import linear_sum_assignment
from test_state_dict import descriptions, placed_on

from tenplex import ParallelConfig, PlanError, model_ptc, plan
from tenplex.layout.mesh import NamedMesh, Replicate, Shard, StridedShard
from tenplex.layout.ptc import PTC, Replicated, Split, TensorSpec
from tenplex.layout.state_layout import Placed, StateLayout
from tenplex.native.state_dict import state_layout_of
from tenplex.planning import assignment
from tenplex.planning.planner import locality_order


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


# ---------------------------------------------------------------------------------------------
# torch-native state-dict layouts (StateLayout): no class structure, the sparse matching
# ---------------------------------------------------------------------------------------------
def brute_force(held: np.ndarray) -> int:
    """The most bytes kept in place over every assignment of the survivors to the new ranks."""
    rows, cols = held.shape
    return max(int(held[np.arange(rows), list(p)].sum()) for p in itertools.permutations(range(cols), rows))


def named(kind: str, world: int, ndim: int) -> Placed:
    """The placements torch-native jobs give a tensor of ``ndim`` dims on ``world`` ranks."""
    everyone = tuple(range(world))
    if kind == "plain" or not ndim:
        return Placed.replicated(everyone)
    if kind == "fsdp2":
        return Placed(NamedMesh((("dp_shard", world),)), (Shard(0),), everyone)
    tp = 2 if world % 2 == 0 else 1
    if kind == "tp":
        return Placed(NamedMesh((("tp", world),)), (Shard(ndim - 1),), everyone)
    if kind == "hsdp":
        return Placed(NamedMesh((("dp_replicate", 2), ("dp_shard", world // 2))), (Replicate(), Shard(0)), everyone) \
            if tp == 2 else Placed(NamedMesh((("dp_shard", world),)), (Shard(0),), everyone)
    # FSDP2 x TP (colwise): the TP chunk first, FSDP2's rows of it
    mesh = NamedMesh((("dp_shard", world // tp), ("tp", tp)))
    return Placed(mesh, (StridedShard(0, tp) if tp > 1 else Shard(0), Shard(0)), everyone)


@st.composite
def state_cases(draw):
    """(shapes, old layout, new layout, survivors) over at most 6 ranks: named torch-native placements
    (FSDP2, TP, HSDP, FSDP2 x TP, plain) or random ones (``placed_on``: any mesh, StridedShard, ranks in
    any order), some tensors on part of the ranks only (pipeline stages), uneven shapes."""
    shapes = {}
    for i in range(draw(st.integers(1, 4))):
        ndim = draw(st.integers(0, 2))
        shapes[f"t{i}"] = (tuple(draw(st.lists(st.sampled_from([1, 3, 4, 5, 7, 8, 9]), min_size=ndim,
                                               max_size=ndim))), torch.float32)
    out = []
    for _ in range(2):
        world = draw(st.integers(1, 6))
        stages = draw(st.sampled_from([1, 2])) if world % 2 == 0 else 1
        placed = {}
        for i, (name, (shape, _)) in enumerate(shapes.items()):
            kind = draw(st.sampled_from(["fsdp2", "tp", "hsdp", "fsdp2_tp", "plain", "random"]))
            if stages == 2:  # a pipeline stage's tensor: on half of the ranks, its own sub-mesh
                sub = world // 2
                p = named(kind if kind != "random" else "fsdp2", sub, len(shape))
                first = (i % 2) * sub
                placed[name] = Placed(p.mesh, p.placements, tuple(first + r for r in p.ranks))
            elif kind == "random":
                placed[name] = draw(placed_on(len(shape), world))
            else:
                placed[name] = named(kind, world, len(shape))
        out.append(StateLayout.of(world, placed))
    old, new = out
    perm = draw(st.permutations(range(old.world_size)))
    survivors = list(perm[: draw(st.integers(1, old.world_size))])
    return shapes, old, new, survivors


@settings(max_examples=examples(60), deadline=None)
@given(state_cases())
def test_locality_order_of_state_layouts_equals_brute_force(case):
    """On StateLayouts the order keeps in place as many bytes as the best of all assignments of the
    survivors (every permutation), and the plan with it counts those bytes as local."""
    shapes, old, new, survivors = case
    ptc, _ = state_layout_of(descriptions(old, shapes))
    held = held_matrix(ptc, old, new, survivors)
    best = brute_force(held)
    order = locality_order(ptc, old, new, survivors)
    assert sorted(order) == sorted(survivors) and len(order) == len(survivors)
    assert kept(held, survivors, order) == best, order
    assert plan(ptc, old, new, alive=order).stats.bytes_local == best


def pc_as_state_layout(ptc: PTC, cfg: ParallelConfig) -> StateLayout:
    """``cfg`` (no ZeRO) as a torch-native layout: every tensor on its stage's (dp, tp) sub-mesh in
    Megatron rank order, Replicate over DP and Shard(d) (or Replicate) over TP."""
    placed = {}
    for name, spec in ptc.tensors.items():
        stage = ptc.stages_of(name, cfg)[0]
        mesh = NamedMesh((("dp", cfg.dp), ("tp", cfg.tp)))
        tp = Replicate() if spec.split_dim is None else Shard(spec.split_dim)
        first = stage * cfg.dp * cfg.tp
        placed[name] = Placed(mesh, (Replicate(), tp), tuple(range(first, first + cfg.dp * cfg.tp)))
    return StateLayout.of(cfg.world_size, placed)


@st.composite
def config_cases(draw):
    """A small model of Split / Replicated tensors over 1-2 layers and two (DP, TP, PP) layouts
    (even splits) with some survivors."""
    layers = draw(st.integers(1, 2))
    specs = [TensorSpec("emb", (8, 4), tp=Split(0), placement="first"),
             TensorSpec("head", (4, 8), tp=Split(1), placement="last")]
    for layer in range(layers):
        specs += [TensorSpec(f"l{layer}.w", (8, 4), tp=Split(draw(st.integers(0, 1))), placement=layer),
                  TensorSpec(f"l{layer}.norm", (4,), tp=Replicated(), placement=layer)]
    ptc = PTC(specs, num_layers=layers)
    cfgs = []
    for _ in range(2):
        pp = draw(st.integers(1, layers))
        tp = draw(st.sampled_from([1, 2, 4]))
        dp = draw(st.integers(1, max(1, 6 // (pp * tp))))
        cfgs.append(ParallelConfig(dp=dp, tp=tp, pp=pp))
    perm = draw(st.permutations(range(cfgs[0].world_size)))
    return ptc, cfgs[0], cfgs[1], list(perm[: draw(st.integers(1, cfgs[0].world_size))])


@settings(max_examples=examples(40), deadline=None)
@given(config_cases())
def test_locality_order_of_state_layouts_agrees_with_the_parallel_config_one(case):
    """Where both apply (a (DP, TP, PP) layout written as named meshes), the structured solver on the
    ParallelConfigs and the sparse one on the StateLayouts keep the same bytes in place: the optimum."""
    ptc, old, new, survivors = case
    old_s, new_s = pc_as_state_layout(ptc, old), pc_as_state_layout(ptc, new)
    by_config = plan(ptc, old, new, alive=locality_order(ptc, old, new, survivors)).stats
    by_state = plan(ptc, old_s, new_s, alive=locality_order(ptc, old_s, new_s, survivors)).stats
    assert by_state.bytes_needed == by_config.bytes_needed  # the same layouts
    assert by_state.bytes_local == by_config.bytes_local == brute_force(held_matrix(ptc, old, new, survivors))


def test_locality_order_of_a_state_layout_beats_the_old_rank_order():
    """HSDP 2 x 2 -> FSDP2 over 3 with worker 3 dead: by old rank, new rank 1 would run on worker 1
    and new rank 2 on worker 2, each away from most of its rows; the locality order swaps them."""
    shapes = {"w": ((12, 4), torch.float32), "n": ((12,), torch.float32)}
    old = StateLayout.of(4, {n: named("hsdp", 4, len(s)) for n, (s, _) in shapes.items()})
    new = old.remesh({"dp_shard": 3})
    ptc, _ = state_layout_of(descriptions(old, shapes))
    order = locality_order(ptc, old, new, [0, 1, 2])
    assert order == [0, 2, 1]
    by_rank, by_locality = (plan(ptc, old, new, alive=a).stats for a in ([0, 1, 2], order))
    assert by_locality.bytes_local == brute_force(held_matrix(ptc, old, new, [0, 1, 2]))
    assert by_locality.bytes_same_host < by_rank.bytes_same_host
