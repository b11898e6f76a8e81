"""The host store's snapshots as files: the pure tree, and a real read-only FUSE mount."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tenplex import ParallelConfig, model_ptc, save
from tenplex.checkpoint import writer_assignment
from tenplex.vfs.store_view import StoreTree

PTC_ = model_ptc("tiny")
CFG = ParallelConfig(tp=2)


def _store(tmp_path: Path) -> tuple[Path, dict]:
    g = {n: torch.randn(s.shape) for n, s in PTC_.tensors.items()}
    g["optimizer.step"] = 3
    shards = PTC_.shard(g, CFG)
    root = tmp_path / "store"
    for r in range(CFG.world_size):
        save(str(root), PTC_, CFG, r, shards[r], step=3)
    return root, g


def _expected_chunk(g: dict, name: str, start: int, length: int) -> bytes:
    flat = PTC_.tensors[name].to_canonical(g[name])
    return flat[start : start + length].numpy().tobytes()


def test_store_tree_lists_steps_ranks_and_chunks(tmp_path: Path) -> None:
    root, g = _store(tmp_path)
    tree = StoreTree(str(root))
    assert tree.lookup("/model").entries == ("step-3",)
    assert set(tree.lookup("/model/step-3").entries) == {"manifest.json", "rank-000", "rank-001"}
    assert tree.lookup("/model/../etc") is None and tree.lookup("/../x") is None and tree.lookup("/nope") is None
    for rank, chunks in writer_assignment(PTC_, CFG).items():
        entries = set(tree.lookup(f"/model/step-3/rank-{rank:03d}").entries)
        assert entries == {"index.json", *(f"{n}@{s}" for n, _, s, _ in chunks)}
        name, _, start, length = chunks[0]
        path = f"/model/step-3/rank-{rank:03d}/{name}@{start}"
        assert tree.lookup(path).size == length * 4
        fh = tree.open(path)
        buf = bytearray(length * 4)
        assert tree.read_handle_into(fh, 0, memoryview(buf)) == length * 4
        tree.release(fh)
        assert bytes(buf) == _expected_chunk(g, name, start, length)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not (os.path.exists("/dev/fuse") and shutil.which("fusermount3")),
                    reason="needs /dev/fuse and fusermount3 (Debian fuse3) for a real mount")
def test_store_view_mount(tmp_path: Path) -> None:
    root, g = _store(tmp_path)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "tenplex", "mount-store", str(root), str(mnt)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not os.path.ismount(mnt) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert os.path.ismount(mnt)
        manifest = json.loads((mnt / "model" / "step-3" / "manifest.json").read_text())
        assert manifest["layout"] == str(CFG)
        name, _, start, length = writer_assignment(PTC_, CFG)[1][0]
        data = (mnt / "model" / "step-3" / "rank-001" / f"{name}@{start}").read_bytes()
        assert data == _expected_chunk(g, name, start, length)
        with pytest.raises(OSError):
            (mnt / "model" / "new.txt").write_text("x")  # read-only
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False, timeout=30)
        proc.wait(timeout=30)


def test_damaged_or_reused_snapshots_are_hidden(tmp_path: Path) -> None:
    """The view checks the manifest's and indexes' digests: a damaged one hides its step or rank
    part instead of serving chunk spans from unverified offsets; a reused save id hides the step."""
    root, _ = _store(tmp_path)
    tree = StoreTree(str(root))
    assert tree.lookup("/model/step-3/rank-001") is not None
    (sdir,) = root.iterdir()
    index = sdir / "rank-00001.json"
    raw = index.read_bytes()
    index.write_bytes(raw.replace(b'"data_offset":', b'"data_offset":1', 1))
    assert index.read_bytes() != raw
    assert tree.lookup("/model/step-3/rank-001") is None
    index.write_bytes(raw)
    (sdir / "reused-rank-00001").write_bytes(b"{}")
    assert tree.lookup("/model/step-3") is None
