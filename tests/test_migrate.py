"""Live state migration (``tenplex.elastic.migrate``).

The exchange plan is pure: hypothesis draws models, layout pairs, survivor sets and rounds and
checks that every element a new rank needs arrives exactly once from a rank that holds it,
that sends and receives pair up, and that the bytes per kind are the plan's. Then one spawned
gloo world of 3 processes migrates the tiny trainer state for real: a dead rank with pieces
only a checkpoint holds, survivors in another order sending in a schedule's rounds (one of
them only sends), and a scale-up where a fresh rank receives everything; every result equals
``ptc.shard`` of the new layout bit for bit and the bytes on the wire are the plan's.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import assert_same, examples, layouts, model_kwargs, random_global
from spawned import free_port, here, in_env, reap, run_spawned, worker_context
from hypothesis import given, settings
from hypothesis import strategies as st

import tenplex
from tenplex import ParallelConfig
from tenplex.elastic.migrate import ExchangePlan, exchange_plan, storage_items
from tenplex.layout.ptc import PAD
from tenplex.planning.planner import CROSS_HOST, KIND_NAMES, LOCAL, SAME_HOST, STORAGE, Plan
from tenplex.planning.schedule import Transfer
from tenplex.train.trainer import trainer_ptc

P = ParallelConfig


def _local_to_global(ptc: tenplex.PTC, name: str, cfg: ParallelConfig, rank: int) -> np.ndarray:
    segs = ptc.segments(name, cfg, rank)
    out = np.full(sum(ln for _, _, ln in segs), -1, dtype=np.int64)
    for lo, g, ln in segs:
        if g != PAD:
            out[lo : lo + ln] = np.arange(g, g + ln)
    return out


def check_exchange(p: Plan, ex: ExchangePlan) -> None:
    """Every needed element exactly once from a holder; sends pair with receives; bytes per kind."""
    ptc, old, new = p.ptc, p.old, p.new
    c = ex.columns
    alive = list(p.alive)
    n_new = new.world_size
    assert ex.group_size == max(n_new, len(alive))
    # bytes per kind are the plan's
    s = p.stats
    assert ex.bytes_by_kind() == {"local": s.bytes_local, "same_host": s.bytes_same_host,
                                  "cross_host": s.bytes_cross_host, "storage": s.bytes_storage}
    # every element of every new shard, exactly once, and from where the piece says
    for r in range(n_new):
        rows = np.flatnonzero(c["dst"] == r)
        for name in ptc.rank_tensors(new, r):
            ti = ex.tensor_names.index(name)
            want = _local_to_global(ptc, name, new, r)
            got = np.zeros(len(want), dtype=np.int64)
            for i in rows[c["tensor"][rows] == ti].tolist():
                a, n, g = int(c["dst_offset"][i]), int(c["length"][i]), int(c["start"][i])
                assert n > 0
                got[a : a + n] += 1
                assert np.array_equal(want[a : a + n], np.arange(g, g + n)), (name, r, i)
                k, src = int(c["kind"][i]), int(c["src"][i])
                assert c["nbytes"][i] == n * ptc.tensors[name].itemsize
                if k == STORAGE:
                    assert src == -1 and c["round"][i] == -1
                    assert int(c["src_offset"][i]) == g
                    continue
                if k == LOCAL:
                    assert src == r and c["round"][i] == -1
                else:
                    assert k in (SAME_HOST, CROSS_HOST) and 0 <= src < len(alive) and src != r
                    assert 0 <= c["round"][i] < ex.num_rounds
                have = _local_to_global(ptc, name, old, alive[src])
                so = int(c["src_offset"][i])
                assert np.array_equal(have[so : so + n], np.arange(g, g + n)), (name, r, i, "source")
            assert np.array_equal(got, (want >= 0).astype(np.int64)), (name, r)
        assert not np.any(c["tensor"][rows] < 0)
    # messages: one per (round, src, dst), sends == receives pairwise, covering every peer piece once
    keys = [(m.round, m.src, m.dst) for m in ex.messages]
    assert len(keys) == len(set(keys)) and keys == sorted(keys)
    covered = np.zeros(len(c["round"]), dtype=np.int64)
    for m in ex.messages:
        assert m in ex.sends(m.src) and m in ex.recvs(m.dst)
        assert m.nbytes == int(c["nbytes"][m.first : m.last].sum())
        assert np.all(c["src"][m.first : m.last] == m.src) and np.all(c["dst"][m.first : m.last] == m.dst)
        assert np.all(c["round"][m.first : m.last] == m.round)
        covered[m.first : m.last] += 1
    peer = (c["kind"] == SAME_HOST) | (c["kind"] == CROSS_HOST)
    assert np.array_equal(covered, peer.astype(np.int64))
    for g in range(ex.group_size):
        assert all(m.src == g for m in ex.sends(g)) and all(m.dst == g for m in ex.recvs(g))
        assert [(m.round, m.dst) for m in ex.sends(g)] == sorted((m.round, m.dst) for m in ex.sends(g))
    assert sum(m.nbytes for m in ex.messages) == s.bytes_same_host + s.bytes_cross_host
    assert all(m.dst < n_new for m in ex.messages)


def random_rounds(p: Plan, seed: int, n_rounds: int) -> list[list[Transfer]]:
    """Rounds that deliver every peer move in up to three parts, each in a random round."""
    rng = np.random.default_rng(seed)
    out: list[list[Transfer]] = [[] for _ in range(n_rounds)]
    for m in (m for r in range(p.new.world_size) for m in p.moves(r)):
        if m.kind not in ("same_host", "cross_host"):
            continue
        cuts = sorted(set(rng.integers(1, m.length, size=2).tolist())) if m.length > 1 else []
        bounds = [0, *cuts, m.length]
        isz = m.nbytes // m.length
        for a, b in zip(bounds, bounds[1:]):
            rd = int(rng.integers(0, n_rounds))
            out[rd].append(Transfer(rd, "gpu?", f"gpu{p.device_of(m.new_rank)}", m.tensor, m.start + a, b - a,
                                    (b - a) * isz, 0, m.src_rank, (m.new_rank,)))
    return out


@st.composite
def exchange_cases(draw: st.DrawFn) -> tuple[dict[str, Any], ParallelConfig, ParallelConfig, list[int], int, int]:
    kw = draw(model_kwargs(max_layers=3))
    old = draw(layouts(kw, max_world=8, max_dp=2))
    new = draw(layouts(kw, max_world=8, max_dp=2))
    perm = draw(st.permutations(list(range(old.world_size))))
    alive = list(perm[: draw(st.integers(0, old.world_size))])
    return kw, old, new, alive, draw(st.sampled_from([1, 2, 8])), draw(st.integers(0, 4))


@settings(max_examples=examples(60))
@given(exchange_cases(), st.integers(0, 2**16))
def test_exchange_plan_properties(case: tuple, seed: int) -> None:
    kw, old, new, alive, gph, n_rounds = case
    ptc = tenplex.model_ptc(**kw)
    p = tenplex.plan(ptc, old, new, alive=alive, gpus_per_host=gph)
    ex = exchange_plan(p)
    check_exchange(p, ex)
    assert ex.num_rounds == (1 if ex.messages else 0)
    if n_rounds:
        exr = exchange_plan(p, rounds=random_rounds(p, seed, n_rounds))
        check_exchange(p, exr)
        assert exr.num_rounds <= n_rounds
        # the same pieces, only cut at round boundaries
        for k in range(len(KIND_NAMES)):
            assert int(exr.columns["length"][exr.columns["kind"] == k].sum()) == \
                int(ex.columns["length"][ex.columns["kind"] == k].sum())


def test_exchange_plan_follows_a_schedule() -> None:
    from tenplex.planning.schedule import schedule
    from tenplex.planning.topology import Topology

    ptc = trainer_ptc("tiny", distributed_optimizer=True)
    p = tenplex.plan(ptc, P(dp=2, tp=2), P(pp=3), alive=[3, 0, 2], gpus_per_host=4)
    sch = schedule(p, Topology.from_spec("hosts=1,gpus=4"), time_limit=2.0)
    ex = exchange_plan(p, rounds=sch)
    check_exchange(p, ex)
    assert ex.num_rounds >= 1
    # each piece in the (renumbered) round in which the schedule delivers its first element
    deliveries: dict[tuple[str, int], list[tuple[int, int, int]]] = {}
    for i, rnd in enumerate(sch.rounds()):
        for t in rnd:
            for r in t.new_ranks:
                deliveries.setdefault((t.tensor, r), []).append((t.start, t.start + t.length, i))
    c = ex.columns
    peer = np.flatnonzero(c["round"] >= 0)
    first_round = [min(i for a, b, i in deliveries[(ex.tensor_names[c["tensor"][j]], int(c["dst"][j]))]
                       if a <= c["start"][j] < b) for j in peer.tolist()]
    used = sorted(set(first_round))
    assert [used.index(i) for i in first_round] == c["round"][peer].tolist()


def test_storage_items_read_only_the_pieces() -> None:
    ptc = trainer_ptc("tiny", distributed_optimizer=True)
    old, new = P(dp=2, tp=2), P(pp=3)
    p = tenplex.plan(ptc, old, new, alive=[0, 2, 3])
    ex = exchange_plan(p)
    for r in range(new.world_size):
        rows = ex.rows(r, STORAGE)
        c = ex.columns
        pieces = [(ex.tensor_names[c["tensor"][i]], int(c["start"][i]), int(c["length"][i])) for i in rows.tolist()]
        items = storage_items(ptc, old, new, r, pieces)
        assert sum(it.length * it.itemsize for it in items) == int(c["nbytes"][rows].sum())
        want = {(n, s + k) for n, s, ln in pieces for k in range(ln)}
        got = {(it.tensor, it.chunk_start + it.a + k) for it in items for k in range(it.length)}
        assert got == want
        for it in items:  # destinations are where the new rank keeps those elements
            l2g = _local_to_global(ptc, it.tensor, new, r)
            assert np.array_equal(l2g[it.dst : it.dst + it.length],
                                  np.arange(it.chunk_start + it.a, it.chunk_start + it.b))


# ---------------------------------------------------------------------------------------------
# real migrations: a spawned gloo world of 3
# ---------------------------------------------------------------------------------------------
SAVE_ID = "0000cafe"

# name, distributed optimizer, old layout, alive, new layout, storage, rounds (schedule), group members
# (global ranks of a subgroup; None: the default group)
SCENARIOS: list[tuple[str, bool, ParallelConfig, list[int], ParallelConfig, bool, bool, list[int] | None]] = [
    ("dead rank, pieces from storage", True, P(dp=2, tp=2), [0, 2, 3], P(pp=3), True, False, None),
    ("reordered survivors in schedule rounds, one only sends", False, P(dp=2, tp=2), [3, 0, 2], P(tp=2), False, True,
     None),
    ("scale up: a fresh rank", True, P(tp=2), [0, 1], P(dp=3), False, False, None),
    ("a subgroup (group ranks are not global ranks)", True, P(tp=2), [1, 0], P(dp=2), False, False, [1, 2]),
]


def _ptc(dist_opt: bool) -> tenplex.PTC:
    return trainer_ptc("tiny", distributed_optimizer=dist_opt)


def _plan_of(sc: tuple) -> Plan:
    _, dist_opt, old, alive, new, _, _, _ = sc
    return tenplex.plan(_ptc(dist_opt), old, new, alive=alive, gpus_per_host=4)


def _migrate_worker(rank: int, port: int, url: str, out: Any) -> None:
    import torch.distributed as dist

    from tenplex.elastic.migrate import migrate
    from tenplex.planning.schedule import schedule
    from tenplex.planning.topology import Topology

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    try:
        for k, sc in enumerate(SCENARIOS):
            name, dist_opt, old, alive, new, use_storage, use_rounds, members = sc
            res: dict[str, Any] = {"error": None, "sent": 0, "received": 0, "local": 0, "storage": 0, "rounds": 0,
                                   "seconds": 0.0}
            group = dist.new_group(members) if members else None  # every rank joins new_group calls
            if members and rank not in members:
                out.put((k, rank, res))
                continue
            grank = dist.get_rank(group)
            try:
                ptc = _ptc(dist_opt)
                glob = random_global(ptc, seed=k)
                old_rank = alive[grank] if grank < len(alive) else None
                shard = ptc.shard(glob, old)[old_rank] if old_rank is not None else None
                p = tenplex.plan(ptc, old, new, alive=alive, gpus_per_host=4)
                rounds = schedule(p, Topology.from_spec("hosts=1,gpus=4"), time_limit=1.0) if use_rounds else None
                r = migrate(ptc, old, new, shard, alive=alive, group=group, old_rank=old_rank, new_rank=grank,
                            gpus_per_host=4, storage=url if use_storage else None, rounds=rounds, plan=p)
                res.update(sent=r.bytes_sent, received=r.bytes_received, local=r.bytes_local,
                           storage=r.bytes_storage, rounds=r.rounds, seconds=r.seconds,
                           storage_read=(r.storage_read.bytes_needed, r.storage_read.bytes_read)
                           if r.storage_read else None)
                if grank < new.world_size:
                    want = ptc.shard(glob, new)[grank]
                    assert set(r.shard) == set(want), (sorted(set(r.shard) ^ set(want)))
                    for n, t in want.items():
                        if isinstance(t, torch.Tensor):
                            assert_same(r.shard[n], t, n)
                        else:
                            assert r.shard[n] == t, n
                    if use_storage and r.bytes_storage:
                        res["load_read"] = tenplex.load(url, new, grank).stats.bytes_read
                else:
                    assert r.shard == {} and r.new_rank is None
                assert shard is None or all(torch.equal(shard[n], t) for n, t in ptc.shard(glob, old)[old_rank].items()
                                            if isinstance(t, torch.Tensor)), "the old shard was modified"
            except BaseException as e:  # reported to the parent, which fails the test with it
                import traceback

                res["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2500:]}"
            out.put((k, rank, res))
            if res["error"]:
                return
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(150)
def test_live_migration_in_a_gloo_world(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    ptc = _ptc(True)
    old = SCENARIOS[0][2]
    for r, shard in ptc.shard(random_global(ptc, seed=0), old).items():  # what the dead rank left behind
        tenplex.save(url, ptc, old, r, shard, step=5, save_id=SAVE_ID)
    t0 = time.monotonic()
    port = free_port()
    results = run_spawned(_migrate_worker, [(r, port, url) for r in range(3)], expect=3 * len(SCENARIOS), timeout=120)
    errors = [f"{SCENARIOS[k][0]}, rank {r}: {res['error']}" for (k, r), res in results.items() if res["error"]]
    assert not errors, "\n".join(errors)
    for k, sc in enumerate(SCENARIOS):
        p = _plan_of(sc)
        s = p.stats
        rs = [results[(k, r)] for r in range(3)]
        sent = sum(x["sent"] for x in rs)
        assert sent == sum(x["received"] for x in rs) == s.bytes_moved - s.bytes_storage, sc[0]
        assert sum(x["local"] for x in rs) == s.bytes_local, sc[0]
        assert sum(x["storage"] for x in rs) == s.bytes_storage, sc[0]
        if sc[5]:
            assert s.bytes_storage > 0
            for x in rs:
                if x["storage"]:
                    needed, read = x["storage_read"]
                    assert needed == x["storage"] <= read < x["load_read"], (needed, read, x["load_read"])
        else:
            assert s.bytes_storage == 0
        if sc[6]:
            assert max(x["rounds"] for x in rs) >= 1
    assert _plan_of(SCENARIOS[3]).stats.bytes_moved > 0 and results[(3, 0)]["seconds"] == 0  # not a member
    assert results[(1, 2)]["sent"] > 0 and results[(1, 2)]["received"] == 0  # the survivor outside the new world
    fresh = results[(2, 2)]
    assert fresh["sent"] == 0 and fresh["local"] == 0 and fresh["received"] == _plan_of(SCENARIOS[2]).received_bytes()[2]
    print(f"\nmigrations in {time.monotonic() - t0:.1f}s: "
          + "; ".join(f"{sc[0]}: {max(results[(k, r)]['seconds'] for r in range(3)) * 1e3:.0f} ms"
                      for k, sc in enumerate(SCENARIOS)))


def test_one_process_group_local_storage_and_refusals(tmp_path: Path) -> None:
    """A world of one: the survivor of tp=2 keeps its half and reads the dead rank's half from the
    checkpoint (again into given tensors, filled in place); a wrong group size, a missing storage URL
    and a shard on a fresh joiner are refused."""
    import torch.distributed as dist

    from tenplex.errors import PlanError
    from tenplex.elastic.migrate import migrate

    ptc = trainer_ptc("tiny", distributed_optimizer=True)
    glob = random_global(ptc, seed=3)
    old, new = P(tp=2), P()
    url = str(tmp_path / "ck")
    for r, shard in ptc.shard(glob, old).items():
        tenplex.save(url, ptc, old, r, shard, step=2, save_id=SAVE_ID)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mine = ptc.shard(glob, old)[1]
        res = migrate(ptc, old, new, mine, alive=[1], storage=url)
        want = ptc.shard(glob, new)[0]
        for n, t in want.items():
            if isinstance(t, torch.Tensor):
                assert_same(res.shard[n], t, n)
        s = tenplex.plan(ptc, old, new, alive=[1]).stats
        assert res.bytes_sent == res.bytes_received == 0
        assert (res.bytes_local, res.bytes_storage) == (s.bytes_local, s.bytes_storage) and s.bytes_storage > 0
        assert res.storage_read is not None and res.storage_read.bytes_needed == s.bytes_storage
        assert res.storage_read.step == 2
        # into: the new shard's own tensors receive the move in place (natural-order ones straight into
        # their memory, the others copied once from the flat buffer); a destination of another shape
        # or dtype is not used
        into = {n: torch.full_like(t, -1.0) for n, t in want.items() if isinstance(t, torch.Tensor)}
        odd = next(n for n, t in into.items() if t.dim() == 2)
        into[odd] = torch.empty(3, dtype=into[odd].dtype)
        kinds = {ptc.tensors[n].natural for n in into if n != odd}
        assert kinds == {True, False}, "both paths: a natural-order tensor and a relaid one"
        res = migrate(ptc, old, new, mine, alive=[1], storage=url, into=into)
        assert (res.bytes_local, res.bytes_storage) == (s.bytes_local, s.bytes_storage)
        for n, t in want.items():
            if isinstance(t, torch.Tensor):
                assert_same(res.shard[n], t, n)
                assert (res.shard[n] is into[n]) == (n != odd), n
        assert into[odd].shape == (3,)
        with pytest.raises(PlanError, match="pass storage="):
            migrate(ptc, old, new, mine, alive=[1])
        with pytest.raises(PlanError, match="group has 1 ranks"):
            migrate(ptc, old, P(tp=2), mine, alive=[1, 0], storage=url)
        with pytest.raises(PlanError, match="fresh joiner"):
            migrate(ptc, old, new, mine, alive=[], storage=url)
        with pytest.raises(PlanError, match="old rank"):
            migrate(ptc, old, new, mine, alive=[1], old_rank=0, storage=url)
        # a fresh joiner alone: every byte from storage
        res = migrate(ptc, old, new, None, alive=[], storage=url)
        assert res.bytes_storage == tenplex.plan(ptc, old, new, alive=[]).stats.bytes_needed
        for n, t in want.items():
            if isinstance(t, torch.Tensor):
                assert_same(res.shard[n], t, n)
    finally:
        dist.destroy_process_group()


def _dying_worker(rank: int, port: int, out: Any) -> None:
    import datetime

    import torch.distributed as dist

    from tenplex.elastic.migrate import migrate

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=10))
    ptc = trainer_ptc("tiny", distributed_optimizer=False)
    old, new = P(tp=2), P(dp=2)
    shard = ptc.shard(random_global(ptc, seed=1), old)[rank]
    dist.barrier()
    if rank == 1:
        os._exit(0)  # dies just before the migration
    time.sleep(0.5)
    try:
        migrate(ptc, old, new, shard, alive=[0, 1])
        out.put("no error")
    except BaseException as e:  # reported to the parent
        out.put(f"{type(e).__name__}: {e}")


@pytest.mark.timeout(60)
def test_a_peer_dying_raises_migration_error() -> None:
    ctx = worker_context()
    q = ctx.Queue()
    port = free_port()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    procs = [ctx.Process(target=in_env, args=(*here(), _dying_worker, r, port, q)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        got = q.get(timeout=45)
    finally:
        reap(procs)
    assert got.startswith("MigrationError: live migration"), got
