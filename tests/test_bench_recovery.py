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


def _grow_records(t_kill: float) -> list[dict]:
    """A grow-back run's log (examples/train_native.py's): 4 workers, worker 3 killed in the forward
    pass of step 5, 3 survivors run steps 5-9, the replacement is admitted after step 10's boundary
    and 4 workers run steps 10-11. Rank 0 logs step 4 just after the kill (its step ended first)."""
    recs = [{"step": s, "loss": 5.0 - 0.1 * s, "world_size": 4, "time_s": 0.4, "wall": t_kill - 2 + 0.3 * s}
            for s in range(4)]
    recs.append({"step": 4, "loss": 4.6, "world_size": 4, "time_s": 0.4, "wall": t_kill + 0.02})
    recs += [{"step": s, "loss": 5.0 - 0.1 * s, "world_size": 3, "time_s": 0.5, "wall": t_kill + 1 + 0.5 * (s - 5)}
             for s in range(5, 10)]
    recs.append({"event": "recover", "joiners": [], "step": 5, "failure_to_state_s": 0.4, "ring_s": 0.1,
                 "bytes_live": 24_200_448, "bytes_storage": 0, "mesh": {"dp_shard": 3}})
    recs.append({"event": "joined", "rank": 3, "bytes_held": 72_449_412, "wall": t_kill + 6.1, "was": "joiner",
                 "timeline": {"process_start": t_kill + 0.03, "imports_done": t_kill + 2.3, "runtime_init": t_kill + 2.8,
                              "registered": t_kill + 2.9, "warmed": t_kill + 3.5, "admitted": t_kill + 5.7,
                              "in_place": t_kill + 5.9}})
    recs += [{"step": s, "loss": 5.0 - 0.1 * s, "world_size": 4, "time_s": 0.45, "wall": t_kill + 6 + 0.4 * (s - 10),
              **({"after_recovery": {}} if s == 10 else {})} for s in (10, 11)]
    recs.append({"event": "recover", "joiners": [4], "step": 10, "failure_to_state_s": 0.3, "ring_s": 0.05,
                 "failed_at": t_kill + 5.6,
                 "bytes_live": 96_000_000, "bytes_storage": 0, "mesh": {"dp_replicate": 2, "dp_shard": 2},
                 "latency": {"agreement_s": 0.02, "transfer_s": 0.1, "first_step_s": 0.45, "total_s": 0.7}})
    return recs


def test_grow_back_figures_from_the_log() -> None:
    """kill -> the first step back at 4 workers (not rank 0's step-4 record written after the kill),
    the join's own time (its round's start -> that step: failure_to_state + ring + the step), the bytes
    the replacement holds; losses against the uninterrupted run; a log without the grow back is refused."""
    b = _bench()
    kill = {"event": "die", "rank": 3, "step": 5, "wall": 1000.0}
    recs = _grow_records(1000.0)
    g = {**b.native.grow_figures(recs, kill), "joiner_timeline": b.native.joiner_timeline(recs, kill, 1000.01)}
    assert g["kill_to_full_size_s"] == pytest.approx(6.0) and g["full_size_step"] == 10
    assert g["join_s"] == pytest.approx(0.3 + 0.05 + 0.45) and g["joined_after_step"] == 10
    assert g["bytes_to_joiner"] == 72_449_412 and g["join_bytes_live"] == 96_000_000 and g["join_bytes_storage"] == 0
    losses = {r["step"]: r["loss"] for r in recs if "loss" in r}
    out = b.grow_back({**g, "losses": losses}, dict(losses), "w")
    assert out["losses_equal"] and out["max_rel_loss_diff"] == 0.0
    assert out["join_latency"]["total_s"] == 0.7 and out["join_latency"]["regroup_s"] is None
    off = {**losses, 11: losses[11] * (1 + 1e-3)}
    assert not b.grow_back({**g, "losses": losses}, off, "w")["losses_equal"]
    with pytest.raises(b.Refused, match="are not the uninterrupted run's"):
        b.grow_back({**g, "losses": losses}, {**losses, 12: 3.0}, "w")
    no_join = [r for r in recs if not (r.get("joiners") or r.get("event") == "joined" or r.get("world_size") == 4
                                       and r["step"] >= 5)]
    with pytest.raises(b.Refused, match=r"kill_to_full_size_s=None, join_s=None, bytes_to_joiner=None"):
        b.grow_back({**b.native.grow_figures(no_join, kill), "losses": losses}, losses, "w")
    with pytest.raises(b.Refused, match="no timeline of the replacement"):
        b.grow_back({**g, "joiner_timeline": None, "losses": losses}, losses, "w")


def test_the_replacements_timeline_is_seconds_since_the_kill_on_one_clock() -> None:
    """Each mark of the replacement's start (its own, the survivors' round start, rank 0's first step at
    4 workers, the benchmark's spawn) as seconds since the kill, in the order of the run; None without
    the joined record or the join."""
    b = _bench()
    kill = {"event": "die", "rank": 3, "step": 5, "wall": 1000.0}
    recs = _grow_records(1000.0)
    t = b.native.joiner_timeline(recs, kill, 1000.01)
    assert list(t) == ["spawned", "process_start", "imports_done", "runtime_init", "registered", "warmed",
                       "boundary", "admitted", "in_place", "full_size"]
    assert t["spawned"] == pytest.approx(0.01) and t["imports_done"] == pytest.approx(2.3)
    assert t["boundary"] == pytest.approx(5.6) and t["full_size"] == pytest.approx(6.0)
    assert list(t.values()) == sorted(t.values())
    assert "spawned" not in b.native.joiner_timeline(recs, kill, None)
    assert b.native.joiner_timeline([r for r in recs if r.get("event") != "joined"], kill, 1000.01) is None
    assert b.native.joiner_timeline([r for r in recs if not r.get("joiners")], kill, 1000.01) is None


def test_a_spare_promoted_in_the_failures_own_round() -> None:
    """The spare row: the kill -> the first step on a mesh of 4 trainers again after it (not rank 0's
    step-4 record written just after the kill, nor steps before it), the bytes the spare holds after
    its promotion; None where the log lacks them."""
    b = _bench()
    t_kill = 1000.0
    hsdp = {"dp_replicate": 2, "dp_shard": 2}
    recs = [{"step": s, "loss": 5.0, "world_size": 5, "mesh": hsdp, "wall": t_kill - 2 + 0.3 * s} for s in range(5)]
    recs.append({"step": 4, "loss": 4.6, "world_size": 5, "mesh": hsdp, "wall": t_kill + 0.02})
    recs.append({"event": "recover", "joiners": [], "step": 5, "world_size": 4, "mesh": hsdp, "alive": [0, 1, 2, 4],
                 "bytes_live": 48_000_000, "bytes_storage": 0})
    recs.append({"event": "joined", "rank": 3, "bytes_held": 72_449_412, "wall": t_kill + 1.0, "was": "spare"})
    recs += [{"step": s, "loss": 4.5, "world_size": 4, "mesh": hsdp, "wall": t_kill + 1.1 + 0.4 * (s - 5),
              **({"after_recovery": {}} if s == 5 else {})} for s in (5, 6)]
    f = b.native.spare_figures(recs, {"event": "die", "rank": 3, "step": 5, "wall": t_kill})
    assert f["spare_back_full_s"] == pytest.approx(1.1) and f["bytes_to_spare"] == 72_449_412
    assert (f["spare_bytes_live"], f["spare_bytes_storage"], f["spare_world_after"]) == (48_000_000, 0, 4)
    bare = b.native.spare_figures([r for r in recs if r.get("event") != "joined"],
                                  {"event": "die", "rank": 3, "step": 5, "wall": t_kill})
    assert bare["bytes_to_spare"] is None


def test_grow_back_beside_torchft_heal() -> None:
    """The grow-back block: tenplex's spreads beside torchft's heal per heartbeat, the goal against the
    fastest heal and the smallest full copy."""
    b = _bench()
    sp = b._spread
    out = {"torchft_1000ms": {"heal_s": sp([5.8, 5.6, 7.1]), "bytes_full_copy": sp([144_898_824] * 3)},
           "torchft_5000ms": {"heal_s": sp([5.3, 5.2, 5.3]), "bytes_full_copy": sp([144_898_824] * 3)},
           "tenplex_hsdp3_grow": {**{k: sp([1.0, 2.0, 3.0]) for k in b.GROW_KEYS}, "losses_equal": True}}
    out["tenplex_hsdp3_grow"]["kill_to_full_size_s"] = sp([5.0, 5.2, 5.4])
    out["tenplex_hsdp3_grow"]["bytes_to_joiner"] = sp([72_449_412] * 3)
    g = b.grow_beside_heal(out, ["hsdp3_grow"], (1000, 5000))
    assert g["torchft_best_heal_s"] == 5.3 and g["torchft_heal_s"]["torchft_1000ms"]["median"] == 5.8
    assert g["goal"] == {"tenplex_hsdp3_grow_full_size_before_torchft_heal": True,
                         "tenplex_hsdp3_grow_fewer_bytes_than_full_copy": True, "tenplex_hsdp3_grow_losses_equal": True}
    out["tenplex_hsdp3_grow"]["kill_to_full_size_s"] = sp([5.3, 5.4, 5.5])
    assert not b.grow_beside_heal(out, ["hsdp3_grow"], (1000, 5000))["goal"][
        "tenplex_hsdp3_grow_full_size_before_torchft_heal"]
