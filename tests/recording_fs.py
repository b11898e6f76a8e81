"""Test filesystems: one that records the storage options it is built with (``recfs://``), one that
counts the bytes read from local files (``countfs://``).

An in-memory filesystem (its own store) registered with fsspec under ``recfs``; every
construction appends its keyword arguments to ``RecordingFileSystem.calls`` (instances are not
cached), so a test can assert that ``--storage-option k=v`` / ``storage_options={...}`` reached
fsspec for a given URL.
"""

from __future__ import annotations

from typing import Any, ClassVar

import fsspec
from fsspec.implementations.dirfs import DirFileSystem
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

__all__ = ["RecordingFileSystem", "CountingFileSystem"]


class RecordingFileSystem(MemoryFileSystem):
    protocol = "recfs"
    cachable = False
    store: ClassVar[dict[str, Any]] = {}
    pseudo_dirs: ClassVar[list[str]] = [""]
    calls: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        type(self).calls.append(dict(kwargs))
        super().__init__(*args, **kwargs)

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        return super()._strip_protocol(path.removeprefix("recfs://") if isinstance(path, str) else path)

    @classmethod
    def reset(cls) -> None:
        cls.store.clear()
        cls.pseudo_dirs[:] = [""]
        cls.calls.clear()


fsspec.register_implementation("recfs", RecordingFileSystem, clobber=True)


class CountingFileSystem(DirFileSystem):
    """Local files through fsspec (``countfs:///abs/path``), counting every byte ``cat_file`` and
    ``cat_ranges`` return
    (``CountingFileSystem.bytes``, per process): what a load really fetched, data and metadata, to
    hold against its own ``LoadStats``. Not a ``LocalFileSystem``, so tenplex reads it with ranged
    ``cat_file`` calls as it reads remote storage."""

    protocol = "countfs"
    cachable = False
    bytes: ClassVar[int] = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(path="/", fs=LocalFileSystem())

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        return path.removeprefix("countfs://") if isinstance(path, str) else path

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        raw = super().cat_file(path, start=start, end=end, **kwargs)
        type(self).bytes += len(raw)
        return raw

    def cat_ranges(self, paths: list[str], starts: list[int], ends: list[int], *args: Any, **kwargs: Any) -> list[Any]:
        out = super().cat_ranges(paths, starts, ends, *args, **kwargs)
        type(self).bytes += sum(len(raw) for raw in out if isinstance(raw, bytes))
        return out


fsspec.register_implementation("countfs", CountingFileSystem, clobber=True)
