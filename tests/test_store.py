"""Host stores: HTTP byte ranges, tokens, tree confinement, replication and tiered recovery."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import fsspec
import pytest
import torch

from tenplex import CheckpointCorruptError, ParallelConfig, model_ptc, save
from tenplex.store import HostStore, StoreServer, Tier, load_tiered, recovery_tiers, usable_steps

PTC_ = model_ptc("tiny")


def _global(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {n: torch.randn(s.shape, generator=g) for n, s in PTC_.tensors.items()}
    out["optimizer.step"] = 7
    return out


def _stores(tmp_path: Path, n: int, *, replicas: int = 1, token: str | None = None) -> list[StoreServer]:
    servers = [StoreServer(str(tmp_path / f"host{i}"), token=token, replicas=replicas) for i in range(n)]
    for s in servers:
        s.peers = [x.address for x in servers]
        s.start()
    return servers


def _wait_replicated(servers: list[StoreServer], files: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(sum(len(v) for v in s.listing().values()) >= files for s in servers):
            return
        time.sleep(0.05)
    raise AssertionError({s.address: s.listing() for s in servers})


def _snapshot_all(servers: list[StoreServer], cfg: ParallelConfig, g: dict, step: int, per_host: int) -> None:
    shards = PTC_.shard(g, cfg)
    for r in range(cfg.world_size):
        s = servers[r // per_host]
        HostStore(str(s.root), s.address, s.token).snapshot(PTC_, cfg, r, shards[r], step=step)


@pytest.mark.timeout(60)
def test_range_reads_listing_and_health(tmp_path: Path) -> None:
    (server,) = _stores(tmp_path, 1)
    try:
        sdir = server.root / "step-000000000001-0123abcd"
        sdir.mkdir()
        (sdir / "blob.bin").write_bytes(bytes(range(256)) * 4)
        fs = fsspec.filesystem("http")
        url = f"{server.address}/step-000000000001-0123abcd/blob.bin"
        assert fs.cat_file(url, start=10, end=20) == bytes(range(10, 20))
        assert fs.size(url) == 1024
        assert any(p.endswith("blob.bin") for p in fs.ls(f"{server.address}/step-000000000001-0123abcd/",
                                                           detail=False))
        served_before = server.bytes_served
        fs.cat_file(url, start=100, end=110)
        assert server.bytes_served - served_before == 10  # only the range crossed the wire
        health = urllib.request.urlopen(f"{server.address}/health", timeout=5).read()
        assert b'"ok": true' in health
    finally:
        server.shutdown()


@pytest.mark.timeout(60)
def test_token_and_tree_confinement(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="token"):
        StoreServer(str(tmp_path / "x"), host="0.0.0.0")
    (server,) = _stores(tmp_path, 1, token="s3cret")
    try:
        (tmp_path / "secret.txt").write_text("outside")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{server.address}/health", timeout=5)
        assert e.value.code == 401
        req = urllib.request.Request(f"{server.address}/..%2Fsecret.txt", headers={"Authorization": "Bearer s3cret"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 403
        put = urllib.request.Request(f"{server.address}/evil.txt", data=b"x", method="PUT",
                                     headers={"Authorization": "Bearer s3cret"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(put, timeout=5)
        assert e.value.code == 403
        assert not (server.root / "evil.txt").exists()
        ok = urllib.request.Request(f"{server.address}/health", headers={"Authorization": "Bearer s3cret"})
        assert urllib.request.urlopen(ok, timeout=5).status == 200
    finally:
        server.shutdown()


def _needed_by_writer(old: ParallelConfig, new: ParallelConfig, rank: int) -> dict[int, int]:
    """Bytes new ``rank`` needs from each old writer rank's part (no I/O: a recording reader)."""
    from tenplex.checkpoint import read_shard

    needed: dict[int, int] = {}

    class Recorder:
        def read(self, w, name, chunk_start, a, b, dtype, itemsize, out=None):  # noqa: ANN001, ANN201
            needed[w] = needed.get(w, 0) + (b - a) * itemsize
            return torch.zeros(b - a, dtype=dtype)

    read_shard(PTC_, old, new, rank, Recorder())
    return needed


@pytest.mark.timeout(120)
def test_replication_and_host_failures(tmp_path: Path) -> None:
    """Three hosts, one replica: one failed host is survivable from memory, two need storage."""
    servers = _stores(tmp_path, 3, replicas=1)
    cfg, new = ParallelConfig(dp=3, tp=2), ParallelConfig(dp=1, tp=2, pp=2)
    g = _global(1)
    persistent = str(tmp_path / "persistent")
    shards = PTC_.shard(g, cfg)
    for r in range(cfg.world_size):
        save(persistent, PTC_, cfg, r, shards[r], step=4)  # an older persistent checkpoint
    try:
        _snapshot_all(servers, cfg, g, step=6, per_host=2)
        # every host holds its own 2 parts and its ring predecessor's 2 parts (+ manifest/objects)
        _wait_replicated(servers, files=8)
        urls = [s.address for s in servers]
        want = PTC_.shard(g, new)

        # host 2 dies: its parts survive on its ring successor, so memory still has every part
        servers[2].shutdown()
        local = HostStore(str(servers[0].root), servers[0].address)
        tiers = recovery_tiers(local, urls, persistent)
        assert [t.kind for t in tiers] == ["local", "peer", "storage"]
        assert usable_steps(tiers)[-1][0] == 6
        local_ranks = {int(f.name[5:10]) for d in servers[0].root.iterdir() if d.is_dir()
                       for f in d.glob("rank-*.json")}
        for r in range(new.world_size):
            res = load_tiered(tiers, new, r, ptc=PTC_)
            assert res.result.step == 6
            assert res.bytes_by_kind["storage"] == 0
            # bytes across hosts: exactly the needed pieces whose writer's part this host lacks
            # (attributed independently of the tiers), rounded out to checksum blocks
            need = _needed_by_writer(cfg, new, r)
            peer_need = sum(n for w, n in need.items() if w not in local_ranks)
            local_need = sum(n for w, n in need.items() if w in local_ranks)
            assert peer_need > 0 and local_need > 0
            assert peer_need <= res.bytes_by_kind["peer"] <= peer_need + 2 * 65536 * res.result.stats.ranges
            assert local_need <= res.bytes_by_kind["local"] <= local_need + 2 * 65536 * res.result.stats.ranges
            assert all(torch.equal(res.result.shard[n], want[r][n]) for n in PTC_.rank_tensors(new, r))
            assert sum(res.bytes_by_tier.values()) == res.result.stats.bytes_read >= res.result.stats.bytes_needed

        # host 1 dies too: with one replica, two failed hosts lose at least one host's parts (both dead
        # hosts cannot have the survivor as ring successor) -> recovery falls back to persistent step 4
        servers[1].shutdown()
        tiers = recovery_tiers(local, urls, persistent)
        assert [t.kind for t in tiers] == ["local", "storage"]
        res = load_tiered(tiers, new, 0, ptc=PTC_)
        assert res.result.step == 4 and res.bytes_by_kind["storage"] > 0
    finally:
        for s in servers:
            try:
                s.shutdown()
            except Exception:  # noqa: BLE001 - already stopped
                pass


@pytest.mark.timeout(120)
def test_corrupted_copy_falls_back_to_another(tmp_path: Path) -> None:
    servers = _stores(tmp_path, 2, replicas=1)
    cfg, new = ParallelConfig(dp=2), ParallelConfig(tp=2)
    g = _global(2)
    try:
        _snapshot_all(servers, cfg, g, step=3, per_host=1)
        _wait_replicated(servers, files=6)
        # damage host 0's own copy of rank 0's data inside a chunk every new rank reads (a replicated tensor)
        (sdir,) = [d for d in servers[0].root.iterdir() if d.is_dir()]
        index = json.loads((sdir / "rank-00000.json").read_text())
        chunk = next(c for c in index["chunks"] if c["tensor"].endswith("norm.weight"))
        data = bytearray((sdir / "rank-00000.safetensors").read_bytes())
        data[chunk["offset"] + 1] ^= 0xFF
        (sdir / "rank-00000.safetensors").write_bytes(bytes(data))
        local = HostStore(str(servers[0].root), servers[0].address)
        tiers = recovery_tiers(local, [s.address for s in servers], None)
        want = PTC_.shard(g, new)
        res = load_tiered(tiers, new, 0, ptc=PTC_)
        assert res.fallbacks >= 1 and res.bytes_by_kind["peer"] > 0
        assert all(torch.equal(res.result.shard[n], want[0][n]) for n in PTC_.rank_tensors(new, 0))
        # with the peer gone too, no intact copy of rank 0's part is left
        servers[1].shutdown()
        tiers = recovery_tiers(local, [s.address for s in servers], None)
        with pytest.raises(CheckpointCorruptError, match="no usable copy"):
            load_tiered(tiers, new, 0, ptc=PTC_)
    finally:
        for s in servers:
            try:
                s.shutdown()
            except Exception:  # noqa: BLE001
                pass


@pytest.mark.timeout(60)
def test_store_gc_keeps_newest_steps(tmp_path: Path) -> None:
    (server,) = _stores(tmp_path, 1)
    server.keep_last = 2
    try:
        cfg = ParallelConfig()
        shard = PTC_.shard(_global(3), cfg)[0]
        for step in (1, 2, 3, 4):
            HostStore(str(server.root), server.address).snapshot(PTC_, cfg, 0, shard, step=step)
        time.sleep(0.5)
        server.gc()
        steps = sorted(int(d.name[5:17]) for d in server.root.iterdir() if d.is_dir())
        assert steps == [3, 4]
    finally:
        server.shutdown()
