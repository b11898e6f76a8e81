"""Hostile control requests against a real dataset mount: each is refused and changes nothing.

A mount process serves a 200,000-sample index. Every bad request (wrong types, out-of-range
values, unknown ops and fields, garbage bytes, deep nesting, over-long lines) is sent raw over
the control socket; afterwards the mount's status, ``job.json`` and a rank's ``samples.bin``
must be byte-identical to before. A huge DP size is refused and a valid DP as large as the
dataset is listed lazily (the mount's resident memory stays bounded); a mount whose process
died is reported as stale with the fix.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from hostile import Tally
from test_vfs_mount import _wait, mounted

from tenplex.cli import main
from tenplex.data import DataState, build_index, remaining_ids
from tenplex.vfs import VfsError, mount_status, remount, socket_path

pytestmark = [
    pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse: this machine cannot mount FUSE"),
    pytest.mark.skipif(shutil.which("fusermount3") is None, reason="fusermount3 missing (Debian package fuse3)"),
]

N = 200_000  # samples of one byte each
BIG = 10**30


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[str, bytes, str]:  # type: ignore[no-untyped-def]
    d = tmp_path_factory.mktemp("hostile-mount")
    src = d / "src.bin"
    data = bytes((i * 7 + i // 256) % 256 for i in range(N))
    src.write_bytes(data)
    idx = str(d / "idx.npz")
    build_index([str(src)], kind="records", record_bytes=1).save(idx)
    return idx, data, str(d)


@pytest.fixture(scope="module")
def mnt(dataset, runtime) -> Iterator[tuple[str, subprocess.Popen]]:  # type: ignore[no-untyped-def, type-arg]
    idx, _, d = dataset
    m = os.path.join(d, "mnt")
    with mounted(idx, m, "--dp", "2", "--global-batch", "4", "--seed", "7", log=os.path.join(d, "mount.log")) as p:
        yield m, p


def _send(mountpoint: str, raw: bytes, timeout: float = 20.0) -> dict | None:  # type: ignore[type-arg]
    """Send raw bytes to the control socket; the parsed answer, or None when the mount closed without one."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(socket_path(mountpoint))
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)
        buf = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    return json.loads(buf) if buf.strip() else None


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _state(m: str) -> tuple[object, ...]:
    """What a bad request must not change: the layout and generations, job.json, a rank's bytes."""
    st = mount_status(m)
    st.pop("open_handles")  # the kernel releases handles of earlier reads asynchronously
    return (st, _read(f"{m}/job.json"), hashlib.sha256(_read(f"{m}/rank-001/samples.bin")).hexdigest(),
            len(os.listdir(m)))


def _req(**fields: object) -> bytes:
    return (json.dumps({"op": "reshard", **fields}) + "\n").encode()


BAD: list[tuple[str, bytes]] = [
    # wrong types
    ("seed str", _req(seed="x")), ("shuffle str", _req(shuffle="no")), ("shuffle int", _req(shuffle=1)),
    ("progress 1e300", _req(progress=1e300)), ("dp bool", _req(dp=True)), ("dp float", _req(dp=2.0)),
    ("dp str", _req(dp="2")), ("dp list", _req(dp=[2])), ("dp object", _req(dp={"a": 1})),
    ("global_batch null", _req(global_batch=None)), ("dp null", _req(dp=None)), ("seed null", _req(seed=None)),
    ("progress NaN", b'{"op": "reshard", "progress": NaN}\n'),
    ("progress Infinity", b'{"op": "reshard", "progress": Infinity}\n'),
    ("progress -Infinity", b'{"op": "reshard", "progress": -Infinity}\n'),
    ("num_epochs float", _req(num_epochs=1.5)), ("num_epochs str", _req(num_epochs="all")),
    ("num_epochs bool", _req(num_epochs=False)),
    # values out of range
    ("dp 0", _req(dp=0)), ("dp -1", _req(dp=-1)), ("dp 10**30", _req(dp=BIG, global_batch=BIG)),
    ("dp N+2", _req(dp=N + 2, global_batch=N + 2)), ("global_batch 0", _req(global_batch=0)),
    ("global_batch N+2", _req(global_batch=N + 2)), ("global_batch not divisible", _req(global_batch=5)),
    ("dp not dividing", _req(dp=3)), ("progress -1", _req(progress=-1)), ("progress 2**63", _req(progress=1 << 63)),
    ("seed -1", _req(seed=-1)), ("seed 2**64", _req(seed=1 << 64)), ("seed 10**100", _req(seed=10**100)),
    ("num_epochs -1", _req(num_epochs=-1)), ("num_epochs 10**9", _req(num_epochs=10**9)),
    ("5000-digit dp", b'{"op": "reshard", "dp": ' + b"9" * 5000 + b"}\n"),
    # ops and fields
    ("no op", b'{"dp": 1}\n'), ("op delete", b'{"op": "delete"}\n'), ("op null", b'{"op": null, "dp": 1}\n'),
    ("op number", b'{"op": 5}\n'), ("op list", b'{"op": ["reshard"], "dp": 1}\n'),
    ("op upper case", b'{"op": "RESHARD", "dp": 1}\n'), ("status with fields", b'{"op": "status", "dp": 1}\n'),
    ("reshard without fields", _req()), ("unknown field", _req(dpp=1)), ("known and unknown", _req(dp=1, x=2)),
    ("duplicate key, last bad", b'{"op": "reshard", "dp": 1, "dp": "x"}\n'),
    ("duplicate op, last reshard", b'{"op": "status", "op": "reshard", "dp": 3}\n'),
    # garbage bytes
    ("invalid utf-8", b"\xff\xfe\x00garbage\n"), ("not json", b"not json\n"), ("NUL bytes", b"\x00" * 64 + b"\n"),
    ("json list", b"[1, 2]\n"), ("json string", b'"reshard"\n'), ("json number", b"42\n"), ("json null", b"null\n"),
    ("truncated json", b'{"op": "reshard", "dp":\n'), ("deep nesting", b"[" * 50_000 + b"\n"),
    ("over-long line", b'{"op": "reshard", "pad": "' + b"x" * 70_000 + b'"}\n'),
    ("binary noise", bytes(range(256)) * 4 + b"\n"),
]
PROBES: list[tuple[str, bytes]] = [("empty line", b"\n"), ("blank line", b"   \n"), ("nothing", b"")]


@pytest.mark.timeout(180)
def test_bad_control_requests_change_nothing(mnt, dataset) -> None:  # type: ignore[no-untyped-def]
    m, proc = mnt
    _, data, _ = dataset
    t = Tally.of("mount")
    remount(m, dp=2, progress=6, global_batch=4, seed=7)
    ref = _state(m)
    problems = []
    for what, raw in BAD + PROBES:
        answer = _send(m, raw)
        after = _state(m)
        if after != ref:
            t.record("silent", what)
            problems.append(f"{what}: the mount changed ({answer})")
        elif answer is None or answer.get("ok"):
            t.record("identical", what)
            if (what, raw) in BAD:
                problems.append(f"{what}: not refused ({answer})")
        else:
            assert isinstance(answer.get("error"), str) and answer["error"], what
            t.record("refused", what)
    assert proc.poll() is None, "the mount process died"
    assert not problems, "\n".join(problems)
    # a good request afterwards works on the unchanged state
    st = remount(m, dp=1, progress=10, global_batch=4)
    ids = remaining_ids(DataState(N, 4, 7, True, 10), 1, 0)
    assert st["generation"] == ref[0]["generation"] + 1  # type: ignore[index]
    assert _read(f"{m}/rank-000/samples.bin") == bytes(data[i] for i in ids)
    t.assert_none_silent()


@pytest.mark.timeout(180)
def test_cli_remount_with_bad_values_is_refused(mnt, capsys) -> None:  # type: ignore[no-untyped-def]
    m, _ = mnt
    t = Tally.of("mount")
    remount(m, dp=2, progress=0, global_batch=4, seed=7)
    ref = _state(m)
    for args, fragment in ((["--dp", str(BIG), "--global-batch", str(BIG)], "dp must be <="),
                           (["--dp", str(N + 2), "--global-batch", str(N + 2)], f"larger than the index's {N}"),
                           (["--dp", "0"], "dp must be >= 1"), (["--global-batch", "0"], "global_batch must be >= 1"),
                           (["--dp", "3"], "not divisible by dp=3"), (["--progress", "-5"], "progress must be >= 0"),
                           (["--seed", "-1"], "seed must be >= 0"), ([], "at least one of")):
        rc = main(["remount", m, *args])
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if "error:" in ln]
        ok = rc == 2 and len(lines) == 1 and fragment in lines[0] and "Traceback" not in err
        same = _state(m) == ref
        t.record("refused" if ok and same else "silent", f"tenplex remount {' '.join(args)}")
        assert ok and same, (args, rc, err)
    t.assert_none_silent()


def _memory_kib(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) for k, v in (ln.split(":", 1) for ln in f) if k in ("VmRSS", "VmHWM")}


@pytest.mark.timeout(180)
def test_huge_dp_is_refused_and_a_dataset_sized_dp_is_listed_lazily(  # type: ignore[no-untyped-def]
        mnt, dataset) -> None:
    m, proc = mnt
    _, data, _ = dataset
    t = Tally.of("mount")
    remount(m, dp=2, progress=0, global_batch=4, seed=7)
    before = _memory_kib(proc.pid)
    gen = mount_status(m)["generation"]
    with pytest.raises(VfsError, match="refused: dp must be <="):
        remount(m, dp=BIG, global_batch=BIG)
    os.listdir(m)  # the lookup of / that ran the old mount out of memory
    assert mount_status(m)["generation"] == gen
    t.record("refused", "remount dp=10**30 global_batch=10**30")
    st = remount(m, dp=N, global_batch=N)  # as many ranks as samples: valid
    names = os.listdir(m)
    assert len(names) == N + 1 + len(st["generations"]) and f"rank-{N - 1:03d}" in names
    for r in (0, N // 2, N - 1):  # any single rank is an O(1) lookup
        ids = _read(f"{m}/rank-{r:03d}/ids.txt").split()
        want = remaining_ids(DataState(N, N, 7, True, 0), N, r)
        assert [int(x) for x in ids] == want.tolist()
        assert _read(f"{m}/rank-{r:03d}/samples.bin") == bytes(data[i] for i in want)
    after = _memory_kib(proc.pid)
    grown = max(after["VmRSS"] - before["VmRSS"], after["VmHWM"] - before["VmHWM"])
    assert grown < 64 << 10, f"the mount grew by {grown} KiB listing {N} ranks ({before} -> {after})"
    remount(m, dp=2, global_batch=4)
    assert _read(f"{m}/rank-001/ids.txt").split()[0].isdigit()


@pytest.mark.timeout(120)
def test_a_dead_mount_is_reported_as_stale(dataset, runtime, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    idx, _, _ = dataset
    t = Tally.of("mount")
    m = str(tmp_path / "mnt")
    os.makedirs(m)
    proc = subprocess.Popen([sys.executable, "-m", "tenplex", "mount", idx, m, "--dp", "1", "--foreground"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(lambda: os.path.ismount(m) or proc.poll() is not None, 60, "mount")
        assert os.path.ismount(m)
        proc.send_signal(signal.SIGKILL)  # the mount process dies; the kernel keeps the mount
        proc.wait(timeout=20)

        def stale() -> bool:
            try:
                os.stat(m)
            except OSError as e:
                return e.errno == errno.ENOTCONN
            return False
        _wait(stale, 20, "ENOTCONN")
        for argv in (["mount", idx, m, "--dp", "1"], ["remount", m, "--dp", "1"]):
            rc = main(argv)
            err = capsys.readouterr().err
            ok = rc == 2 and f"stale mount at {m}" in err and f"run fusermount3 -u {m}" in err
            t.record("refused" if ok else "silent", f"tenplex {argv[0]} on a stale mount")
            assert ok, err
    finally:
        subprocess.run(["fusermount3", "-u", "-z", m], capture_output=True, timeout=10)
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.1)
    assert os.path.isdir(m) and not os.path.ismount(m)
    t.assert_none_silent()
