"""Host stores: HTTP byte ranges, tokens, tree confinement, replication, GC, robustness and tiered recovery.

Every store here is a real ``StoreServer`` on 127.0.0.1 (or ``tenplex store serve`` in a child
process where resources are measured); malformed requests go over raw sockets.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import fsspec
import pytest
import torch

from tenplex import CheckpointCorruptError, ConfigError, ParallelConfig, model_ptc, save
from tenplex.checkpoint import read_part_chunks
from tenplex.checkpoint.writer import PartWriter
from tenplex.cli import main as cli_main
from tenplex.store import (HostStore, StoreOptions, StoreServer, Tier, alive_stores, load_tiered, peer_storage_options,
                           recovery_tiers, resolve_token, step_complete, store_token, usable_steps)
from tenplex.train.launch import StoreProcess, free_port

PTC_ = model_ptc("tiny")
STEP = "step-000000000001-0123abcd"


@pytest.fixture(autouse=True)
def _own_token_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test finds (or generates) the default store token in a directory of its own."""
    d = tmp_path_factory.mktemp("runtime")
    d.chmod(0o700)
    monkeypatch.setenv("TENPLEX_RUNTIME_DIR", str(d))
    monkeypatch.delenv("TENPLEX_STORE_TOKEN", raising=False)
    monkeypatch.delenv("TENPLEX_STORE_TOKEN_FILE", raising=False)


def raw(server: StoreServer | int, data: bytes, *, timeout: float = 5.0) -> tuple[int, bytes]:
    """Send ``data`` as is on a fresh connection; (status, body) of the answer (0: no answer)."""
    port = server if isinstance(server, int) else int(server.address.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as c:
        try:
            c.sendall(data)
        except OSError:
            pass
        buf = b""
        try:
            while b"\r\n\r\n" not in buf:
                chunk = c.recv(65536)
                if not chunk:
                    break
                buf += chunk
        except OSError:
            pass
    if not buf.startswith(b"HTTP/1."):
        return 0, buf
    head, _, body = buf.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def request(server: StoreServer, method: str, path: str, body: bytes | None = None, *, token: str | None = "",
            headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One HTTP request with ``server``'s token (``token=None``: none; a string: that one)."""
    h = dict(headers or {})
    tok = server.token if token == "" else token
    if tok is not None:
        h["Authorization"] = f"Bearer {tok}"
    u = server.address.rsplit(":", 1)
    c = http.client.HTTPConnection("127.0.0.1", int(u[1]), timeout=10)
    try:
        c.request(method, path, body=body, headers=h)
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


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
        fs = fsspec.filesystem("http", **peer_storage_options(server.token))  # every request carries the token
        url = f"{server.address}/step-000000000001-0123abcd/blob.bin"
        assert fs.cat_file(url, start=10, end=20) == bytes(range(10, 20))
        assert fs.size(url) == 1024
        assert any(p.endswith("blob.bin") for p in fs.ls(f"{server.address}/step-000000000001-0123abcd/",
                                                           detail=False))
        served_before = server.bytes_served
        fs.cat_file(url, start=100, end=110)
        assert server.bytes_served - served_before == 10  # only the range crossed the wire
        status, health = request(server, "GET", "/health")
        assert status == 200 and json.loads(health)["ok"] is True
    finally:
        server.shutdown()


@pytest.mark.timeout(60)
def test_token_and_tree_confinement(tmp_path: Path) -> None:
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
    """Bytes new ``rank`` needs from each old writer rank's part (no I/O: the read plan)."""
    from tenplex.checkpoint import plan_reads

    needed: dict[int, int] = {}
    for item in plan_reads(PTC_, old, new, rank):
        needed[item.writer] = needed.get(item.writer, 0) + item.length * item.itemsize
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
        chunk = next(c for c in read_part_chunks(str(sdir), 0) if c["tensor"].endswith("norm.weight"))
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


# ---------------------------------------------------------------------------------------------
# GC keeps what is usable (finding 2)
# ---------------------------------------------------------------------------------------------
def _snap(server: StoreServer, step: int, seed: int = 3) -> None:
    cfg = ParallelConfig()
    HostStore(str(server.root), server.address).snapshot(PTC_, cfg, 0, PTC_.shard(_global(seed), cfg)[0], step=step,
                                                         replicate=False)
    time.sleep(0.02)  # distinct modification times even on file systems with coarse clocks


def _usable(server: StoreServer) -> list[int]:
    return [s for s, _, _ in usable_steps([Tier("local", str(server.root), "local")])]


@pytest.mark.timeout(60)
def test_gc_keeps_new_snapshots_after_a_rollback(tmp_path: Path) -> None:
    """Steps 20 and 22 from before a rollback to step 10: the new snapshots 12, 14, 15 are kept."""
    server = StoreServer(str(tmp_path / "s"), keep_last=2)
    try:
        for step in (20, 22):
            _snap(server, step)
        server.gc()
        assert _usable(server) == [20, 22]
        for step in (12, 14, 15):
            _snap(server, step)
            server.gc()
            assert step in _usable(server)  # the snapshot just written survives its own GC
        assert _usable(server) == [14, 15]
    finally:
        server.shutdown()


@pytest.mark.timeout(60)
def test_gc_ignores_bogus_and_incomplete_steps(tmp_path: Path) -> None:
    (server,) = _stores(tmp_path, 1)
    server.keep_last, server.incomplete_grace = 1, 0.0
    try:
        _snap(server, 4)
        _snap(server, 6)
        server.gc()
        assert _usable(server) == [6]
        bogus = "/step-999999999998-00000000/rank-99999.json"
        assert request(server, "PUT", bogus, b"{}")[0] == 201
        assert request(server, "PUT", bogus, b"{}")[0] == 200  # identical bytes: idempotent
        assert not step_complete(server.root / "step-999999999998-00000000")
        # a part still being written (data, no index) is incomplete too and does not count
        partial = server.root / "step-000000000007-0000beef"
        partial.mkdir()
        (partial / "rank-00000.safetensors").write_bytes(b"x" * 100)
        server.gc()
        assert _usable(server) == [6] and partial.exists()
        # once a newer complete step exists, superseded incomplete attempts go (after the grace period)
        _snap(server, 8)
        server.gc()
        assert _usable(server) == [8]
        assert not partial.exists() and not (server.root / "step-999999999998-00000000").exists()
    finally:
        server.shutdown()


@pytest.mark.timeout(60)
def test_gc_never_removes_the_newest_complete_step(tmp_path: Path) -> None:
    server = StoreServer(str(tmp_path / "s"), keep_last=1, incomplete_grace=0.0)
    try:
        _snap(server, 5)
        d = server.root / "step-000000000009-0000abcd"  # newer but damaged: index size disagrees with the data
        d.mkdir()
        (d / "rank-00000.safetensors").write_bytes(b"x" * 10)
        (d / "rank-00000.json").write_text(json.dumps({"file": "rank-00000.safetensors", "file_size": 11}))
        server.gc()
        assert _usable(server) == [5]
    finally:
        server.shutdown()


def _part(server: StoreServer, cfg: ParallelConfig, rank: int, step: int, save_id: str) -> PartWriter:
    """Rank ``rank``'s part of ``step`` streamed to its temporary file, not yet published."""
    part = PartWriter(fsspec.filesystem("file"), f"{server.root}/step-{step:012d}-{save_id}", PTC_, cfg, rank,
                      step=step, save_id=save_id)
    part.begin()
    part.stream(_Flats(PTC_.shard(_global(step), cfg)[rank], cfg, rank))
    return part


class _Flats(dict):
    """A shard as ``PartWriter.stream`` reads it: each tensor's canonical flat form."""

    def __init__(self, shard: dict, cfg: ParallelConfig, rank: int) -> None:
        super().__init__({n: PTC_.to_local_flat(n, t, cfg, rank) for n, t in shard.items() if n in PTC_.tensors})


@pytest.mark.timeout(60)
def test_gc_leaves_a_step_another_local_rank_still_writes(tmp_path: Path) -> None:
    """Issue 29 item 6: two ranks of one host flush their newest states on SIGTERM, rank 0 steps
    136 and 137, rank 1 (one step behind) 135 and 136. Rank 1's 135 lands after rank 0's 136,
    so by arrival 136 was the oldest of three attempts that each held one whole part; rank 0's
    ``/replicate`` of 137 made the GC (keep_last 2) remove 136 while rank 1 streamed into it:
    its publish found its temporary file gone, and the one step both ranks held was lost.
    A step lacking a rank that the same launch's other steps here hold is not complete."""
    server = StoreServer(str(tmp_path / "s"), keep_last=2).start()
    cfg, sid = ParallelConfig(dp=2), "0000c0de"
    host = HostStore(str(server.root), server.address, server.token)
    g = {s: PTC_.shard(_global(s), cfg) for s in (100, 135, 136, 137)}
    try:
        for r in (0, 1):  # the periodic snapshot: both ranks
            host.snapshot(PTC_, cfg, r, g[100][r], step=100, save_id=sid)
        for rank, step in ((0, 136), (1, 135)):
            time.sleep(0.02)  # distinct modification times
            host.snapshot(PTC_, cfg, rank, g[step][rank], step=step, save_id=sid)
        part = _part(server, cfg, 1, 136, sid)  # rank 1 streams its part of 136 ...
        time.sleep(0.02)
        host.snapshot(PTC_, cfg, 0, g[137][0], step=137, save_id=sid)  # ... when rank 0's 137 asks for GC
        part.publish()  # before the fix: FileNotFoundError, its temporary file removed
        server.gc()
        assert 136 in _usable(server), server.listing()
        tier = [Tier("local", str(server.root), "local")]
        for r in (0, 1):
            res = load_tiered(tier, cfg, r, ptc=PTC_, step=136)
            assert res.result.step == 136
            assert all(torch.equal(res.result.shard[n], g[136][r][n]) for n in PTC_.rank_tensors(cfg, r))
    finally:
        server.shutdown()


@pytest.mark.timeout(60)
def test_gc_never_removes_an_attempt_a_writer_is_writing_into(tmp_path: Path) -> None:
    """A launch's first step: rank 0's part is whole, rank 1 streams its own; a newer complete
    attempt of another launch (keep_last 1) supersedes it, but rank 1's fresh temporary file
    keeps it: no clean-up removes a file a live writer owns."""
    server = StoreServer(str(tmp_path / "s"), keep_last=1).start()
    cfg = ParallelConfig(dp=2)
    host = HostStore(str(server.root), server.address, server.token)
    try:
        host.snapshot(PTC_, cfg, 0, PTC_.shard(_global(10), cfg)[0], step=10, save_id="0000aaaa")
        part = _part(server, cfg, 1, 10, "0000aaaa")
        time.sleep(0.02)
        for r in (0, 1):
            host.snapshot(PTC_, cfg, r, PTC_.shard(_global(12), cfg)[r], step=12, save_id="0000bbbb")
        part.publish()  # before: FileNotFoundError, the attempt removed under it
        assert step_complete(server.root / "step-000000000010-0000aaaa")
        server.incomplete_grace = 0.0  # once nobody writes into it, the superseded attempt goes
        assert server.gc() == ["step-000000000010-0000aaaa"]
    finally:
        server.shutdown()


def test_keep_last_must_be_at_least_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for k in (0, -1):
        with pytest.raises(ConfigError, match=rf"keep_last = {k} < 1"):
            StoreServer(str(tmp_path / "s"), keep_last=k)
    assert cli_main(["store", "serve", "--root", str(tmp_path / "s"), "--listen", "127.0.0.1:0",
                     "--keep-last", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "keep_last = -1 < 1" in err and "--keep-last 1" in err


def test_store_options_are_validated_and_fields_override(tmp_path: Path) -> None:
    """StoreOptions: validated once (the CLI's, serve's and StoreServer's), the token out of its repr;
    StoreServer's keywords override single fields of the options given."""
    with pytest.raises(ConfigError, match=r"incomplete_grace = -1\.0 < 0"):
        StoreOptions(incomplete_grace=-1.0)
    with pytest.raises(ConfigError, match="is not a store URL"):
        StoreOptions(peers=["ftp://10.0.0.2:7700"])
    opts = StoreOptions(token="s3cret-token", keep_last=3, peers=["http://10.0.0.2:7700/"])
    assert "s3cret" not in repr(opts) and opts.peers == ("http://10.0.0.2:7700",)
    server = StoreServer(str(tmp_path / "s"), options=opts, replicas=0)
    try:
        assert (server.keep_last, server.replicas, server.token, server.peers) == \
            (3, 0, "s3cret-token", ["http://10.0.0.2:7700"])
        assert server.replica_targets() == []
    finally:
        server.shutdown()


# ---------------------------------------------------------------------------------------------
# tokens on loopback too, write-once parts (findings 8, 9)
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_every_request_needs_the_token_on_loopback(tmp_path: Path) -> None:
    server = StoreServer(str(tmp_path / "s")).start()  # no token given: one is generated
    try:
        assert server.loopback and server.token
        (server.root / STEP).mkdir()
        (server.root / STEP / "rank-00000.json").write_text("{}")
        part = f"/{STEP}/rank-00001.json"
        for method, path, body in [("GET", "/health", None), ("GET", "/list", None), ("GET", "/", None),
                                   ("GET", f"/{STEP}/rank-00000.json", None), ("HEAD", f"/{STEP}/rank-00000.json", None),
                                   ("PUT", part, b"{}"), ("POST", "/replicate", b"{}")]:
            for token in (None, "wrong", server.token + "x", server.token[:-1]):
                assert request(server, method, path, body, token=token)[0] == 401, (method, path, token)
        assert not (server.root / STEP / "rank-00001.json").exists()
        assert request(server, "GET", "/health")[0] == 200
    finally:
        server.shutdown()


@pytest.mark.timeout(60)
def test_parts_are_write_once(tmp_path: Path) -> None:
    (server,) = _stores(tmp_path, 1)
    try:
        part = f"/{STEP}/rank-00000.safetensors"
        assert request(server, "PUT", part, b"a" * 1000)[0] == 201
        assert request(server, "PUT", part, b"a" * 1000)[0] == 200  # a replication retry
        assert request(server, "PUT", part, b"b" * 1000)[0] == 409
        assert request(server, "PUT", part, b"a" * 999)[0] == 409
        assert (server.root / STEP / "rank-00000.safetensors").read_bytes() == b"a" * 1000
        index = f"/{STEP}/rank-00000.json"
        assert request(server, "PUT", index, b'{"file": "rank-00000.safetensors"}')[0] == 201
        assert request(server, "PUT", index, b'{"file": "evil"}')[0] == 409
        # only checkpoint file names inside step directories
        for path in (f"/{STEP}/evil.txt", f"/{STEP}/.rank-00000.json", "/evil.txt", f"/{STEP}/x/rank-00000.json",
                     "/step-1-0123abcd/rank-00000.json", f"/{STEP}/rank-0.json"):
            assert request(server, "PUT", path, b"x")[0] in (403, 404), path
        assert sorted(os.listdir(server.root / STEP)) == ["rank-00000.json", "rank-00000.safetensors"]
    finally:
        server.shutdown()


def test_loopback_is_judged_on_the_resolved_address(tmp_path: Path) -> None:
    # names that merely start like loopback are resolved first: here they do not resolve (or not to
    # an address of this machine), so the store refuses to start instead of skipping the token
    for host in ("localhost.attacker.example", "127.attacker.example"):
        with pytest.raises(ConfigError, match="listen"):
            StoreServer(str(tmp_path / "s"), host=host)
    server = StoreServer(str(tmp_path / "s"), host="localhost")
    try:
        assert server.loopback and server.httpd.server_address[0].startswith("127.")
    finally:
        server.shutdown()


def test_token_sources_and_file_permissions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = StoreServer(str(tmp_path / "s"))  # generated into the default token file
    path = Path(os.environ["TENPLEX_RUNTIME_DIR"]) / "store.token"
    try:
        assert path.stat().st_mode & 0o777 == 0o600 and path.read_text().strip() == server.token
        assert "generated" in server.token_source
        assert StoreServer(str(tmp_path / "t")).token == server.token  # a second store of the user agrees
    finally:
        server.shutdown()
    assert store_token() == server.token and HostStore("r", "u").token is None
    monkeypatch.setenv("TENPLEX_STORE_ROOT", "r")
    monkeypatch.setenv("TENPLEX_STORE_URL", "u")
    assert HostStore.from_env().token == server.token
    other = tmp_path / "other.token"
    other.write_text("from-file\n")
    other.chmod(0o644)
    monkeypatch.setenv("TENPLEX_STORE_TOKEN_FILE", str(other))
    with pytest.raises(ConfigError, match=r"chmod 600"):
        store_token()
    other.chmod(0o600)
    assert store_token() == "from-file" and HostStore.from_env().token == "from-file"
    link = tmp_path / "link.token"
    link.symlink_to(other)
    with pytest.raises(ConfigError, match="symlink"):
        resolve_token(token_file=str(link))
    monkeypatch.setenv("TENPLEX_STORE_TOKEN", "from-env")
    assert store_token() == "from-env" and store_token("given") == "given"
    monkeypatch.setenv("TENPLEX_STORE_TOKEN", "two words")
    with pytest.raises(ConfigError, match="visible ASCII"):
        store_token()


# ---------------------------------------------------------------------------------------------
# replication stays inside the root and survives bad input (finding 10)
# ---------------------------------------------------------------------------------------------
def _post_replicate(server: StoreServer, step_dir: object, files: object) -> int:
    return request(server, "POST", "/replicate", json.dumps({"step_dir": step_dir, "files": files}).encode())[0]


@pytest.mark.timeout(60)
def test_replication_reads_only_regular_files_inside_the_root(tmp_path: Path) -> None:
    a, b = _stores(tmp_path, 2)
    try:
        secret = tmp_path / "secret.bin"
        secret.write_bytes(b"outside the root")
        d = a.root / STEP
        d.mkdir()
        (d / "rank-00000.safetensors").symlink_to(secret)  # a link out of the root
        os.mkfifo(d / "rank-00001.safetensors")  # would block a plain open
        (d / "rank-00002.safetensors").mkdir()
        (d / "rank-00003.safetensors").write_bytes(b"good data")
        (d / "rank-00003.json").write_text("{}")
        for n in range(4):
            files = [f"rank-{n:05d}.safetensors", f"rank-{n:05d}.json"]
            assert _post_replicate(a, STEP, files) == 202
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (b.root / STEP / "rank-00003.json").exists():
            time.sleep(0.05)
        got = sorted(os.listdir(b.root / STEP))
        assert got == ["rank-00003.json", "rank-00003.safetensors"]  # the bad parts and their indexes stayed
        assert b"outside" not in b"".join(p.read_bytes() for p in (b.root / STEP).iterdir())
        health = json.loads(request(a, "GET", "/health")[1])
        assert health["ok"] and health["replicator"]["alive"] and health["replicator"]["failures"] == 3
        assert "no regular file" in health["replicator"]["last_error"]
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.timeout(60)
def test_bad_replicate_payloads_are_refused_and_the_replicator_lives(tmp_path: Path) -> None:
    a, b = _stores(tmp_path, 2)
    try:
        for step_dir, files in [(STEP, ["rank-00000.json\x00"]), (STEP, ["../../etc/passwd"]), ("../x", ["manifest.json"]),
                                (STEP, ["a/b"]), (STEP, []), (STEP, "manifest.json"), (7, ["manifest.json"]),
                                (STEP, [1]), (STEP, ["rank-00000.json"] * 65), (STEP + "\x00", ["objects.pt"])]:
            assert _post_replicate(a, step_dir, files) == 400, (step_dir, files)
        for body in (b"{", b"[]", b"null", b'{"step_dir": "x"}', "\u00e9".encode()):
            assert request(a, "POST", "/replicate", body)[0] == 400
        health = json.loads(request(a, "GET", "/health")[1])
        assert health["ok"] and health["replicator"]["alive"]
        _snapshot_all([a], ParallelConfig(), _global(5), step=2, per_host=1)  # real replication still works
        _wait_replicated([b], files=4)
        # /health says not ok once the replicator is gone
        a._replicator.stop()
        a._replicator.thread.join(5)
        health = json.loads(request(a, "GET", "/health")[1])
        assert health["ok"] is False and health["replicator"]["alive"] is False
    finally:
        a.shutdown()
        b.shutdown()


# ---------------------------------------------------------------------------------------------
# robust HTTP: malformed requests, timeouts, connection cap, streaming (finding 11)
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_malformed_requests_get_4xx_without_tracebacks(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                       caplog: pytest.LogCaptureFixture) -> None:
    (server,) = _stores(tmp_path, 1)
    (server.root / STEP).mkdir()
    (server.root / STEP / "rank-00000.safetensors").write_bytes(bytes(range(256)) * 4)
    auth = f"Authorization: Bearer {server.token}\r\n".encode()
    f = f"/{STEP}/rank-00000.safetensors".encode()
    cases = {
        "reversed range": (b"GET " + f + b" HTTP/1.1\r\n" + auth + b"Range: bytes=100-11\r\n\r\n", 416),
        "range beyond": (b"GET " + f + b" HTTP/1.1\r\n" + auth + b"Range: bytes=5000-\r\n\r\n", 416),
        "two ranges": (b"GET " + f + b" HTTP/1.1\r\n" + auth + b"Range: bytes=0-1,4-5\r\n\r\n", 416),
        "huge range": (b"GET " + f + b" HTTP/1.1\r\n" + auth + b"Range: bytes=0-" + b"9" * 30 + b"\r\n\r\n", 416),
        "NUL in path": (b"GET /%00 HTTP/1.1\r\n" + auth + b"\r\n", 400),
        "NUL in file name": (b"GET /" + STEP.encode() + b"/rank%00.json HTTP/1.1\r\n" + auth + b"\r\n", 400),
        "300-char component": (b"GET /" + b"a" * 300 + b" HTTP/1.1\r\n" + auth + b"\r\n", 400),
        "non-UTF-8 path": (b"GET /%ff%fe HTTP/1.1\r\n" + auth + b"\r\n", 400),
        "absolute-form target": (b"GET http://x/health HTTP/1.1\r\n" + auth + b"\r\n", 400),
        "non-ASCII Authorization": (b"GET /health HTTP/1.1\r\nAuthorization: Bearer \xe9\xe9\r\n\r\n", 400),
        "non-ASCII other header": (b"GET /health HTTP/1.1\r\n" + auth + b"X-Name: \xff\r\n\r\n", 400),
        "Content-Length abc": (b"PUT /" + STEP.encode() + b"/rank-00001.json HTTP/1.1\r\n" + auth
                               + b"Content-Length: abc\r\n\r\n", 400),
        "Content-Length -1": (b"PUT /" + STEP.encode() + b"/rank-00001.json HTTP/1.1\r\n" + auth
                              + b"Content-Length: -1\r\n\r\n", 400),
        "no Content-Length": (b"PUT /" + STEP.encode() + b"/rank-00001.json HTTP/1.1\r\n" + auth + b"\r\n", 411),
        "chunked PUT": (b"PUT /" + STEP.encode() + b"/rank-00001.json HTTP/1.1\r\n" + auth
                        + b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 411),
        "two Content-Lengths": (b"PUT /" + STEP.encode() + b"/rank-00001.json HTTP/1.1\r\n" + auth
                                + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400),
        "POST Content-Length abc": (b"POST /replicate HTTP/1.1\r\n" + auth + b"Content-Length: abc\r\n\r\n", 400),
        "POST too large": (b"POST /replicate HTTP/1.1\r\n" + auth + b"Content-Length: 99999999\r\n\r\n", 413),
        "DELETE": (b"DELETE " + f + b" HTTP/1.1\r\n" + auth + b"\r\n", 405),
        "garbage request line": (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),
    }
    caplog.set_level("DEBUG", logger="tenplex.store")
    try:
        for what, (data, want) in cases.items():
            assert raw(server, data)[0] == want, what
        # a short body: the client gives up half way (the connection is closed; nothing is stored)
        with socket.create_connection(("127.0.0.1", int(server.address.rsplit(":", 1)[1]))) as c:
            c.sendall(b"PUT /" + STEP.encode() + b"/rank-00001.json HTTP/1.1\r\n" + auth + b"Content-Length: 10\r\n\r\n{}")
        time.sleep(0.3)
        assert not (server.root / STEP / "rank-00001.json").exists()
        assert request(server, "GET", f"/{STEP}/rank-00000.safetensors", headers={"Range": "bytes=10-19"}) \
            == (206, bytes(range(10, 20)))
    finally:
        server.shutdown()
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")]


@pytest.mark.timeout(60)
def test_idle_connections_are_capped_and_time_out(tmp_path: Path) -> None:
    """40 idle sockets against a cap of 8: at most 8 handler threads at once, all gone after the timeout."""
    server = StoreServer(str(tmp_path / "s"), max_connections=8, timeout=1.0).start()
    base = threading.active_count()  # threads of other servers can only end meanwhile
    try:
        port = int(server.address.rsplit(":", 1)[1])
        socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(40)]
        time.sleep(0.5)
        assert 0 < server.httpd.active <= 8 and threading.active_count() - base <= 8
        peak = 0
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and server.httpd.active:
            peak = max(peak, server.httpd.active, threading.active_count() - base)
            time.sleep(0.1)
        assert peak <= 8 and server.httpd.active == 0  # every idle socket timed out (or got 503)
        assert threading.active_count() <= base
        for s in socks:
            s.close()
        assert request(server, "GET", "/health")[0] == 200
        # a client that stops sending half way through a body is cut off too
        with socket.create_connection(("127.0.0.1", port)) as c:
            c.sendall(b"PUT /" + STEP.encode() + f"/objects.pt HTTP/1.1\r\nAuthorization: Bearer {server.token}\r\n"
                      "Content-Length: 1000\r\n\r\nabc".encode())
            c.settimeout(5)
            t0 = time.monotonic()
            assert c.recv(100) == b"" and time.monotonic() - t0 < 3
    finally:
        server.shutdown()


def _vm(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) << 10
    raise KeyError(key)


@pytest.mark.timeout(120)
def test_concurrent_gets_stream_instead_of_buffering(tmp_path: Path) -> None:
    """8 clients GET a 48 MiB file at once: the store's peak RSS grows by far less than 8 x 48 MiB."""
    size = 48 << 20
    root = tmp_path / "s"
    (root / STEP).mkdir(parents=True)
    data = os.urandom(1 << 20) * 48
    (root / STEP / "rank-00000.safetensors").write_bytes(data)
    token = "t" * 32
    port = free_port()
    proc = StoreProcess(str(root), port, [], token=token)
    try:
        before = _vm(proc.proc.pid, "VmHWM")
        errors: list[str] = []

        def get() -> None:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            c.request("GET", f"/{STEP}/rank-00000.safetensors",
                      headers={"Authorization": f"Bearer {token}", "Range": f"bytes=0-{size - 1}"})
            r = c.getresponse()
            got = bytearray()
            while chunk := r.read(1 << 20):
                got += chunk
                time.sleep(0.001)
            if bytes(got) != data:
                errors.append("wrong bytes")

        threads = [threading.Thread(target=get) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        grown = _vm(proc.proc.pid, "VmHWM") - before
        assert not errors and grown < 32 << 20, grown / 2**20  # was about 8 x 48 MiB buffered
    finally:
        proc.stop()


# ---------------------------------------------------------------------------------------------
# latency on reused connections, stalled peers (finding 12)
# ---------------------------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_reused_connection_requests_are_fast(tmp_path: Path) -> None:
    """Range GETs on one keep-alive connection: well under Nagle + delayed ACK's 40 ms per request."""
    (server,) = _stores(tmp_path, 1)
    (server.root / STEP).mkdir()
    (server.root / STEP / "rank-00000.safetensors").write_bytes(os.urandom(1 << 16))
    try:
        c = http.client.HTTPConnection("127.0.0.1", int(server.address.rsplit(":", 1)[1]), timeout=10)
        times = []
        for i in range(60):
            t0 = time.perf_counter()
            c.request("GET", f"/{STEP}/rank-00000.safetensors",
                      headers={"Authorization": f"Bearer {server.token}", "Range": f"bytes={i}-{i + 1023}"})
            r = c.getresponse()
            assert r.status == 206 and len(r.read()) == 1024
            times.append(time.perf_counter() - t0)
        c.close()
        assert statistics.median(times) < 0.015, statistics.median(times)  # 44 ms before TCP_NODELAY
    finally:
        server.shutdown()


@pytest.mark.timeout(120)
def test_stalled_peer_makes_recovery_fall_back_within_seconds(tmp_path: Path) -> None:
    cfg, new = ParallelConfig(dp=2), ParallelConfig(tp=2)
    g = _global(4)
    shards = PTC_.shard(g, cfg)
    persistent = str(tmp_path / "persistent")
    for r in range(2):
        save(persistent, PTC_, cfg, r, shards[r], step=5, save_id="0000abcd")
    local = StoreServer(str(tmp_path / "a")).start()
    save(str(local.root), PTC_, cfg, 0, shards[0], step=5, save_id="0000abcd")
    # a peer that accepts connections and never answers: not even /health
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    silent_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    # a real store that answers /health, then stops (SIGSTOP) before the reads
    root_b = tmp_path / "b"
    root_b.mkdir()
    save(str(root_b), PTC_, cfg, 1, shards[1], step=5, save_id="0000abcd")
    port = free_port()
    peer = StoreProcess(str(root_b), port, [], token=local.token)
    try:
        host = HostStore(str(local.root), local.address, local.token)
        t0 = time.perf_counter()
        assert alive_stores([silent_url], token=local.token, timeout=1.0) == []
        assert time.perf_counter() - t0 < 3
        t0 = time.perf_counter()
        tiers = recovery_tiers(host, [local.address, silent_url, peer.url], persistent, timeout=2.0)
        assert time.perf_counter() - t0 < 4 and [t.kind for t in tiers] == ["local", "peer", "storage"]
        os.kill(peer.proc.pid, signal.SIGSTOP)
        t0 = time.perf_counter()
        res = load_tiered(tiers, new, 0, ptc=PTC_)
        elapsed = time.perf_counter() - t0
        assert elapsed < 12, elapsed  # aiohttp's default would wait 300 s
        assert res.bytes_by_kind["peer"] == 0 and res.bytes_by_kind["storage"] > 0
        want = PTC_.shard(g, new)[0]
        assert all(torch.equal(res.result.shard[n], want[n]) for n in PTC_.rank_tensors(new, 0))
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
        peer.stop()
        silent.close()
        local.shutdown()


# ---------------------------------------------------------------------------------------------
# `tenplex store serve` errors (finding 14)
# ---------------------------------------------------------------------------------------------
def test_store_serve_errors_are_one_line_with_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    root = str(tmp_path / "root")
    try:
        cases = [
            (["--root", root, "--listen", f"127.0.0.1:{busy.getsockname()[1]}"], "is in use"),
            (["--root", str(a_file), "--listen", "127.0.0.1:0"], "is not a directory"),
            (["--root", root, "--listen", "127.0.0.1:0", "--peers", "notaurl"], "http://HOST:PORT"),
            (["--root", root, "--listen", "127.0.0.1:0", "--peers", "ftp://x:1"], "http://HOST:PORT"),
            (["--root", root, "--listen", "nonsense"], "HOST:PORT"),
            (["--root", root, "--listen", "127.0.0.1:99999"], "HOST:PORT"),
            (["--root", root, "--listen", "127.0.0.1:0", "--token", "abc"], "--token-file"),
            (["--root", root, "--listen", "127.0.0.1:0", "--keep-last", "0"], "keep_last = 0 < 1"),
            (["--root", root, "--listen", "127.0.0.1:0", "--token-file", str(tmp_path / "none")], "does not exist"),
        ]
        for args, msg in cases:
            assert cli_main(["store", "serve", *args]) == 2, args
            err = capsys.readouterr().err.strip()
            assert err.startswith("tenplex store: error:") and "\n" not in err and msg in err, (args, err)
    finally:
        busy.close()


@pytest.mark.timeout(60)
def test_store_serve_without_token_generates_one(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen([sys.executable, "-m", "tenplex", "store", "serve", "--root", str(tmp_path / "s"),
                             "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        path = Path(os.environ["TENPLEX_RUNTIME_DIR"]) / "store.token"
        assert "serving" in line and f"generated into {path}" in line, line
        assert path.stat().st_mode & 0o777 == 0o600
        url = line.split(" at ")[1].split()[0]
        assert alive_stores([url]) == [url]  # the client finds the same token file
        assert alive_stores([url], token="wrong") == []
    finally:
        proc.terminate()
        proc.wait(10)
