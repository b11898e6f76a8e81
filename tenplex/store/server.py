"""The per-host tensor store: snapshots of the host's ranks in local memory (tmpfs), served to peers.

One store runs per host (``tenplex store serve``). Workers write snapshots into its root
directory with ``tenplex.save`` (a memory copy when the root is on tmpfs); the store serves
byte ranges to peer hosts over HTTP (``Range`` requests, readable with fsspec's HTTP
filesystem), accepts replicas pushed by peers (``PUT``, write-once), pushes its own ranks'
parts to its replica hosts in the background, keeps the newest complete steps only, and
answers ``/health`` and ``/list``. This module is the process and its protocol: the server, its
connections and the request handler; what it keeps and collects is ``tenplex.store.space``,
the pushes to peers ``tenplex.store.replication``.

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
import ipaddress
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote_to_bytes

from ..checkpoint.format import RANK_INDEX_RE, STEP_DIR_RE
from ..errors import ConfigError
from ..options import with_overrides
from .auth import resolve_token
from .replication import Replicator, check_peers, ring_targets
from .space import NAME_MAX, PART_NAME, StoreSpace, step_complete, whole_ranks

__all__ = ["StoreOptions", "StoreServer", "serve", "step_complete", "whole_ranks", "parse_listen", "check_peers",
           "PART_NAME"]

log = logging.getLogger(__name__)

_CHUNK = 1 << 20
_MAX_POST = 64 << 10
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



@dataclass(frozen=True, slots=True)
class StoreOptions:
    """How a store serves, replicates and keeps (``tenplex store serve``'s options).

    ``token``: the shared token (default: ``tenplex.store.auth.resolve_token`` with
    ``token_file``, generated into the user's token file when none exists). ``peers``: URLs of
    all host stores (the replication ring), ``replicas``: copies of each snapshot on the next
    hosts of the ring. ``keep_last`` (>= 1): complete step attempts kept. ``timeout``: seconds a
    connection may wait for the next request or stall one socket operation.
    ``max_connections``: connections served at once; further ones wait up to ``timeout`` for a
    slot, then get 503. ``max_put_bytes``: largest accepted ``PUT`` body. ``incomplete_grace``:
    seconds an incomplete attempt, once superseded, is left alone before it is removed.
    """

    token: str | None = field(default=None, repr=False)
    token_file: str | None = None
    peers: Sequence[str] = ()
    replicas: int = 1
    keep_last: int = 2
    timeout: float = 30.0
    max_connections: int = 128
    max_put_bytes: int = 1 << 40
    incomplete_grace: float = 60.0

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise ConfigError(f"keep_last = {self.keep_last} < 1: the store must keep at least its newest complete "
                              "step; pass --keep-last 1 or more (default 2)")
        if self.replicas < 0:
            raise ConfigError(f"replicas = {self.replicas} < 0: pass --replicas 0 (no copies) or more")
        if self.max_connections < 1 or self.timeout <= 0 or self.max_put_bytes < 1:
            raise ConfigError(f"max_connections = {self.max_connections}, timeout = {self.timeout}, max_put_bytes = "
                              f"{self.max_put_bytes}: each must be positive")
        if self.incomplete_grace < 0:
            raise ConfigError(f"incomplete_grace = {self.incomplete_grace} < 0: pass 0 (remove superseded "
                              "incomplete attempts at once) or more seconds")
        object.__setattr__(self, "peers", tuple(check_peers(self.peers)))


# ---------------------------------------------------------------------------------------------
# the server
# ---------------------------------------------------------------------------------------------
class StoreServer:
    """An HTTP server over ``root``: GET/HEAD with ranges, PUT, /health, /list, /replicate.

    ``options`` (:class:`StoreOptions`) says how it serves, replicates and keeps; keyword
    ``settings`` override single fields of it (``StoreServer(root, keep_last=1)``).
    """

    def __init__(self, root: str, host: str = "127.0.0.1", port: int = 0, options: StoreOptions | None = None,
                 **settings: Any) -> None:
        opts = with_overrides(options or StoreOptions(), settings, "StoreServer")
        self.options = opts
        self.space = StoreSpace(root)
        self.root = self.space.root
        found = resolve_token(opts.token, token_file=opts.token_file, create=True)
        assert found is not None  # create=True: generated when nothing else gives one
        self.token = found.value
        self.token_source = found.source
        self._expected_auth = f"Bearer {self.token}".encode("ascii")
        self.peers = list(opts.peers)
        self.replicas, self.keep_last = opts.replicas, opts.keep_last
        self.timeout, self.max_put_bytes = opts.timeout, opts.max_put_bytes
        self.incomplete_grace = opts.incomplete_grace
        self.bytes_served = 0
        self._lock = threading.Lock()  # counters
        self._serving = False
        try:
            self.httpd = _bind(self, host, port, opts.max_connections)
        except BaseException:
            self.space.close()
            raise
        bound = self.httpd.server_address[0]
        self.loopback = ipaddress.ip_address(bound.split("%")[0]).is_loopback
        if not self.loopback:
            log.warning("store listens on %s (beyond loopback): requests and the token travel unencrypted; use it "
                        "on a trusted network only (docs/security.md)", bound)
        shown = f"[{host}]" if ":" in host else host
        self.address = f"http://{shown}:{self.httpd.server_address[1]}"
        self._replicator = Replicator(self.space, self.token, self.timeout, self.replica_targets, self.address)

    # -- what it keeps (tenplex.store.space) -------------------------------------------------------
    @contextmanager
    def open_file(self, step_dir: str, name: str) -> Iterator[tuple[int, os.stat_result]]:
        """A regular file directly inside a step directory of the root (``StoreSpace.open_file``)."""
        with self.space.open_file(step_dir, name) as opened:
            yield opened

    def gc(self) -> list[str]:
        """Remove what is not worth keeping (``StoreSpace.gc`` under this store's ``keep_last``
        and ``incomplete_grace``); returns the removed step directories."""
        return self.space.gc(self.keep_last, self.incomplete_grace, self.address)

    def listing(self) -> dict[str, Any]:
        """Step directory -> its visible files (``/list``)."""
        return self.space.listing()

    def replica_targets(self) -> list[str]:
        """The next ``replicas`` peers after this store in the ring of all stores."""
        return ring_targets(self.peers, self.address, self.replicas)

    @property
    def bytes_replicated(self) -> int:
        """Bytes this store pushed to its replica hosts."""
        return self._replicator.bytes_replicated

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
        self.space.close()


# ---------------------------------------------------------------------------------------------
# connections
# ---------------------------------------------------------------------------------------------
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
        if any(len(p.encode()) > NAME_MAX for p in parts):
            raise _Refused(HTTPStatus.BAD_REQUEST, f"a path component is longer than {NAME_MAX} bytes")
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
        root = self.store.space.root_fd
        with self.store.space.write_lock:
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
        with self.store.space.write_lock:
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


def serve(root: str, listen: str, options: StoreOptions | None = None) -> None:
    """Run a store in the foreground until SIGTERM/SIGINT (``tenplex store serve``)."""
    host, port = parse_listen(listen)
    server = StoreServer(root, host, port, options or StoreOptions())

    def stop(signum: int, frame: Any) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"tenplex store: serving {server.root} at {server.address} (token: {server.token_source})", flush=True)
    server.serve_forever()
    time.sleep(0.1)
