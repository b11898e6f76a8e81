"""The mount's control socket: a unix socket served by the mount process.

Protocol: the client sends one JSON object on one line, the server answers one JSON line.
``{"op": "reshard", "dp": 4, "progress": 1024, ...}`` -> ``{"ok": true, "generation": 2, ...}``;
``{"op": "status"}`` -> the current layout. Errors: ``{"ok": false, "error": "..."}``.
A request is validated whole before anything changes (unknown ops or fields, wrong types,
out-of-range values, garbage bytes are refused and the current generation stays). The socket
lives at :func:`socket_path` (derived from the mountpoint's real path) and is readable by its
owner only.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import socket
import socketserver
import tempfile
import threading
from typing import Any

from ..errors import TenplexError
from .tree import UNCHANGED, DatasetTree, VfsError

__all__ = ["socket_path", "ControlServer", "remount", "mount_status", "handle_request", "check_not_stale",
           "RESHARD_FIELDS", "MAX_REQUEST_BYTES"]

log = logging.getLogger(__name__)
#: Fields a re-shard request may carry (each optional; at least one). ``num_epochs`` and
#: ``micro_batch`` may be null (through the current epoch; equal DP slices).
RESHARD_FIELDS = ("dp", "progress", "global_batch", "seed", "shuffle", "num_epochs", "micro_batch")
#: A request is one line of at most this many bytes.
MAX_REQUEST_BYTES = 1 << 16


def socket_path(mountpoint: str) -> str:
    """Where the mount process at ``mountpoint`` listens (``$TENPLEX_RUNTIME_DIR`` or the temp dir)."""
    real = os.path.realpath(mountpoint)
    key = hashlib.sha256(real.encode()).hexdigest()[:16]
    base = os.environ.get("TENPLEX_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(base, f"tenplex-vfs-{key}.sock")


def _refuse(message: str) -> dict[str, Any]:
    return {"ok": False, "error": message}


def handle_request(tree: DatasetTree, req: object) -> dict[str, Any]:
    """Apply one control request to the tree (pure apart from the tree).

    The whole request is checked before the tree is touched, so a refused request changes
    nothing; any later request (a good re-shard) works on the generation that was current.
    """
    if not isinstance(req, dict):
        return _refuse(f"a request is a JSON object such as {{\"op\": \"status\"}}, got {type(req).__name__}")
    op = req.get("op")
    if op == "status":
        extra = sorted(map(str, set(req) - {"op"}))
        if extra:
            return _refuse(f"status takes no fields, got {', '.join(extra)}")
        return {"ok": True, **tree.status()}
    if op == "reshard":
        unknown = sorted(map(str, set(req) - {"op", *RESHARD_FIELDS}))
        if unknown:
            return _refuse(f"unknown field(s) {', '.join(unknown)}: a re-shard takes {', '.join(RESHARD_FIELDS)}")
        kwargs = {k: req[k] for k in RESHARD_FIELDS if k in req}
        if not kwargs:
            return _refuse(f"a re-shard needs at least one of {', '.join(RESHARD_FIELDS)}")
        nulls = [k for k, v in kwargs.items() if v is None and k not in ("num_epochs", "micro_batch")]
        if nulls:
            return _refuse(f"{', '.join(nulls)} must not be null: leave a field out to keep its value")
        try:
            gen = tree.reshard(**kwargs)
        except (TenplexError, ValueError, TypeError) as e:
            return _refuse(str(e))
        return {"ok": True, "generation": gen.number, **tree.status()}
    return _refuse(f"unknown op {op!r}: use 'reshard' or 'status'")


class _Handler(socketserver.StreamRequestHandler):
    timeout = 30  # a client that connects and never finishes its line does not keep a thread forever

    def handle(self) -> None:
        try:
            line = self.rfile.readline(MAX_REQUEST_BYTES + 1)
        except OSError as e:
            log.warning("control request not read: %s", e)
            return
        if not line.strip():
            return  # a liveness probe: connected and closed
        try:
            if len(line) > MAX_REQUEST_BYTES:
                raise VfsError(f"longer than {MAX_REQUEST_BYTES} bytes")
            req = json.loads(line)
        except (ValueError, RecursionError) as e:
            resp = _refuse(f"bad request (send one JSON object on one line): {str(e)[:200]}")
        else:
            try:
                resp = handle_request(self.server.tree, req)  # type: ignore[attr-defined]
            except Exception as e:  # a bug: answer and keep serving
                log.exception("control request %r failed", line[:200])
                resp = _refuse(f"internal error ({type(e).__name__}: {e}); the mount is unchanged")
        try:
            self.wfile.write((json.dumps(resp) + "\n").encode())
        except OSError as e:
            log.warning("control client went away before the answer: %s", e)


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class ControlServer:
    """Serves :func:`handle_request` on a unix socket in a daemon thread."""

    def __init__(self, tree: DatasetTree, path: str) -> None:
        self.path = path
        if os.path.exists(path):
            if _alive(path):
                raise VfsError(f"another tenplex mount already serves {path}; unmount it first")
            os.unlink(path)
        old = os.umask(0o177)
        try:
            self._server = _Server(path, _Handler)
        finally:
            os.umask(old)
        self._server.tree = tree  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, name="tenplex-vfs-control", daemon=True)

    def start(self) -> ControlServer:
        self._thread.start()
        log.info("control socket %s", self.path)
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _alive(path: str) -> bool:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(1)
            s.connect(path)
        return True
    except OSError:
        return False


def check_not_stale(mountpoint: str) -> None:
    """Raise :class:`VfsError` when ``mountpoint`` is a FUSE mount whose process is gone (stat: ENOTCONN)."""
    path = os.path.abspath(mountpoint)
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ENOTCONN:
            raise VfsError(f"stale mount at {path} (its mount process is gone: {e.strerror}): run "
                           f"fusermount3 -u {path}") from None


def _request(mountpoint: str, req: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    path = socket_path(mountpoint)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(path)
            s.sendall((json.dumps(req) + "\n").encode())
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
    except (FileNotFoundError, ConnectionRefusedError):
        check_not_stale(mountpoint)
        raise VfsError(f"no tenplex mount serves {mountpoint} (no control socket at {path}): mount it with "
                       "`tenplex mount INDEX MOUNTPOINT --dp N`") from None
    except TimeoutError:
        raise VfsError(f"the mount at {mountpoint} did not answer within {timeout:.0f} s (socket {path}); see its "
                       "log next to the socket") from None
    except OSError as e:
        raise VfsError(f"cannot talk to the mount at {mountpoint} over {path}: {e}") from None
    try:
        resp = json.loads(buf)
        if not isinstance(resp, dict):
            raise VfsError("not a JSON object")
    except ValueError:
        raise VfsError(f"the mount at {mountpoint} sent no valid answer ({buf[:100]!r}); see its log next to "
                       f"{path}") from None
    if not resp.get("ok"):
        what = "re-shard" if req.get("op") == "reshard" else f"{req.get('op')} request"
        raise VfsError(f"{what} of {mountpoint} refused: {resp.get('error')}")
    return resp


def remount(mountpoint: str, *, dp: int | None = None, progress: int | None = None, global_batch: int | None = None,
            seed: int | None = None, shuffle: bool | None = None, micro_batch: int | None = UNCHANGED,
            timeout: float = 30.0) -> dict[str, Any]:
    """Re-shard a running mount in place; returns its new status (``generation`` included).
    ``micro_batch``: split global batches by whole micro-batches (None: equal slices; left out: unchanged)."""
    req: dict[str, Any] = {"op": "reshard"}
    for k, v in (("dp", dp), ("progress", progress), ("global_batch", global_batch), ("seed", seed),
                 ("shuffle", shuffle)):
        if v is not None:
            req[k] = v
    if micro_batch is not UNCHANGED:
        req["micro_batch"] = micro_batch
    return _request(mountpoint, req, timeout)


def mount_status(mountpoint: str, timeout: float = 30.0) -> dict[str, Any]:
    """The running mount's current layout and generation."""
    return _request(mountpoint, {"op": "status"}, timeout)
