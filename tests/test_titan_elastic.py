"""torchtitan's own trainer, elastic in process (issue #31 item 2): ``tenplex.train.titan.ElasticTrainer``.

1. The data: torchtitan's dataloader over ``TokenRows`` serves every step the same global rows
   whatever the data-parallel degree (what makes a remeshed run's losses equal an uninterrupted
   one's); the mesh rule gives FSDP2 x TP where it fits, else FSDP2.
2. Spawned: ``examples/titan_elastic_job.py`` (torchtitan's Llama 3, ``parallelize_llama``,
   ``OptimizersContainer``, LR scheduler, ``ParallelAwareDataloader``, ``train_step``) on 4 gloo
   workers as FSDP2 2 x TP 2; worker 3 is SIGKILLed in the forward pass of step 3, the 3 survivors
   continue in process as FSDP2 over 3, a 5th process started with ``--join`` is admitted at a
   step boundary and the job grows back to 2 x 2. Every step is committed once, in order, and its
   loss equals the uninterrupted 4-worker run's within 1e-5 relative; the join moves nothing from storage.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spawned import free_port, gloo_env, log_tails, rank_env, wait_procs

ROOT = Path(__file__).resolve().parent.parent
JOB = str(ROOT / "examples" / "titan_elastic_job.py")
STEPS, REL_TOL = 8, 1e-5


def test_every_mesh_sees_the_same_global_rows() -> None:
    from tenplex.errors import ConfigError
    from tenplex.train.titan import TokenRows, titan_mesh_rule

    rows = [[i] * 5 for i in range(40)]  # row i: tokens all i

    def global_rows(dp: int, step: int) -> list[int]:
        got = []
        for r in range(dp):
            ds = TokenRows(rows, r, dp, 6)
            ds.seek(step)
            it = iter(ds)
            got += [int(next(it)[0]["input"][0]) for _ in range(6 // dp)]
        return got

    for step in (0, 3, 7):  # rows cycle: 7 * 6 = 42 wraps to 2
        assert global_rows(1, step) == global_rows(2, step) == global_rows(3, step) == \
            [(step * 6 + i) % 40 for i in range(6)]
    rule = titan_mesh_rule(2, 6)
    assert (rule(4), rule(3), rule(2), rule(1)) == ({"dp_shard": 2, "tp": 2}, {"dp_shard": 3}, {"dp_shard": 1, "tp": 2},
                                                    {"dp_shard": 1})
    with pytest.raises(ConfigError, match="no mesh for 5 workers"):
        rule(5)
    with pytest.raises(ConfigError, match="global batch 6 % data-parallel degree 4"):
        TokenRows(rows, 0, 4, 6)


def _env(extra: dict[str, str], store_port: int) -> dict[str, str]:
    return {**os.environ, **extra, "PYTHONUNBUFFERED": "1", "TENPLEX_MEMBERSHIP_STORE": f"127.0.0.1:{store_port}",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _steps(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines() if '"loss"' in line]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_torchtitan_trainer_shrinks_in_process_and_grows_back(tmp_path: Path) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
    job, ref = tmp_path / "job", tmp_path / "ref"
    job.mkdir()
    ref.mkdir()
    args = ["--steps", str(STEPS), "--global-batch", "6", "--ckpt-every", "2"]
    port = free_port()
    procs = []
    with gloo_env():
        for r in range(4):
            procs.append(subprocess.Popen(
                [sys.executable, JOB, "--out", str(job), *args, "--events", str(job / "log.jsonl"),
                 "--kill-at", "3:3", "--hold-after", "5"], env=_env(rank_env(r, 4, port), store.port),
                stdout=(tmp_path / f"worker{r}.log").open("w"), stderr=subprocess.STDOUT))
        joiner_env = _env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCAL_RANK": "0"}, store.port)
        for k in ("RANK", "WORLD_SIZE"):
            joiner_env.pop(k, None)
        procs.append(subprocess.Popen(  # imports now; registers once the job runs on 3 (--join-when)
            [sys.executable, JOB, "--out", str(job), *args, "--join", "--join-when", str(job / "go")],
            env=joiner_env, stdout=(tmp_path / "worker4.log").open("w"), stderr=subprocess.STDOUT))
        # the uninterrupted run: the same 4 workers (torchtitan's initialisation depends on the mesh)
        ref_store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False)
        ref_port = free_port()
        reference = [subprocess.Popen(
            [sys.executable, JOB, "--out", str(ref), *args, "--events", str(ref / "log.jsonl")],
            env=_env(rank_env(r, 4, ref_port), ref_store.port),
            stdout=(tmp_path / f"reference{r}.log").open("w"), stderr=subprocess.STDOUT) for r in range(4)]
    try:
        deadline = time.monotonic() + 360
        while not (job / "joined").exists() and time.monotonic() < deadline and procs[0].poll() is None:
            log = job / "log.jsonl"
            if not (job / "go").exists() and log.exists() and any(s["world_size"] == 3 for s in _steps(log)):
                (job / "go").touch()  # the job runs on the survivors: the joiner may come
            if "registered with" in (tmp_path / "worker4.log").read_text():
                (job / "joined").touch()  # the workers (held after step 5) go on: admitted at the first boundary after
                #                          its registration (step 4's or step 5's)
            time.sleep(0.1)
        codes = wait_procs([*procs, *reference], max(1.0, deadline - time.monotonic()))
    finally:
        wait_procs([*procs, *reference], 0)
    assert codes == [0, 0, 0, -9, 0, 0, 0, 0, 0], (codes, log_tails(tmp_path, "*.log"))
    expected = {s["step"]: s["loss"] for s in _steps(ref / "log.jsonl")}
    steps = _steps(job / "log.jsonl")
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1)) == sorted(expected), steps  # none skipped or repeated
    sizes = [s["world_size"] for s in steps]  # 4 until the kill in step 3, 3 until the join's boundary, 4 again
    assert sizes[:2] == [4, 4] and sizes[2:4] == [3, 3] and sizes[-1] == 4 and sizes == sorted(sizes[:2]) + \
        [3] * sizes.count(3) + [4] * (sizes.count(4) - 2), sizes
    for s in steps:
        assert abs(s["loss"] - expected[s["step"]]) <= REL_TOL * abs(expected[s["step"]]), (s, expected)
    events = [json.loads(line) for line in (job / "log.jsonl").read_text().splitlines() if '"recover"' in line]
    assert [(e["world_size"], e["mesh"], e["live"]) for e in events] == [
        (3, {"dp_shard": 3}, True), (4, {"dp_shard": 2, "tp": 2}, True)], events
    shrink, grow = events
    assert shrink["step"] == 2 and shrink["alive"] == [0, 1, 2] and grow["reason"] == "join" and grow["joiners"], events
    # FSDP2 x TP holds each piece once: the dead worker's share comes from step 2's checkpoint, the
    # rest moves between the survivors; at the join the survivors hold everything: nothing from storage
    assert shrink["bytes_storage"] == shrink["plan_bytes_storage"] > 0 and shrink["bytes_live"] > 0, shrink
    assert grow["bytes_storage"] == 0 and grow["bytes_live"] == grow["plan_bytes_peer"] > 0, grow
    assert shrink["latency"]["path"] == "in-process" and shrink["latency"]["first_step_s"] > 0, shrink
