"""What the benchmark scripts share: a figure measured per repeat, in the project's form."""

from __future__ import annotations

import statistics
from typing import Any


def spread(values: list[float]) -> dict[str, Any]:
    """A figure over repeats: {"median", "min", "max", "runs"} (the project's benchmark convention)."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": list(values)}
