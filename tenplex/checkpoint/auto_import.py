"""``import_checkpoint``: the importer (``import_dcp`` or ``import_hf``) that what a source holds calls for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .dcp_import import import_dcp
from .hf_import import import_hf
from .import_source import ImportResult, detect_format

__all__ = ["import_checkpoint"]


def import_checkpoint(src: str | Path, url: str, *, fmt: str = "auto", **kw: Any) -> ImportResult:
    """``import_dcp`` or ``import_hf``, chosen by ``fmt`` or by what ``src`` holds (keywords as
    theirs, ``storage_options`` and ``source_storage_options`` included; ``names`` only for DCP). Without ``step`` the
    result keeps the source's step (``source_step``: torchtitan's ``step-5`` is step 5), else 0."""
    fmt = detect_format(src, storage_options=kw.get("source_storage_options")) if fmt == "auto" else fmt
    if fmt == "dcp":
        return import_dcp(src, url, **kw)
    if fmt == "hf":
        kw.pop("names", None)
        return import_hf(src, url, **kw)
    raise ConfigError(f"unknown import format {fmt!r}: use auto, dcp or hf")
