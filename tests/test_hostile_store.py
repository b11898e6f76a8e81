"""Hostile requests against a host store: each is refused (4xx), detected, or answers exactly what
a legitimate client would get; none changes what a legitimate client reads.

Two real stores on 127.0.0.1 (the target and its replica peer) hold a real checkpoint step; the
attempts go over raw sockets. At the end every legitimate file reads back bit-identical and a
tiered load gives the same shard as before.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hostile import Tally
from test_store import PTC_, _global, raw

from tenplex import ParallelConfig
from tenplex.store import HostStore, StoreServer, Tier, load_tiered, step_complete, usable_steps

CFG, NEW = ParallelConfig(dp=2), ParallelConfig(tp=2)


@pytest.fixture
def stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[StoreServer, StoreServer, dict]]:
    """Target ``a`` (holds both ranks of step 3, replicated to ``b``) and peer ``b``; the truth."""
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("TENPLEX_RUNTIME_DIR", str(runtime))
    monkeypatch.delenv("TENPLEX_STORE_TOKEN", raising=False)
    monkeypatch.delenv("TENPLEX_STORE_TOKEN_FILE", raising=False)
    a = StoreServer(str(tmp_path / "a"), timeout=2.0, keep_last=2, incomplete_grace=0.0)
    b = StoreServer(str(tmp_path / "b"), timeout=2.0, keep_last=2, incomplete_grace=0.0)
    for s in (a, b):
        s.peers = [a.address, b.address]
        s.start()
    g = _global(11)
    shards = PTC_.shard(g, CFG)
    for r in range(CFG.world_size):
        HostStore(str(a.root), a.address).snapshot(PTC_, CFG, r, shards[r], step=3)
    (sdir,) = [d for d in a.root.iterdir() if d.is_dir()]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and sorted(os.listdir(b.root / sdir.name) if (b.root / sdir.name).exists()
                                                 else []) != sorted(os.listdir(sdir)):
        time.sleep(0.05)
    truth = {"step_dir": sdir.name, "files": {p.name: p.read_bytes() for p in sdir.iterdir()},
             "shard": load_tiered([Tier("a", str(a.root), "local")], NEW, 0, ptc=PTC_).result.shard}
    assert sorted(os.listdir(b.root / sdir.name)) == sorted(truth["files"])
    try:
        yield a, b, truth
    finally:
        a.shutdown()
        b.shutdown()


def _req(method: str, path: bytes | str, token: str | None, headers: dict[str, bytes | str] | None = None,
         body: bytes = b"", length: bool = True) -> bytes:
    p = path.encode() if isinstance(path, str) else path
    lines = [method.encode() + b" " + p + b" HTTP/1.1", b"Host: store"]
    if token is not None:
        lines.append(b"Authorization: Bearer " + token.encode())
    for k, v in (headers or {}).items():
        lines.append(k.encode() + b": " + (v.encode() if isinstance(v, str) else v))
    if length and body and not any(k.lower() == "content-length" for k in (headers or {})):
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def _judge(t: Tally, what: str, status: int, same: bool | None = None, *, detected: bool = False) -> None:
    """4xx/5xx: refused; 2xx: identical when ``same`` says the answer is what a legitimate client gets."""
    if status == 0:
        t.record("silent", f"{what}: no answer")
    elif status >= 400:
        t.record("refused", what)
    elif detected:
        t.record("detected", what)
    elif same:
        t.record("identical", what)
    else:
        t.record("silent", f"{what}: HTTP {status}")


def _intact(a: StoreServer, b: StoreServer, truth: dict) -> bool:
    sd = truth["step_dir"]
    for s in (a, b):
        for name, data in truth["files"].items():
            p = s.root / sd / name
            if p.is_symlink() or not p.is_file() or p.read_bytes() != data:
                return False
    return True


def _body_and_status(server: StoreServer, data: bytes) -> tuple[int, bytes]:
    """Like ``raw`` but reads the whole body (Content-Length) of the answer."""
    port = int(server.address.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
        c.sendall(data)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = c.recv(65536)
            if not chunk:
                return (0, b"") if not buf.startswith(b"HTTP/") else (int(buf.split()[1]), b"")
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        n = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")),
                 0)
        while len(body) < n:
            chunk = c.recv(65536)
            if not chunk:
                break
            body += chunk
    return int(head.split()[1]), body


@pytest.mark.timeout(120)
def test_hostile_requests(stores: tuple[StoreServer, StoreServer, dict], tmp_path: Path) -> None:
    a, b, truth = stores
    t = Tally.of("store")
    tok = a.token
    sd = truth["step_dir"]
    data_name = "rank-00000.safetensors"
    data = truth["files"][data_name]
    legit = f"/{sd}/{data_name}"

    # -- authentication variants, every verb -------------------------------------------------------
    auth_variants: list[tuple[str, dict[str, bytes | str]]] = [
        ("none", {}), ("empty", {"Authorization": ""}), ("scheme only", {"Authorization": "Bearer"}),
        ("scheme and space", {"Authorization": "Bearer "}), ("wrong", {"Authorization": "Bearer wrong"}),
        ("lowercase scheme", {"Authorization": f"bearer {tok}"}), ("basic", {"Authorization": f"Basic {tok}"}),
        ("suffix", {"Authorization": f"Bearer {tok}x"}), ("prefix", {"Authorization": f"Bearer {tok[:-1]}"}),
        ("double space", {"Authorization": f"Bearer  {tok}"}), ("bare token", {"Authorization": tok}),
        ("two tokens", {"Authorization": f"Bearer {tok}, Bearer {tok}"}),
        ("non-ASCII", {"Authorization": b"Bearer " + tok.encode()[:-1] + b"\xe9"}),
        ("long", {"Authorization": "Bearer " + "x" * 10000}),
        ("token in another header", {"X-Authorization": f"Bearer {tok}"}),
    ]
    verbs = [("GET", legit, b""), ("HEAD", legit, b""), ("GET", "/health", b""), ("GET", "/list", b""),
             ("PUT", legit, b"x" * 16), ("PUT", f"/{sd}/rank-00009.json", b"{}"),
             ("POST", "/replicate", json.dumps({"step_dir": sd, "files": [data_name]}).encode())]
    for name, hdrs in auth_variants:
        for method, path, body in verbs:
            status, _ = raw(a, _req(method, path, None, hdrs, body))
            _judge(t, f"auth {name} {method} {path}", status)
    # two Authorization headers, the right one first or second
    for order in ((f"Bearer {tok}", "Bearer x"), ("Bearer x", f"Bearer {tok}")):
        req = (b"GET /health HTTP/1.1\r\nAuthorization: " + order[0].encode() + b"\r\nAuthorization: "
               + order[1].encode() + b"\r\n\r\n")
        _judge(t, "duplicate Authorization", raw(a, req)[0])
    assert not (a.root / sd / "rank-00009.json").exists()

    # -- paths ---------------------------------------------------------------------------------------
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"SECRET outside the root")
    (a.root / sd / "rank-00007.safetensors").symlink_to(outside)
    (a.root / sd / "rank-00008.safetensors").symlink_to(a.root / sd / data_name)
    os.mkfifo(a.root / sd / "rank-00006.safetensors")
    (a.root / sd / "rank-00005.safetensors").mkdir()
    (a.root / sd / ".rank-00000.json.tmp-deadbeef").write_bytes(b"half written")
    (a.root / "step-000000000060-0000abcd").symlink_to(tmp_path)  # a step dir that is a link out of the root
    (a.root / "notastep").mkdir()
    (a.root / "notastep" / "x.bin").write_bytes(b"not served")
    paths: list[tuple[bytes, bytes | None]] = [  # (path, the bytes a legitimate GET gives, or None: must be refused)
        (b"/../secret.bin", None), (b"/..%2fsecret.bin", None), (b"/%2e%2e/secret.bin", None),
        (b"/%2E%2E%2Fsecret.bin", None), (b"/" + sd.encode() + b"/../../secret.bin", None),
        (b"/" + sd.encode() + b"/..", None), (b"/.", None), (b"/./" + sd.encode() + b"/" + data_name.encode(), None),
        (b"//etc/passwd", None), (b"/etc/passwd", None), (b"/proc/self/environ", None),
        (b"/%00", None), (b"/" + sd.encode() + b"/rank-00000.json%00.txt", None),
        (b"/" + b"a" * 300, None), (b"/" + sd.encode() + b"/" + b"b" * 256, None), (b"/%ff", None),
        (b"/%c0%ae%c0%ae/secret.bin", None), (b"/" + sd.encode() + b"%5c..%5c..%5csecret.bin", None),
        (b"http://evil/" + sd.encode() + b"/" + data_name.encode(), None), (b"*", None), (b"", None),
        (b"/" + sd.encode() + b"/rank-00007.safetensors", None), (b"/" + sd.encode() + b"/rank-00008.safetensors", None),
        (b"/" + sd.encode() + b"/rank-00006.safetensors", None), (b"/" + sd.encode() + b"/rank-00005.safetensors", None),
        (b"/" + sd.encode() + b"/.rank-00000.json.tmp-deadbeef", None),
        (b"/step-000000000060-0000abcd/secret.bin", None), (b"/step-000000000060-0000abcd/", None),
        (b"/notastep/x.bin", None), (b"/notastep/", None), (b"/" + sd.upper().encode() + b"/" + data_name.encode(), None),
        (b"/" + sd.encode() + b"/" + data_name.encode() + b"/extra", None), (b"/a/b/c/d", None),
        (b"/" + sd.encode() + b"//" + data_name.encode(), None), (b"/%2f" + sd.encode() + b"/" + data_name.encode(), None),
        (b"/" + sd.encode() + b"/" + data_name.encode(), data),  # the legitimate read itself
        (b"/" + sd.encode() + b"/" + data_name.encode() + b"?x=1", data),
        (b"/" + sd.encode() + b"/" + data_name.encode() + b"#frag", data),
        (b"/" + sd.encode() + b"/" + data_name.encode() + b"/", data),
        (b"/" + sd.encode() + b"/rank%2d00000.safetensors", data),
        (b"/" + sd.encode() + b"/rank-00000.json", truth["files"]["rank-00000.json"]),
    ]
    for path, want in paths:
        status, body = _body_and_status(a, b"GET " + path + b" HTTP/1.1\r\nAuthorization: Bearer " + tok.encode()
                                        + b"\r\n\r\n")
        _judge(t, f"path {path[:60]!r}", status, want is not None and body == want)
        assert b"SECRET" not in body and b"not served" not in body

    # -- ranges ---------------------------------------------------------------------------------------
    n = len(data)
    ranges: list[tuple[str, tuple[int, int] | None]] = [  # (Range, the slice a correct server sends, or None: 416)
        ("bytes=0-0", (0, 1)), ("bytes=0-", (0, n)), ("bytes=-1", (n - 1, n)), (f"bytes=-{n}", (0, n)),
        (f"bytes=-{n + 5}", (0, n)), (f"bytes={n - 1}-{n - 1}", (n - 1, n)), (f"bytes=0-{n + 100}", (0, n)),
        (f"bytes=10-{n}", (10, n)), ("bytes=100-199", (100, 200)), (" bytes=5-9 ", (5, 10)),
        ("bytes=5-4", None), ("bytes=100-11", None), (f"bytes={n}-", None), (f"bytes={n}-{n + 10}", None),
        ("bytes=-0", None), ("bytes=-", None), ("bytes=a-b", None), ("bytes=--1", None), ("bytes=1-2-3", None),
        ("bytes=0-1,2-3", None), ("items=0-1", None), ("bytes =0-1", None), ("bytes=0x10-20", None),
        ("bytes=+1-2", None), ("bytes=1.5-2", None), ("bytes=" + "9" * 20 + "-", None),
        ("bytes=0-" + "9" * 20, None), ("bytes=-" + "9" * 20, None), ("bytes=18446744073709551616-", None),
        ("bytes=1-0", None), ("bytes=0--0", None), ("bytes= 0-1", None), ("", None), ("bytes", None),
        ("bytes=0-1;q=1", None), ("bytes=\u0663-\u0664", None),
    ]
    for rng, want in ranges:
        status, body = _body_and_status(a, _req("GET", legit, tok, {"Range": rng.encode("utf-8")}))
        _judge(t, f"range {rng!r}", status, want is not None and status == 206 and body == data[want[0]:want[1]])
    status, _ = raw(a, _req("GET", legit, tok, {"Range": "bytes=0-1"}) .replace(b"\r\n\r\n", b"\r\nRange: bytes=2-3\r\n\r\n"))
    _judge(t, "two Range headers", status)

    # -- Content-Length and bodies ---------------------------------------------------------------------
    for cl in ("-1", "abc", "", " ", "1e3", "0x10", "+5", "5.0", "9" * 20, "18446744073709551616", "１２"):
        status, _ = raw(a, _req("PUT", legit, tok, {"Content-Length": cl.encode("utf-8")}, b"12345", length=False))
        _judge(t, f"PUT Content-Length {cl!r}", status)
        status, _ = raw(a, _req("POST", "/replicate", tok, {"Content-Length": cl.encode("utf-8")}, b"{}", length=False))
        _judge(t, f"POST Content-Length {cl!r}", status)
    for what, req in [
        ("no Content-Length", _req("PUT", legit, tok, {}, b"", length=False)),
        ("chunked", _req("PUT", legit, tok, {"Transfer-Encoding": "chunked"}, b"5\r\n12345\r\n0\r\n\r\n", length=False)),
        ("too large", _req("PUT", legit, tok, {"Content-Length": str(1 << 41)}, b"", length=False)),
        ("zero length", _req("PUT", legit, tok, {"Content-Length": "0"}, b"", length=False)),
        ("two lengths", _req("PUT", legit, tok, {"Content-Length": "5\r\nContent-Length: 6"}, b"123456", length=False)),
        ("GET with a body", _req("GET", legit, tok, {"Content-Length": "5"}, b"12345", length=False)),
        ("GET chunked", _req("GET", legit, tok, {"Transfer-Encoding": "chunked"}, b"0\r\n\r\n", length=False)),
        ("POST too large", _req("POST", "/replicate", tok, {"Content-Length": str(1 << 20)}, b"", length=False)),
    ]:
        _judge(t, what, raw(a, req)[0])
    for m in ("DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT", "MOVE", "GETX"):
        _judge(t, f"method {m}", raw(a, _req(m, legit, tok))[0])
    # a body shorter than its Content-Length (the client half-closes): refused, nothing stored
    for cl in (10, 1000, len(data) + 1):
        port = int(a.address.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as c:
            c.sendall(_req("PUT", f"/{sd}/rank-00004.safetensors", tok, {"Content-Length": str(cl)}, b"abc",
                           length=False))
            c.shutdown(socket.SHUT_WR)
            answer = c.recv(100)
        _judge(t, f"short body of {cl}", int(answer.split()[1]) if answer.startswith(b"HTTP/") else 0)
    assert not (a.root / sd / "rank-00004.safetensors").exists()

    # -- headers -----------------------------------------------------------------------------------------
    for what, req in [
        ("non-ASCII Range", _req("GET", legit, tok, {"Range": b"bytes=0-\xff"})),
        ("non-ASCII name", _req("GET", legit, tok, {b"X-\xe9".decode("latin-1"): "1"})),
        ("non-ASCII Host", _req("GET", legit, tok, {"X-Host": b"\xc3\xa9"})),
        ("150 headers", _req("GET", legit, tok, {f"X-{i}": "1" for i in range(150)})),
        ("70 kB header", _req("GET", legit, tok, {"X-Big": "y" * 70000})),
        ("70 kB request line", _req("GET", "/" + "z" * 70000, tok)),
        ("HTTP/2.0", _req("GET", legit, tok).replace(b"HTTP/1.1", b"HTTP/2.0", 1)),
        ("HTTP/9", _req("GET", legit, tok).replace(b"HTTP/1.1", b"HTTP/9", 1)),
        ("Expect without token", _req("PUT", f"/{sd}/rank-00004.json", None, {"Expect": "100-continue",
                                                                              "Content-Length": "2"}, b"", length=False)),
        ("TLS hello", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n"),
        ("NUL in header", _req("GET", legit, tok, {"X-Null": b"a\x00b"})),
        ("header without colon", _req("GET", legit, tok).replace(b"Host: store", b"Host store")),
    ]:
        status, body = _body_and_status(a, req)
        # e.g. a NUL in a value, a header without a colon: answered 4xx, or served as the legit file
        _judge(t, f"header {what}", status, status == 200 and body == data)
    for what, hdrs in [("Connection: close", {"Connection": "close"}), ("odd Host", {"Host2": "evil.example"}),
                       ("Accept-Encoding gzip", {"Accept-Encoding": "gzip"}), ("If-None-Match", {"If-None-Match": "*"})]:
        status, body = _body_and_status(a, _req("GET", legit, tok, hdrs))
        _judge(t, f"header {what}", status, body == data)
    assert not (a.root / sd / "rank-00004.json").exists()

    # -- PUT over existing parts: write-once ----------------------------------------------------------------
    for name, content in truth["files"].items():
        path = f"/{sd}/{name}"
        for what, body in [("other bytes", bytes(x ^ 1 for x in content[:64]) + content[64:]),
                           ("truncated", content[:-1]), ("extended", content + b"\x00"), ("empty", b"")]:
            if not body and not content:
                continue
            _judge(t, f"PUT {what} over {name}", raw(a, _req("PUT", path, tok, {"Content-Length": str(len(body))},
                                                             body, length=False))[0])
        status = raw(a, _req("PUT", path, tok, {}, content))[0]
        _judge(t, f"PUT identical {name}", status, status == 200)
    # PUT through links: a step dir that is a symlink, a name that is a symlink out of the root
    _judge(t, "PUT into a linked step dir", raw(a, _req("PUT", "/step-000000000060-0000abcd/rank-00000.json", tok,
                                                        {}, b"{}"))[0])
    _judge(t, "PUT over a link out", raw(a, _req("PUT", f"/{sd}/rank-00007.safetensors", tok, {}, b"overwrite"))[0])
    for path in ("/x.json", f"/{sd}/x.bin", f"/{sd}/rank-1.json", f"/{sd}/RANK-00000.json", "/step-1-0/rank-00000.json",
                 f"/{sd}/rank-00000.json.tmp-1", "/notastep/rank-00000.json", "/health", "/replicate"):
        _judge(t, f"PUT {path}", raw(a, _req("PUT", path, tok, {}, b"{}"))[0])
    assert outside.read_bytes() == b"SECRET outside the root" and not list(tmp_path.glob("rank-*"))
    assert _intact(a, b, truth)

    # -- replicate payloads ------------------------------------------------------------------------------
    bad_payloads: list[bytes] = [b"{", b"[]", b"null", b"1", b'"x"', b'{"step_dir": 1}', b'{"files": []}',
                                 json.dumps({"step_dir": sd}).encode(), json.dumps({"step_dir": sd, "files": []}).encode(),
                                 json.dumps({"step_dir": sd, "files": "manifest.json"}).encode(),
                                 json.dumps({"step_dir": sd, "files": [None]}).encode(),
                                 json.dumps({"step_dir": sd, "files": [["x"]]}).encode(),
                                 json.dumps({"step_dir": sd, "files": ["manifest.json"] * 100}).encode(),
                                 "\u00e9".encode("latin-1"), b"\xff\xfe{}"]
    for name in ("../../etc/passwd", "rank-00000.json\x00", "a/b", "..", ".", "", "x" * 300, "rank-00000.json\n",
                 ".rank-00000.json.tmp-deadbeef", "/etc/passwd", "rank-00000.JSON", "secret.bin"):
        bad_payloads.append(json.dumps({"step_dir": sd, "files": [name]}).encode())
    for step_dir in ("../" + sd, sd + "/..", "step-1-0", "notastep", "", sd + "\x00", "/" + sd):
        bad_payloads.append(json.dumps({"step_dir": step_dir, "files": ["manifest.json"]}).encode())
    for body in bad_payloads:
        _judge(t, f"replicate {body[:60]!r}", raw(a, _req("POST", "/replicate", tok, {}, body))[0])
    # names that pass the pattern but are not regular files inside the root: accepted, then refused by the replicator
    failures, pushed = a.health()["replicator"]["failures"], a.health()["replicator"]["pushed"]
    odd = ["rank-00007.safetensors", "rank-00008.safetensors", "rank-00006.safetensors", "rank-00005.safetensors",
           "rank-00003.safetensors"]
    for name in odd:
        status = raw(a, _req("POST", "/replicate", tok, {}, json.dumps({"step_dir": sd, "files": [name]}).encode()))[0]
        assert status == 202
    status = raw(a, _req("POST", "/replicate", tok, {},
                         json.dumps({"step_dir": "step-000000000060-0000abcd", "files": ["objects.pt"]}).encode()))[0]
    assert status == 202
    status = raw(a, _req("POST", "/replicate", tok, {},
                         json.dumps({"step_dir": sd, "files": sorted(truth["files"])}).encode()))[0]  # a legitimate retry
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (a.health()["replicator"]["failures"] < failures + len(odd) + 1
                                           or a.health()["replicator"]["pushed"] < pushed + len(truth["files"])):
        time.sleep(0.05)
    rep = a.health()["replicator"]
    assert rep["alive"] and a.health()["ok"]
    peer_names = set(os.listdir(b.root / sd))
    for name in odd + ["objects.pt (linked step dir)"]:
        leaked = name in peer_names or any(b"SECRET" in (b.root / sd / p).read_bytes() for p in peer_names)
        t.record("silent" if leaked else "detected", f"replicate {name}")
    _judge(t, "replicate legitimate retry", status, _intact(a, b, truth))
    assert not (b.root / "step-000000000060-0000abcd").exists()

    # -- GC with bogus and incomplete steps ---------------------------------------------------------------
    def put(path: str, body: bytes) -> int:
        return raw(a, _req("PUT", path, tok, {}, body))[0]

    bogus: list[tuple[str, list[tuple[str, bytes]]]] = [
        ("empty index", [("rank-99999.json", b"{}")]), ("list index", [("rank-00000.json", b"[]")]),
        ("null index", [("rank-00000.json", b"null")]), ("not JSON", [("rank-00000.json", b"{")]),
        ("index naming another file", [("rank-00000.safetensors", b"x"),
                                       ("rank-00000.json", b'{"file": "rank-00001.safetensors", "file_size": 1}')]),
        ("size mismatch", [("rank-00000.safetensors", b"xx"),
                           ("rank-00000.json", b'{"file": "rank-00000.safetensors", "file_size": 1}')]),
        ("size as string", [("rank-00000.safetensors", b"x"),
                            ("rank-00000.json", b'{"file": "rank-00000.safetensors", "file_size": "1"}')]),
        ("data without index", [("rank-00000.safetensors", b"x" * 100)]),
        ("index without data", [("rank-00000.json", b'{"file": "rank-00000.safetensors", "file_size": 1}')]),
        ("manifest only", [("manifest.json", b'{"world_size": 1}')]),
        ("objects only", [("objects.pt", b"x")]),
        ("world too small", [("rank-00005.safetensors", b"x"), ("manifest.json", b'{"world_size": 2}'),
                             ("rank-00005.json", b'{"file": "rank-00005.safetensors", "file_size": 1}')]),
        ("bad manifest", [("rank-00000.safetensors", b"x"), ("manifest.json", b"{"),
                          ("rank-00000.json", b'{"file": "rank-00000.safetensors", "file_size": 1}')]),
    ]
    usable_before = usable_steps([Tier("a", str(a.root), "local")])
    for i, (what, files) in enumerate(bogus):
        step_dir = f"step-{999999999990 - i:012d}-{i:08x}"
        statuses = [put(f"/{step_dir}/{name}", body) for name, body in files]
        assert all(s == 201 for s in statuses), (what, statuses)  # authenticated writes of new names
        assert not step_complete(a.root / step_dir)
        a.gc()
        ok = _intact(a, b, truth) and usable_steps([Tier("a", str(a.root), "local")]) == usable_before
        t.record("identical" if ok else "silent", f"GC after bogus step: {what}")
    for i in range(10):
        put(f"/step-{999999999900 + i:012d}-0000beef/rank-99999.json", b"{}")
    a.gc()
    t.record("identical" if _intact(a, b, truth) else "silent", "GC after 10 more bogus steps")

    # -- what a legitimate client reads is unchanged -----------------------------------------------------------
    assert _intact(a, b, truth)
    res = load_tiered([Tier("a", str(a.root), "local")], NEW, 0, ptc=PTC_, step=3)
    assert all(torch.equal(res.result.shard[k], v) if isinstance(v, torch.Tensor) else res.result.shard[k] == v
               for k, v in truth["shard"].items())
    assert a.health()["ok"] and b.health()["ok"]
    assert t.tried >= 300, t.tried
    t.assert_none_silent()

    # two new real snapshots: the superseded bogus steps and the oldest real one go, the new ones stay
    shards = PTC_.shard(_global(11), CFG)
    for step in (4, 5):
        time.sleep(0.02)
        for r in range(CFG.world_size):
            HostStore(str(a.root), a.address).snapshot(PTC_, CFG, r, shards[r], step=step, replicate=False)
    a.gc()
    kept = sorted(d.name[:17] for d in a.root.iterdir() if d.name.startswith("step-") and not d.is_symlink())
    assert kept == ["step-000000000004", "step-000000000005"], kept
