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


def with_overrides(options: T, overrides: Mapping[str, Any], what: str) -> T:
    """``options`` (a dataclass) with ``overrides`` applied (validated again by its ``__post_init__``);
    ConfigError naming the unknown keywords and the fields ``what`` takes."""
    if not overrides:
        return options
    fields = [f.name for f in dataclasses.fields(options)]  # type: ignore[arg-type]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ConfigError(f"{what}() got unknown keyword(s) {unknown}; it takes {', '.join(fields)}")
    return dataclasses.replace(options, **overrides)  # type: ignore[type-var]
