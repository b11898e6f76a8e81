"""Recovery policies side by side (tenplex.planning.policies): the failure process, each policy's
accounting by hand, properties over traces, and the calibration script's table (issue #33)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tenplex import ConfigError
from tenplex.cli import main
from tenplex.planning.policies import (META_MTTF_POINTS, CheckpointRestartPolicy, MttfCurve, PolicyJob,
                                       ReplicaGroupPolicy, StallPolicy, StandbyPolicy, compare_policies,
                                       draw_failures, fit_mttf, meta_mttf, replay_policy)
from tenplex.planning.simulate import FAILURE_CLASSES, LLAMA3_COMPONENTS, FailureClass, FailureEvent

ROOT = Path(__file__).resolve().parent.parent
HOUR = 3600.0
CRASH = {"crash": FailureClass(1.0, 0, 0.0)}
HOST = {"host": FailureClass(1.0, 1, 2.0)}


def test_classes_are_the_llama3_component_counts() -> None:
    assert sum(n for n, _ in LLAMA3_COMPONENTS.values()) == 419
    assert LLAMA3_COMPONENTS["faulty GPU"] == (148, "gpu") and LLAMA3_COMPONENTS["GPU HBM3 memory"][0] == 72
    assert FAILURE_CLASSES["gpu"].share == pytest.approx(268 / 419)
    assert FAILURE_CLASSES["software"].share == pytest.approx(63 / 419)
    assert sum(c.share for c in FAILURE_CLASSES.values()) == pytest.approx(1.0)


def test_mttf_fit() -> None:
    curve = meta_mttf()
    for gpus, mttf in META_MTTF_POINTS:
        assert abs(curve.mttf_h(gpus) / mttf - 1) < 0.06  # two parameters, three points: 5.3 % at most
    exact = MttfCurve(0.2, 4e-5)
    back = fit_mttf([(g, exact.mttf_h(g)) for g in (512, 8192, 65536)])
    assert back.job_rate_h == pytest.approx(0.2, rel=1e-4) and back.gpu_rate_h == pytest.approx(4e-5, rel=1e-4)
    with pytest.raises(ConfigError, match="fit_mttf needs >= 2 points"):
        fit_mttf([(1024, 7.9)])
    with pytest.raises(ConfigError, match=r"job_rate_h=0 \+ gpu_rate_h=0 = 0"):
        MttfCurve(0, 0)


def test_draw_failures_is_a_seeded_poisson_process_at_the_curve_rate() -> None:
    curve = meta_mttf()
    a = draw_failures(16384, 1000.0, seed=3)
    assert a == draw_failures(16384, 1000.0, seed=3) and a != draw_failures(16384, 1000.0, seed=4)
    expect = curve.rate_h(16384) * 1000.0
    assert abs(len(a) - expect) < 5 * expect ** 0.5
    assert [e.time_h for e in a] == sorted(e.time_h for e in a) and a[-1].time_h <= 1000.0
    gpu = sum(e.cause == "gpu" for e in a) / len(a)
    assert abs(gpu - 268 / 419) < 5 * (0.64 * 0.36 / len(a)) ** 0.5


def test_stalls_queue_and_a_shrunk_job_runs_in_proportion() -> None:
    """Two crashes 10 s apart with 60 s stalls: the second waits for the first (120 s lost); a
    host lost without a spare runs the job at 3/4 until it is back 2 h later (a 60 s grow stall)."""
    job = PolicyJob(32, 10.0, 1.0, spare_hosts=0, classes={**CRASH, **HOST})
    p = StallPolicy("s", 60.0)
    r = replay_policy([FailureEvent(1.0, "crash"), FailureEvent(1.0 + 10 / HOUR, "crash")], job, p)
    assert r.goodput == pytest.approx(1 - 120 / (10 * HOUR)) and r.stalled_h == pytest.approx(120 / HOUR)
    r = replay_policy([FailureEvent(1.0, "host")], job, p)
    # the first stall falls while the job runs at 3/4: it costs 3/4 of its 60 s
    assert r.goodput == pytest.approx((10 * HOUR - 2 * HOUR * 0.25 - 0.75 * 60 - 60) / (10 * HOUR))
    rated = StallPolicy("s", 60.0, host_rates=((3, 0.5),))
    assert replay_policy([FailureEvent(1.0, "host")], job, rated).goodput == pytest.approx(
        (10 * HOUR - 2 * HOUR * 0.5 - 0.5 * 60 - 60) / (10 * HOUR))


def test_checkpoint_restart_by_hand() -> None:
    """Saves every 0.5 h of running time blocking 6 s; a crash at 1.2 h loses 0.2 h and pays
    1 + 100 + 9 s; a planned stop at 3 h loses nothing; without spares a lost host stops the job
    until its repair, then it restarts."""
    job = PolicyJob(32, 4.0, 1.0, spare_hosts=0, classes={**CRASH, **HOST, "planned": FailureClass(1.0, 0, 0.0, True)})
    p = CheckpointRestartPolicy(interval_h=0.5, write_s=6.0, detect_s=1.0, restart_s=100.0, load_s=9.0)
    eff = 1 - 6.0 / 1800
    assert replay_policy([], job, p).goodput == pytest.approx(eff)
    r = replay_policy([FailureEvent(1.2, "crash"), FailureEvent(3.0, "planned")], job, p)
    run_s = 4 * HOUR - 2 * 110
    assert r.goodput * 4 * HOUR == pytest.approx(run_s * eff - 0.2 * HOUR * eff)
    r = replay_policy([FailureEvent(1.2, "host")], job, p)  # waits 1.2 -> 3.2 h, then restarts
    assert r.goodput * 4 * HOUR == pytest.approx((4 * HOUR - 2 * HOUR - 110) * eff - 0.2 * HOUR * eff)
    elastic = CheckpointRestartPolicy(interval_h=0.5, write_s=6.0, detect_s=1.0, restart_s=100.0, load_s=9.0,
                                      replica_hosts=2)
    # 2 of its 4 hosts' replicas go on at half speed (the restart stall too); growing back at 3.2 h is
    # a planned restart (a save first): nothing lost
    r = replay_policy([FailureEvent(1.2, "host")], job, elastic)
    assert r.goodput * 4 * HOUR == pytest.approx((4 * HOUR - HOUR - 0.2 * HOUR - 55 - 110) * eff)


def test_replica_groups_by_hand() -> None:
    """2 groups, 10 s steps, a kill at 25 s: the step 20-30 fails, the group is out until 40 s
    (restart 10 + heal 5), the next two steps pay a quorum each (one at half the batch)."""
    job = PolicyJob(16, 100 / HOUR, 10.0, spare_hosts=0, classes=CRASH)
    p = ReplicaGroupPolicy(groups=2, restart_s=10.0, heal_s=5.0, quorum_s=1.0)
    r = replay_policy([FailureEvent(25 / HOUR, "crash")], job, p)
    assert r.committed == pytest.approx(8 / 9) and r.goodput == pytest.approx(75 / 100)
    assert replay_policy([], job, p).goodput == pytest.approx(1.0)


def test_standby_by_hand() -> None:
    job = PolicyJob(32, 10.0, 1.0, spare_hosts=1, classes={**CRASH, **HOST})
    p = StandbyPolicy(swap_s=20.0)
    r = replay_policy([FailureEvent(1.0, "host"), FailureEvent(1.5, "host")], job, p)
    # the standby takes the first; none is free for the second until the first's repair at 3 h
    assert r.goodput == pytest.approx((10 * HOUR - 20 - 1.5 * HOUR - 20) / (10 * HOUR))


events = st.lists(st.tuples(st.floats(0, 47.9), st.sampled_from(["gpu", "host", "network", "software"])),
                  max_size=40)


@settings(max_examples=40, deadline=None)
@given(events=events, keep=st.lists(st.booleans(), min_size=40, max_size=40), spares=st.integers(0, 3))
def test_fewer_failures_never_lose_goodput(events: list[tuple[float, str]], keep: list[bool], spares: int) -> None:
    """Goodput is monotone in the MTTF: a thinned trace (a longer MTTF, the same failures kept)
    never loses goodput, whatever the policy; in process >= restart path >= the baseline's floor."""
    trace = [FailureEvent(t, c) for t, c in events]
    thin = [e for e, k in zip(trace, keep) if k]
    job = PolicyJob(64, 48.0, 10.0, spare_hosts=spares)
    policies = [StallPolicy("in", 15.0), StallPolicy("restart", 140.0), StandbyPolicy(swap_s=20.0),
                CheckpointRestartPolicy(interval_h=0.5, restart_s=120.0), ReplicaGroupPolicy(groups=4)]
    full, few = compare_policies(trace, job, policies), compare_policies(thin, job, policies)
    for name in full:
        assert few[name].goodput >= full[name].goodput - 1e-9, name
    assert full["in"].goodput >= full["restart"].goodput
    assert all(0 <= r.goodput <= 1 for r in full.values())


def test_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"gpus=30 is not a multiple of gpus_per_host=8 \(30 % 8 = 6\)"):
        PolicyJob(30, 1.0, 1.0)
    with pytest.raises(ConfigError, match="PolicyJob.step_s must be a finite number > 0, got 0"):
        PolicyJob(8, 1.0, 0)
    with pytest.raises(ConfigError, match=r"write_s=3600.0 s does not fit its interval of 0.5 h = 1800.0 s"):
        CheckpointRestartPolicy(interval_h=0.5, write_s=3600.0)
    with pytest.raises(ConfigError, match="StallPolicy.recovery_s must be a finite number >= 0"):
        StallPolicy("x", -1.0)
    with pytest.raises(ConfigError, match=r"failure classes \['cosmic'\]"):
        replay_policy([FailureEvent(0.5, "cosmic")], PolicyJob(8, 1.0, 1.0), StandbyPolicy())
    with pytest.raises(ConfigError, match="policy names must differ"):
        compare_policies([], PolicyJob(8, 1.0, 1.0), [StandbyPolicy(), StandbyPolicy()])


def test_cli_policies_side_by_side(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--model", "tiny", "--gpus", "16", "--gpus-per-host", "4", "--spare-hosts", "2",
                 "--global-batch", "16", "--seq-len", "64", "--days", "10", "--mttf", "--json", "--policies"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["events"]) >= 15  # 10 days at the curve's 11.2 h MTTF for 16 GPUs: about 21 failures
    pol = out["policies"]
    assert set(pol) == {"tenplex in-process", "tenplex restart path", "checkpoint restart", "replica groups", "standby"}
    assert pol["tenplex in-process"]["goodput"] >= pol["tenplex restart path"]["goodput"]
    # the replay's own figures and the policy model's agree for tenplex (same stalls, same rates)
    assert pol["tenplex in-process"]["goodput"] == pytest.approx(out["goodput_tenplex"], abs=2e-3)


@pytest.mark.timeout(120)
def test_calibration_table(tmp_path: Path) -> None:
    """scripts/calibrate_simulate.py --json: every published case within 10 % or explained."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "c.json"
    script = ROOT / "scripts" / "calibrate_simulate.py"
    proc = subprocess.run([sys.executable, str(script), "--json", "--out", str(out)], capture_output=True,
                          text=True, env=env, timeout=110, check=True)
    table = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == table
    names = " | ".join(c["case"] for c in table["cases"])
    for needed in ("Llama 3", "MTTF at 1,024", "MTTF at 16,384", "MTTF at 131,072", "FT-HSDP", "10-minute",
                   "3-minute", "torchft", "every 60 s", "every 15 s", "TrainMover", "FlashRecovery"):
        assert needed in names, needed
    for c in table["cases"]:
        assert {"case", "predicted", "published", "rel_error", "explained"} <= set(c)
        assert c["rel_error"] == pytest.approx(abs(c["predicted"] - c["published"]) / c["published"])
        assert (c["explained"] is None) == (c["rel_error"] <= 0.10), c["case"]
        assert c["explained"] is None or len(c["explained"]) > 40
    old = {r["row"]: r for r in table["baseline"]}
    assert abs(old["old: 1 h interval, 16 spares"]["goodput"] - 0.8323) < 0.02  # the replay's figure, reproduced
