"""End to end: the reference trainer under real torch.distributed (gloo), resumed under other layouts.

Per-step losses after a restart under a different (DP, TP, PP) must match an uninterrupted
single-process run of the same seed and data, and the samples of every step must be the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tenplex import ParallelConfig
from tenplex.train.launch import Agent, RendezvousStore, free_port, wait_for

STEPS = 14
COMMON = ["--model", "tiny", "--steps", str(STEPS), "--global-batch", "8", "--micro-batch", "2", "--lr", "3e-3",
          "--seed", "7"]
REL_TOL = 1e-4


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_single(log: Path, *extra: str) -> None:
    res = subprocess.run([sys.executable, "-m", "tenplex.train", *COMMON, "--log", str(log), *extra],
                         capture_output=True, text=True, timeout=240, env=_env())
    assert res.returncode == 0, res.stdout + res.stderr


def run_torchrun(nproc: int, log: Path, *extra: str, expect_fail: bool = False) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           f"--master-port={free_port()}", "-m", "tenplex.train", "--", *COMMON, "--log", str(log), *extra]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())
    if expect_fail:
        assert res.returncode != 0, "the run was meant to fail midway"
    else:
        assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]


def read_log(path: Path) -> tuple[dict[int, dict], list[dict]]:
    """Last record of every step (steps redone after a restart replace earlier ones) and start events."""
    steps: dict[int, dict] = {}
    starts = []
    for line in path.read_text().splitlines():
        obj = json.loads(line)
        if "loss" in obj:
            steps[obj["step"]] = obj
        elif obj.get("event") == "start":
            starts.append(obj)
    return steps, starts


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict]:
    log = tmp_path_factory.mktemp("ref") / "log.jsonl"
    run_single(log)
    steps, _ = read_log(log)
    assert sorted(steps) == list(range(1, STEPS + 1))
    assert steps[STEPS]["loss"] < steps[1]["loss"] - 0.5, "the reference run does not learn"
    return steps


def assert_matches(reference: dict[int, dict], got: dict[int, dict], *, resumed_from: int) -> None:
    assert sorted(got) == list(range(1, STEPS + 1))
    assert STEPS - resumed_from >= 10, "compare at least 10 steps after the restart"
    for step, ref in reference.items():
        rel = abs(got[step]["loss"] - ref["loss"]) / abs(ref["loss"])
        assert rel <= REL_TOL, f"step {step}: loss {got[step]['loss']} vs {ref['loss']} (rel {rel:.2e})"
        assert got[step]["samples"] == ref["samples"], f"step {step}: different samples"
    all_samples = [s for step in sorted(got) for s in got[step]["samples"]]
    ref_samples = [s for step in sorted(reference) for s in reference[step]["samples"]]
    assert all_samples == ref_samples
    assert len(set(all_samples)) == len(all_samples), "a sample was repeated"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "before, after, extra",
    [
        # TP and PP change, DP grows, half the workers: 4 -> 2
        ("dp=1,tp=2,pp=2", "dp=2,tp=1,pp=1", []),
        # distributed optimizer (optimizer state sharded over DP): DP and PP shrink, TP grows
        ("dp=2,tp=1,pp=2", "dp=1,tp=2,pp=1", ["--distributed-optimizer"]),
    ],
)
def test_restart_under_new_layout_matches_uninterrupted(tmp_path: Path, reference: dict[int, dict], before: str,
                                                        after: str, extra: list[str]) -> None:
    log, ckpt = tmp_path / "log.jsonl", tmp_path / "ckpt"
    run_torchrun(4, log, "--parallel", before, "--ckpt", str(ckpt), "--ckpt-every", "2", "--fail-at-step", "5",
                 *extra, expect_fail=True)
    run_torchrun(2, log, "--parallel", after, "--ckpt", str(ckpt), "--ckpt-every", "2", *extra)
    steps, starts = read_log(log)
    assert [s["layout"] for s in starts] == [before, after]
    assert starts[1]["step"] == 4 and starts[1]["previous"] == before
    assert starts[1]["bytes_read"] >= starts[1]["bytes_needed"] > 0
    assert {steps[s]["tp"] for s in range(5, STEPS + 1)} == {int(after.split("tp=")[1][0])}
    assert_matches(reference, steps, resumed_from=4)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_elastic_node_failure_two_agents(tmp_path: Path, reference: dict[int, dict]) -> None:
    """Two torchrun agents form a 4-worker job; one 'node' (agent + workers) is killed midway;
    the survivor's agent restarts its workers with world size 2 and rescale() continues."""
    log, ckpt, pids = tmp_path / "log.jsonl", tmp_path / "ckpt", tmp_path / "pids"
    args = [*COMMON, "--parallel", "dp=1,tp=2,pp=2", "--ckpt", str(ckpt), "--ckpt-every", "3", "--log", str(log)]
    store = RendezvousStore()
    run_id = f"t{free_port()}"
    agents = [Agent(f"node{i}", store.endpoint, args, nproc=2, min_nodes=1, max_nodes=2, pid_dir=str(pids),
                    log_path=str(tmp_path / f"node{i}.log"), run_id=run_id) for i in range(2)]
    try:
        def four_worker_steps() -> int:
            if not log.exists():
                return 0
            return sum(1 for o in read_log(log)[0].values() if o["world_size"] == 4)

        assert wait_for(lambda: four_worker_steps() >= 4, 240), "the 4-worker job did not train"
        agents[1].kill()
        assert agents[0].wait(timeout=400) == 0, (tmp_path / "node0.log").read_text()[-4000:]
    finally:
        for a in agents:
            a.stop()
        store.stop()
    steps, starts = read_log(log)
    assert any(s["world_size"] == 4 for s in starts) and starts[-1]["world_size"] == 2
    assert starts[-1]["previous"] == "dp=1,tp=2,pp=2" and starts[-1]["step"] % 3 == 0
    assert steps[STEPS]["world_size"] == 2
    # compare every step; require >= 10 after the restart only when the failure came early enough
    for step, ref in reference.items():
        rel = abs(steps[step]["loss"] - ref["loss"]) / abs(ref["loss"])
        assert rel <= REL_TOL, f"step {step}: rel {rel:.2e}"
        assert steps[step]["samples"] == ref["samples"]


# -- rescale() on its own: fresh start, resume, and its errors --------------------------------
def _options() -> dict:
    return dict(global_batch=8, micro_batch=2, seq_len=64, gpu_mem="16GiB", precision="fp32",
                distributed_optimizer=False)


def test_rescale_fresh_then_resume_under_chosen_layout(tmp_path: Path) -> None:
    import torch

    import tenplex
    from tenplex.train import trainer_ptc

    ptc = trainer_ptc("tiny", distributed_optimizer=False)
    fresh = tenplex.rescale(str(tmp_path), ptc, rank=0, world_size=4, layout_options=_options())
    assert fresh.fresh and fresh.shard is None and fresh.cfg.world_size == 4
    cfg = ParallelConfig(dp=1, tp=2, pp=2)
    g = {n: torch.randn(s.shape) for n, s in ptc.tensors.items()}
    g.update({"optimizer.step": 3, "data": {"consumed": 24}})
    shards = ptc.shard(g, cfg)
    for r in range(cfg.world_size):
        tenplex.save(str(tmp_path), ptc, cfg, r, shards[r], step=3)
    res = tenplex.rescale(str(tmp_path), ptc, rank=1, world_size=2, layout_options=_options())
    assert not res.fresh and res.step == 3 and res.previous == cfg and res.cfg.world_size == 2
    want = ptc.shard(g, res.cfg)[1]
    assert all(torch.equal(res.shard[n], want[n]) for n in ptc.rank_tensors(res.cfg, 1))
    assert res.shard["optimizer.step"] == 3 and res.shard["data"] == {"consumed": 24}
    assert res.load_stats.bytes_read >= res.load_stats.bytes_needed > 0
    assert set(res.timings) >= {"list", "choose", "plan", "load"}
    pinned = tenplex.rescale(str(tmp_path), ptc, rank=0, world_size=2, parallel=ParallelConfig(tp=2))
    assert pinned.cfg == ParallelConfig(tp=2)


def test_rescale_errors(tmp_path: Path) -> None:
    import torch

    import tenplex
    from tenplex.train import trainer_ptc

    ptc = trainer_ptc("tiny", distributed_optimizer=False)
    cfg = ParallelConfig()
    g = {n: torch.zeros(s.shape) for n, s in ptc.tensors.items()}
    tenplex.save(str(tmp_path), ptc, cfg, 0, ptc.shard(g, cfg)[0], step=1)
    other = trainer_ptc("llama-small", distributed_optimizer=False)
    with pytest.raises(tenplex.CheckpointMismatchError, match="another model"):
        tenplex.rescale(str(tmp_path), other, rank=0, world_size=1, layout_options=_options())
    # 5 GPUs: tp=5 does not divide 8 heads, pp=5 exceeds 4 layers, dp=5 does not divide a batch of 8
    with pytest.raises(tenplex.LayoutError):
        tenplex.rescale(str(tmp_path), ptc, rank=0, world_size=5, layout_options=_options())
    with pytest.raises(tenplex.ConfigError, match="world size is 2"):
        tenplex.rescale(str(tmp_path), ptc, rank=0, world_size=2, parallel=ParallelConfig(tp=4))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_host_failure_recovers_from_host_stores(tmp_path: Path, reference: dict[int, dict]) -> None:
    """Two hosts (store + agent + 2 workers each), snapshots every 2 steps, one replica, no
    persistent checkpoint before the end: killing a host's store, agent and workers, the survivor
    resumes from its own store (holding the dead host's replicas) and matches the reference."""
    from tenplex.train.launch import start_hosts

    log = tmp_path / "log.jsonl"
    args = [*COMMON, "--parallel", "dp=1,tp=2,pp=2", "--ckpt", str(tmp_path / "ckpt"), "--ckpt-every", "1000",
            "--store", "auto", "--snapshot-every", "2", "--log", str(log)]
    rdzv = RendezvousStore()
    hosts = start_hosts(2, str(tmp_path), args, nproc=2, endpoint=rdzv.endpoint, run_id=f"h{free_port()}")
    try:
        def four_worker_steps() -> int:
            if not log.exists():
                return 0
            return max([s for s, o in read_log(log)[0].items() if o["world_size"] == 4] or [0])

        assert wait_for(lambda: four_worker_steps() >= 5, 240), "the 4-worker job did not train"
        hosts[1].kill()
        assert hosts[0].agent.wait(timeout=400) == 0, (tmp_path / "host0.log").read_text()[-4000:]
    finally:
        for h in hosts:
            h.stop()
        rdzv.stop()
    steps, starts = read_log(log)
    resume = starts[-1]
    assert resume["world_size"] == 2 and resume["step"] >= 4 and resume["step"] % 2 == 0
    assert resume["bytes_by_tier"].get("storage", 0) == 0 and resume["bytes_by_tier"]["local"] > 0
    for step, ref in reference.items():
        rel = abs(steps[step]["loss"] - ref["loss"]) / abs(ref["loss"])
        assert rel <= REL_TOL, f"step {step}: rel {rel:.2e}"
        assert steps[step]["samples"] == ref["samples"]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not (os.path.exists("/dev/fuse") and __import__("shutil").which("fusermount3")),
                    reason="needs /dev/fuse and fusermount3 (Debian fuse3) for a real mount")
def test_trainer_reads_through_the_dataset_mount_and_reshards_it(tmp_path: Path,
                                                                  reference: dict[int, dict]) -> None:
    from tenplex.data.corpus import stdlib_corpus
    from tenplex.train.batches import corpus_index

    index_path, _ = corpus_index(stdlib_corpus(64))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run([sys.executable, "-m", "tenplex", "mount", index_path, str(mnt), "--dp", "2", "--global-batch",
                    "8", "--seed", "7"], check=True, capture_output=True, timeout=120)
    try:
        log, ckpt = tmp_path / "log.jsonl", tmp_path / "ckpt"
        run_torchrun(2, log, "--parallel", "dp=2,tp=1,pp=1", "--ckpt", str(ckpt), "--ckpt-every", "2",
                     "--fail-at-step", "3", "--data-mount", str(mnt), expect_fail=True)
        run_torchrun(2, log, "--parallel", "dp=1,tp=1,pp=2", "--ckpt", str(ckpt), "--ckpt-every", "2",
                     "--data-mount", str(mnt))
        job = json.loads((mnt / "job.json").read_text())
        assert job["dp"] == 1 and job["progress"] == 2 * 8 and job["generation"] >= 2
        steps, _ = read_log(log)
        for step, ref in reference.items():
            assert abs(steps[step]["loss"] - ref["loss"]) / ref["loss"] <= REL_TOL
            assert steps[step]["samples"] == ref["samples"]
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mnt)], check=False, timeout=30)


@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_trainer_on_cuda(tmp_path: Path, reference: dict[int, dict]) -> None:
    """One worker on the GPU, alone (14 steps) and under torchrun with nccl (7 steps, then a
    checkpoint of GPU state), then resumed on CPU to step 14: the CPU reference's losses and
    samples throughout."""
    gpu_env = {k: v for k, v in _env().items() if k != "TENPLEX_DEVICE"}
    ckpt = tmp_path / "ckpt"
    runs = (
        ("alone", [sys.executable, "-m", "tenplex.train", *COMMON], gpu_env, range(1, STEPS + 1)),
        ("nccl", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                  f"--master-port={free_port()}", "-m", "tenplex.train", "--", *COMMON, "--steps", "7",
                  "--ckpt", str(ckpt)], gpu_env, range(1, 8)),
        ("resumed on cpu", [sys.executable, "-m", "tenplex.train", *COMMON, "--ckpt", str(ckpt)], _env(),
         range(8, STEPS + 1)),
    )
    for name, cmd, env, steps in runs:
        log = tmp_path / f"{name.replace(' ', '_')}.jsonl"
        res = subprocess.run([*cmd, "--log", str(log)], capture_output=True, text=True, timeout=300, env=env)
        assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
        got, starts = read_log(log)
        assert sorted(got) == list(steps), name
        for step in steps:
            ref = reference[step]
            assert abs(got[step]["loss"] - ref["loss"]) <= 1e-3 * abs(ref["loss"]), (name, step, got[step]["loss"])
            assert got[step]["samples"] == ref["samples"], (name, step)


def test_more_workers_than_gpus_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker whose LOCAL_RANK has no GPU stops before joining nccl, saying how to fix it."""
    from tenplex.train.parallel import init_distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for k, v in {"TENPLEX_DEVICE": "", "WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK 1 needs CUDA device 1 but this host has 1.*TENPLEX_DEVICE=cpu"):
        init_distributed(ParallelConfig.parse("dp=2,tp=1,pp=1"))
