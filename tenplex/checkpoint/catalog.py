"""The checkpoint catalogue: save attempts under a URL, their manifests, and the files of a part.

``scan_attempts`` lists the attempt directories once (``StepInfo`` and a verified ``Manifest`` or
why not); ``list_steps`` reports them; ``iter_candidates`` yields the attempts a load tries, newest
first, reading manifests one step at a time; ``read_manifest`` / ``read_manifest_at`` read and verify
one manifest; ``read_part_chunks`` lists a part's verified chunks. ``url_fs``, ``local_path`` and
``read_sealed`` are the small file helpers every reader shares. I/O, no plans or data reads.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from ..errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError
from ..layout.ptc import Layout
from ..urls import url_fs
from .format import (
    MANIFEST_NAME,
    OBJECTS_NAME,
    RANK_INDEX_RE,
    REUSED_PREFIX,
    Binding,
    index_name,
    Manifest,
    open_sealed_json,
    parse_step_dir,
    verify_index,
    verify_manifest,
)

__all__ = ["StepInfo", "local_path", "read_sealed", "read_manifest_at", "read_part_chunks",
           "ScannedAttempt", "scan_attempts", "list_steps", "iter_candidates", "read_manifest"]

@dataclass(frozen=True, slots=True)
class StepInfo:
    """One save attempt of a step: ``path`` is its directory, ``save_id`` tells attempts apart.

    ``problem``: why an attempt whose manifest exists cannot be used (a manifest that fails
    verification, a reused save id); empty otherwise. Such an attempt is never ``complete``.
    """

    step: int
    complete: bool
    layout: Layout | None
    world_size: int | None
    ranks_done: int
    nbytes: int
    save_id: str = ""
    path: str = ""
    created: float = 0.0
    problem: str = ""


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------
def local_path(path: str) -> str:
    """A local filesystem's path without its ``file://`` protocol, for ``os`` calls."""
    return LocalFileSystem._strip_protocol(path)


def read_sealed(fs: fsspec.AbstractFileSystem, path: str) -> tuple[dict[str, Any], int]:
    """A sealed JSON file, verified, and its size. A missing file is CheckpointCorruptError
    (callers read only files a listing showed)."""
    try:
        raw = fs.cat_file(path)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{path} is missing although its save attempt lists it") from None
    except OSError as e:
        raise CheckpointCorruptError(f"{path} cannot be read ({e})") from None
    return open_sealed_json(raw, path), len(raw)


def read_manifest_at(fs: fsspec.AbstractFileSystem, sdir: str, *, step: int | None = None,
                     save_id: str | None = None, with_ptc: bool = True) -> Manifest:
    """The manifest of save attempt ``sdir``, verified (digest, schema, directory; see ``verify_manifest``)."""
    if step is None or save_id is None:
        parsed = parse_step_dir(sdir)
        if parsed:
            step, save_id = parsed
    path = f"{sdir}/{MANIFEST_NAME}"
    obj, nbytes = read_sealed(fs, path)
    return verify_manifest(obj, path, nbytes, step=step, save_id=save_id, with_ptc=with_ptc)


def read_part_chunks(sdir: str, rank: int, *, storage_options: Mapping[str, Any] | None = None,
                     manifest: Manifest | None = None) -> list[dict[str, Any]]:
    """The chunks of rank ``rank``'s part of save attempt ``sdir`` (a URL or path), verified, in file
    order: ``tensor, start, length, offset, block`` (bytes ``[offset, offset + length * itemsize)`` of
    the data file); version 4 derives them from the manifest (``part_chunks``), older versions list
    them (with ``crc32``) in the index. For tools and tests; loads use ``PartReader``."""
    fs, path = url_fs(sdir, storage_options)
    path = path.rstrip("/")
    full = (manifest or read_manifest_at(fs, path)).full()
    ipath = f"{path}/{index_name(rank)}"
    idx, _ = read_sealed(fs, ipath)
    return list(verify_index(idx, ipath, rank, Binding.of(full)).values())


# ---------------------------------------------------------------------------------------------
# listing
# ---------------------------------------------------------------------------------------------
ScannedAttempt = tuple[StepInfo, "Manifest | CheckpointError | None"]
"""A save attempt with its verified manifest, the error verifying it raised, or None (no manifest)."""


def _attempt_dirs(fs: fsspec.AbstractFileSystem, root: str) -> list[tuple[int, str, str]]:
    """``(step, save id, path)`` of every save attempt directory under ``root`` (one listing, nothing read)."""
    try:
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return []
    out = []
    for entry in entries:
        path = entry.rstrip("/")
        parsed = parse_step_dir(path)
        if parsed:
            out.append((parsed[0], parsed[1], path))
    return out


def _scan_attempt(fs: fsspec.AbstractFileSystem, step: int, sid: str, path: str) -> ScannedAttempt | None:
    """One save attempt with its verified manifest, the error verifying it raised, or None (no
    manifest); None for a directory removed while listing."""
    try:
        files = fs.ls(path, detail=True)
    except FileNotFoundError:  # removed while listing
        return None
    names = {f["name"].rstrip("/").rsplit("/", 1)[-1]: f for f in files}
    names = {n: f for n, f in names.items() if ".tmp-" not in n}
    done = sum(1 for n in names if RANK_INDEX_RE.fullmatch(n))
    nbytes = sum(int(f.get("size") or 0) for n, f in names.items() if n.endswith(".safetensors"))
    layout = world = None
    complete = False
    created = 0.0
    problem = ""
    manifest: Manifest | CheckpointError | None = None
    if any(n.startswith(REUSED_PREFIX) for n in names):
        problem = (f"save id {sid} was used by two saves ({REUSED_PREFIX}* marker): its parts may mix them; "
                   "this attempt is never loaded")
    if MANIFEST_NAME in names:
        try:
            manifest = read_manifest_at(fs, path, step=step, save_id=sid, with_ptc=False)
            layout, world, created = manifest.layout, manifest.world_size, manifest.created
            complete = (not problem and OBJECTS_NAME in names
                        and all(index_name(r) in names for r in range(world)))
        except CheckpointError as e:
            problem = problem or str(e)
            manifest = e
    return StepInfo(step, complete, layout, world, done, nbytes, sid, path, created, problem), manifest


def _attempt_order(x: ScannedAttempt) -> tuple[int, bool, float]:
    return x[0].step, x[0].complete, x[0].created


def scan_attempts(fs: fsspec.AbstractFileSystem, root: str) -> list[ScannedAttempt]:
    """Every save attempt under ``root`` with its verified manifest, or the error verifying it
    raised, or None (no manifest); the newest complete attempt of a step sorts last."""
    scanned = (_scan_attempt(fs, *d) for d in _attempt_dirs(fs, root))
    return sorted((x for x in scanned if x is not None), key=_attempt_order)


def list_steps(url: str, *, storage_options: Mapping[str, Any] | None = None) -> list[StepInfo]:
    """Every save attempt under ``url``, oldest first, with its layout, whether it is complete
    and, where its manifest exists but it cannot be used, the problem."""
    fs, root = url_fs(url, storage_options)
    return [info for info, _ in scan_attempts(fs, root)]


def _usable(scan: Sequence[ScannedAttempt]) -> list[ScannedAttempt]:
    """The attempts of ``scan`` a load considers, newest first: complete ones (with their manifest)
    and, to be reported as skipped, unusable ones whose manifest exists (with the error verifying it
    raised, or None for a reused save id)."""
    pool = [(i, m if i.complete or isinstance(m, CheckpointError) else None) for i, m in scan
            if i.complete or i.problem]
    return sorted(pool, key=_attempt_order, reverse=True)


def _candidates(scan: list[ScannedAttempt], url: str, step: int | None) -> list[ScannedAttempt]:
    """``_usable`` attempts of ``scan`` (of ``step`` when given), newest first. Raises
    CheckpointNotFoundError when there is nothing to try or report."""
    infos = [i for i, _ in scan]
    pool = _usable([x for x in scan if step is None or x[0].step == step])
    if not pool:
        complete = sorted({i.step for i in infos if i.complete})
        if step is None:
            extra = f" ({len(infos)} incomplete steps found)" if infos else ""
            raise CheckpointNotFoundError(f"no complete checkpoint under {url}{extra}")
        state = "is incomplete" if any(i.step == step for i in infos) else "does not exist"
        raise CheckpointNotFoundError(
            f"checkpoint step {step} under {url} {state}; complete steps: {complete or 'none'}"
        )
    return pool


def iter_candidates(fs: fsspec.AbstractFileSystem, root: str, url: str, step: int | None) -> Iterator[ScannedAttempt]:
    """``_candidates`` of the attempts under ``root``, newest first, scanned one step at a time as the
    caller asks for more: a load that uses the newest step reads that step's manifests only, not
    every kept step's (25-100 ms each: 1.3 s of a load with 50 steps kept; #29 item 3). Raises
    CheckpointNotFoundError (after a full scan, for its message) when there is nothing to try."""
    dirs = [d for d in _attempt_dirs(fs, root) if step is None or d[0] == step]
    found = False
    for s in sorted({d[0] for d in dirs}, reverse=True):
        group = [_scan_attempt(fs, *d) for d in dirs if d[0] == s]
        for x in _usable([a for a in group if a is not None]):
            found = True
            yield x
    if not found:  # nothing usable: the full scan's error names what is there (or, after a race, the attempts)
        yield from _candidates(scan_attempts(fs, root), url, step)


def read_manifest(url: str, step: int | None = None, *,
                  storage_options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The verified manifest of ``step`` (default: the latest complete step), with ``ptc`` as a PTC.

    Only the manifest is checked here; ``load`` also verifies the data and falls back to an
    older step when it must.
    """
    fs, root = url_fs(url, storage_options)
    problems = []
    for info, manifest in iter_candidates(fs, root, url, step):
        if isinstance(manifest, Manifest):
            try:
                full = manifest.full()
            except CheckpointCorruptError as e:
                problems.append(f"step {info.step} ({info.save_id}): {e}")
                continue
            return {**full.raw, "ptc": full.ptc}
        if manifest is not None and not isinstance(manifest, CheckpointCorruptError):
            raise manifest  # a format version this tenplex does not read
        problems.append(f"step {info.step} ({info.save_id}): {info.problem}")
    raise CheckpointCorruptError(f"no complete checkpoint{'' if step is None else f' of step {step}'} under {url} "
                                 f"has a valid manifest: {'; '.join(problems)}")
