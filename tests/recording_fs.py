"""A test filesystem that records the storage options it is built with (``recfs://``).

An in-memory filesystem (its own store) registered with fsspec under ``recfs``; every
construction appends its keyword arguments to ``RecordingFileSystem.calls`` (instances are not
cached), so a test can assert that ``--storage-option k=v`` / ``storage_options={...}`` reached
fsspec for a given URL.
"""

from __future__ import annotations

from typing import Any, ClassVar

import fsspec
from fsspec.implementations.memory import MemoryFileSystem

__all__ = ["RecordingFileSystem"]


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
