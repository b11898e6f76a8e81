"""The per-host tensor store: snapshots of the host's ranks in local memory (tmpfs), served to peers.

One store runs per host (``tenplex store serve``). Workers write snapshots into its root
directory with ``tenplex.save`` (a memory copy when the root is on tmpfs); the store serves
byte ranges to peer hosts over HTTP (``Range`` requests, readable with fsspec's HTTP
filesystem), accepts replicas pushed by peers (``PUT``), pushes its own ranks' parts to its
replica hosts in the background, keeps the newest steps only, and answers ``/health`` and
``/list``. Listening beyond loopback requires a shared token; paths outside the root are
refused.
"""

from __future__ import annotations

import hmac
import html
import json
import logging
import os
import re
import shutil
import threading
import time
import urllib.request
import uuid
from collections.abc import Sequence
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

__all__ = ["StoreServer", "serve"]

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{12})-[0-9a-f]{8}$")
_LOOPBACK = ("127.", "localhost", "::1")


class StoreServer:
    """An HTTP server over ``root``: GET/HEAD with ranges, PUT, /health, /list, /replicate."""

    def __init__(self, root: str, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None,
                 peers: Sequence[str] = (), replicas: int = 1, keep_last: int = 2) -> None:
        if not host.startswith(_LOOPBACK) and not token:
            raise ValueError(f"listening on {host} (beyond loopback) needs a shared token: pass --token or "
                             "set TENPLEX_STORE_TOKEN")
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self.token = token
        self.peers = [p.rstrip("/") for p in peers]
        self.replicas = replicas
        self.keep_last = keep_last
        self.bytes_served = 0
        self.bytes_replicated = 0
        self._lock = threading.Lock()
        self._replicator = _Replicator(self)
        handler = type("Handler", (_Handler,), {"store": self})
        self.httpd = ThreadingHTTPServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.address = f"http://{host}:{self.httpd.server_address[1]}"

    # -- paths ---------------------------------------------------------------------------------
    def resolve(self, url_path: str) -> Path | None:
        """The file or directory a request path names, or None when it leaves the root."""
        rel = unquote(urlsplit(url_path).path).lstrip("/")
        target = (self.root / rel).resolve()
        if target != self.root and self.root not in target.parents:
            return None
        return target

    def replica_targets(self) -> list[str]:
        """The next ``replicas`` peers after this store in the ring of all stores."""
        ring = sorted(set(self.peers) | {self.address})
        i = ring.index(self.address)
        return [ring[(i + k) % len(ring)] for k in range(1, min(self.replicas, len(ring) - 1) + 1)]

    def gc(self) -> None:
        """Remove step directories older than the ``keep_last`` newest steps."""
        steps: dict[int, list[Path]] = {}
        for d in self.root.iterdir():
            m = _STEP_DIR.match(d.name)
            if m and d.is_dir():
                steps.setdefault(int(m.group(1)), []).append(d)
        for step in sorted(steps)[: -self.keep_last] if self.keep_last else []:
            for d in steps[step]:
                shutil.rmtree(d, ignore_errors=True)
                log.info("store %s: removed %s", self.address, d.name)

    def listing(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for d in sorted(self.root.iterdir()):
            if _STEP_DIR.match(d.name) and d.is_dir():
                out[d.name] = sorted(f.name for f in d.iterdir() if f.is_file() and ".tmp-" not in f.name)
        return out

    # -- lifecycle -------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        log.info("store serving %s at %s (peers %s, replicas %d)", self.root, self.address, self.peers,
                 self.replicas)
        self._replicator.start()
        self.httpd.serve_forever(poll_interval=0.2)

    def start(self) -> StoreServer:
        """Serve in a background thread (for tests and in-process use)."""
        threading.Thread(target=self.serve_forever, daemon=True, name="tenplex-store").start()
        return self

    def shutdown(self) -> None:
        self._replicator.stop()
        self.httpd.shutdown()
        self.httpd.server_close()


class _Replicator:
    """Background pushes of complete rank parts to the replica hosts, data before index."""

    def __init__(self, store: StoreServer) -> None:
        self.store = store
        self.queue: list[tuple[str, list[str]]] = []
        self.cv = threading.Condition()
        self.running = False

    def start(self) -> None:
        self.running = True
        threading.Thread(target=self._run, daemon=True, name="tenplex-replicator").start()

    def stop(self) -> None:
        with self.cv:
            self.running = False
            self.cv.notify_all()

    def submit(self, step_dir: str, files: list[str]) -> None:
        with self.cv:
            self.queue.append((step_dir, files))
            self.cv.notify_all()

    def _run(self) -> None:
        while True:
            with self.cv:
                while self.running and not self.queue:
                    self.cv.wait(timeout=1.0)
                if not self.running:
                    return
                step_dir, files = self.queue.pop(0)
            # index files last: a peer sees a complete part or none
            ordered = sorted(files, key=lambda f: (f.endswith(".json") and f != "manifest.json", f))
            for target in self.store.replica_targets():
                for name in ordered:
                    src = self.store.root / step_dir / name
                    try:
                        data = src.read_bytes()
                        req = urllib.request.Request(f"{target}/{step_dir}/{name}", data=data, method="PUT")
                        if self.store.token:
                            req.add_header("Authorization", f"Bearer {self.store.token}")
                        with urllib.request.urlopen(req, timeout=30):
                            pass
                        with self.store._lock:
                            self.store.bytes_replicated += len(data)
                    except OSError as e:
                        log.warning("store %s: replicating %s/%s to %s failed: %s", self.store.address, step_dir,
                                    name, target, e)
                        break


class _Handler(BaseHTTPRequestHandler):
    store: StoreServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("store %s: " + format, self.store.address, *args)

    # -- helpers ---------------------------------------------------------------------------------
    def _authorised(self) -> bool:
        token = self.store.token
        if not token:
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given, f"Bearer {token}"):
            return True
        self._send(HTTPStatus.UNAUTHORIZED, b"missing or wrong token\n")
        return False

    def _send(self, status: HTTPStatus, body: bytes = b"", ctype: str = "text/plain",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _target(self) -> Path | None:
        target = self.store.resolve(self.path)
        if target is None:
            self._send(HTTPStatus.FORBIDDEN, b"path outside the store\n")
        return target

    # -- verbs -----------------------------------------------------------------------------------
    def do_HEAD(self) -> None:  # noqa: N802 - stdlib naming
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802
        if not self._authorised():
            return
        path = urlsplit(self.path).path
        if path == "/health":
            body = json.dumps({"ok": True, "address": self.store.address, "root": str(self.store.root),
                               "bytes_served": self.store.bytes_served,
                               "bytes_replicated": self.store.bytes_replicated}).encode()
            return self._send(HTTPStatus.OK, body, "application/json")
        if path == "/list":
            return self._send(HTTPStatus.OK, json.dumps(self.store.listing()).encode(), "application/json")
        target = self._target()
        if target is None:
            return
        if target.is_dir():
            links = "".join(f'<a href="{html.escape(e.name)}{"/" if e.is_dir() else ""}">{html.escape(e.name)}</a>\n'
                            for e in sorted(target.iterdir()) if ".tmp-" not in e.name)
            return self._send(HTTPStatus.OK, f"<html><body>\n{links}</body></html>".encode(), "text/html")
        if not target.is_file():
            return self._send(HTTPStatus.NOT_FOUND, b"no such file\n")
        size = target.stat().st_size
        rng = self.headers.get("Range")
        start, end = 0, size
        status = HTTPStatus.OK
        if rng:
            m = re.fullmatch(r"bytes=(\d*)-(\d*)", rng.strip())
            if not m or (not m.group(1) and not m.group(2)):
                return self._send(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE, b"bad range\n")
            if m.group(1):
                start = int(m.group(1))
                end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            else:
                start = max(0, size - int(m.group(2)))
            if start >= size and size > 0:
                return self._send(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE, b"range beyond the file\n",
                                  headers={"Content-Range": f"bytes */{size}"})
            status = HTTPStatus.PARTIAL_CONTENT
        with open(target, "rb") as f:
            f.seek(start)
            body = f.read(max(0, end - start)) if self.command != "HEAD" else b""
        with self.store._lock:
            self.store.bytes_served += len(body)
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        self.send_header("Accept-Ranges", "bytes")
        if status == HTTPStatus.PARTIAL_CONTENT:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_PUT(self) -> None:  # noqa: N802
        if not self._authorised():
            return
        target = self._target()
        if target is None:
            return
        if not _STEP_DIR.match(target.parent.name) or target.parent.parent != self.store.root:
            return self._send(HTTPStatus.FORBIDDEN, b"only files inside step directories can be written\n")
        length = int(self.headers.get("Content-Length", "0"))
        data = self.rfile.read(length)
        if len(data) != length:
            return self._send(HTTPStatus.BAD_REQUEST, b"short body\n")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex[:8]}")
        tmp.write_bytes(data)
        os.replace(tmp, target)
        self._send(HTTPStatus.CREATED)
        if target.name.endswith(".json") and target.name != "manifest.json":
            self.store.gc()

    def do_POST(self) -> None:  # noqa: N802
        if not self._authorised():
            return
        if urlsplit(self.path).path != "/replicate":
            return self._send(HTTPStatus.NOT_FOUND)
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            step_dir, files = str(body["step_dir"]), [str(f) for f in body["files"]]
        except (ValueError, KeyError, TypeError):
            return self._send(HTTPStatus.BAD_REQUEST, b"expected {step_dir, files}\n")
        if not _STEP_DIR.match(step_dir) or any("/" in f or f.startswith(".") for f in files):
            return self._send(HTTPStatus.FORBIDDEN, b"bad step_dir or file names\n")
        self.store.gc()
        self.store._replicator.submit(step_dir, files)
        self._send(HTTPStatus.ACCEPTED)


def serve(root: str, listen: str, *, token: str | None = None, peers: Sequence[str] = (), replicas: int = 1,
          keep_last: int = 2) -> None:
    """Run a store in the foreground until SIGTERM/SIGINT (``tenplex store serve``)."""
    import signal

    host, _, port = listen.rpartition(":")
    server = StoreServer(root, host or "127.0.0.1", int(port), token=token, peers=peers, replicas=replicas,
                         keep_last=keep_last)

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"tenplex store: serving {server.root} at {server.address}", flush=True)
    server.serve_forever()
    time.sleep(0.1)
