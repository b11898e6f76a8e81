"""Counting hostile inputs: every attempt of the hostile suites ends in one recorded outcome.

A hostile test tries many bad inputs (requests, bit flips, swapped files, bad commands) and
records, for each, what happened:

- ``refused``: rejected up front with a clear error (an HTTP 4xx, a ``TenplexError``, exit code 2
  with a one-line message);
- ``detected``: accepted, then found damaged (``CheckpointCorruptError`` or a fallback to an
  intact copy / an earlier step that the result reports);
- ``identical``: accepted with a result identical to the untampered one (a flip in padding, a
  harmless spelling);
- ``silent``: accepted with a different result and no error. That is a failure: every test
  ends with ``tally.assert_none_silent()``.

The session's totals per area are printed at the end of the run (``conftest.py``) and written
to ``$TENPLEX_HOSTILE_REPORT`` when set (JSON), so a note can quote them.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field

__all__ = ["Tally", "OUTCOMES", "tallies", "report"]

OUTCOMES = ("refused", "detected", "identical", "silent")

_lock = threading.Lock()
_tallies: dict[str, "Tally"] = {}


@dataclass
class Tally:
    """Outcomes of one area's hostile attempts (shared by every test of the area in a run)."""

    area: str
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    silent: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, area: str) -> Tally:
        """The run-wide tally of ``area`` (created on first use)."""
        with _lock:
            if area not in _tallies:
                _tallies[area] = cls(area)
            return _tallies[area]

    @property
    def tried(self) -> int:
        return sum(self.counts.values())

    def record(self, outcome: str, what: str = "") -> None:
        """Record one attempt's outcome; ``what`` describes it (kept for silent ones)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
        with _lock:
            self.counts[outcome] += 1
            if outcome == "silent":
                self.silent.append(what)

    def assert_none_silent(self) -> None:
        assert not self.silent, f"{len(self.silent)} hostile inputs changed results silently: {self.silent[:10]}"


def tallies() -> dict[str, Tally]:
    with _lock:
        return dict(_tallies)


def report() -> dict[str, dict[str, int]]:
    """Per area and in total: tried and each outcome."""
    out: dict[str, dict[str, int]] = {}
    total = dict.fromkeys(("tried", *OUTCOMES), 0)
    for area, t in sorted(tallies().items()):
        row = {"tried": t.tried, **t.counts}
        out[area] = row
        for k, v in row.items():
            total[k] += v
    if out:
        out["total"] = total
    path = os.environ.get("TENPLEX_HOSTILE_REPORT")
    if path and out:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
    return out
