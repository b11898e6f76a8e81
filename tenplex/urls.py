"""Where a URL's bytes live: the one place tenplex turns a local path or fsspec URL into a filesystem.

Checkpoints, host stores, dataset indexes, interop sources and the command line all open their
URLs through :func:`url_fs`, so a bad URL or storage option is the same clear error everywhere
(the caller says which error class and what the URL and the options are to the user).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import fsspec

from .errors import ConfigError, TenplexError

__all__ = ["url_fs"]


def url_fs(url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None, *, what: str = "",
           options: str = "storage_options", error: type[TenplexError] = ConfigError,
           ) -> tuple[fsspec.AbstractFileSystem, str]:
    """The filesystem of ``url`` (a local path or an fsspec URL) built with ``storage_options``,
    and its path without a trailing slash. ``error`` (ConfigError unless given) naming ``what``
    (what the URL is: "index", "source file") for a URL that is not a non-empty string or whose
    protocol no installed fsspec implementation serves, and naming ``options`` (how the user gave
    them) for options that do not map names to values or that the filesystem's constructor refuses."""
    named = f"{what} " if what else ""
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url:
        raise error(f"the {named}URL must be a non-empty string, got {url!r}")
    if storage_options is not None and (not isinstance(storage_options, Mapping)
                                        or not all(isinstance(k, str) for k in storage_options)):
        raise error(f"{options} must map option names (strings) to values, got {storage_options!r}")
    given = dict(storage_options or {})
    try:
        fs, root = fsspec.core.url_to_fs(url, **given)
    except TypeError as e:
        if not given:
            raise
        raise error(f"cannot open {url} with {options} {', '.join(given)} ({e}): pass options the filesystem's "
                    "constructor takes") from None
    except (ValueError, ImportError) as e:
        raise error(f"cannot use {named}{url!r} ({e}): pass a local path or a URL of an installed fsspec "
                    "protocol (file://, memory://, s3://, ...)") from None
    return fs, root.rstrip("/")
