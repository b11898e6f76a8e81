"""The mount's control socket: a unix socket served by the mount process.

Protocol: the client sends one JSON object on one line, the server answers one JSON line.
``{"op": "reshard", "dp": 4, "progress": 1024, ...}`` -> ``{"ok": true, "generation": 2, ...}``;
``{"op": "status"}`` -> the current layout. Errors: ``{"ok": false, "error": "..."}``.
The socket lives at :func:`socket_path` (derived from the mountpoint's real path) and is
readable by its owner only.
"""

from __future__ import annotations

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
from .tree import DatasetTree, VfsError

__all__ = ["socket_path", "ControlServer", "remount", "mount_status"]

log = logging.getLogger(__name__)


def socket_path(mountpoint: str) -> str:
    """Where the mount process at ``mountpoint`` listens (``$TENPLEX_RUNTIME_DIR`` or the temp dir)."""
    real = os.path.realpath(mountpoint)
    key = hashlib.sha256(real.encode()).hexdigest()[:16]
    base = os.environ.get("TENPLEX_RUNTIME_DIR") or tempfile.gettempdir()
    return os.path.join(base, f"tenplex-vfs-{key}.sock")


def handle_request(tree: DatasetTree, req: dict[str, Any]) -> dict[str, Any]:
    """Apply one control request to the tree (pure apart from the tree)."""
    op = req.get("op")
    if op == "status":
        return {"ok": True, **tree.status()}
    if op == "reshard":
        kwargs = {k: req[k] for k in ("dp", "progress", "global_batch", "seed", "shuffle") if k in req}
        if "num_epochs" in req:
            kwargs["num_epochs"] = req["num_epochs"]
        try:
            gen = tree.reshard(**kwargs)
        except (TenplexError, ValueError, TypeError) as e:
            return {"ok": False, "error": str(e)}
        return {"ok": True, "generation": gen.number, **tree.status()}
    return {"ok": False, "error": f"unknown op {op!r}: use 'reshard' or 'status'"}


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        line = self.rfile.readline(1 << 16)
        if not line.strip():
            return  # a liveness probe: connected and closed
        try:
            req = json.loads(line)
            if not isinstance(req, dict):
                raise ValueError("not a JSON object")
            resp = handle_request(self.server.tree, req)  # type: ignore[attr-defined]
        except ValueError as e:
            resp = {"ok": False, "error": f"bad request: {e}"}
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
        raise VfsError(f"no tenplex mount serves {mountpoint} (no control socket at {path}): mount it with "
                       "`tenplex mount INDEX MOUNTPOINT --dp N`") from None
    resp = json.loads(buf)
    if not resp.get("ok"):
        raise VfsError(f"re-shard of {mountpoint} refused: {resp.get('error')}")
    return resp


def remount(mountpoint: str, *, dp: int | None = None, progress: int | None = None, global_batch: int | None = None,
            seed: int | None = None, shuffle: bool | None = None, timeout: float = 30.0) -> dict[str, Any]:
    """Re-shard a running mount in place; returns its new status (``generation`` included)."""
    req: dict[str, Any] = {"op": "reshard"}
    for k, v in (("dp", dp), ("progress", progress), ("global_batch", global_batch), ("seed", seed),
                 ("shuffle", shuffle)):
        if v is not None:
            req[k] = v
    return _request(mountpoint, req, timeout)


def mount_status(mountpoint: str, timeout: float = 30.0) -> dict[str, Any]:
    """The running mount's current layout and generation."""
    return _request(mountpoint, {"op": "status"}, timeout)
