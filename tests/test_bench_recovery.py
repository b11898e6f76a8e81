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


def _ft_events(t_kill: float) -> list[dict]:
    """A torchft run's events (scripts/torchft_job.py) of 2 groups of 2: group 1's worker 1 killed in
    the forward pass of step 5; group 0 fails step 4's commit, commits step 5 alone; group 1 restarts,
    heals and commits step 9."""
    ev = [{"event": "start", "group": g, "rank": r, "restart": 0, "wall": t_kill - 20, "state_bytes": 100 + r}
          for g in (0, 1) for r in (0, 1)]
    ev += [{"event": "step", "group": g, "rank": r, "restart": 0, "step": s, "committed": True, "wall": t_kill - 5 + s}
           for g in (0, 1) for r in (0, 1) for s in range(4)]
    ev.append({"event": "die", "group": 1, "rank": 1, "restart": 0, "step": 5, "wall": t_kill})
    ev += [{"event": "step", "group": 0, "rank": r, "restart": 0, "step": 4, "committed": True, "wall": t_kill + 0.1}
           for r in (0, 1)]  # the step in flight at the kill: before the killed one
    ev += [{"event": "step", "group": 0, "rank": r, "restart": 0, "step": 5, "committed": False, "wall": t_kill + 0.5}
           for r in (0, 1)]
    ev += [{"event": "step", "group": 0, "rank": r, "restart": 0, "step": 5, "committed": True,
            "wall": t_kill + 1.5 + 0.25 * r} for r in (0, 1)]
    ev += [{"event": "start", "group": 1, "rank": r, "restart": 1, "wall": t_kill + 8, "state_bytes": 200 + r}
           for r in (0, 1)]
    ev += [{"event": "step", "group": 1, "rank": r, "restart": 1, "step": 9, "committed": True,
            "wall": t_kill + 12 + r} for r in (0, 1)]
    return ev


def test_torchft_figures_from_its_events() -> None:
    """The kill -> the surviving group's next committed step (at or after the killed step, its slowest
    worker), the heal (the restarted group committing), the restarted group's full copy; refusals."""
    b = _bench()
    ev = _ft_events(1000.0)
    out = b.torchft_figures(ev, "w")
    assert out["recovery_s"] == pytest.approx(1.75) and out["next_committed_step"] == 5
    assert out["heal_s"] == pytest.approx(13.0) and out["heal_step"] == 9
    assert out["bytes_full_copy"] == 401 and out["uncommitted_steps"] == [5] and out["restarts"] == 1
    with pytest.raises(b.Refused, match="0 kills"):
        b.torchft_figures([e for e in ev if e["event"] != "die"], "w")
    with pytest.raises(b.Refused, match="the restarted group 1 committed no step"):
        b.torchft_figures([e for e in ev if e["restart"] == 0], "w")
    with pytest.raises(b.Refused, match="group 0 committed no step after the kill"):
        b.torchft_figures([e for e in ev if not (e["group"] == 0 and e.get("step", 0) >= 4)], "w")
    failed_before = {"event": "step", "group": 0, "rank": 0, "restart": 0, "step": 3, "committed": False, "wall": 999.0}
    with pytest.raises(b.Refused, match="failed to commit step 3 before the kill"):
        b.torchft_figures([*ev, failed_before], "w")
