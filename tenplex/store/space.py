"""What a host store keeps: its root of step directories, which attempts are complete, and GC.

A store's root holds step attempt directories (``step-NNNNNNNNNNNN-XXXXXXXX``) of checkpoint
files, its own ranks' parts and peers' replicas. :class:`StoreSpace` opens files in it only as
regular files directly inside step directories (never through a symlink), judges which attempts
are complete (:func:`whole_ranks`) and removes what is not worth keeping (:meth:`StoreSpace.gc`).
The HTTP server (``tenplex.store.server``) and the replicator (``tenplex.store.replication``)
read and write through it.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..checkpoint.format import MANIFEST_NAME, PART_NAME_RE, RANK_INDEX_RE, STEP_DIR_RE, data_name
from ..errors import ConfigError

__all__ = ["StoreSpace", "step_complete", "whole_ranks", "valid_name", "PART_NAME", "NAME_MAX"]

log = logging.getLogger(__name__)

PART_NAME = PART_NAME_RE  # (from the checkpoint format) always .fullmatch: "$" would allow a trailing newline
"""Names of the checkpoint files a store accepts (``PUT``) and replicates (use ``.fullmatch``)."""
NAME_MAX = 255
"""Longest name (bytes) of a step directory or file the store opens."""


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



class StoreSpace:
    """The root directory of a store: step attempt directories of checkpoint files.

    ``root`` is created (mode 0700) when missing. ``write_lock`` orders creating step
    directories and files against GC removing them; ``root_fd`` is the root, opened once, for
    ``*at`` calls that never follow a symlink out of it.
    """

    def __init__(self, root: str) -> None:
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
        self.write_lock = threading.Lock()  # creating step dirs and files vs GC removing them
        self._complete_cache: dict[str, tuple[tuple, frozenset[int] | None]] = {}
        self.root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def close(self) -> None:
        """Close the root (once: a second close could hit a reused descriptor)."""
        fd, self.root_fd = self.root_fd, -1
        if fd >= 0:
            os.close(fd)

    # -- files -------------------------------------------------------------------------------------
    @contextmanager
    def open_file(self, step_dir: str, name: str) -> Iterator[tuple[int, os.stat_result]]:
        """A regular file directly inside a step directory of the root, never through a symlink.

        Raises FileNotFoundError when there is none (missing, a symlink, a directory, a FIFO)."""
        if not STEP_DIR_RE.fullmatch(step_dir) or not valid_name(name):
            raise FileNotFoundError(f"{step_dir}/{name}")
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            dfd = os.open(step_dir, flags | os.O_DIRECTORY, dir_fd=self.root_fd)
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

    # -- garbage collection ------------------------------------------------------------------------
    def _attempts(self) -> list[_Attempt]:
        """Every step attempt directory of the root, its completeness cached while its files are unchanged."""
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

    def gc(self, keep_last: int, incomplete_grace: float, label: str = "") -> list[str]:
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
        with self.write_lock:
            attempts = self._attempts()
            now = time.time_ns()
            grace = int(incomplete_grace * 1e9)
            launch: dict[str, frozenset[int]] = {}
            for a in attempts:
                launch[a.save_id] = launch.get(a.save_id, frozenset()) | (a.ranks or frozenset())

            def full(a: _Attempt) -> bool:
                return a.ranks is not None and a.ranks >= launch[a.save_id]

            complete = sorted((a for a in attempts if a.ranks is not None and (full(a) or now - a.last_ns >= grace)),
                              key=lambda a: (a.first_ns, a.step))
            kept = complete[-keep_last:]
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
                log.info("store %s: removed %s (%s)", label or self.root, a.name,
                         "older than the newest complete steps" if a.name in counted else "incomplete, superseded")
            return [a.name for a in remove]

    def listing(self) -> dict[str, Any]:
        """Step directory -> the names of its visible files (no temporaries, no hidden names)."""
        out: dict[str, Any] = {}
        for d in sorted(self.root.iterdir()):
            if STEP_DIR_RE.fullmatch(d.name) and d.is_dir() and not d.is_symlink():
                out[d.name] = sorted(f.name for f in d.iterdir() if _visible(f))
        return out


def valid_name(name: str) -> bool:
    """A name the store may open inside a step directory: no separator, NUL or leading dot, <= NAME_MAX bytes."""
    return 0 < len(name.encode("utf-8", "surrogateescape")) <= NAME_MAX and "/" not in name and "\x00" not in name \
        and not name.startswith(".")


def _visible(p: Path) -> bool:
    return p.is_file() and not p.is_symlink() and ".tmp-" not in p.name and not p.name.startswith(".")
