"""``tenplex.ElasticRuntime`` (issue #31 items 1 and 4): the user's own loop, elastic in process.

1. Pure: the latency table (``RecoveryTimes``) validates its figures, sums its components per path,
   and a torchft-style heal's bytes are one whole replica of the state.
2. Spawned: ``examples/elastic_loop.py`` (a user's minimal loop: ``build(mesh)``, a mesh rule, one
   ``with step:`` per step; not the reference trainer) on 4 gloo workers; worker 3 is SIGKILLed in
   the forward pass of step 3; the 3 survivors recover in process through the runtime and every
   step's loss and samples match an uninterrupted single-process run; the recovery's record has its
   latency table with every component > 0 and bytes moved below the full-replica copy's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tenplex.elastic import RecoveryTimes
from tenplex.elastic.latency import full_replica_bytes
from tenplex.errors import ConfigError
from tenplex.layout.ptc import PTC, Replicated, Split, TensorSpec

from spawned import free_port, gloo_env, log_tails, wait_procs
from test_native_inprocess import BATCH, check_native_run, native_reference

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "examples" / "elastic_loop.py")
STEPS = 6


def test_recovery_times_sum_their_path_and_refuse_bad_figures() -> None:
    t = RecoveryTimes.in_process(detect_s=0.5, unwind_s=0.25, agree_s=0.125, regroup_s=0.0625, rebuild_s=1.0,
                                 timings={"choose": 0.25, "plan": 0.25, "agree": 0.125, "migrate": 0.5, "fill": 0.5},
                                 bytes_moved={"live": 10, "storage": 5}, full_replica=100)
    assert t.first_step_s is None and t.total_s == 0.75 + 0.25 + 0.0625 + 1.0 + 0.5 + 1.0
    done = t.with_first_step(2.0).with_extra(regroup_s=0.0625)
    assert done.parts == {"detection": 0.75, "agreement": 0.25, "regroup": 0.125, "rebuild": 1.0, "choose_plan": 0.5,
                          "transfer": 1.0, "first_step": 2.0}
    assert done.to_json()["total_s"] == done.total_s == 5.625
    table = done.table()
    assert "first_step" in table and "full-replica copy would move 100" in table
    restart = RecoveryTimes("restart", teardown_s=1.0, restart_s=2.0, load_s=0.5)
    assert list(restart.parts) == ["teardown", "restart", "load", "first_step"] and restart.total_s == 3.5
    with pytest.raises(ConfigError, match="detection_s must be a finite number of seconds >= 0, got -1"):
        RecoveryTimes("in-process", detection_s=-1)
    with pytest.raises(ConfigError, match="path must be"):
        RecoveryTimes("elsewhere")
    with pytest.raises(ConfigError, match="bytes_live must be an integer >= 0"):
        RecoveryTimes("in-process", bytes_live=-3)


def test_a_full_replica_copy_is_the_whole_state() -> None:
    """A torchft heal copies the dead rank's replica group's whole state, whatever share it held."""
    ptc = PTC([TensorSpec("w", (8, 4), torch.float32, Split(0)), TensorSpec("b", (4,), torch.bfloat16, Replicated())],
              num_layers=0)
    assert full_replica_bytes(ptc) == 8 * 4 * 4 + 4 * 2 == ptc.nbytes


@pytest.mark.timeout(240)
def test_a_users_own_loop_survives_a_kill_in_process(tmp_path: Path) -> None:
    import torch.distributed as dist

    from tenplex.checkpoint import read_manifest

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    log, ckpt, port = tmp_path / "log.jsonl", tmp_path / "ckpt", free_port()
    procs = []
    with gloo_env():
        for r in range(4):
            env = {**os.environ, "RANK": str(r), "WORLD_SIZE": "4", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "4",
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1",
                   "TENPLEX_MEMBERSHIP_STORE": f"127.0.0.1:{store.port}",
                   "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
            procs.append(subprocess.Popen([sys.executable, SCRIPT, "--ckpt", str(ckpt), "--steps", str(STEPS),
                                           "--global-batch", str(BATCH), "--log", str(log), "--kill-at", "3:3"],
                                          env=env, stdout=(tmp_path / f"worker{r}.log").open("w"),
                                          stderr=subprocess.STDOUT))
    reference = native_reference(STEPS)
    codes = wait_procs(procs, 200)
    assert codes == [0, 0, 0, -9], (codes, log_tails(tmp_path))
    recs = check_native_run(tmp_path, log, reference, steps=STEPS)
    assert len(recs) == 1 and recs[0]["live"] and recs[0]["world_size"] == 3, recs
    rec = recs[0]
    lat = rec["latency"]
    assert lat["path"] == "in-process", lat
    parts = ("detection", "agreement", "regroup", "rebuild", "choose_plan", "transfer", "first_step")
    assert all(lat[f"{p}_s"] > 0 for p in parts), lat
    assert abs(lat["total_s"] - sum(lat[f"{p}_s"] for p in parts)) < 1e-9
    # the bytes: what the recovery moved and read, and a full-replica copy's (the whole state dict)
    whole = read_manifest(str(ckpt), STEPS)["ptc"].nbytes
    assert lat["bytes_full_replica"] == rec["bytes_full_replica"] == whole, (lat, whole)
    assert (lat["bytes_live"], lat["bytes_storage"]) == (rec["bytes_live"], rec["bytes_storage"])
    assert 0 < rec["bytes_live"] + rec["bytes_storage"] < whole, rec
    assert "recovery (in-process) latency" in (tmp_path / "worker0.log").read_text()
    json.dumps(rec)  # the record the benchmarks read is plain JSON
