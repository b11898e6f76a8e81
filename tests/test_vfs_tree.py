"""The pure VFS tree and the control protocol, without mounting."""

from __future__ import annotations

import json
import os
import stat

import numpy as np
import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from test_data_index import write_jsonl

from tenplex.data import DataState, build_index, remaining_ids
from tenplex.vfs import DatasetTree, DataView, VfsError, gen_name, mount_status, remount
from tenplex.vfs.control import ControlServer, handle_request, socket_path


@pytest.fixture(scope="module")
def data(tmp_path_factory):  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("tree")
    a, b = str(d / "a.jsonl"), str(d / "b.jsonl")
    samples = write_jsonl(a, 40, 1) + write_jsonl(b, 33, 2)
    return build_index([a, b], kind="jsonl"), samples


def _read_all(tree: DatasetTree, path: str) -> bytes:
    node = tree.lookup(path)
    assert node is not None and node.kind == "file"
    return tree.read(path, 0, node.size)


def _resolve(tree: DatasetTree, path: str) -> str:
    parts = path.strip("/").split("/")
    node = tree.lookup("/" + parts[0])
    assert node is not None
    head = node.target if node.kind == "link" else parts[0]
    return "/" + "/".join([head, *parts[1:]])


def test_layout_and_contents(data) -> None:  # type: ignore[no-untyped-def]
    index, samples = data
    tree = DatasetTree(index, DataView(dp=2, progress=6, global_batch=4, seed=3))
    root = tree.lookup("/")
    assert root is not None and root.entries == ("job.json", "rank-000", "rank-001", gen_name(1))
    link = tree.lookup("/rank-001")
    assert link is not None and link.kind == "link" and link.target == "gen-000001/rank-001"
    assert stat.S_ISLNK(link.attrs()["st_mode"])
    job = json.loads(_read_all(tree, _resolve(tree, "/job.json")))
    assert job["generation"] == 1 and job["dp"] == 2 and job["progress"] == 6 and job["seed"] == 3
    assert job["num_samples"] == 73 and job["global_batch"] == 4 and job["shuffle"] is True
    state = DataState(num_samples=73, global_batch=4, seed=3, consumed=6)
    for r in range(2):
        ids = remaining_ids(state, 2, r)
        base = f"/gen-000001/rank-{r:03d}"
        assert tree.lookup(base).entries == ("samples.bin", "ids.txt", "offsets.txt")  # type: ignore[union-attr]
        assert _read_all(tree, f"{base}/ids.txt").decode().split() == [str(i) for i in ids]
        blob = _read_all(tree, f"{base}/samples.bin")
        assert blob == b"".join(samples[i] for i in ids)
        offs = [int(x) for x in _read_all(tree, f"{base}/offsets.txt").split()]
        assert offs[-1] == len(blob) and [blob[offs[k]:offs[k + 1]] for k in range(len(ids))] == [
            samples[i] for i in ids]
        node = tree.lookup(f"{base}/samples.bin")
        assert node is not None and node.attrs()["st_size"] == len(blob) and node.attrs()["st_mode"] & 0o222 == 0


def test_paths_outside_the_tree(data) -> None:  # type: ignore[no-untyped-def]
    index, _ = data
    tree = DatasetTree(index, DataView(dp=2, progress=0, global_batch=2))
    for p in ("/..", "/../etc/passwd", "/rank-000/../../x", "/gen-000001/../..", "/rank-002", "/rank-2",
              "/rank-0000", "/gen-1", "/gen-000009", "/gen-000001/rank-000/x", "/gen-000001/rank-005/ids.txt",
              "/job.json/x", "/gen-000001/job.json/x", "/etc", "/rank-000/samples.bin"):
        assert tree.lookup(p) is None, p
    with pytest.raises(FileNotFoundError):
        tree.open("/gen-000001/rank-000")


@settings(max_examples=examples(40))
@given(st.integers(1, 5), st.integers(0, 200), st.integers(1, 4), st.booleans(), st.data())
def test_union_over_ranks(data, dp: int, progress: int, per: int, shuffle: bool, d: st.DataObject) -> None:  # type: ignore[no-untyped-def]
    index, samples = data
    tree = DatasetTree(index, DataView(dp=dp, progress=progress, global_batch=dp * per, shuffle=shuffle, seed=1))
    gen = tree.current
    got = [np.array(_read_all(tree, f"/gen-000001/rank-{r:03d}/ids.txt").split(), dtype=np.int64) for r in range(dp)]
    assert sum(map(len, got)) == gen.end - progress
    r = d.draw(st.integers(0, dp - 1))
    path = f"/gen-000001/rank-{r:03d}/samples.bin"
    size = tree.lookup(path).size  # type: ignore[union-attr]
    off = d.draw(st.integers(0, size))
    n = d.draw(st.integers(0, 500))
    assert tree.read(path, off, n) == b"".join(samples[i] for i in got[r])[off:off + n]


def test_reshard_pins_open_handles(data) -> None:  # type: ignore[no-untyped-def]
    index, samples = data
    tree = DatasetTree(index, DataView(dp=3, progress=0, global_batch=6), keep=1)
    fh = tree.open(_resolve(tree, "/rank-002/samples.bin"))
    old = tree.read_handle(fh, 0, 1 << 20)
    gen = tree.reshard(dp=2, progress=12)
    assert gen.number == 2 and tree.lookup("/rank-002") is None
    assert tree.lookup("/rank-001").target == "gen-000002/rank-001"  # type: ignore[union-attr]
    assert tree.generations() == [1, 2]  # gen 1 pinned by the handle although keep=1
    assert tree.read_handle(fh, 0, 1 << 20) == old
    new = _read_all(tree, _resolve(tree, "/rank-001/samples.bin"))
    ids = remaining_ids(DataState(73, 6, 0, True, 12), 2, 1)
    assert new == b"".join(samples[i] for i in ids)
    tree.release(fh)
    assert tree.generations() == [2] and tree.lookup("/gen-000001") is None
    with pytest.raises(VfsError, match="not divisible by dp=4"):
        tree.reshard(dp=4)
    with pytest.raises(VfsError, match="progress must be >= 0"):
        tree.reshard(progress=-1)
    assert tree.current.number == 2


def test_control_protocol(data, tmp_path) -> None:  # type: ignore[no-untyped-def]
    index, _ = data
    tree = DatasetTree(index, DataView(dp=2, progress=0, global_batch=4))
    assert handle_request(tree, {"op": "status"})["generation"] == 1
    assert handle_request(tree, {"op": "bogus"})["ok"] is False
    assert "not divisible" in handle_request(tree, {"op": "reshard", "dp": 3})["error"]
    os.environ["TENPLEX_RUNTIME_DIR"] = str(tmp_path)
    try:
        mp = str(tmp_path / "mnt")
        server = ControlServer(tree, socket_path(mp)).start()
        try:
            st_ = remount(mp, dp=4, progress=8)
            assert st_["generation"] == 2 and st_["dp"] == 4 and tree.current.layout.progress == 8
            assert mount_status(mp)["generation"] == 2
            with pytest.raises(VfsError, match="refused.*not divisible"):
                remount(mp, dp=3)
            with pytest.raises(VfsError, match="already serves"):
                ControlServer(tree, socket_path(mp))
        finally:
            server.close()
        with pytest.raises(VfsError, match="no tenplex mount serves"):
            remount(mp, dp=2)
    finally:
        del os.environ["TENPLEX_RUNTIME_DIR"]


def test_no_fuse_support_is_explained(monkeypatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tenplex.vfs import fuse

    real = os.path.exists
    monkeypatch.setattr(fuse.os.path, "exists", lambda p: False if p == "/dev/fuse" else real(p))
    with pytest.raises(VfsError, match="/dev/fuse does not exist: load the fuse kernel module"):
        fuse.check_fuse()
    monkeypatch.setattr(fuse.os.path, "exists", real)
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(VfsError, match="is not a directory"):
        fuse.check_mountpoint(str(f))


BAD_LAYOUTS = [  # (reshard kwargs, message)
    (dict(dp=True), "dp must be an integer, got True"), (dict(dp=2.0), "dp must be an integer"),
    (dict(dp=0), "dp must be >= 1"), (dict(dp=10**30, global_batch=10**30), "dp must be <="),
    (dict(dp=74, global_batch=74), "dp=74 is larger than the index's 73 samples"),
    (dict(global_batch=0), "global_batch must be >= 1"), (dict(global_batch=76), "global batch 76 is larger"),
    (dict(global_batch=5), "not divisible by dp=2"), (dict(progress=-1), "progress must be >= 0"),
    (dict(progress=1e300), "progress must be an integer"), (dict(progress=float("nan")), "progress must be an integer"),
    (dict(progress=1 << 63), "progress must be <="), (dict(seed="x"), "seed must be an integer"),
    (dict(seed=-1), "seed must be >= 0"), (dict(shuffle="no"), "shuffle must be true or false"),
    (dict(shuffle=1), "shuffle must be true or false"), (dict(num_epochs=-1), "num_epochs must be >= 0"),
    (dict(num_epochs=1.0), "num_epochs must be an integer"), (dict(num_epochs=10**6), "more than 64 epochs"),
]


@pytest.mark.parametrize("kwargs, match", BAD_LAYOUTS)
def test_bad_reshard_changes_nothing(data, kwargs, match) -> None:  # type: ignore[no-untyped-def]
    index, samples = data
    tree = DatasetTree(index, DataView(dp=2, progress=4, global_batch=4, seed=3))
    before = (tree.status(), _read_all(tree, "/gen-000001/rank-001/samples.bin"), tree.lookup("/"))
    with pytest.raises(VfsError, match=match):
        tree.reshard(**kwargs)
    assert (tree.status(), _read_all(tree, "/gen-000001/rank-001/samples.bin"), tree.lookup("/")) == before
    resp = handle_request(tree, {"op": "reshard", **kwargs})
    assert resp["ok"] is False and match.split()[0] in resp["error"]
    assert tree.status() == before[0]
    gen = tree.reshard(dp=1, progress=8, seed=4)  # a good request afterwards works
    ids = remaining_ids(DataState(73, 4, 4, True, 8), 1, 0)
    assert gen.number == 2
    assert _read_all(tree, "/gen-000002/rank-000/samples.bin") == b"".join(samples[i] for i in ids)


def test_mount_layout_is_checked_first_by_dp() -> None:
    with pytest.raises(VfsError, match="dp must be >= 1"):
        DataView(dp=0, progress=0, global_batch=0)
    with pytest.raises(VfsError, match="global_batch must be >= 1"):
        DataView(dp=1, progress=0, global_batch=0)


@pytest.mark.parametrize("req, match", [
    ([1, 2], "JSON object"), ("reshard", "JSON object"), ({"op": "reshard"}, "at least one of"),
    ({"op": "reshard", "dp": None}, "must not be null"), ({"op": "reshard", "dpp": 2}, "unknown field"),
    ({"op": "status", "dp": 2}, "status takes no fields"), ({"op": ["reshard"]}, "unknown op"),
    ({"op": "delete"}, "unknown op"), ({}, "unknown op"),
])
def test_control_requests_of_the_wrong_shape_are_refused(data, req, match) -> None:  # type: ignore[no-untyped-def]
    index, _ = data
    tree = DatasetTree(index, DataView(dp=2, progress=0, global_batch=4))
    before = tree.status()
    resp = handle_request(tree, req)
    assert resp["ok"] is False and match in resp["error"]
    assert tree.status() == before


def test_root_of_a_huge_dp_is_listed_lazily(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import tracemalloc

    src = tmp_path / "r.bin"
    n = 1_000_000
    src.write_bytes(bytes(range(256)) * (n // 256) + bytes(n % 256))
    tree = DatasetTree(build_index([str(src)], kind="records", record_bytes=1), DataView(dp=1, progress=0,
                                                                                        global_batch=1))
    tree.reshard(dp=n, global_batch=n)
    tracemalloc.start()
    try:
        root = tree.lookup("/")
        gen = tree.lookup("/gen-000002")
        assert root is not None and gen is not None
        assert len(root.entries) == n + 3 and root.entries[n] == "rank-999999" and root.entries[-1] == "gen-000002"
        assert list(root.entries[:3]) == ["job.json", "rank-000", "rank-001"] and len(gen.entries) == n + 1
        peak_dirs = tracemalloc.get_traced_memory()[1]
        node = tree.lookup("/gen-000002/rank-765432/ids.txt")  # one rank: its view only (and the epoch's order)
        assert node is not None and tree.read("/gen-000002/rank-765432/ids.txt", 0, 100).strip().isdigit()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak_dirs < 1 << 20, f"lookups of a dp={n} root allocated {peak_dirs} bytes"
    assert peak < 12 * n, f"a lookup of one of {n} ranks allocated {peak} bytes"
    from tenplex.vfs.fuse import FuseOps

    names = [e[0] for e in FuseOps._entries(root.entries, n + 1)]  # readdir from an offset: the tail only
    assert names == ["rank-999998", "rank-999999", "gen-000001", "gen-000002"]


@settings(max_examples=examples(30))
@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 3), st.integers(0, 100))
def test_uneven_split_over_ranks(data, dp: int, micro_batches: int, mb: int, progress: int) -> None:  # type: ignore[no-untyped-def]
    """A layout with a micro-batch size whose DP does not divide the batch: each rank's files hold
    its share of whole micro-batches of every step (replica_samples), every sample once."""
    index, samples = data
    g = mb * micro_batches
    layout = DataView(dp=dp, progress=progress, global_batch=g, seed=1, micro_batch=mb)
    if dp > micro_batches:
        with pytest.raises(VfsError, match="cannot each take a micro-batch"):
            DatasetTree(index, layout)
        return
    tree = DatasetTree(index, layout)
    assert json.loads(_read_all(tree, f"/{gen_name(1)}/job.json"))["micro_batch"] == mb
    state = DataState(num_samples=index.num_samples, global_batch=g, seed=1, consumed=progress)
    end = tree.current.end
    for r in range(dp):
        got = np.array(_read_all(tree, f"/gen-000001/rank-{r:03d}/ids.txt").split(), dtype=np.int64)
        assert np.array_equal(got, remaining_ids(state, dp, r, end=end, micro_batch=mb))
        assert _read_all(tree, f"/gen-000001/rank-{r:03d}/samples.bin") == b"".join(samples[i] for i in got)
    # back to equal slices by a re-shard with micro_batch=None (where dp divides the batch)
    if g % dp == 0:
        gen = tree.reshard(micro_batch=None)
        assert gen.layout.micro_batch is None and "micro_batch" not in json.loads(gen.job_json)
