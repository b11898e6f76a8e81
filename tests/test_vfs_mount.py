"""Real FUSE mounts: a child process serves the mount; re-shard, concurrency, faults, signals."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from test_data_index import write_jsonl

from tenplex.cli import main
from tenplex.data import DataState, build_index, ids_at, remaining_ids, stream_end
from tenplex.vfs import mount_status, remount

pytestmark = [
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse: this machine cannot mount FUSE"),
    pytest.mark.skipif(shutil.which("fusermount3") is None, reason="fusermount3 missing (Debian package fuse3)"),
]


def _wait(pred, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


@contextmanager
def mounted(index: str, mnt: str, *args: str, log: str) -> Iterator[subprocess.Popen]:  # type: ignore[type-arg]
    os.makedirs(mnt, exist_ok=True)
    with open(log, "wb") as logf:
        proc = subprocess.Popen([sys.executable, "-m", "tenplex", "-v", "mount", index, mnt, *args, "--foreground"],
                                stdout=logf, stderr=logf)
    try:
        try:
            _wait(lambda: os.path.ismount(mnt) or proc.poll() is not None, 60, "mount")
        except TimeoutError:
            pass
        if not os.path.ismount(mnt):
            raise AssertionError(f"not mounted; log:\n{open(log).read()[-3000:]}")
        yield proc
    finally:
        subprocess.run(["fusermount3", "-u", "-z", mnt], capture_output=True, timeout=10)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("ds")
    a, b = str(d / "a.jsonl"), str(d / "b.jsonl")
    samples = write_jsonl(a, 300, 1) + write_jsonl(b, 213, 2)
    idx = str(d / "idx.npz")
    build_index([a, b], kind="jsonl").save(idx)
    return idx, samples, str(d)


@pytest.fixture(scope="module")
def mnt(dataset, runtime) -> Iterator[str]:  # type: ignore[no-untyped-def]
    idx, _, d = dataset
    m = os.path.join(d, "mnt")
    with mounted(idx, m, "--dp", "2", "--global-batch", "4", "--seed", "7", log=os.path.join(d, "mount.log")):
        yield m


def _check_generation(m: str, samples: list[bytes], dp: int, progress: int, g: int, seed: int) -> None:
    job = json.loads(_read(f"{m}/job.json"))
    assert (job["dp"], job["progress"], job["global_batch"], job["seed"]) == (dp, progress, g, seed)
    n = len(samples)
    end = stream_end(n, g, progress)
    assert sorted(os.listdir(m)) == sorted(["job.json", *(f"rank-{r:03d}" for r in range(dp)),
                                             *(f"gen-{x:06d}" for x in mount_status(m)["generations"])])
    per = g // dp
    views = []
    for r in range(dp):
        ids = np.array(_read(f"{m}/rank-{r:03d}/ids.txt").split(), dtype=np.int64)
        views.append(ids)
        blob = _read(f"{m}/rank-{r:03d}/samples.bin")
        assert os.stat(f"{m}/rank-{r:03d}/samples.bin").st_size == len(blob)
        assert blob == b"".join(samples[i] for i in ids), "samples.bin equals the source bytes"
        offs = [int(x) for x in _read(f"{m}/rank-{r:03d}/offsets.txt").split()]
        assert len(offs) == len(ids) + 1 and offs[-1] == len(blob)
    # the union over ranks, batch by batch, is exactly the remaining global order
    nb = (end - progress) // g
    rebuilt = np.concatenate([v[b * per:(b + 1) * per] for b in range(nb) for v in views])
    assert np.array_equal(rebuilt, ids_at(np.arange(progress, end), n, seed))
    first = rebuilt[: n - progress % n]  # none twice within the epoch
    assert len(np.unique(first)) == len(first)


@pytest.mark.timeout(120)
def test_random_layouts_union_and_bytes(mnt, dataset) -> None:  # type: ignore[no-untyped-def]
    _, samples, _ = dataset
    _check_generation(mnt, samples, 2, 0, 4, 7)
    rng = random.Random(4)
    for _ in range(5):
        dp = rng.randint(1, 6)
        g = dp * rng.randint(1, 5)
        progress = rng.randint(0, 2 * len(samples))
        st = remount(mnt, dp=dp, progress=progress, global_batch=g)
        _check_generation(mnt, samples, dp, progress, g, 7)
        assert json.loads(_read(f"{mnt}/job.json"))["generation"] == st["generation"]


@pytest.mark.timeout(60)
def test_reshard_while_reader_open(mnt, dataset) -> None:  # type: ignore[no-untyped-def]
    _, samples, _ = dataset
    remount(mnt, dp=3, progress=30, global_batch=6)
    old = _read(f"{mnt}/rank-002/samples.bin")
    with open(f"{mnt}/rank-002/samples.bin", "rb", buffering=0) as f:
        head = f.read(100)
        st = remount(mnt, dp=2, progress=42, global_batch=6)
        assert not os.path.exists(f"{mnt}/rank-002")  # new opens see the new generation
        new = _read(f"{mnt}/rank-001/samples.bin")
        assert new == b"".join(samples[i] for i in remaining_ids(DataState(len(samples), 6, 7, True, 42), 2, 1))
        rest = f.read()  # the open handle keeps its generation's view
    assert head + rest == old
    assert json.loads(_read(f"{mnt}/job.json"))["generation"] == st["generation"]


@pytest.mark.timeout(60)
def test_concurrent_readers(mnt, dataset) -> None:  # type: ignore[no-untyped-def]
    _, samples, _ = dataset
    remount(mnt, dp=4, progress=17, global_batch=8)
    want = {r: b"".join(samples[i] for i in remaining_ids(DataState(len(samples), 8, 7, True, 17), 4, r))
            for r in range(4)}
    errors: list[str] = []

    def reader(k: int) -> None:
        rng = random.Random(k)
        r = k % 4
        fd = os.open(f"{mnt}/rank-{r:03d}/samples.bin", os.O_RDONLY)
        try:
            for _ in range(50):
                off = rng.randrange(len(want[r]))
                n = rng.randrange(1, 5000)
                if os.pread(fd, n, off) != want[r][off:off + n]:
                    errors.append(f"rank {r} [{off}, +{n})")
        finally:
            os.close(fd)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors


@pytest.mark.timeout(60)
def test_read_only_and_confined(mnt) -> None:  # type: ignore[no-untyped-def]
    for flags in (os.O_WRONLY, os.O_RDWR):
        with pytest.raises(OSError) as e:
            os.open(f"{mnt}/rank-000/samples.bin", flags)
        assert e.value.errno in (errno.EROFS, errno.EACCES)
    with pytest.raises(OSError):
        os.open(f"{mnt}/new-file", os.O_WRONLY | os.O_CREAT)
    assert not os.path.exists(f"{mnt}/rank-099/ids.txt")
    assert os.path.realpath(f"{mnt}/rank-000/..") == os.path.realpath(f"{mnt}/gen-{mount_status(mnt)['generation']:06d}")


@pytest.mark.timeout(60)
def test_cli_errors(mnt, dataset, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    idx, _, _ = dataset
    assert main(["mount", str(tmp_path / "none.npz"), str(tmp_path), "--dp", "1"]) == 2
    assert "no dataset index" in capsys.readouterr().err
    assert main(["mount", idx, str(tmp_path / "nodir"), "--dp", "1"]) == 2
    assert "does not exist: create it first" in capsys.readouterr().err
    assert main(["mount", idx, mnt, "--dp", "1"]) == 2
    assert "already a mount point" in capsys.readouterr().err
    assert main(["remount", str(tmp_path), "--dp", "1"]) == 2
    assert "no tenplex mount serves" in capsys.readouterr().err
    assert main(["remount", mnt, "--dp", "3", "--global-batch", "4"]) == 2
    assert "not divisible by dp=3" in capsys.readouterr().err


@pytest.mark.timeout(90)
def test_faults_give_eio_and_mount_stays_up(tmp_path, runtime) -> None:  # type: ignore[no-untyped-def]
    a, b = str(tmp_path / "a.bin"), str(tmp_path / "b.bin")
    rec, n = 1000, 2000
    for p, c in ((a, 1), (b, 2)):
        with open(p, "wb") as f:
            f.write(bytes([c]) * (rec * n))
    idx = str(tmp_path / "idx.npz")
    build_index([a, b], kind="records", record_bytes=rec).save(idx)
    m = str(tmp_path / "mnt")
    with mounted(idx, m, "--dp", "1", "--no-shuffle", log=str(tmp_path / "log")) as proc:
        path = f"{m}/rank-000/samples.bin"
        assert os.stat(path).st_size == 2 * n * rec
        fd = os.open(path, os.O_RDONLY)
        try:
            assert os.pread(fd, 4096, 0) == b"\x01" * 4096
            with open(b, "r+b") as f:
                f.truncate(rec * 10)  # shrunk: only b's first 10 records are left
            assert os.pread(fd, 4096, n * rec) == b"\x02" * 4096  # unaffected
            with pytest.raises(OSError) as e:
                os.pread(fd, 4096, (n + 1000) * rec)
            assert e.value.errno == errno.EIO
            os.remove(a)  # missing: reads of its (uncached) bytes fail too
            with pytest.raises(OSError) as e:
                os.pread(fd, 100, 1500 * rec + 500)
            assert e.value.errno == errno.EIO
        finally:
            os.close(fd)
        assert os.path.ismount(m) and json.loads(_read(f"{m}/job.json"))["dp"] == 1  # still up
        assert "EIO" in open(tmp_path / "log").read()  # logged
        proc.send_signal(signal.SIGINT)  # Ctrl-C unmounts cleanly
        _wait(lambda: not os.path.ismount(m), 20, "unmount after SIGINT")
        assert proc.wait(timeout=20) == 0


@pytest.mark.timeout(90)
def test_background_mount_remount_cli_and_sigterm(dataset, tmp_path, runtime, capsys) -> None:  # type: ignore[no-untyped-def]
    idx, samples, _ = dataset
    m = str(tmp_path / "mnt")
    os.makedirs(m)
    assert main(["mount", idx, m, "--dp", "2", "--global-batch", "2", "--no-shuffle"]) == 0
    out = capsys.readouterr().out
    pid = int(out.split("(pid ")[1].split(")")[0])
    try:
        assert os.path.ismount(m)
        assert _read(f"{m}/rank-001/ids.txt").split()[:3] == [b"1", b"3", b"5"]
        assert main(["remount", m, "--dp", "1", "--progress", "10", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["generation"] == 2
        assert _read(f"{m}/rank-000/ids.txt").split()[0] == b"10"
        assert json.loads(_read(f"{m}/job.json"))["seed"] is None
        os.kill(pid, signal.SIGTERM)
        _wait(lambda: not os.path.ismount(m), 20, "unmount after SIGTERM")

        def gone() -> bool:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
            return subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                                  text=True).stdout.strip().startswith("Z")
        _wait(gone, 20, "mount process exit")
        from tenplex.vfs import socket_path
        assert not os.path.exists(socket_path(m))
    finally:
        if os.path.ismount(m):
            subprocess.run(["fusermount3", "-u", "-z", m], capture_output=True, timeout=10)


def test_trainer_batches_of_an_uneven_split_through_the_mount(tmp_path, runtime) -> None:  # type: ignore[no-untyped-def]
    """The trainer's MountBatches re-shards a mount to dp=3 with micro-batches of 2 (a global batch
    of 8 split 4, 2, 2) and reads the same tokens as the index reader, step after step; back at an
    even dp the mount shows equal slices again (no micro_batch in job.json)."""
    import torch

    from tenplex.data.corpus import stdlib_corpus
    from tenplex.data.batches import IndexBatches, corpus_index
    from tenplex.train.batches import MountBatches

    corpus = stdlib_corpus(64)
    index_path, _ = corpus_index(corpus)
    m = str(tmp_path / "mnt")
    with mounted(index_path, m, "--dp", "2", "--global-batch", "8", "--seed", "7", log=str(tmp_path / "mount.log")):
        state = DataState(corpus.num_samples, 8, seed=7, source=corpus.fingerprint(), consumed=16)
        MountBatches.prepare(m, state, 3, 2)
        job = json.loads(_read(f"{m}/job.json"))
        assert (job["dp"], job["progress"], job["micro_batch"]) == (3, 16, 2)
        mounts, reader = [MountBatches(m, corpus) for _ in range(3)], IndexBatches(corpus)  # one per rank
        for step in range(2):
            sizes = []
            for r in range(3):
                got = mounts[r].batch(state, 3, r, 2)
                assert torch.equal(got, reader.batch(state, 3, r, 2)), (step, r)
                sizes.append(got.shape[0])
            assert sizes == [4, 2, 2]
            state = state.advance()
        del mounts  # closes their samples.bin: a lazy unmount waits for open files
        MountBatches.prepare(m, state, 2, 2)
        job = json.loads(_read(f"{m}/job.json"))
        assert job["dp"] == 2 and "micro_batch" not in job
        assert torch.equal(MountBatches(m, corpus).batch(state, 2, 1, 2), reader.batch(state, 2, 1, 2))
