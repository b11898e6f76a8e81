"""Planner and in-memory reshard: executing a plan reproduces the new layout bit for bit, moves
tile every shard exactly once, moved bytes equal an independently computed lower bound, source
rules (local > same host > any live holder > storage) hold, and reads are balanced."""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np
import pytest
import torch
from conftest import assert_same, canonical_flat, examples, layouts, model_kwargs, random_global
from test_ptc import custom_ptc
from hypothesis import given, settings
from hypothesis import strategies as st

from tenplex import PTC, LayoutError, ParallelConfig, PlanError, Replicated, Split, TensorSpec, model_ptc, plan
from tenplex.planning.planner import KIND_NAMES, intersect
from tenplex.planning.reshard import reshard


# -- independent reference: which global canonical element sits where ---------------------------
def index_maps(ptc: PTC, cfg: ParallelConfig) -> dict[int, dict[str, np.ndarray]]:
    """``{rank: {name: array}}``: for each position of a rank's canonical flat shard, the global
    canonical index stored there (-1 for padding). Computed by sharding an int64 PTC whose global
    tensors hold ``canonical index + 1`` (built with plain torch, not the library's helpers)."""
    ispecs = [dataclasses.replace(s, dtype=torch.int64) for s in ptc.tensors.values()]
    iptc = PTC(ispecs, num_layers=ptc.num_layers, meta=ptc.meta)
    glob = {}
    for spec in ispecs:
        natural = torch.arange(spec.numel, dtype=torch.int64).reshape(spec.shape)
        perm = canonical_flat(spec, natural)  # natural index at each canonical position
        vals = torch.empty(spec.numel, dtype=torch.int64)
        vals[perm] = torch.arange(1, spec.numel + 1)
        glob[spec.name] = vals.reshape(spec.shape)
    shards = iptc.shard(glob, cfg)
    return {r: {n: iptc.to_local_flat(n, t).numpy() - 1 for n, t in s.items()} for r, s in shards.items()}


def held_masks(ptc: PTC, cfg: ParallelConfig, maps) -> dict[str, np.ndarray]:
    """``{name: bool[world, numel]}``: which old rank holds which global element."""
    out = {n: np.zeros((cfg.world_size, s.numel), dtype=bool) for n, s in ptc.tensors.items()}
    for r, per in maps.items():
        for n, idx in per.items():
            out[n][r, idx[idx >= 0]] = True
    return out


def brute_force_bounds(ptc, old, new, alive, old_held, new_maps):
    """(bytes needed, lower bound): per new rank, bytes it needs and bytes its device lacked."""
    devices = list(alive[: new.world_size]) + [None] * max(0, new.world_size - len(alive))
    needed = lower = 0
    for r in range(new.world_size):
        dev = devices[r]
        for name, idx in new_maps[r].items():
            item = ptc.tensors[name].itemsize
            real = idx[idx >= 0]
            have = int(old_held[name][dev, real].sum()) if dev is not None else 0
            needed += item * len(real)
            lower += item * (len(real) - have)
    return needed, lower


def host(device: int, gph: int) -> int:
    return device // gph


# -- the invariant checker ------------------------------------------------------------------------
def check_plan(ptc, old, new, alive, gph, seed=0):
    g = random_global(ptc, seed)
    flats = {n: canonical_flat(s, g[n].to(s.dtype)) for n, s in ptc.tensors.items()}
    old_shards = ptc.shard(g, old)
    expected = ptc.shard(g, new)
    p = plan(ptc, old, new, alive=alive, gpus_per_host=gph)
    alive = list(range(min(old.world_size, new.world_size))) if alive is None else list(alive)
    alive_set = set(alive)
    assert p.alive == tuple(alive)

    # Device assignment: i-th survivor, then fresh devices numbered after the old ones.
    n_new = new.world_size
    fresh = list(range(old.world_size, old.world_size + max(0, n_new - len(alive))))
    assert [p.device_of(r) for r in range(n_new)] == (alive[:n_new] + fresh)[:n_new]

    # 1. Executing the plan (only live old shards available) reproduces ptc.shard(g, new).
    storage_reads = []

    def read_storage(name, start, length):
        storage_reads.append((name, start, length))
        return flats[name][start : start + length]

    live_shards = {r: old_shards[r] for r in alive}
    got = reshard(p, live_shards, read_storage=read_storage)
    assert sorted(got) == list(range(n_new))
    for r in range(n_new):
        assert [k for k in got[r] if k in ptc.tensors] == ptc.rank_tensors(new, r)
        for name in ptc.rank_tensors(new, r):
            assert_same(got[r][name], expected[r][name], f"new rank {r}: {name}")
        if alive:
            for obj in ptc.objects:
                assert got[r][obj] == g[obj]

    # 2. Independent bookkeeping.
    old_maps, new_maps = index_maps(ptc, old), index_maps(ptc, new)
    old_held = held_masks(ptc, old, old_maps)
    needed, lower = brute_force_bounds(ptc, old, new, alive, old_held, new_maps)
    s = p.stats
    assert s.bytes_needed == needed
    assert s.bytes_needed == sum(ptc.rank_nbytes(new, r) for r in range(n_new))
    assert s.bytes_lower_bound == lower
    assert s.bytes_moved == s.bytes_lower_bound
    assert s.bytes_local + s.bytes_moved == s.bytes_needed
    assert s.num_moves == len(p.columns["new_rank"])

    coverage = {(r, n): np.zeros(len(idx), dtype=np.int64) for r in range(n_new) for n, idx in new_maps[r].items()}
    by_kind = defaultdict(int)
    sent = np.zeros(old.world_size)
    ideal = np.zeros(old.world_size)
    largest_piece = 0
    n_moves = 0
    for r in range(n_new):
        dev = p.device_of(r)
        for m in p.moves(r):
            n_moves += 1
            spec = ptc.tensors[m.tensor]
            assert m.new_rank == r and m.length > 0 and m.nbytes == m.length * spec.itemsize
            piece = np.arange(m.start, m.start + m.length)
            # Destination: the new shard holds exactly these global elements there.
            dst_map = new_maps[r][m.tensor]
            assert np.array_equal(dst_map[m.dst_offset : m.dst_offset + m.length], piece), m
            coverage[(r, m.tensor)][m.dst_offset : m.dst_offset + m.length] += 1
            # Who held the whole piece under the old layout, and who of them is alive.
            holders = np.flatnonzero(old_held[m.tensor][:, m.start : m.start + m.length].all(axis=1))
            live = [h for h in holders.tolist() if h in alive_set]
            same = [h for h in live if host(h, gph) == host(dev, gph)]
            by_kind[m.kind] += m.nbytes
            if m.kind == "storage":
                assert not live, f"storage move although {live} are alive: {m}"
                assert m.src_rank == -1 and m.src_offset == m.start
                continue
            # The source really holds the piece at src_offset.
            src_map = old_maps[m.src_rank][m.tensor]
            assert np.array_equal(src_map[m.src_offset : m.src_offset + m.length], piece), m
            assert m.src_rank in live
            if dev in live:
                assert m.kind == "local" and m.src_rank == dev, m
                continue
            assert m.kind != "local"
            sent[m.src_rank] += m.nbytes
            largest_piece = max(largest_piece, m.nbytes)
            if same:
                assert m.kind == "same_host" and m.src_rank in same, m
                cand = same
            else:
                assert m.kind == "cross_host", m
                cand = live
            for h in cand:
                ideal[h] += m.nbytes / len(cand)
    assert n_moves == s.num_moves

    # 3. The moves tile the real part of every local shard exactly once, padding never.
    for (r, name), cov in coverage.items():
        real = new_maps[r][name] >= 0
        assert (cov[real] == 1).all(), f"new rank {r} {name}: covered {cov[real].tolist()}"
        assert (cov[~real] == 0).all()

    assert by_kind["local"] == s.bytes_local
    assert by_kind["same_host"] == s.bytes_same_host
    assert by_kind["cross_host"] == s.bytes_cross_host
    assert by_kind["storage"] == s.bytes_storage
    assert set(by_kind) <= set(KIND_NAMES)
    assert sum(ptc.tensors[n].itemsize * ln for n, _, ln in storage_reads) == s.bytes_storage

    # Send/receive accounting.
    assert np.array_equal(p.sent_bytes(), sent)
    assert s.max_send_bytes == int(sent.max())
    recv = p.received_bytes()
    assert len(recv) == n_new and int(recv.sum()) == s.bytes_moved
    assert s.max_recv_bytes == int(recv.max())

    # 4. Balance: no old rank sends much more than its share of the fractional ideal.
    if sent.sum():
        assert sent.max() <= 1.25 * ideal.max() + largest_piece, (sent.tolist(), ideal.tolist(), largest_piece)
    return p


# -- hypothesis: random shapes, layout pairs, alive sets, hosts ----------------------------------
@st.composite
def scenarios(draw):
    kw = draw(model_kwargs(max_layers=3))
    old = draw(layouts(kw, max_world=12))
    new = draw(layouts(kw, max_world=12))
    perm = draw(st.permutations(range(old.world_size)))
    size = draw(st.integers(0, old.world_size))
    alive = None if draw(st.integers(0, 9)) == 0 else list(perm[:size])
    gph = draw(st.sampled_from([1, 2, 4, 8]))
    return kw, old, new, alive, gph


@settings(max_examples=examples(80))
@given(scenarios(), st.integers(0, 1000))
def test_plan_invariants(sc, seed):
    kw, old, new, alive, gph = sc
    ptc = model_ptc(**kw)
    check_plan(ptc, old, new, alive, gph, seed)


@st.composite
def custom_scenarios(draw):
    def layout():
        tp = draw(st.sampled_from([1, 2, 4]))
        pp = draw(st.integers(1, 3))
        dp = draw(st.integers(1, max(1, min(4, 12 // (tp * pp)))))
        return ParallelConfig(dp=dp, tp=tp, pp=pp)
    old, new = layout(), layout()
    perm = draw(st.permutations(range(old.world_size)))
    alive = list(perm[: draw(st.integers(0, old.world_size))])
    return old, new, alive, draw(st.sampled_from([1, 2, 4, 8]))


@settings(max_examples=examples(40))
@given(custom_scenarios(), st.integers(0, 1000))
def test_plan_invariants_custom_ptc(sc, seed):
    old, new, alive, gph = sc
    check_plan(custom_ptc(), old, new, alive, gph, seed)


# -- explicit alive-set sizes ---------------------------------------------------------------------
TINY = dict(arch="llama", num_layers=4, hidden=16, heads=4, kv_heads=2, ffn_hidden=8, vocab=37, vocab_pad=4,
            dtype=torch.bfloat16, distributed_optimizer=True)


@pytest.mark.parametrize("old, new", [
    (ParallelConfig(dp=2, tp=2, pp=2), ParallelConfig(dp=1, tp=2, pp=2)),     # scale down
    (ParallelConfig(dp=1, tp=2, pp=2), ParallelConfig(dp=3, tp=1, pp=2)),     # scale up
    (ParallelConfig(dp=2, tp=2, pp=2), ParallelConfig(dp=1, tp=1, pp=3, stages=(2, 0, 2))),
    (ParallelConfig(dp=4, tp=1, pp=1), ParallelConfig(dp=2, tp=2, pp=2)),
])
@pytest.mark.parametrize("which", ["smaller", "equal", "larger", "none", "all"])
@pytest.mark.parametrize("gph", [1, 2, 4, 8])
def test_alive_sizes(old, new, which, gph):
    ptc = model_ptc(**TINY)
    rng = np.random.default_rng(old.world_size * 100 + new.world_size + gph)
    perm = rng.permutation(old.world_size).tolist()
    size = {"smaller": max(0, min(new.world_size, old.world_size) - 1), "equal": min(new.world_size, old.world_size),
            "larger": min(old.world_size, new.world_size + 1), "none": 0, "all": old.world_size}[which]
    alive = perm[:size]
    p = check_plan(ptc, old, new, alive, gph, seed=size)
    if not alive:
        assert p.stats.bytes_storage == p.stats.bytes_needed and p.stats.bytes_local == 0
    if len(alive) < new.world_size:
        assert p.device_of(new.world_size - 1) >= old.world_size  # a fresh device


def test_default_alive_is_first_devices():
    ptc = model_ptc(**TINY)
    old, new = ParallelConfig(dp=2, tp=2, pp=2), ParallelConfig(dp=1, tp=2, pp=1)
    a = plan(ptc, old, new)
    b = plan(ptc, old, new, alive=[0, 1])
    assert a.alive == (0, 1)
    for k in a.columns:
        assert np.array_equal(a.columns[k], b.columns[k]), k
    assert dataclasses.replace(a.stats, plan_seconds=0) == dataclasses.replace(b.stats, plan_seconds=0)
    check_plan(ptc, old, new, None, 8)


def test_identity_plan_is_all_local():
    ptc = model_ptc(**TINY)
    cfg = ParallelConfig(dp=2, tp=2, pp=2)
    p = check_plan(ptc, cfg, cfg, list(range(8)), 4)
    s = p.stats
    assert s.bytes_local == s.bytes_needed > 0
    assert s.bytes_moved == 0 and s.bytes_lower_bound == 0 and s.max_send_bytes == 0 and s.max_recv_bytes == 0
    assert all(m.kind == "local" and m.src_rank == r for r in range(8) for m in p.moves(r))


def test_permuted_devices_move_everything():
    """Same layout on permuted devices: stages swapped -> everything moves, nothing from storage."""
    ptc = model_ptc(**{**TINY, "distributed_optimizer": False})
    cfg = ParallelConfig(dp=1, tp=2, pp=2)
    p = check_plan(ptc, cfg, cfg, [2, 3, 0, 1], 1)
    s = p.stats
    assert s.bytes_local == 0 and s.bytes_storage == 0 and s.bytes_cross_host == s.bytes_needed
    # New rank 0 (stage 0, TP 0) runs on old rank 2's device; TP-split pieces come from old rank 0,
    # replicated ones from old rank 0 or 1.
    assert {m.src_rank for m in p.moves(0)} <= {0, 1}
    assert all(m.src_rank == 0 for m in p.moves(0) if isinstance(ptc.tensors[m.tensor].tp, Split))
    p = check_plan(ptc, cfg, cfg, [2, 3, 0, 1], 4)  # now all four share a host
    assert p.stats.bytes_same_host == p.stats.bytes_needed
    # TP indices swapped: only the replicated tensors (norms) stay local.
    p = check_plan(ptc, cfg, cfg, [1, 0, 3, 2], 2)
    replicated = sum(sp.nbytes for sp in ptc.tensors.values() if isinstance(sp.tp, Replicated))
    assert p.stats.bytes_local == 2 * replicated  # two TP ranks hold every replicated tensor
    assert p.stats.bytes_same_host == p.stats.bytes_needed - p.stats.bytes_local


def test_same_host_preferred_over_cross_host():
    ptc = model_ptc(**{**TINY, "optimizer": False})
    old, new = ParallelConfig(dp=2, tp=2), ParallelConfig(dp=4, tp=1)  # old ranks: 0,1 = replica 0; 2,3 = replica 1
    p = check_plan(ptc, old, new, [0, 1, 2, 3], 2)
    s = p.stats
    # Each new rank holds the full model; half of it is local, the other half on the host mate.
    assert s.bytes_cross_host == 0 and s.bytes_storage == 0
    assert s.bytes_local == sum(ptc.rank_nbytes(old, r) for r in range(4))
    assert s.bytes_same_host == s.bytes_needed - s.bytes_local > 0
    assert {m.src_rank for m in p.moves(0) if m.kind != "local"} == {1}
    assert {m.src_rank for m in p.moves(3) if m.kind != "local"} == {2}
    # Without the host mate (rank 1 died), rank 0's second half must cross hosts, from rank 3.
    p = check_plan(ptc, old, new, [0, 2, 3], 2)
    remote0 = [m for m in p.moves(0) if m.kind != "local"]
    assert remote0 and all(m.kind == "cross_host" and m.src_rank == 3 for m in remote0)


def test_storage_only_when_every_holder_died():
    ptc = model_ptc(**{**TINY, "optimizer": False})
    old, new = ParallelConfig(dp=2, tp=1, pp=2), ParallelConfig(dp=1, tp=1, pp=2)
    # old: stage 0 = ranks 0, 1; stage 1 = ranks 2, 3. Both holders of stage 1 die.
    p = check_plan(ptc, old, new, [1, 0], 8)
    assert p.stats.bytes_storage == ptc.rank_nbytes(new, 1) and p.stats.bytes_local == ptc.rank_nbytes(new, 0)
    assert {m.kind for m in p.moves(1)} == {"storage"}
    # One holder of stage 1 alive: nothing from storage.
    p = check_plan(ptc, old, new, [1, 3], 8)
    assert p.stats.bytes_storage == 0


# -- balance ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("optimizer", [False, True])
def test_balance_between_replicas(arch, optimizer):
    """A fresh device reading a whole model from two live replicas reads about half from each,
    whatever the pattern of tensor sizes (weights and small biases alternate in every layer)."""
    ptc = model_ptc(arch=arch, num_layers=6, hidden=32, heads=4, vocab=100, seq_len=16, optimizer=optimizer)
    old, new = ParallelConfig(dp=2), ParallelConfig(dp=3)
    p = check_plan(ptc, old, new, [0, 1], 1)
    sent = p.sent_bytes()
    assert sent.sum() == p.stats.bytes_cross_host == ptc.rank_nbytes(new, 2)
    largest = max(s.nbytes for s in ptc.tensors.values())
    assert abs(sent[0] - sent[1]) <= largest, sent.tolist()


def test_balance_many_fresh_readers():
    ptc = model_ptc(arch="gpt", num_layers=4, hidden=32, heads=4, vocab=64, seq_len=8, optimizer=False)
    old, new = ParallelConfig(dp=4, tp=2), ParallelConfig(dp=8, tp=2)
    p = check_plan(ptc, old, new, list(range(8)), 2)
    sent = p.sent_bytes()
    # New ranks 0..7 find their shard on their own device; the 8 fresh ranks 8..15 each read one
    # TP half of the model from the 4 live replicas of that half.
    assert p.stats.bytes_local == sum(ptc.rank_nbytes(new, r) for r in range(8))
    per_tp = [sum(ptc.rank_nbytes(new, r) for r in range(8, 16) if new.coords(r).tp == t) for t in range(2)]
    assert sent.sum() == p.stats.bytes_cross_host == p.stats.bytes_moved == sum(per_tp)
    assert p.stats.bytes_storage == 0
    assert sent.max() <= 1.25 * max(per_tp) / 4 + max(s.nbytes for s in ptc.tensors.values())


# -- errors -------------------------------------------------------------------------------------------
def test_plan_errors():
    ptc = model_ptc(**TINY)
    old, new = ParallelConfig(dp=2, tp=2), ParallelConfig(dp=1, tp=2)
    with pytest.raises(PlanError, match="alive lists a rank twice"):
        plan(ptc, old, new, alive=[0, 1, 1])
    with pytest.raises(PlanError, match=r"alive ranks \[4\] are outside the old world \[0, 4\)"):
        plan(ptc, old, new, alive=[0, 4])
    with pytest.raises(PlanError, match=r"alive ranks \[-1\] are outside"):
        plan(ptc, old, new, alive=[-1, 2])
    with pytest.raises(PlanError, match="gpus_per_host must be >= 1"):
        plan(ptc, old, new, gpus_per_host=0)
    with pytest.raises(LayoutError, match="tp=8 does not divide heads=4"):
        plan(ptc, old, ParallelConfig(tp=8))
    with pytest.raises(LayoutError):
        plan(ptc, ParallelConfig(tp=3), new)
    p = plan(ptc, old, new)
    with pytest.raises(PlanError, match=r"new rank 2 is outside \[0, 2\)"):
        p.moves(2)
    with pytest.raises(PlanError, match="outside"):
        p.moves(-1)
    assert "dp=2,tp=2,pp=1 -> dp=1,tp=2,pp=1" in repr(p)


def test_reshard_errors():
    ptc = model_ptc(**TINY)
    old, new = ParallelConfig(dp=2, tp=2), ParallelConfig(dp=2, tp=2, pp=2)
    g = random_global(ptc)
    shards = ptc.shard(g, old)
    p = plan(ptc, old, new, alive=[0, 1])  # new rank 1 reads old rank 1 locally
    with pytest.raises(PlanError, match="which old_shards does not provide"):
        reshard(p, {0: shards[0]})
    q = plan(ptc, old, new, alive=[])
    with pytest.raises(PlanError, match="no read_storage was given"):
        reshard(q, {})
    # A subset of ranks.
    flats = {n: canonical_flat(s, g[n]) for n, s in ptc.tensors.items()}
    out = reshard(q, {}, read_storage=lambda n, s, ln: flats[n][s : s + ln], ranks=[6])
    expected = ptc.shard(g, new)
    assert list(out) == [6]
    assert ptc.rank_tensors(new, 6) == [n for n in out[6]]
    for name in ptc.rank_tensors(new, 6):
        assert_same(out[6][name], expected[6][name], name)


# -- intersect -------------------------------------------------------------------------------------
@given(st.lists(st.integers(1, 6), min_size=1, max_size=12), st.lists(st.tuples(st.integers(0, 60), st.integers(0, 8)),
                                                                       max_size=12))
def test_intersect_brute_force(class_lengths, queries):
    c_start = np.cumsum([0] + class_lengths[:-1]).astype(np.int64)
    c_end = c_start + np.array(class_lengths, dtype=np.int64)
    q_start = np.array([q[0] for q in queries], dtype=np.int64)
    q_len = np.array([q[1] for q in queries], dtype=np.int64)
    qi, ci, ps, pe = intersect(q_start, q_len, c_start, c_end)
    got = sorted(zip(qi.tolist(), ci.tolist(), ps.tolist(), pe.tolist()))
    want = []
    for i, (s, ln) in enumerate(queries):
        for j in range(len(c_start)):
            a, b = max(s, int(c_start[j])), min(s + ln, int(c_end[j]))
            if b > a:
                want.append((i, j, a, b))
    assert got == sorted(want)
    assert list(qi) == sorted(qi.tolist())  # queries in order


# -- a big model: planning is cheap and the stats are consistent ---------------------------------------
def test_gpt3_175b_scale_down():
    ptc = model_ptc("gpt3-175b")
    old, new = ParallelConfig(dp=8, tp=8, pp=16), ParallelConfig(dp=6, tp=8, pp=16)
    p = plan(ptc, old, new)
    s = p.stats
    assert p.alive == tuple(range(768)) and p.device_of(767) == 767
    assert s.bytes_moved == s.bytes_lower_bound
    assert s.bytes_local + s.bytes_same_host + s.bytes_cross_host + s.bytes_storage == s.bytes_needed
    # No distributed optimizer: a rank's bytes depend on its (stage, tp) only.
    nb = {(st_, t): ptc.rank_nbytes(new, new.rank(pp=st_, tp=t)) for st_ in range(16) for t in range(8)}
    assert s.bytes_needed == 6 * sum(nb.values())
    recv = p.received_bytes()
    for r in (0, 7, 100, 383, 500, 767):
        c = new.coords(r)
        local = sum(m.nbytes for m in p.moves(r) if m.kind == "local")
        assert int(recv[r]) + local == nb[(c.pp, c.tp)] == ptc.rank_nbytes(new, r)
    # New rank r runs on device r = old rank r; its shard is local exactly when old rank r had
    # the same stage and TP index (TP segments and stage boundaries are unchanged), else nothing
    # is local (the tied embedding's old holders on stages 0 and 15 never meet a new stage-15/0 rank).
    expected_local = 0
    for r in range(768):
        o, n = old.coords(r), new.coords(r)
        if (o.pp, o.tp) == (n.pp, n.tp):
            expected_local += nb[(n.pp, n.tp)]
    assert s.bytes_local == expected_local
    assert all(m.kind == "local" for r in range(48) for m in p.moves(r))
    # Devices 0..767 held old stages 0..11; every replica of stages 12..15 is lost and comes from
    # storage, except the tied word embedding of the last stage, which old stage 0 still holds.
    emb = sum(sp.nbytes for sp in ptc.tensors.values() if sp.placement == "both")  # weight + Adam state
    assert emb == 50257 * 12288 * (2 + 4 + 4 + 4)
    lost = 6 * sum(nb[(st_, t)] for st_ in range(12, 16) for t in range(8)) - 6 * emb
    assert s.bytes_storage == lost
    # Hosts of 8 GPUs hold one (stage, replica) of 8 TP ranks, so no same-host holder exists.
    assert s.bytes_same_host == 0
    sent = p.sent_bytes()
    assert int(sent.sum()) == s.bytes_cross_host and s.max_send_bytes == int(sent.max())
    # Balance: a cross-host piece of (stage, tp) can come from any of its 8 live old replicas.
    c = p.columns
    cross = c["kind"] == KIND_NAMES.index("cross_host")
    src = c["src_rank"][cross]
    group = (src // 64) * 8 + src % 8  # old (stage, tp) of the source
    ideal = np.bincount(group, weights=c["nbytes"][cross], minlength=128) / 8
    largest = int(c["nbytes"][cross].max())
    assert s.max_send_bytes <= 1.25 * ideal.max() + largest, (s.max_send_bytes, ideal.max(), largest)


def test_locality_order_keeps_state_in_place() -> None:
    """A DP shrink under PP: the default mapping (new rank i on survivor i) moves most of the
    state; the locality order puts every new rank where its stage's data already is."""
    from tenplex.planning.planner import locality_order

    ptc = model_ptc("tiny")
    old, new = ParallelConfig(dp=4, tp=1, pp=2), ParallelConfig(dp=2, tp=1, pp=2)
    survivors = list(range(old.world_size))
    default = plan(ptc, old, new, alive=survivors).stats
    order = locality_order(ptc, old, new, survivors)
    assert sorted(order) == survivors
    better = plan(ptc, old, new, alive=order).stats
    assert default.bytes_moved > 0
    assert better.bytes_moved == 0 and better.bytes_local == better.bytes_needed
    for r in range(new.world_size):  # each new rank sits on an old rank of its own stage
        assert old.coords(order[r]).pp == new.coords(r).pp
    with pytest.raises(PlanError):
        locality_order(ptc, old, new, [0, 0])


# -- a rank's own part ------------------------------------------------------------------------------
def rows_of(p, sel=None) -> set[tuple]:
    c = p.columns
    idx = range(len(c["new_rank"])) if sel is None else np.flatnonzero(sel)
    return {tuple(int(c[k][i]) for k in p.columns) for i in idx}


@settings(max_examples=examples(40), deadline=None)
@given(scenarios(), st.data())
def test_rank_parts_are_the_plan(sc, data):
    """plan(ranks=[r]) is exactly the whole plan's rows r receives and r's device sends; the parts
    of all ranks together are the plan (so the same bytes per kind and the same balance)."""
    kw, old, new, alive, gph = sc
    ptc = model_ptc(**kw)
    whole = plan(ptc, old, new, alive=alive, gpus_per_host=gph)
    c = whole.columns
    peer = (c["kind"] == KIND_NAMES.index("same_host")) | (c["kind"] == KIND_NAMES.index("cross_host"))
    union: set[tuple] = set()
    for r in range(new.world_size):
        part = plan(ptc, old, new, alive=alive, gpus_per_host=gph, ranks=[r])
        want = rows_of(whole, (c["new_rank"] == r) | (peer & (c["src_rank"] == whole.device_of(r))))
        got = rows_of(part)
        assert got == want, r
        assert part.stats.num_moves == len(got) and part.ranks == (r,)
        order = part.columns["tensor"]
        assert np.all(np.diff(order) >= 0)  # plan order: grouped by tensor
        union |= got
    assert union == rows_of(whole)
    some = data.draw(st.lists(st.integers(0, new.world_size - 1), max_size=3))
    part = plan(ptc, old, new, alive=alive, gpus_per_host=gph, ranks=some)
    sel = np.isin(c["new_rank"], some) | (peer & np.isin(c["src_rank"], [whole.device_of(r) for r in some]))
    assert rows_of(part) == rows_of(whole, sel)


def test_rank_part_errors():
    ptc = model_ptc(**TINY)
    with pytest.raises(PlanError, match=r"ranks \[4\] are outside the new world \[0, 4\)"):
        plan(ptc, ParallelConfig(dp=2, tp=2), ParallelConfig(dp=1, tp=2, pp=2), ranks=[0, 4])
    part = plan(ptc, ParallelConfig(dp=2, tp=2), ParallelConfig(dp=1, tp=2, pp=2), ranks=[3])
    assert "part of new ranks [3]" in repr(part) and part.ranks == (3,)
