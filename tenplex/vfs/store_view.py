"""A read-only view of a host store's snapshots as ordinary files (``tenplex mount-store``).

Layout (built from the store's directory on every lookup, so new snapshots appear)::

    MOUNT/model/step-<N>/manifest.json
    MOUNT/model/step-<N>/rank-<XXX>/index.json          that rank part's chunk index
    MOUNT/model/step-<N>/rank-<XXX>/<tensor>@<start>     the chunk's raw bytes (canonical flat order)

``step-<N>`` is the newest save attempt of step N whose save id was not reused. The manifest
and indexes are checked against their digests before use (a damaged one hides its step or
rank part). A chunk file maps straight onto its byte range in the rank's safetensors file;
nothing is copied into memory. The tree is pure apart
from reading the store directory and is tested without mounting; ``mount_store`` serves it
through the same thin mfusepy adapter as the dataset VFS.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from ..checkpoint.catalog import read_part_chunks
from ..checkpoint.format import (
    MANIFEST_NAME,
    RANK_INDEX_RE,
    REUSED_PREFIX,
    data_name,
    index_name,
    open_sealed_json,
    parse_step_dir,
)
from ..errors import CheckpointError
from ..layout.ptc import dtype_from_str
from .fuse import FuseOps, check_fuse, check_mountpoint, fuse_class, mfusepy
from .tree import DIR, FILE, Node, VfsError

__all__ = ["StoreTree", "mount_store"]

log = logging.getLogger(__name__)


class StoreTree:
    """Paths of the store view -> nodes; open handles -> (file, offset, size)."""

    def __init__(self, root: str) -> None:
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise VfsError(f"store root {self.root} is not a directory")
        self._handles: dict[int, tuple[str, int, int]] = {}
        self._next = 1
        self._lock = threading.Lock()

    # -- structure -------------------------------------------------------------------------------
    def _steps(self) -> dict[str, Path]:
        best: dict[int, Path] = {}
        for d in self.root.iterdir():
            parsed = parse_step_dir(d.name)
            if (parsed and d.is_dir() and (d / MANIFEST_NAME).exists()
                    and not any(f.name.startswith(REUSED_PREFIX) for f in d.iterdir())):
                step = parsed[0]
                if step not in best or d.stat().st_mtime > best[step].stat().st_mtime:
                    best[step] = d
        return {f"step-{s}": d for s, d in sorted(best.items())}

    def _manifest(self, d: Path) -> dict[str, Any]:
        p = d / MANIFEST_NAME
        return open_sealed_json(p.read_bytes(), str(p))

    def _ranks(self, d: Path) -> dict[str, int]:
        out = {}
        for f in d.iterdir():
            m = RANK_INDEX_RE.fullmatch(f.name)
            if m and (d / data_name(int(m.group(1)))).exists():
                out[f"rank-{int(m.group(1)):03d}"] = int(m.group(1))
        return dict(sorted(out.items()))

    def _chunks(self, d: Path, rank: int) -> dict[str, tuple[str, int, int]]:
        manifest = self._manifest(d)
        sizes = {t["name"]: dtype_from_str(t["dtype"]).itemsize for t in manifest["ptc"]["tensors"]}
        data = str(d / data_name(rank))
        return {f"{c['tensor']}@{c['start']}": (data, int(c["offset"]), int(c["length"]) * sizes[c["tensor"]])
                for c in read_part_chunks(str(d), rank)}  # verified; version 4 derives them from the manifest

    def _resolve(self, path: str) -> tuple[Node, tuple[str, int, int] | None]:
        parts = [p for p in path.split("/") if p]
        if any(p in (".", "..") for p in parts):
            return Node(kind="missing"), None
        if not parts:
            return Node(kind=DIR, entries=("model",)), None
        if parts[0] != "model":
            return Node(kind="missing"), None
        steps = self._steps()
        if len(parts) == 1:
            return Node(kind=DIR, entries=tuple(steps)), None
        d = steps.get(parts[1])
        if d is None:
            return Node(kind="missing"), None
        ranks = self._ranks(d)
        if len(parts) == 2:
            return Node(kind=DIR, entries=(MANIFEST_NAME, *ranks)), None
        if len(parts) == 3 and parts[2] == MANIFEST_NAME:
            p = d / MANIFEST_NAME
            return Node(kind=FILE, size=p.stat().st_size), (str(p), 0, p.stat().st_size)
        if parts[2] not in ranks:
            return Node(kind="missing"), None
        rank = ranks[parts[2]]
        chunks = self._chunks(d, rank)
        if len(parts) == 3:
            return Node(kind=DIR, entries=("index.json", *chunks)), None
        if len(parts) == 4:
            if parts[3] == "index.json":
                p = d / index_name(rank)
                return Node(kind=FILE, size=p.stat().st_size), (str(p), 0, p.stat().st_size)
            if parts[3] in chunks:
                span = chunks[parts[3]]
                return Node(kind=FILE, size=span[2]), span
        return Node(kind="missing"), None

    # -- the interface FuseOps uses --------------------------------------------------------------
    def lookup(self, path: str) -> Node | None:
        try:
            node, _ = self._resolve(path)
        except (OSError, ValueError, KeyError, TypeError, CheckpointError):
            return None  # a snapshot being written or removed under us, or a damaged one
        return None if node.kind == "missing" else node

    def open(self, path: str) -> int:
        try:
            node, span = self._resolve(path)
        except (ValueError, KeyError, TypeError, CheckpointError):
            raise FileNotFoundError(path) from None  # damaged or changed since the lookup
        if span is None:
            raise FileNotFoundError(path)
        with self._lock:
            fh, self._next = self._next, self._next + 1
            self._handles[fh] = span
        return fh

    def read_handle_into(self, fh: int, offset: int, buf: memoryview) -> int:
        try:
            path, start, size = self._handles[fh]
        except KeyError:
            raise FileNotFoundError(fh) from None
        n = max(0, min(len(buf), size - offset))
        if n == 0:
            return 0
        fd = os.open(path, os.O_RDONLY)
        try:
            return os.preadv(fd, [buf[:n]], start + offset)
        finally:
            os.close(fd)

    def release(self, fh: int) -> None:
        with self._lock:
            self._handles.pop(fh, None)


def mount_store(root: str, mountpoint: str, *, debug: bool = False) -> None:
    """Serve ``StoreTree(root)`` at ``mountpoint`` in the foreground until unmounted or signalled."""
    mp = check_mountpoint(mountpoint)
    check_fuse()
    fuse_mod = mfusepy()
    tree = StoreTree(root)
    ops = type("TenplexStoreFS", (FuseOps, fuse_mod.Operations), {})(tree, fuse_mod)
    try:
        fuse_class(fuse_mod)(ops, mp, foreground=True, nothreads=False, ro=True, fsname="tenplex-store",
                            subtype="tenplex", debug=debug)
    except RuntimeError as e:
        if ops.started:
            return
        raise VfsError(f"could not mount the store view at {mp} (libfuse error {e})") from None
