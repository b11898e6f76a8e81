"""scripts/bench_recovery.py refuses runs its log contradicts (issue 29 item 7): a recovery that
began before the kill, figures that are not positive. The figures are those of the run that once
reported recovery_s -6.16 and detect_s -103.5 and exited 0."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_recovery", REPO / "scripts" / "bench_recovery.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_recovery", mod)
    spec.loader.exec_module(mod)
    return mod


def test_a_recovery_before_the_kill_and_non_positive_figures_are_refused() -> None:
    b = _bench()
    t_kill = 1000.0
    early = {"event": "recover", "step": 0, "wall": t_kill - 97.0, "failed_at": t_kill - 103.5, "reason": "failure"}
    late = {"event": "recover", "step": 8, "wall": t_kill + 1.2, "failed_at": t_kill + 0.05, "reason": "failure"}
    start = {"event": "start", "step": 0, "wall": t_kill - 120.0}
    with pytest.raises(b.Refused, match=r"recovery at step 0 began 103.5 s before the kill"):
        b.recovery_after([start, early, late], t_kill, "tiny/in_process")
    with pytest.raises(b.Refused, match="no in-process recovery after the kill"):
        b.recovery_after([start], t_kill, "tiny/in_process")
    assert b.recovery_after([start, late], t_kill, "tiny/in_process") is late
    good = {k: 0.5 for k in b.POSITIVE["in_process"]}
    assert b.check_positive(good, "in_process", "w") is good
    with pytest.raises(b.Refused, match=r"recovery_s=-6.16, detect_s=-103.5"):
        b.check_positive({**good, "recovery_s": -6.16, "detect_s": -103.5}, "in_process", "w")
    with pytest.raises(b.Refused, match=r"restart_s=0.0, step_s=None"):
        b.check_positive({**{k: 1.0 for k in b.POSITIVE["stores"]}, "restart_s": 0.0, "step_s": None}, "stores", "w")
