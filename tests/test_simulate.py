"""Failure-trace replay (tenplex.planning.simulate): traces, the event records and the goodput accounting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tenplex import ConfigError
from tenplex.cli import main
from tenplex.planning.simulate import (FAILURE_CLASSES, CostModel, FailureClass, FailureEvent, SimulationSettings, draw_trace,
                              read_trace, simulate_trace)

HOUR = 3600.0
SMALL = dict(global_batch=16, seq_len=1024, micro_batch=1, gpus_per_host=4)


def test_draw_trace_is_seeded_sorted_and_classed() -> None:
    a, b = draw_trace(seed=3), draw_trace(seed=3)
    assert a == b and len(a) == 419 and a != draw_trace(seed=4)
    assert [e.time_h for e in a] == sorted(e.time_h for e in a) and 0 <= a[0].time_h and a[-1].time_h <= 54 * 24
    gpu = sum(e.cause == "gpu" for e in a) / len(a)
    assert abs(gpu - FAILURE_CLASSES["gpu"].share) < 0.08  # 419 draws of a 0.587 share
    assert draw_trace(failures=0) == []


def test_read_trace(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('# a comment\n{"time_h": 2.5, "cause": "gpu"}\n\n{"time_h": 1, "cause": "software"}\n')
    assert read_trace(p) == [FailureEvent(1.0, "software"), FailureEvent(2.5, "gpu")]
    p.write_text('{"time_h": 1}\n')
    with pytest.raises(ConfigError, match=r"t.jsonl:1: expected"):
        read_trace(p)
    with pytest.raises(ConfigError, match="time_h must be a finite number >= 0"):
        FailureEvent(-1.0, "gpu")


def test_one_failure_by_hand() -> None:
    """16 GPUs in 4 hosts, no spares: a GPU failure at 1 h (repaired after 2 h) shrinks the job to
    12 GPUs until 3 h; the baseline stops from 1 h to 3 h and pays detection, the work since its
    last checkpoint, then a restart and a checkpoint load."""
    classes = {"gpu": FailureClass(1.0, 1, 2.0)}
    costs = CostModel(detect_s=1.0, restart_s=100.0, ckpt_interval_h=0.75, storage_bw=1e9)
    res = simulate_trace([FailureEvent(1.0, "gpu")], SimulationSettings("llama-100m", 16, spare_hosts=0, hours=4.0,
                                                                        classes=classes, costs=costs, **SMALL))
    fail, grow = res.events
    assert (fail.kind, fail.gpus_lost, grow.kind, grow.time_h) == ("fail", 4, "grow", 3.0)
    assert fail.layout_before == grow.layout_after and fail.layout_after == grow.layout_before
    assert fail.bytes_moved > 0 and fail.recovery_s >= 1.0 + fail.plan_s
    for key in ("time_h", "gpus_lost", "layout_before", "layout_after", "idle_gpus", "plan_s", "bytes_moved",
                "transfer_s", "recovery_s"):
        assert key in fail.to_json()
    (t0, w0, r0), (t1, w1, r1), (t2, w2, r2) = res.timeline
    assert (t0, t1, t2) == (0.0, 1.0, 3.0) and w0 == w2 and w1 <= 12 and r0 == r2 == 1.0 and r1 <= 1.0
    useful = (2.0 * 1.0 + 2.0 * r1) * HOUR  # full speed 2 h, degraded 2 h
    assert res.goodput_tenplex == pytest.approx((useful - fail.recovery_s - grow.recovery_s) / (4 * HOUR))
    # baseline: detect + 0.25 h since the checkpoint at 0.75 h, down 2 h, restart + load of its state
    from tenplex import choose_layout

    est = choose_layout("llama-100m", 16, gpu_mem="80GiB", allow_idle=True, uneven_batch=True, **SMALL).estimate
    load = max(s.param_bytes + s.optimizer_bytes for s in est.stages) / 1e9
    lost = 1.0 + 0.25 * HOUR + 2 * HOUR + 100.0 + load
    assert res.goodput_checkpoint_restart == pytest.approx((4 * HOUR - lost) / (4 * HOUR))
    assert res.goodput_tenplex > res.goodput_tenplex_restart > res.goodput_checkpoint_restart


def test_spares_replace_and_shapes_are_cached() -> None:
    trace = [FailureEvent(1.0, "gpu"), FailureEvent(2.0, "gpu"), FailureEvent(2.5, "software")]
    res = simulate_trace(trace, SimulationSettings("tiny", 16, spare_hosts=4, hours=3.0, seed=1, **SMALL))
    kinds = [(e.kind, e.layout_before == e.layout_after) for e in res.events]
    assert kinds == [("fail", True), ("fail", True), ("restart", True)]  # a spare took each failed host
    assert len({w for _, w, _ in res.timeline}) == 1
    assert res.goodput_tenplex > 0.99
    same_stage = [e for e in res.events[:2]]
    if len({e.bytes_moved for e in same_stage}) == 1 and same_stage[1].cached:
        assert same_stage[1].plan_s == same_stage[0].plan_s


def test_unknown_cause_and_bad_costs() -> None:
    with pytest.raises(ConfigError, match=r"failure classes \['cosmic'\]"):
        simulate_trace([FailureEvent(1.0, "cosmic")], SimulationSettings("tiny", 16, **SMALL))
    with pytest.raises(ConfigError, match="CostModel.restart_s must be a finite number >= 0"):
        CostModel(restart_s=-1)
    with pytest.raises(ConfigError, match="not a multiple of gpus_per_host"):
        simulate_trace([], SimulationSettings("tiny", 10, **SMALL))


def test_cli_simulate_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "s.png"
    assert main(["simulate", "--model", "tiny", "--gpus", "16", "--gpus-per-host", "4", "--spare-hosts", "1",
                 "--global-batch", "16", "--seq-len", "64", "--days", "1", "--failures", "4", "--json",
                 "--plot", str(png)]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("events", "goodput_tenplex", "goodput_checkpoint_restart", "simulate_s"):
        assert key in out
    assert len(out["events"]) >= 4 and out["events"][0]["time_h"] <= 24
    assert png.stat().st_size > 10_000


def test_settings_are_validated_with_the_arithmetic() -> None:
    with pytest.raises(ConfigError, match=r"gpus=18 is not a multiple of gpus_per_host=4 \(18 % 4 = 2\)"):
        SimulationSettings("tiny", 18, 16, 1024, gpus_per_host=4)
    with pytest.raises(ConfigError, match="SimulationSettings.gpus must be an integer >= 1, got 0"):
        SimulationSettings("tiny", 0, 16, 1024)
    with pytest.raises(ConfigError, match="spare_hosts must be an integer >= 0, got -1"):
        SimulationSettings("tiny", 16, 16, 1024, spare_hosts=-1)
    with pytest.raises(ConfigError, match="hours must be a finite number > 0 or None, got -2.0"):
        SimulationSettings("tiny", 16, 16, 1024, hours=-2.0)
    s = SimulationSettings("tiny", 16, 16, 1024, gpus_per_host=4)
    assert s.hosts == 4 and s.end_hours([FailureEvent(25.0, "gpu")]) == 48.0 and s.end_hours([]) == 24.0
