"""Options objects with keyword overrides: how the wide entry points take their settings.

``rescale``, ``migrate`` and ``load_tiered`` take a frozen options dataclass (validated in its
``__post_init__``) and, for the call sites written with keywords, the same fields as keyword
overrides: ``with_overrides`` applies them, refusing names the options do not have.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from .errors import ConfigError

__all__ = ["with_overrides"]

T = TypeVar("T")


def with_overrides(options: T | type[T], overrides: Mapping[str, Any], what: str) -> T:
    """``options`` (a dataclass) with ``overrides`` applied (validated again by its ``__post_init__``),
    or, given the class, a new one of ``overrides``; ConfigError naming the unknown keywords and the
    fields ``what`` takes, or the fields without a default that are missing."""
    fields = dataclasses.fields(options)  # type: ignore[arg-type]
    names = [f.name for f in fields]
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise ConfigError(f"{what}() got unknown keyword(s) {unknown}; it takes {', '.join(names)}")
    if isinstance(options, type):
        missing = [f.name for f in fields if f.default is dataclasses.MISSING
                   and f.default_factory is dataclasses.MISSING and f.name not in overrides]
        if missing:
            raise ConfigError(f"{what}() needs {', '.join(missing)} (no default), as keywords or in an options object")
        return options(**overrides)
    if not overrides:
        return options
    return dataclasses.replace(options, **overrides)  # type: ignore[type-var]
