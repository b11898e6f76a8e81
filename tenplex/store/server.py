"""The per-host tensor store: snapshots of the host's ranks in local memory (tmpfs), served to peers.

One store runs per host (``tenplex store serve``). Workers write snapshots into its root
directory with ``tenplex.save`` (a memory copy when the root is on tmpfs); the store serves
byte ranges to peer hosts over HTTP (``Range`` requests, readable with fsspec's HTTP
filesystem), accepts replicas pushed by peers (``PUT``, write-once), pushes its own ranks'
parts to its replica hosts in the background, keeps the newest complete steps only, and
answers ``/health`` and ``/list``.

Its trust boundary (docs/security.md): every request carries the shared token
(``tenplex.store.auth``), loopback included; only regular files directly inside step
directories are read, written or replicated; a part once stored is never replaced by other
bytes; malformed requests are answered 4xx; connections are capped, time out, and bodies are
streamed in bounded chunks.
"""

from __future__ import annotations

import errno
import hmac
import html
import http.client
import ipaddress
import json
import logging
import os
import re
import shutil
import socket
import stat
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote_to_bytes, urlsplit

from ..checkpoint.format import MANIFEST_NAME, PART_NAME_RE, RANK_INDEX_RE, STEP_DIR_RE, data_name
from ..errors import ConfigError
from .auth import resolve_token

__all__ = ["StoreServer", "serve", "step_complete", "whole_ranks", "parse_listen", "check_peers", "PART_NAME"]

log = logging.getLogger(__name__)

PART_NAME = PART_NAME_RE  # (from the checkpoint format) always .fullmatch: "$" would allow a trailing newline
"""Names of the checkpoint files a store accepts (``PUT``) and replicates (use ``.fullmatch``)."""
_NAME_MAX = 255
_CHUNK = 1 << 20
_MAX_POST = 64 << 10
_MAX_QUEUE = 1024
_MAX_FILES = 64


class _Refused(Exception):
    """A request answered with a 4xx/5xx status (raised inside a handler, answered once)."""

    def __init__(self, status: HTTPStatus, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


def parse_listen(listen: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` too) -> (host, port); ConfigError with the fix otherwise."""
    host, sep, port = listen.rpartition(":")
    host = host.strip("[]")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--listen {listen!r} is not HOST:PORT with a port in 0..65535; e.g. 127.0.0.1:7700 "
                          "(port 0 picks a free one)")
    return host or "127.0.0.1", int(port)


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


# ---------------------------------------------------------------------------------------------
# completeness of a step attempt (what garbage collection keeps)
# ---------------------------------------------------------------------------------------------
def _load_json(dir_fd: int, name: str) -> Any:
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{name} is not a regular file")  # step_complete: not a complete part
        return json.loads(f.read())


def step_complete(step_dir: str | os.PathLike[str]) -> bool:
    """Whether a step attempt directory holds only whole, parseable parts (what GC counts).

    A store holds some ranks' parts of a step (its own and replicas), so "complete" is judged
    on what is here: at least one rank part; every rank index (``rank-NNNNN.json``) parses as
    an object naming its data file, which exists as a regular file of the index's
    ``file_size``; no data file lacks its index (a part still being written); the manifest,
    when present, parses as an object with a positive ``world_size`` that covers the ranks
    here. The one place to call the checkpoint module's verifier from once it has one.
    """
    return whole_ranks(step_dir) is not None


def whole_ranks(step_dir: str | os.PathLike[str]) -> frozenset[int] | None:
    """The ranks whose parts ``step_dir`` holds whole, or None when it is not complete
    (``step_complete``)."""
    try:
        dfd = os.open(step_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        names = {e.name: e for e in os.scandir(dfd)}
        ranks = []
        for name in names:
            m = RANK_INDEX_RE.fullmatch(name)
            if m is None:
                continue
            index = _load_json(dfd, name)
            data = data_name(int(m.group(1)))
            if not isinstance(index, dict) or index.get("file") != data or data not in names:
                return None
            st = os.stat(data, dir_fd=dfd, follow_symlinks=False)
            size = index.get("file_size")
            if not stat.S_ISREG(st.st_mode) or not isinstance(size, int) or st.st_size != size:
                return None
            ranks.append(int(m.group(1)))
        if not ranks:
            return None
        if any(n.endswith(".safetensors") and n[: -len(".safetensors")] + ".json" not in names
               for n in names if PART_NAME.fullmatch(n)):
            return None
        if MANIFEST_NAME in names:
            manifest = _load_json(dfd, MANIFEST_NAME)
            world = manifest.get("world_size") if isinstance(manifest, dict) else None
            if not isinstance(world, int) or world < 1 or max(ranks) >= world:
                return None
        return frozenset(ranks)
    except (OSError, ValueError):
        return None
    finally:
        os.close(dfd)


@dataclass(frozen=True, slots=True)
class _Attempt:
    name: str
    step: int
    save_id: str
    ranks: frozenset[int] | None  # ranks whose parts are whole here (None: not complete, ``whole_ranks``)
    first_ns: int  # when the first rank part here was whole (its index's mtime)
    last_ns: int  # newest modification of the directory or a file in it
    temp_ns: int  # newest modification of a temporary file in it (a writer's part under way); 0: none


# ---------------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------------
class StoreServer:
    """An HTTP server over ``root``: GET/HEAD with ranges, PUT, /health, /list, /replicate.

    ``token``: the shared token (default: ``tenplex.store.auth.resolve_token``, generated into
    the user's token file when none exists). ``keep_last`` (>= 1): complete step attempts kept.
    ``timeout``: seconds a connection may wait for the next request or stall one socket
    operation. ``max_connections``: connections served at once; further ones wait up to
    ``timeout`` for a slot, then get 503. ``max_put_bytes``: largest accepted ``PUT`` body.
    ``incomplete_grace``: seconds an incomplete attempt, once superseded, is left alone before
    it is removed.
    """

    def __init__(self, root: str, host: str = "127.0.0.1", port: int = 0, *, token: str | None = None,
                 token_file: str | None = None, peers: Sequence[str] = (), replicas: int = 1, keep_last: int = 2,
                 timeout: float = 30.0, max_connections: int = 128, max_put_bytes: int = 1 << 40,
                 incomplete_grace: float = 60.0) -> None:
        if keep_last < 1:
            raise ConfigError(f"keep_last = {keep_last} < 1: the store must keep at least its newest complete step; "
                              "pass --keep-last 1 or more (default 2)")
        if replicas < 0:
            raise ConfigError(f"replicas = {replicas} < 0: pass --replicas 0 (no copies) or more")
        if max_connections < 1 or timeout <= 0 or max_put_bytes < 1:
            raise ConfigError(f"max_connections = {max_connections}, timeout = {timeout}, max_put_bytes = "
                              f"{max_put_bytes}: each must be positive")
        rootp = Path(root)
        if rootp.exists() and not rootp.is_dir():
            raise ConfigError(f"store root {root} exists and is not a directory: pass --root DIR (a new or existing "
                              "directory, e.g. on tmpfs: /dev/shm/tenplex-store)")
        try:
            rootp.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create the store root {root} ({e.strerror}): pass --root DIR where you may "
                              "write") from None
        self.root = rootp.resolve()
        if os.stat(self.root).st_mode & 0o077:
            log.warning("store root %s is accessible by group or others: local users can read snapshots without "
                        "the token (chmod 700 it)", self.root)
        found = resolve_token(token, token_file=token_file, create=True)
        assert found is not None  # create=True: generated when nothing else gives one
        self.token = found.value
        self.token_source = found.source
        self._expected_auth = f"Bearer {self.token}".encode("ascii")
        self.peers = check_peers(peers)
        self.replicas, self.keep_last = replicas, keep_last
        self.timeout, self.max_put_bytes, self.incomplete_grace = timeout, max_put_bytes, incomplete_grace
        self.bytes_served = 0
        self.bytes_replicated = 0
        self._lock = threading.Lock()  # counters
        self._write_lock = threading.Lock()  # creating step dirs and files vs GC removing them
        self._complete_cache: dict[str, tuple[tuple, bool]] = {}
        self._root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._replicator = _Replicator(self)
        self._serving = False
        try:
            self.httpd = _bind(self, host, port, max_connections)
        except BaseException:
            os.close(self._root_fd)
            raise
        bound = self.httpd.server_address[0]
        self.loopback = ipaddress.ip_address(bound.split("%")[0]).is_loopback
        if not self.loopback:
            log.warning("store listens on %s (beyond loopback): requests and the token travel unencrypted; use it "
                        "on a trusted network only (docs/security.md)", bound)
        shown = f"[{host}]" if ":" in host else host
        self.address = f"http://{shown}:{self.httpd.server_address[1]}"

    # -- files -------------------------------------------------------------------------------------
    @contextmanager
    def open_file(self, step_dir: str, name: str) -> Iterator[tuple[int, os.stat_result]]:
        """A regular file directly inside a step directory of the root, never through a symlink.

        Raises FileNotFoundError when there is none (missing, a symlink, a directory, a FIFO)."""
        if not STEP_DIR_RE.fullmatch(step_dir) or not _valid_name(name):
            raise FileNotFoundError(f"{step_dir}/{name}")
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            dfd = os.open(step_dir, flags | os.O_DIRECTORY, dir_fd=self._root_fd)
        except OSError:
            raise FileNotFoundError(step_dir) from None
        try:
            fd = os.open(name, flags | os.O_NONBLOCK, dir_fd=dfd)
        except OSError:
            raise FileNotFoundError(f"{step_dir}/{name}") from None
        finally:
            os.close(dfd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FileNotFoundError(f"{step_dir}/{name} is not a regular file")
            yield fd, st
        finally:
            os.close(fd)

    def replica_targets(self) -> list[str]:
        """The next ``replicas`` peers after this store in the ring of all stores."""
        ring = sorted(set(self.peers) | {self.address})
        i = ring.index(self.address)
        return [ring[(i + k) % len(ring)] for k in range(1, min(self.replicas, len(ring) - 1) + 1)]

    # -- garbage collection ------------------------------------------------------------------------
    def _attempts(self) -> list[_Attempt]:
        out = []
        cache: dict[str, tuple[tuple, frozenset[int] | None]] = {}
        for e in os.scandir(self.root):
            m = STEP_DIR_RE.fullmatch(e.name)
            if not m or not e.is_dir(follow_symlinks=False):
                continue
            try:
                entries = []
                for f in os.scandir(e.path):
                    st = f.stat(follow_symlinks=False)
                    entries.append((f.name, st.st_size, st.st_mtime_ns))
                last = max([e.stat(follow_symlinks=False).st_mtime_ns, *(t for _, _, t in entries)])
            except OSError:
                continue
            sig = tuple(sorted(entries))
            cached = self._complete_cache.get(e.name)
            ranks = cached[1] if cached and cached[0] == sig else whole_ranks(e.path)
            cache[e.name] = (sig, ranks)
            first = min((t for n, _, t in entries if RANK_INDEX_RE.fullmatch(n)), default=last)
            temp = max((t for n, _, t in entries if ".tmp-" in n), default=0)
            out.append(_Attempt(e.name, int(m.group(1)), m.group(2), ranks, first, last, temp))
        self._complete_cache = cache  # (re-checked only when a file of the attempt changed)
        return out

    def gc(self) -> list[str]:
        """Remove what is not worth keeping; returns the removed step directories.

        Complete attempts are ordered by when their first rank part was whole here, not by step
        number: after a rollback to an older step the new snapshots are the ones to keep, and a
        late replica does not make an old step new. The ``keep_last`` newest are kept, so the
        newest complete one always is. An attempt counts as complete when its parts here are
        whole (``whole_ranks``) and it holds every rank that the same launch (save id) has
        whole in any attempt here: ranks of one host write at different speeds (on SIGTERM
        each flushes its own newest steps), and a step with only the faster rank's part is one
        the slower rank may still be writing; counted as complete, it was removed under that
        writer (issue 29 item 6). A step short of ranks counts once unchanged for
        ``incomplete_grace`` seconds (a replica that never comes must not stop GC), but never
        pushes out its launch's newest step that has them all. Incomplete attempts are removed
        only once older than every kept attempt and unchanged for ``incomplete_grace``; no
        attempt is removed while a temporary file in it changed within ``incomplete_grace``
        (a writer's part under way).
        """
        with self._write_lock:
            attempts = self._attempts()
            now = time.time_ns()
            grace = int(self.incomplete_grace * 1e9)
            launch: dict[str, frozenset[int]] = {}
            for a in attempts:
                launch[a.save_id] = launch.get(a.save_id, frozenset()) | (a.ranks or frozenset())

            def full(a: _Attempt) -> bool:
                return a.ranks is not None and a.ranks >= launch[a.save_id]

            complete = sorted((a for a in attempts if a.ranks is not None and (full(a) or now - a.last_ns >= grace)),
                              key=lambda a: (a.first_ns, a.step))
            kept = complete[-self.keep_last:]
            if not kept:
                return []
            for sid in {a.save_id for a in kept if not full(a)}:  # its newest attempt with every rank stays
                newest_full = [a for a in complete if a.save_id == sid and full(a)][-1:]
                kept += [a for a in newest_full if a not in kept]
            kept_names = {a.name for a in kept}
            counted = {a.name for a in complete}
            cutoff = min(a.first_ns for a in kept)
            remove = [a for a in attempts if a.name not in kept_names and now - a.temp_ns >= grace
                      and (a.name in counted or (a.last_ns < cutoff and now - a.last_ns >= grace))]
            for a in remove:
                shutil.rmtree(self.root / a.name, ignore_errors=True)  # fd-based: never follows symlinks
                self._complete_cache.pop(a.name, None)
                log.info("store %s: removed %s (%s)", self.address, a.name,
                         "older than the newest complete steps" if a.name in counted else "incomplete, superseded")
            return [a.name for a in remove]

    def listing(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for d in sorted(self.root.iterdir()):
            if STEP_DIR_RE.fullmatch(d.name) and d.is_dir() and not d.is_symlink():
                out[d.name] = sorted(f.name for f in d.iterdir() if _visible(f))
        return out

    def health(self) -> dict[str, Any]:
        """What ``/health`` answers: ok only while the replicator runs."""
        rep = self._replicator.state()
        return {"ok": rep["alive"], "address": self.address, "root": str(self.root),
                "bytes_served": self.bytes_served, "bytes_replicated": self.bytes_replicated,
                "connections": self.httpd.active, "refused_connections": self.httpd.refused, "replicator": rep}

    # -- lifecycle ---------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        log.info("store serving %s at %s (peers %s, replicas %d, token %s)", self.root, self.address, self.peers,
                 self.replicas, self.token_source)
        self._replicator.start()
        self._serving = True
        self.httpd.serve_forever(poll_interval=0.2)

    def start(self) -> StoreServer:
        """Serve in a background thread (for tests and in-process use)."""
        threading.Thread(target=self.serve_forever, daemon=True, name="tenplex-store").start()
        return self

    def shutdown(self) -> None:
        self._replicator.stop()
        if self._serving:
            self.httpd.shutdown()
            self._serving = False
        self.httpd.server_close()
        self.httpd.close_connections()
        fd, self._root_fd = self._root_fd, -1
        if fd >= 0:  # once: a second close could hit a reused descriptor
            os.close(fd)


def _valid_name(name: str) -> bool:
    return 0 < len(name.encode("utf-8", "surrogateescape")) <= _NAME_MAX and "/" not in name and "\x00" not in name \
        and not name.startswith(".")


def _visible(p: Path) -> bool:
    return p.is_file() and not p.is_symlink() and ".tmp-" not in p.name and not p.name.startswith(".")


class _HTTPServer(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once (the rest wait, then get 503)."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128

    def __init__(self, addr: tuple[Any, ...], handler: type, family: int, max_connections: int,
                 queue_wait: float) -> None:
        self.address_family = family
        self.slots = threading.BoundedSemaphore(max_connections)
        self.queue_wait = queue_wait
        self.active = 0
        self.refused = 0
        self.counter_lock = threading.Lock()
        self.connections: set[socket.socket] = set()
        super().__init__(addr, handler)

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        if not self.slots.acquire(timeout=self.queue_wait):
            with self.counter_lock:
                self.refused += 1
            try:
                request.settimeout(1.0)
                body = b"store busy: too many connections\n"
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nConnection: close\r\n"
                                b"Content-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            except OSError:
                pass
            self.shutdown_request(request)
            return
        self._count(1, request)
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._count(-1, request)
            raise

    def process_request_thread(self, request: socket.socket, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._count(-1, request)

    def _count(self, d: int, request: socket.socket) -> None:
        with self.counter_lock:
            self.active += d
            (self.connections.add if d > 0 else self.connections.discard)(request)
        if d < 0:
            self.slots.release()

    def close_connections(self) -> None:
        """End every open connection (their threads return at once instead of at their timeout)."""
        with self.counter_lock:
            conns = list(self.connections)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a connection that broke or timed out mid-request: one line, no traceback
        log.debug("store: connection from %s ended: %r", client_address, sys.exc_info()[1])


def _bind(store: StoreServer, host: str, port: int, max_connections: int) -> _HTTPServer:
    """Resolve ``host`` (the loopback test uses the bound address, never the name) and listen."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigError(f"cannot resolve the listen host {host!r} ({e.strerror}): pass an IP address, e.g. "
                          "--listen 127.0.0.1:7700") from None
    family, _, _, _, addr = infos[0]
    handler = type("Handler", (_Handler,), {"store": store, "timeout": store.timeout})
    try:
        return _HTTPServer(addr[:2], handler, family, max_connections, store.timeout)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise ConfigError(f"{host}:{port} is in use: pick another port with --listen HOST:PORT (port 0 picks a "
                              "free one), or stop the process using it") from None
        raise ConfigError(f"cannot listen on {host}:{port} ({e.strerror}): pass another --listen HOST:PORT") from None


# ---------------------------------------------------------------------------------------------
# replication
# ---------------------------------------------------------------------------------------------
class _Replicator:
    """Background pushes of complete rank parts to the replica hosts, data before index.

    Reads only regular files directly inside step directories (never through a symlink);
    a bad item is logged, counted and skipped; the thread outlives every error."""

    def __init__(self, store: StoreServer) -> None:
        self.store = store
        self.queue: deque[tuple[str, list[str]]] = deque()
        self.cv = threading.Condition()
        self.running = False
        self.thread: threading.Thread | None = None
        self.pushed = 0
        self.failures = 0
        self.last_error = ""

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
            if len(self.queue) >= _MAX_QUEUE:
                return False
            self.queue.append((step_dir, files))
            self.cv.notify_all()
            return True

    def _failed(self, what: str) -> None:
        log.warning("store %s: %s", self.store.address, what)
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
        for target in self.store.replica_targets():
            try:
                with _Peer(target, self.store.token, self.store.timeout) as peer:
                    for name in ordered:
                        try:
                            with self.store.open_file(step_dir, name) as (fd, st):
                                n = peer.put(f"/{step_dir}/{name}", fd, st.st_size)
                        except FileNotFoundError as e:
                            raise _Skip(f"not replicating {step_dir}/{name}: no regular file in the root ({e})") \
                                from None
                        with self.store._lock:
                            self.store.bytes_replicated += n
                        with self.cv:
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


# ---------------------------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------------------------
class _Handler(BaseHTTPRequestHandler):
    store: StoreServer
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # TCP_NODELAY: no 40 ms Nagle/delayed-ACK stall between header and body
    server_version = "tenplex-store"
    sys_version = ""
    default_request_version = "HTTP/1.0"  # answers to garbage get a status line (no HTTP/0.9)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("store %s: " + format, self.store.address, *args)

    def handle_expect_100(self) -> bool:
        try:
            self._check_headers()
            self._authorise()
        except _Refused as e:
            self._answer(e.status, e.message.encode(), headers=e.headers)
            return False
        return super().handle_expect_100()

    # -- dispatch ----------------------------------------------------------------------------------
    def do_HEAD(self) -> None:  # noqa: N802 - stdlib naming
        self._dispatch(self._get)

    def do_GET(self) -> None:  # noqa: N802
        self._dispatch(self._get)

    def do_PUT(self) -> None:  # noqa: N802
        self._dispatch(self._put)

    def do_POST(self) -> None:  # noqa: N802
        self._dispatch(self._post)

    def do_DELETE(self) -> None:  # noqa: N802
        self._dispatch(self._not_allowed)

    do_OPTIONS = do_PATCH = do_TRACE = do_CONNECT = do_DELETE

    def _not_allowed(self) -> None:
        raise _Refused(HTTPStatus.METHOD_NOT_ALLOWED, "the store answers GET, HEAD, PUT and POST /replicate",
                       {"Allow": "GET, HEAD, PUT, POST"})

    def _dispatch(self, verb: Any) -> None:
        self._started = False
        try:
            self._check_headers()
            self._authorise()
            verb()
        except _Refused as e:
            if not self._started:
                self._answer(e.status, (e.message + "\n").encode(), headers=e.headers)
            self.close_connection = True
        except (ConnectionError, TimeoutError) as e:
            log.debug("store %s: %s %s from %s broke off: %r", self.store.address, self.command, self.path[:200],
                      self.client_address, e)
            self.close_connection = True
        except Exception as e:  # noqa: BLE001 - one line in the log, never a traceback per request
            log.warning("store %s: %s %s failed: %s: %s", self.store.address, self.command, self.path[:200],
                        type(e).__name__, e)
            if not self._started:
                self._answer(HTTPStatus.INTERNAL_SERVER_ERROR, b"internal error\n")
            self.close_connection = True

    def _answer(self, status: HTTPStatus, body: bytes = b"", ctype: str = "text/plain",
                headers: dict[str, str] | None = None) -> None:
        """A whole response in one write; errors close the connection (a request body may be unread)."""
        self._started = True
        error = status >= 400
        lines = [f"HTTP/1.1 {status.value} {status.phrase}", f"Server: {self.server_version}",
                 f"Content-Type: {ctype}", f"Content-Length: {len(body)}"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if error or self.close_connection:
            lines.append("Connection: close")
            self.close_connection = True
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        self.wfile.write(head if self.command == "HEAD" else head + body)
        self.log_request(status.value, len(body))

    # -- checks ------------------------------------------------------------------------------------
    def _check_headers(self) -> None:
        for k, v in self.headers.items():
            if not (k.isascii() and v.isascii()):
                raise _Refused(HTTPStatus.BAD_REQUEST, f"header {k.encode('ascii', 'replace').decode()!r} is not ASCII")
        for k in ("Authorization", "Content-Length", "Range", "Transfer-Encoding"):
            if len(self.headers.get_all(k) or ()) > 1:
                raise _Refused(HTTPStatus.BAD_REQUEST, f"more than one {k} header")

    def _authorise(self) -> None:
        given = self.headers.get("Authorization", "").strip().encode("ascii")
        if not hmac.compare_digest(given, self.store._expected_auth):
            raise _Refused(HTTPStatus.UNAUTHORIZED, "missing or wrong token: send Authorization: Bearer <token> "
                           "(TENPLEX_STORE_TOKEN or the store's token file)", {"WWW-Authenticate": "Bearer"})

    def _parts(self) -> list[str]:
        """The request path as names below the root (validated; query and fragment ignored)."""
        raw = self.path.split("?", 1)[0].split("#", 1)[0]
        if not raw.startswith("/"):
            raise _Refused(HTTPStatus.BAD_REQUEST, "the request target must be a path starting with /")
        try:
            text = unquote_to_bytes(raw).decode("utf-8")
        except UnicodeDecodeError:
            raise _Refused(HTTPStatus.BAD_REQUEST, "the path is not UTF-8") from None
        if "\x00" in text:
            raise _Refused(HTTPStatus.BAD_REQUEST, "NUL byte in the path")
        parts = text.split("/")[1:]
        if parts and parts[-1] == "":
            parts.pop()
        if any(p in (".", "..") for p in parts):
            raise _Refused(HTTPStatus.FORBIDDEN, "path outside the store")
        if any(p == "" for p in parts) or len(parts) > 2:
            raise _Refused(HTTPStatus.NOT_FOUND, "no such file: the store serves /STEP_DIR/FILE")
        if any(len(p.encode()) > _NAME_MAX for p in parts):
            raise _Refused(HTTPStatus.BAD_REQUEST, f"a path component is longer than {_NAME_MAX} bytes")
        return parts

    def _length(self, limit: int) -> int:
        if self.headers.get("Transfer-Encoding"):
            raise _Refused(HTTPStatus.LENGTH_REQUIRED, "chunked bodies are not accepted: send Content-Length")
        text = self.headers.get("Content-Length")
        if text is None:
            raise _Refused(HTTPStatus.LENGTH_REQUIRED, "Content-Length is required")
        if not re.fullmatch(r"[0-9]{1,19}", text.strip()):
            raise _Refused(HTTPStatus.BAD_REQUEST, f"Content-Length {text[:40]!r} is not a non-negative integer")
        n = int(text)
        if n > limit:
            raise _Refused(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body of {n} bytes exceeds the limit of {limit}")
        return n

    # -- verbs -------------------------------------------------------------------------------------
    def _get(self) -> None:
        if self.headers.get("Transfer-Encoding") or self.headers.get("Content-Length", "0").strip() != "0":
            raise _Refused(HTTPStatus.BAD_REQUEST, f"{self.command} takes no body")
        parts = self._parts()
        if parts == ["health"]:
            return self._answer(HTTPStatus.OK, json.dumps(self.store.health()).encode(), "application/json")
        if parts == ["list"]:
            return self._answer(HTTPStatus.OK, json.dumps(self.store.listing()).encode(), "application/json")
        if len(parts) < 2:
            return self._directory(parts)
        step_dir, name = parts
        try:
            with self.store.open_file(step_dir, name) as (fd, st):
                self._send_file(fd, st.st_size)
        except FileNotFoundError:
            raise _Refused(HTTPStatus.NOT_FOUND, "no such file") from None

    def _directory(self, parts: list[str]) -> None:
        if not parts:
            names = [(f"{d}/", d) for d in self.store.listing()]
        elif STEP_DIR_RE.fullmatch(parts[0]) and parts[0] in (listing := self.store.listing()):
            names = [(n, n) for n in listing[parts[0]]]
        else:
            raise _Refused(HTTPStatus.NOT_FOUND, "no such directory")
        links = "".join(f'<a href="{html.escape(h)}">{html.escape(n)}</a>\n' for h, n in names)
        self._answer(HTTPStatus.OK, f"<html><body>\n{links}</body></html>".encode(), "text/html")

    def _range(self, size: int) -> tuple[int, int] | None:
        """(start, end) of a single ``bytes=`` range, or None for the whole file; 416 otherwise."""
        rng = self.headers.get("Range")
        if rng is None:
            return None
        bad = _Refused(HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE, "unsatisfiable range: send one bytes=A-B with "
                       "A <= B < size, bytes=A- or bytes=-N", {"Content-Range": f"bytes */{size}"})
        m = re.fullmatch(r"bytes=([0-9]{0,19})-([0-9]{0,19})", rng.strip())
        if not m or not (m.group(1) or m.group(2)):
            raise bad
        if m.group(1):
            start = int(m.group(1))
            end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            if m.group(2) and int(m.group(2)) < start:
                raise bad
        else:
            n = int(m.group(2))
            if n == 0:
                raise bad
            start, end = max(0, size - n), size
        if start >= size:
            raise bad
        return start, end

    def _send_file(self, fd: int, size: int) -> None:
        rng = self._range(size)
        start, end = rng or (0, size)
        status = HTTPStatus.PARTIAL_CONTENT if rng else HTTPStatus.OK
        lines = [f"HTTP/1.1 {status.value} {status.phrase}", f"Server: {self.server_version}",
                 "Content-Type: application/octet-stream", f"Content-Length: {end - start}", "Accept-Ranges: bytes"]
        if rng:
            lines.append(f"Content-Range: bytes {start}-{end - 1}/{size}")
        if self.close_connection:
            lines.append("Connection: close")
        self._started = True
        self.wfile.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        if self.command == "HEAD":
            return self.log_request(status.value, 0)
        with self.store._lock:
            self.store.bytes_served += end - start
        sent = 0
        with open(os.dup(fd), "rb") as f:  # streamed from the page cache: no copy of the range in memory
            while start + sent < end:
                n = self.connection.sendfile(f, start + sent, end - start - sent)
                if n == 0:  # the file shrank under us: the client sees a short body and retries
                    self.close_connection = True
                    break
                sent += n
        if sent < end - start:
            with self.store._lock:
                self.store.bytes_served -= end - start - sent
        self.log_request(status.value, sent)

    def _put(self) -> None:
        parts = self._parts()
        if len(parts) != 2 or not STEP_DIR_RE.fullmatch(parts[0]) or not PART_NAME.fullmatch(parts[1]):
            raise _Refused(HTTPStatus.FORBIDDEN, "only checkpoint files inside step directories can be written: "
                           "/step-NNNNNNNNNNNN-XXXXXXXX/{manifest.json,objects.pt,rank-NNNNN.json,rank-NNNNN.safetensors}")
        step_dir, name = parts
        length = self._length(self.store.max_put_bytes)
        st = os.statvfs(self.store.root)
        if length > st.f_bavail * st.f_frsize:
            raise _Refused(HTTPStatus.INSUFFICIENT_STORAGE, f"{length} bytes do not fit in the store's "
                           f"{st.f_bavail * st.f_frsize} free bytes")
        root = self.store._root_fd
        with self.store._write_lock:
            try:
                os.mkdir(step_dir, 0o700, dir_fd=root)
            except FileExistsError:
                pass
            try:
                dfd = os.open(step_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root)
            except OSError:
                raise _Refused(HTTPStatus.CONFLICT, f"{step_dir} is not a directory of the store") from None
        tmp = f".{name}.tmp-{uuid.uuid4().hex[:8]}"  # hidden from listings, ignored by step_complete
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dfd)
            try:
                with open(fd, "wb", closefd=False) as f:
                    left = length
                    while left:
                        chunk = self.rfile.read(min(left, _CHUNK))
                        if not chunk:
                            raise _Refused(HTTPStatus.BAD_REQUEST, f"short body: {length - left} of {length} bytes")
                        f.write(chunk)
                        left -= len(chunk)
                status = self._place(dfd, tmp, fd, step_dir, name, length)
            finally:
                os.close(fd)
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except FileNotFoundError:
                    pass
        finally:
            os.close(dfd)
        self._answer(status)
        if status == HTTPStatus.CREATED and RANK_INDEX_RE.fullmatch(name):
            self.store.gc()

    def _place(self, dfd: int, tmp: str, fd: int, step_dir: str, name: str, length: int) -> HTTPStatus:
        """Link the received body into place unless the name exists: parts are write-once."""
        with self.store._write_lock:
            try:
                os.link(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                return HTTPStatus.CREATED
            except FileExistsError:
                pass
            except FileNotFoundError:
                raise _Refused(HTTPStatus.CONFLICT, f"{step_dir} was removed while the body arrived (an old step)") \
                    from None
        try:
            with self.store.open_file(step_dir, name) as (old, st):
                same = st.st_size == length and _same_bytes(old, fd, length)
        except FileNotFoundError:
            same = False
        if not same:
            raise _Refused(HTTPStatus.CONFLICT, f"{step_dir}/{name} exists with other bytes: parts are write-once "
                           "(a new save attempt gets a new step directory)")
        return HTTPStatus.OK

    def _post(self) -> None:
        if self._parts() != ["replicate"]:
            raise _Refused(HTTPStatus.NOT_FOUND, "POST goes to /replicate")
        length = self._length(_MAX_POST)
        raw = self.rfile.read(length)
        if len(raw) != length:
            raise _Refused(HTTPStatus.BAD_REQUEST, f"short body: {len(raw)} of {length} bytes")
        try:
            body = json.loads(raw)
            step_dir, files = body["step_dir"], body["files"]
        except (ValueError, KeyError, TypeError):
            raise _Refused(HTTPStatus.BAD_REQUEST, 'expected {"step_dir": ..., "files": [...]}') from None
        if not isinstance(step_dir, str) or not STEP_DIR_RE.fullmatch(step_dir) or not isinstance(files, list) \
                or not 0 < len(files) <= _MAX_FILES or not all(isinstance(f, str) and PART_NAME.fullmatch(f) for f in files):
            raise _Refused(HTTPStatus.BAD_REQUEST, "step_dir must be step-NNNNNNNNNNNN-XXXXXXXX and files 1 to "
                           f"{_MAX_FILES} checkpoint file names (manifest.json, objects.pt, rank-NNNNN.json/.safetensors)")
        self.store.gc()
        if not self.store._replicator.submit(step_dir, files):
            raise _Refused(HTTPStatus.SERVICE_UNAVAILABLE, "replication queue full; retry later", {"Retry-After": "1"})
        self._answer(HTTPStatus.ACCEPTED)


def _same_bytes(a: int, b: int, length: int) -> bool:
    off = 0
    while off < length:
        n = min(_CHUNK, length - off)
        x, y = os.pread(a, n, off), os.pread(b, n, off)
        if x != y or not x:
            return False
        off += len(x)
    return True


def serve(root: str, listen: str, *, token: str | None = None, token_file: str | None = None,
          peers: Sequence[str] = (), replicas: int = 1, keep_last: int = 2, timeout: float = 30.0,
          max_connections: int = 128) -> None:
    """Run a store in the foreground until SIGTERM/SIGINT (``tenplex store serve``)."""
    import signal

    host, port = parse_listen(listen)
    server = StoreServer(root, host, port, token=token, token_file=token_file, peers=peers, replicas=replicas,
                         keep_last=keep_last, timeout=timeout, max_connections=max_connections)

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"tenplex store: serving {server.root} at {server.address} (token: {server.token_source})", flush=True)
    server.serve_forever()
    time.sleep(0.1)
