"""End to end for a torch-native job (#17): examples/train_native.py (a plain-torch Llama under FSDP2 x TP)
saves with ``tenplex.save_state_dict`` and resumes with ``tenplex.load_state_dict`` under torchrun's
elastic agent. Two simulated nodes of 2 workers train on ``dp_shard=2,tp=2``; one node (agent and
workers) is killed; the survivor's agent restarts its workers with world size 2, which choose another
mesh (``dp_shard=2``) and continue. Every step's loss must match an uninterrupted 2-worker run within
1e-4 relative, with the same samples, and the resume must read exactly the bytes it needs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tenplex.train.launch import Agent, RendezvousStore, free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "examples" / "train_native.py")
STEPS, EVERY = 8, 2
ARGS = ["--steps", str(STEPS), "--ckpt-every", str(EVERY)]
REL_TOL = 1e-4


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}


def read_log(path: Path) -> tuple[dict[int, list[dict]], list[dict]]:
    """Every record of every step (a step redone after the restart appears twice) and the start records."""
    steps: dict[int, list[dict]] = {}
    starts = []
    if path.exists():
        for line in path.read_text().splitlines():
            obj = json.loads(line)
            if "loss" in obj:
                steps.setdefault(obj["step"], []).append(obj)
            else:
                starts.append(obj)
    return steps, starts


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_native_job_survives_a_node_loss_under_another_mesh(tmp_path: Path) -> None:
    ref_log = tmp_path / "ref.jsonl"
    # the uninterrupted run on 2 workers (dp_shard=2 throughout): every mesh computes the same steps
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--master-port={free_port()}", SCRIPT, "--", *ARGS, "--ckpt", str(tmp_path / "ref-ckpt"),
           "--log", str(ref_log)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env())
    if res.returncode != 0 and "terminate called without an active exception" in res.stderr \
            and sorted(read_log(ref_log)[0]) == list(range(STEPS)):
        # a worker aborted in torch's C++ teardown after its last step and checkpoint (seen in about
        # 1 of 15 full-suite runs, before and after tenplex changes): the reference losses are complete
        print("\nreference run: a worker aborted at exit after all its steps; its log is complete")
    else:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    reference, _ = read_log(ref_log)
    assert sorted(reference) == list(range(STEPS))

    log, pids = tmp_path / "log.jsonl", tmp_path / "pids"
    args = [*ARGS, "--ckpt", str(tmp_path / "ckpt"), "--log", str(log)]
    store = RendezvousStore()
    run_id = f"n{free_port()}"
    agents = [Agent(f"node{i}", store.endpoint, args, nproc=2, min_nodes=1, max_nodes=2, pid_dir=str(pids),
                    log_path=str(tmp_path / f"node{i}.log"), run_id=run_id, env=_env(), program=[SCRIPT])
              for i in range(2)]
    try:
        def four_worker_steps() -> int:
            return sum(1 for recs in read_log(log)[0].values() if recs[0]["world_size"] == 4)

        assert wait_for(lambda: four_worker_steps() >= 3, 240), (tmp_path / "node0.log").read_text()[-3000:]
        agents[1].kill()
        assert agents[0].wait(timeout=300) == 0, (tmp_path / "node0.log").read_text()[-4000:]
    finally:
        for a in agents:
            a.stop()
        store.stop()

    steps, starts = read_log(log)
    assert starts[0]["world_size"] == 4 and starts[0]["mesh"] == {"dp_shard": 2, "tp": 2}
    resumed = starts[-1]
    assert resumed["world_size"] == 2 and resumed["mesh"] == {"dp_shard": 2}, starts
    assert resumed["step"] >= EVERY and resumed["step"] % EVERY == 0
    assert resumed["bytes_read"] == resumed["bytes_needed"] > 0  # rank 0 read exactly its own bytes
    assert sorted(steps) == list(range(STEPS))
    assert steps[STEPS - 1][-1]["world_size"] == 2
    for step, recs in steps.items():
        ref = reference[step][0]
        for rec in recs:  # steps redone after the restart must match too
            rel = abs(rec["loss"] - ref["loss"]) / abs(ref["loss"])
            assert rel <= REL_TOL, f"step {step} on {rec['world_size']} workers: relative difference {rel:.2e}"
            assert rec["samples"] == ref["samples"], f"step {step} saw other samples"
