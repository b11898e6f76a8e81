"""Replication between host stores: each store pushes its ranks' complete parts to the next hosts
of the ring of all stores, in the background, data before index (a peer sees a part whole or not
at all). Reads only through :class:`tenplex.store.space.StoreSpace` (regular files directly
inside step directories); a bad item is logged, counted and skipped, and the thread outlives
every error.
"""

from __future__ import annotations

import http.client
import logging
import os
import socket
import threading
from collections import deque
from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

from ..checkpoint.format import RANK_INDEX_RE, STEP_DIR_RE
from ..errors import ConfigError
from .space import PART_NAME, StoreSpace

__all__ = ["Replicator", "check_peers", "ring_targets", "MAX_QUEUE"]

log = logging.getLogger(__name__)

MAX_QUEUE = 1024
"""Replication items a store queues at most (further ``/replicate`` requests get 503)."""


def check_peers(peers: Sequence[str]) -> list[str]:
    """Peer store URLs, normalised (``http://HOST:PORT``); ConfigError naming the first bad one."""
    out = []
    for p in peers:
        try:
            u = urlsplit(p.strip())
            port = u.port
        except ValueError:
            u, port = None, None
        if u is None or u.scheme != "http" or not u.hostname or port is None or u.path not in ("", "/") \
                or u.query or u.fragment or u.username or u.password:
            raise ConfigError(f"peer {p!r} is not a store URL: use http://HOST:PORT (e.g. http://10.0.0.2:7700), "
                              "comma-separated, one per host store")
        out.append(f"http://{u.netloc}")
    return out


def ring_targets(peers: Sequence[str], address: str, replicas: int) -> list[str]:
    """The next ``replicas`` stores after ``address`` in the ring of all stores (``peers`` and itself)."""
    ring = sorted(set(peers) | {address})
    i = ring.index(address)
    return [ring[(i + k) % len(ring)] for k in range(1, min(replicas, len(ring) - 1) + 1)]


class Replicator:
    """Background pushes of complete rank parts to the replica hosts, data before index.

    Reads only regular files directly inside step directories (never through a symlink);
    a bad item is logged, counted and skipped; the thread outlives every error."""

    def __init__(self, space: StoreSpace, token: str, timeout: float, targets: Callable[[], list[str]],
                 label: str) -> None:
        self.space, self.token, self.timeout, self.targets, self.label = space, token, timeout, targets, label
        self.queue: deque[tuple[str, list[str]]] = deque()
        self.cv = threading.Condition()
        self.running = False
        self.thread: threading.Thread | None = None
        self.pushed = 0
        self.failures = 0
        self.last_error = ""
        self.bytes_replicated = 0

    def start(self) -> None:
        self.running = True
        self.thread = threading.Thread(target=self._run, daemon=True, name="tenplex-replicator")
        self.thread.start()

    def stop(self) -> None:
        with self.cv:
            self.running = False
            self.cv.notify_all()

    def state(self) -> dict[str, Any]:
        with self.cv:
            return {"alive": self.thread is not None and self.thread.is_alive(), "queue": len(self.queue),
                    "pushed": self.pushed, "failures": self.failures, "last_error": self.last_error}

    def submit(self, step_dir: str, files: list[str]) -> bool:
        """Queue one part; False when the queue is full."""
        with self.cv:
            if len(self.queue) >= MAX_QUEUE:
                return False
            self.queue.append((step_dir, files))
            self.cv.notify_all()
            return True

    def _failed(self, what: str) -> None:
        log.warning("store %s: %s", self.label, what)
        with self.cv:
            self.failures += 1
            self.last_error = what

    def _run(self) -> None:
        while True:
            with self.cv:
                while self.running and not self.queue:
                    self.cv.wait(timeout=1.0)
                if not self.running:
                    return
                step_dir, files = self.queue.popleft()
            try:
                self._push(step_dir, files)
            except Exception as e:  # noqa: BLE001 - bad input must never end replication
                self._failed(f"replicating {step_dir!r} failed: {type(e).__name__}: {e}")

    def _push(self, step_dir: str, files: list[str]) -> None:
        if not STEP_DIR_RE.fullmatch(step_dir) or not all(PART_NAME.fullmatch(f) for f in files):
            return self._failed(f"refused to replicate {step_dir!r} {files!r}: not checkpoint file names")
        # index files last: a peer sees a complete part or none
        ordered = sorted(set(files), key=lambda f: (RANK_INDEX_RE.fullmatch(f) is not None, f))
        for target in self.targets():
            try:
                with _Peer(target, self.token, self.timeout) as peer:
                    for name in ordered:
                        try:
                            with self.space.open_file(step_dir, name) as (fd, st):
                                n = peer.put(f"/{step_dir}/{name}", fd, st.st_size)
                        except FileNotFoundError as e:
                            raise _Skip(f"not replicating {step_dir}/{name}: no regular file in the root ({e})") \
                                from None
                        with self.cv:
                            self.bytes_replicated += n
                            self.pushed += 1
            except _Skip as e:
                self._failed(str(e))
            except (OSError, http.client.HTTPException) as e:
                self._failed(f"replicating {step_dir} to {target} failed: {type(e).__name__}: {e}")


class _Skip(Exception):
    """One part of a replication item cannot be pushed: the rest of it (its index) must not follow."""


class _Peer:
    """One keep-alive connection to a peer store (TCP_NODELAY), for PUTs streamed from files."""

    def __init__(self, url: str, token: str, timeout: float) -> None:
        u = urlsplit(url)
        self.conn = http.client.HTTPConnection(u.hostname or "", u.port, timeout=timeout)
        self.token = token

    def __enter__(self) -> _Peer:
        self.conn.connect()
        self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return self

    def __exit__(self, *exc: object) -> None:
        self.conn.close()

    def put(self, path: str, fd: int, size: int) -> int:
        c = self.conn
        if c.sock is None:  # the peer closed the previous connection
            self.__enter__()
        c.putrequest("PUT", path, skip_accept_encoding=True)
        c.putheader("Authorization", f"Bearer {self.token}")
        c.putheader("Content-Type", "application/octet-stream")
        c.putheader("Content-Length", str(size))
        c.endheaders()
        sent = 0
        with open(os.dup(fd), "rb") as f:
            while sent < size:
                n = c.sock.sendfile(f, sent, size - sent)
                if n == 0:
                    raise OSError(f"{path} shrank to {sent} bytes while being sent")
                sent += n
        resp = c.getresponse()
        body = resp.read(1 << 16)
        if resp.status == HTTPStatus.CONFLICT:
            raise _Skip(f"peer {c.host}:{c.port} holds other bytes for {path} (parts are write-once): "
                        f"{body.decode(errors='replace').strip()}")
        if resp.status >= 300:
            raise OSError(f"PUT {path}: HTTP {resp.status} {body.decode(errors='replace').strip()}")
        if resp.will_close or not resp.isclosed():
            c.close()  # reconnects on the next request
        return size
