"""Tiered recovery follows the transfer schedule: peer-store reads run in the schedule's rounds."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

import tenplex.store.recovery_plan as recovery_plan
from tenplex import ConfigError, ParallelConfig, model_ptc, save
from tenplex.checkpoint import read_part_chunks
from tenplex.planning.topology import Topology
from tenplex.store import HostStore, StoreServer, Tier, TieredLoad, load_tiered, recovery_tiers
from tenplex.store.recovery import find_usable, plan_recovery
from tenplex.store.recovery_plan import RecoveryOptions

PTC_ = model_ptc("tiny")
OLD, NEW = ParallelConfig(dp=2, tp=2), ParallelConfig(tp=2, pp=2)
GPUS = 2  # ranks per host: old ranks 0-1 and new ranks 0-1 on host 0, 2-3 on host 1


def _global(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(s.shape, generator=g) for n, s in PTC_.tensors.items()}
    out["optimizer.step"] = 7
    return out


@pytest.fixture
def hosts(tmp_path: Path):  # noqa: ANN201 - yields (servers, global state)
    """Two host stores, each holding only its own ranks' parts (no replicas): every new rank reads from a peer."""
    servers = [StoreServer(str(tmp_path / f"host{i}"), replicas=1) for i in range(2)]
    for s in servers:
        s.peers = [x.address for x in servers]
        s.start()
    g = _global(3)
    shards = PTC_.shard(g, OLD)
    for r in range(OLD.world_size):
        s = servers[r // GPUS]
        HostStore(str(s.root), s.address).snapshot(PTC_, OLD, r, shards[r], step=5, replicate=False)
    try:
        yield servers, g
    finally:
        for s in servers:
            s.shutdown()


def _tiers(servers: list[StoreServer], rank: int, persistent: str | None = None) -> list[Tier]:
    s = servers[rank // GPUS]
    return recovery_tiers(HostStore(str(s.root), s.address), [x.address for x in servers], persistent)


def _same_shard(a: TieredLoad, b: TieredLoad, rank: int) -> bool:
    return all(torch.equal(a.result.shard[n], b.result.shard[n]) for n in PTC_.rank_tensors(NEW, rank))


def _intervals(items: list[tuple[str, int, int]]) -> dict[str, list[tuple[int, int]]]:
    """Element intervals per tensor, merged."""
    by: dict[str, list[tuple[int, int]]] = {}
    for name, s, ln in sorted(items):
        iv = by.setdefault(name, [])
        if iv and iv[-1][1] >= s:
            iv[-1] = (iv[-1][0], max(iv[-1][1], s + ln))
        else:
            iv.append((s, s + ln))
    return by


@pytest.mark.timeout(120)
def test_peer_reads_follow_the_schedule_rounds(hosts) -> None:  # noqa: ANN001
    servers, g = hosts
    want = PTC_.shard(g, NEW)
    for rank in range(NEW.world_size):
        tiers = _tiers(servers, rank)
        assert [t.kind for t in tiers] == ["local", "peer"]
        res = load_tiered(tiers, NEW, rank, ptc=PTC_, gpus_per_host=GPUS)
        plain = load_tiered(tiers, NEW, rank, ptc=PTC_, rounds=False)
        rr = res.rounds
        assert rr.followed and rr.reason == "" and rr.method == "greedy"
        # (a) bit-identical to the unscheduled load (and to the truth); (c) the same bytes from the same tiers
        assert _same_shard(res, plain, rank)
        assert all(torch.equal(res.result.shard[n], want[rank][n]) for n in PTC_.rank_tensors(NEW, rank))
        assert res.bytes_by_tier == plain.bytes_by_tier and res.bytes_by_kind["peer"] > 0
        assert res.result.stats.bytes_read == plain.result.stats.bytes_read
        assert sum(rr.bytes_per_round) == res.bytes_by_kind["peer"] and not rr.unscheduled

        # (b) the schedule, computed independently: what its rounds deliver to this rank's GPU
        rplan = plan_recovery(find_usable(tiers)[-1], tiers, NEW, rank, gpus_per_host=GPUS)
        assert rplan.schedule is not None and rplan.gpu == f"gpu{rank}"
        sched_rounds = rplan.schedule.rounds()
        assert rr.schedule_rounds == len(sched_rounds) == len(rplan.deliveries)
        for rnd, got in zip(sched_rounds, rplan.deliveries):
            to_me = sum(x.nbytes for x in rnd if x.dst == rplan.gpu)
            assert to_me == sum(ln * PTC_.tensors[n].itemsize for n, _, ln in got)
        # executed rounds in the schedule's order, one after another
        assert list(rr.order) == sorted(set(rr.order)) and len(rr.order) > 1
        for prev, nxt in zip(rr.executed, rr.executed[1:]):
            assert max(r.finished for r in prev) <= min(r.started for r in nxt)
        # every read runs in the first round that delivers any of its elements to this rank
        first: dict[tuple[str, int, int], int] = {}
        for rnd in rr.executed:
            for r in rnd:
                assert r.round == rnd[0].round and r.tier.startswith("peer:")
                hits = [k for k, got in enumerate(rplan.deliveries) for n, s, ln in got
                        if n == r.tensor and s < r.start + r.length and r.start < s + ln]
                first[(r.tensor, r.start, r.length)] = min(hits)
                assert r.round == min(hits)
        # and the reads cover exactly what the schedule delivers
        delivered = [iv for got in rplan.deliveries for iv in got]
        assert _intervals(delivered) == _intervals(list(first))


@pytest.mark.timeout(120)
def test_fallback_when_scheduling_is_off_fails_or_is_slow(hosts, monkeypatch) -> None:  # noqa: ANN001
    servers, _ = hosts
    tiers = _tiers(servers, 1)
    plain = load_tiered(tiers, NEW, 1, ptc=PTC_, rounds=False)
    assert not plain.rounds.followed and "disabled" in plain.rounds.reason

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("solver exploded")

    monkeypatch.setattr(recovery_plan, "schedule", broken)
    res = load_tiered(tiers, NEW, 1, ptc=PTC_, gpus_per_host=GPUS)
    assert not res.rounds.followed and "solver exploded" in res.rounds.reason and res.rounds.executed == ()
    assert _same_shard(res, plain, 1) and res.bytes_by_tier == plain.bytes_by_tier

    def slow(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        time.sleep(3)
        raise RuntimeError("too late")

    monkeypatch.setattr(recovery_plan, "schedule", slow)
    t0 = time.perf_counter()
    res = load_tiered(tiers, NEW, 1, ptc=PTC_, gpus_per_host=GPUS, time_limit=0.2)
    assert time.perf_counter() - t0 < 3
    assert not res.rounds.followed and "longer than" in res.rounds.reason
    assert _same_shard(res, plain, 1) and res.bytes_by_tier == plain.bytes_by_tier

    # a topology with too few hosts for the stores is a clear error, logged, and the load goes on
    monkeypatch.undo()

    res = load_tiered(tiers, NEW, 1, ptc=PTC_, topology=Topology.from_spec("hosts=1,gpus=4"))
    assert not res.rounds.followed and "peer stores" in res.rounds.reason and _same_shard(res, plain, 1)


@pytest.mark.timeout(120)
def test_corrupt_peer_copy_falls_back_within_the_rounds(hosts, tmp_path: Path) -> None:  # noqa: ANN001
    servers, g = hosts
    persistent = str(tmp_path / "persistent")
    shards = PTC_.shard(g, OLD)
    for r in range(OLD.world_size):
        save(persistent, PTC_, OLD, r, shards[r], step=5, save_id=find_usable(_tiers(servers, 0))[-1].save_id)
    # damage host 1's copy of rank 2's data in a chunk new rank 0 reads
    (sdir,) = [d for d in servers[1].root.iterdir() if d.is_dir()]
    # the chunks of the attempt's rank 2 part (from its complete copy: host 1 holds no manifest)
    chunk = next(c for c in read_part_chunks(f"{persistent}/{sdir.name}", 2) if c["tensor"].endswith("norm.weight"))
    data = bytearray((sdir / "rank-00002.safetensors").read_bytes())
    data[chunk["offset"] + 1] ^= 0xFF
    (sdir / "rank-00002.safetensors").write_bytes(bytes(data))
    tiers = _tiers(servers, 0, persistent)
    assert [t.kind for t in tiers] == ["local", "peer", "storage"]
    res = load_tiered(tiers, NEW, 0, ptc=PTC_, gpus_per_host=GPUS)
    assert res.rounds.followed and res.fallbacks >= 1 and res.bytes_by_kind["storage"] > 0
    assert all(torch.equal(res.result.shard[n], PTC_.shard(g, NEW)[0][n]) for n in PTC_.rank_tensors(NEW, 0))
    plain = load_tiered(tiers, NEW, 0, ptc=PTC_, rounds=False)
    assert _same_shard(res, plain, 0) and res.fallbacks == plain.fallbacks
    # the same bytes in all; which of rank 2's pieces came from the peer before the damage showed
    # depends on the read order
    assert res.result.stats.bytes_read == plain.result.stats.bytes_read
    assert res.bytes_by_kind["local"] == plain.bytes_by_kind["local"]


@pytest.mark.timeout(120)
def test_rescale_with_tiers_reads_in_rounds(hosts, tmp_path: Path) -> None:  # noqa: ANN001
    import tenplex

    servers, g = hosts
    res = tenplex.rescale(str(tmp_path / "none"), PTC_, rank=3, world_size=4, parallel=NEW,
                          tiers=_tiers(servers, 3), gpus_per_host=GPUS)
    assert res.step == 5 and res.bytes_by_tier["peer"] > 0
    assert all(torch.equal(res.shard[n], PTC_.shard(g, NEW)[3][n]) for n in PTC_.rank_tensors(NEW, 3))


@pytest.mark.timeout(120)
def test_malformed_peer_index_and_manifest_fall_back_within_the_rounds(hosts, tmp_path: Path) -> None:  # noqa: ANN001
    """A peer's rank index that fails its digest, and a local manifest that does, are read from
    the next tier holding a copy (persistent storage), with the peer reads still in rounds."""
    servers, g = hosts
    persistent = str(tmp_path / "persistent")
    shards = PTC_.shard(g, OLD)
    for r in range(OLD.world_size):
        save(persistent, PTC_, OLD, r, shards[r], step=5, save_id=find_usable(_tiers(servers, 0))[-1].save_id)
    (peer_dir,) = [d for d in servers[1].root.iterdir() if d.is_dir()]
    (local_dir,) = [d for d in servers[0].root.iterdir() if d.is_dir()]
    for path, find in ((peer_dir / "rank-00002.json", b'"data_offset":'),
                       (local_dir / "manifest.json", b'"world_size":')):
        raw = path.read_bytes()
        bad = bytearray(raw)
        bad[raw.index(find) + len(find)] ^= 0x01  # a digit: still valid JSON
        path.write_bytes(bytes(bad))
    tiers = _tiers(servers, 0, persistent)
    res = load_tiered(tiers, NEW, 0, ptc=PTC_, gpus_per_host=GPUS)
    assert res.result.step == 5 and res.result.skipped == ()
    assert res.tiers_used[2] == "storage" and res.bytes_by_kind["storage"] > 0
    assert all(torch.equal(res.result.shard[n], PTC_.shard(g, NEW)[0][n]) for n in PTC_.rank_tensors(NEW, 0))


def test_recovery_options_are_validated_and_fields_override() -> None:
    with pytest.raises(ConfigError, match="RecoveryOptions.gpus_per_host must be an integer >= 1, got 0"):
        RecoveryOptions(gpus_per_host=0)
    with pytest.raises(ConfigError, match="RecoveryOptions.method 'fast' is not one of auto, milp, lp, greedy"):
        RecoveryOptions(method="fast")
    with pytest.raises(ConfigError, match="time_limit must be a finite number > 0, got 0"):
        RecoveryOptions(time_limit=0)
    # the default topology: as many hosts as stores (one more without a local one) or as the new world needs
    local, peer = Tier("local", "memory://a", "local"), Tier("peer:b", "memory://b", "peer")
    def hosts(topo: Topology) -> int:
        return sum(d.get("kind") == "host" for _, d in topo.graph.nodes(data=True))

    topo = RecoveryOptions(gpus_per_host=2).topology_for([local, peer], ParallelConfig(dp=3, tp=2))
    assert (topo.gpus_per_host, hosts(topo)) == (2, 3)  # 6 GPUs of the new world: 3 hosts of 2
    assert hosts(RecoveryOptions(gpus_per_host=4).topology_for([peer], ParallelConfig(dp=1))) == 2
