"""Numpy helpers the scheduler's modules share."""

from __future__ import annotations

import numpy as np


def excl_cumsum(x: np.ndarray) -> np.ndarray:
    out = np.zeros(len(x), dtype=x.dtype)
    np.cumsum(x[:-1], out=out[1:])
    return out

