"""End to end: the reference trainer under real torch.distributed (gloo), resumed under other layouts.

Per-step losses after a restart under a different (DP, TP, PP) must match an uninterrupted
single-process run of the same seed and data, and the samples of every step must be the same.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from tenplex import ParallelConfig
from tenplex.checkpoint import list_steps, read_part_chunks
from tenplex.train.launch import Agent, RendezvousStore, free_port, wait_for

from spawned import Forked, start_trainer

STEPS = 14
COMMON = ["--model", "tiny", "--steps", str(STEPS), "--global-batch", "8", "--micro-batch", "2", "--lr", "3e-3",
          "--seed", "7"]
REL_TOL = 1e-4


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_single(log: Path, *extra: str) -> None:
    """One uninterrupted process of COMMON (forked: ``spawned.start_trainer``)."""
    proc = start_trainer([*COMMON, "--log", str(log), *extra], log.with_suffix(".out"), _env())
    code, out = finish(proc, 240)
    assert code == 0, out


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
        # distributed optimizer (optimizer state sharded over DP): DP and PP shrink, TP grows
        ("dp=2,tp=1,pp=2", "dp=1,tp=2,pp=1", ["--distributed-optimizer"]),
    ] + ([
        # TP and PP change, DP grows, half the workers: 4 -> 2 (TENPLEX_BIG_WORLDS=1: the suite's time
        # budget; the demo, test_netns and test_inprocess change TP and PP with matching losses too)
        ("dp=1,tp=2,pp=2", "dp=2,tp=1,pp=1", []),
    ] if os.environ.get("TENPLEX_BIG_WORLDS") else []),
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


def _skip_where_namespaces_run_it() -> None:
    """Skip a loopback two-host job where test_netns.py::test_elastic_node_failure_across_namespaces
    runs it across network namespaces (TENPLEX_BIG_WORLDS=1 runs both)."""
    from tenplex.errors import NetnsUnavailableError
    from tenplex.train.netns import HostNetwork, unavailable_reason

    if not unavailable_reason() and not os.environ.get("TENPLEX_BIG_WORLDS"):
        try:
            HostNetwork.create(1).close()
        except NetnsUnavailableError:
            return
        pytest.skip("covered across network namespaces by test_netns.py::test_elastic_node_failure_across_namespaces")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_elastic_node_failure_two_agents(tmp_path: Path, reference: dict[int, dict]) -> None:
    """Two torchrun agents form a 4-worker job; one 'node' (agent + workers) is killed midway;
    the survivor's agent restarts its workers with world size 2 and rescale() continues.
    On loopback only where network namespaces cannot be made: otherwise
    test_netns.py::test_elastic_node_failure_across_namespaces runs this job across namespaces."""
    _skip_where_namespaces_run_it()
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
    # 5 GPUs using all of them: tp=5 does not divide 8 heads, pp=5 exceeds 4 layers, dp=5 is more replicas
    # than the batch's 4 micro-batches; by default a layout of fewer ranks leaves spares (tests/test_spares.py)
    with pytest.raises(tenplex.LayoutError):
        tenplex.rescale(str(tmp_path), ptc, rank=0, world_size=5,
                        layout_options={**_options(), "allow_idle": False, "uneven_batch": False})
    assert tenplex.rescale(str(tmp_path), ptc, rank=4, world_size=5, layout_options=_options()).idle
    with pytest.raises(tenplex.ConfigError, match="world size is 2"):
        tenplex.rescale(str(tmp_path), ptc, rank=0, world_size=2, parallel=ParallelConfig(tp=4))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_host_failure_recovers_from_host_stores(tmp_path: Path, reference: dict[int, dict]) -> None:
    """Two hosts (store + agent + 2 workers each), snapshots every 2 steps, one replica, no
    persistent checkpoint before the end: killing a host's store, agent and workers, the survivor
    resumes from its own store (holding the dead host's replicas) and matches the reference.
    On loopback only where network namespaces cannot be made: otherwise
    test_netns.py::test_elastic_node_failure_across_namespaces runs this job across namespaces."""
    from tenplex.train.launch import HostsConfig, start_hosts

    _skip_where_namespaces_run_it()

    log = tmp_path / "log.jsonl"
    args = [*COMMON, "--parallel", "dp=1,tp=2,pp=2", "--ckpt", str(tmp_path / "ckpt"), "--ckpt-every", "1000",
            "--store", "auto", "--snapshot-every", "2", "--log", str(log)]
    rdzv = RendezvousStore()
    hosts = start_hosts(HostsConfig(2, str(tmp_path), args, nproc=2, endpoint=rdzv.endpoint,
                                    run_id=f"h{free_port()}"))
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
    """2 ranks read their batches through a real FUSE mount of the dataset (dp=2), fail at step 3,
    and resume under pp=2: the trainer re-shards the mount (dp=1) and the losses and samples are
    the uninterrupted run's. The ranks are started by hand (``run_forked``);
    test_restart_under_new_layout_matches_uninterrupted runs torchrun."""
    from tenplex.data.corpus import stdlib_corpus
    from tenplex.data.batches import corpus_index

    index_path, _ = corpus_index(stdlib_corpus(64))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    subprocess.run([sys.executable, "-m", "tenplex", "mount", index_path, str(mnt), "--dp", "2", "--global-batch",
                    "8", "--seed", "7"], check=True, capture_output=True, timeout=120)
    try:
        log, ckpt = tmp_path / "log.jsonl", tmp_path / "ckpt"
        run_forked(2, log, "--parallel", "dp=2,tp=1,pp=1", "--ckpt", str(ckpt), "--ckpt-every", "2",
                   "--fail-at-step", "3", "--data-mount", str(mnt), expect_fail=True)
        run_forked(2, log, "--parallel", "dp=1,tp=1,pp=2", "--ckpt", str(ckpt), "--ckpt-every", "2",
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


# -- failures are loud, resumes are checked (issue #15) -----------------------------------------
def start_single(*args: str, fsize_limit: int | None = None) -> Forked:
    """``python -m tenplex.train ARGS``, one process, forked from the test session's forkserver
    (``spawned.start_trainer``; ``fsize_limit``: a quota on its files), its output to a temporary file."""
    fd, out = tempfile.mkstemp(prefix="tenplex-train-", suffix=".log")
    os.close(fd)
    return start_trainer(list(args), Path(out), _env(), fsize_limit=fsize_limit)


def finish(proc: Forked, timeout: float = 120) -> tuple[int, str]:
    """Its exit code and output (the temporary file removed)."""
    try:
        code = proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.log is not None
    out = proc.log.read_text()
    proc.log.unlink()
    return code, out


def run_ranks(n: int, *args: str, fsize_limit: dict[int, int] | None = None,
              timeout: float = 120) -> list[tuple[int, str]]:
    """``n`` ranks of one job started by hand (torchrun's environment, no agent that would stop
    the others when one fails; forked: ``start_single``): each rank's own exit code and output."""
    port = str(free_port())
    procs = []
    for r in range(n):
        env = {**_env(), "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port}
        fd, out = tempfile.mkstemp(prefix=f"tenplex-rank{r}-", suffix=".log")
        os.close(fd)
        procs.append(start_trainer(list(args), Path(out), env, fsize_limit=(fsize_limit or {}).get(r)))
    deadline = time.monotonic() + timeout
    outs = []
    for p in procs:
        try:
            outs.append(finish(p, max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return outs


def run_forked(nproc: int, log: Path, *extra: str, expect_fail: bool = False) -> None:
    """``run_torchrun`` without the agent: ``nproc`` ranks of COMMON started by hand (``run_ranks``);
    every rank fails (``--fail-at-step``) or exits 0."""
    got = run_ranks(nproc, *COMMON, "--log", str(log), *extra, timeout=240)
    assert all((code != 0) == expect_fail for code, _ in got), [(code, out[-3000:]) for code, out in got]


@pytest.mark.timeout(240)
def test_save_failures_stop_the_run_with_a_clear_error(tmp_path: Path) -> None:
    """Finding 1: a failed save was printed by the thread's hook and the run exited 0. A save or
    snapshot that fails (here: past a file-size quota, after the start-up probe passed) stops the
    run at the next step, or at exit for the last one, with exit code 1, naming the step and the
    cause. (Options and directories that cannot work are refused at start-up with exit code 2:
    tests/test_hostile_trainer.py, as real processes too.)"""
    log = tmp_path / "log.jsonl"
    cases = {  # files up to 200 kB: the probe and the log pass, a checkpoint part (~1.4 MB) does not
        "checkpoint": (["--ckpt", str(tmp_path / "c"), "--ckpt-every", "1", "--log", str(log)],
                       f"could not write checkpoint step 1 to {tmp_path / 'c'}: OSError: File too large"),
        "snapshot": (["--store", str(tmp_path / "s"), "--snapshot-every", "2"],
                     f"could not write the snapshot of step 2 to the host store {tmp_path / 's'}: OSError: File too"),
        "last checkpoint": (["--ckpt", str(tmp_path / "c3")], "could not write checkpoint step 4"),
    }
    procs = {k: start_single("--steps", "4", *args, fsize_limit=200_000) for k, (args, _) in cases.items()}
    outs = {}
    for name, proc in procs.items():
        rc, out = outs[name] = finish(proc)
        assert rc == 1 and cases[name][1] in out, (name, rc, out[-2000:])
        assert "Traceback" not in out and "Exception in thread" not in out, (name, out[-2000:])
    steps, _ = read_log(log)  # the failed save of step 1 surfaces at the next step (or the one after while written)
    stop = re.search(r"training stopped at step (\d+)", outs["checkpoint"][1])
    assert stop and int(stop.group(1)) in (2, 3) and max(steps) == int(stop.group(1)) - 1, outs["checkpoint"]
    assert "training stopped at step 3" in outs["snapshot"][1]
    assert "training stopped after step 4" in outs["last checkpoint"][1]


@pytest.mark.timeout(120)
def test_one_rank_failing_save_stops_every_rank(tmp_path: Path) -> None:
    """Only rank 1's save fails (its files are capped at 200 kB): both ranks stop at the same
    step with a non-zero exit code (no hang, no agent needed to kill the healthy one), rank 1
    naming the step and cause, rank 0 saying another rank failed."""
    ckpt = tmp_path / "ckpt"
    (r0, out0), (r1, out1) = run_ranks(2, "--steps", "8", "--parallel", "dp=1,tp=1,pp=2", "--ckpt", str(ckpt),
                                       "--ckpt-every", "2", fsize_limit={1: 200_000}, timeout=90)
    assert r1 == 1 and f"rank 1: could not write checkpoint step 2 to {ckpt}: OSError: File too large" in out1, out1
    assert r0 == 1 and "rank 0: 1 other rank(s) could not write a checkpoint" in out0, out0
    stopped = [re.search(r"training stopped at step (\d+) on every rank", o) for o in (out0, out1)]
    assert all(stopped) and stopped[0].group(1) == stopped[1].group(1), (out0, out1)
    assert "Exception in thread" not in out0 + out1
    assert not any(i.complete for i in list_steps(str(ckpt)))


def _attempt(ckpt: Path, step: int) -> Path:
    (path,) = ckpt.glob(f"step-{step:012d}-*")
    return path


def flip_data_byte(ckpt: Path, step: int, rank: int) -> None:
    """Flip one bit inside the first chunk's data of ``rank``'s part of ``step``."""
    sdir = _attempt(ckpt, step)
    chunk = read_part_chunks(str(sdir), rank)[0]
    part = sdir / f"rank-{rank:05d}.safetensors"
    raw = bytearray(part.read_bytes())
    raw[chunk["offset"] + 5] ^= 0x01
    part.write_bytes(bytes(raw))


def flip_index_byte(ckpt: Path, step: int, rank: int) -> None:
    index = _attempt(ckpt, step) / f"rank-{rank:05d}.json"
    raw = bytearray(index.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    index.write_bytes(bytes(raw))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_damaged_newest_step_every_rank_resumes_the_previous_one(tmp_path: Path, reference: dict[int, dict]) -> None:
    """Finding 6: one flipped bit in the newest step made every restart fail. Damage that only
    rank 1 reads (a data byte of its part, then a byte of its index) makes rank 1 fall back;
    the ranks agree on the previous step, the start record names the skipped step, and the
    losses match the uninterrupted run. ``--resume-step`` of the damaged step stops both
    ranks at start-up (exit 2), though rank 0 alone could load it. The ranks are started by hand
    (``run_ranks``, forked); test_restart_under_new_layout_matches_uninterrupted runs torchrun."""
    log, ckpt = tmp_path / "log.jsonl", tmp_path / "ckpt"
    layout = ["--parallel", "dp=1,tp=1,pp=2", "--ckpt", str(ckpt), "--ckpt-every", "2"]
    run_forked(2, log, *layout, "--fail-at-step", "6", expect_fail=True)
    flip_data_byte(ckpt, 6, rank=1)
    (r0, out0), (r1, out1) = run_ranks(2, *COMMON, *layout, "--resume-step", "6", timeout=90)
    assert (r0, r1) == (2, 2), (out0, out1)
    assert re.search(r"error: rank 1: .*step 6.*(CRC|checksum|does not verify)", out1), out1
    assert "error: rank 0: 1 other rank(s) could not start" in out0, out0
    run_forked(2, log, *layout)
    steps, starts = read_log(log)
    assert starts[-1]["step"] == 4 and [s["step"] for s in starts[-1]["skipped"]] == [6], starts[-1]
    assert starts[-1]["skipped"][0]["ranks"] == [1]
    assert_matches(reference, steps, resumed_from=4)
    flip_index_byte(ckpt, STEPS, rank=1)
    run_forked(2, log, *layout)
    steps, starts = read_log(log)
    assert starts[-1]["step"] == STEPS - 2 and starts[-1]["skipped"][0]["step"] == STEPS, starts[-1]
    assert starts[-1]["skipped"][0]["ranks"] == [1]
    assert_matches(reference, steps, resumed_from=4)


def write_tokens(path: Path, seed: int, samples: int = 64, seq_len: int = 64) -> None:
    """A token file of ``samples`` samples of the tiny model (byte ids)."""
    import numpy as np

    np.random.default_rng(seed).integers(0, 256, samples * (seq_len + 1), dtype=np.uint16).tofile(path)


def checkpoint_of(ckpt: Path, ptc, steps: int = 2) -> None:  # noqa: ANN001
    """A real checkpoint of ``ptc`` (the trainer's collection, maybe other settings) after ``steps``
    training steps on the stdlib corpus, written in-process by the trainer's own classes."""
    import tenplex
    from tenplex.data.corpus import stdlib_corpus
    from tenplex.layout.models import ModelSpec
    from tenplex.train import TrainConfig, Trainer
    from tenplex.train.parallel import Groups

    cfg = ParallelConfig()
    tc = TrainConfig(steps=steps, seed=7)
    corpus = stdlib_corpus(ModelSpec.from_json(ptc.meta["model"]).seq_len)
    fresh = tenplex.rescale(None, ptc, rank=0, world_size=1, parallel=cfg)
    trainer = Trainer(tc, ptc, Groups(cfg, 0, None, None, torch.device("cpu")), fresh, corpus)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocesses (OMP_NUM_THREADS=1): much faster on a loaded 2-core machine
    try:
        for _ in range(steps):
            trainer.train_step()
    finally:
        torch.set_num_threads(threads)
    tenplex.save(str(ckpt), ptc, cfg, 0, trainer.shard(), step=steps)


@pytest.mark.timeout(240)
def test_resume_refuses_other_data_and_other_model_settings(tmp_path: Path) -> None:
    """Finding 7: the data fingerprint was name:size, so other tokens under the same name and size
    resumed silently, and a checkpoint of tiny with 4 heads (2 KV heads) loaded into 8 heads. Both
    now stop at start-up naming what differs (exit 2), and resume with --allow-data-change /
    --allow-model-change; a run resumed on new data records it, so the next resume needs no flag."""
    import hashlib

    from tenplex.train import trainer_ptc

    data = tmp_path / "tokens.u16"
    write_tokens(data, seed=1)
    fp_a = hashlib.sha256(data.read_bytes()).hexdigest()
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    base = ["--data", str(data), "--ckpt", str(ckpt), "--log", str(log), "--seed", "7"]
    model_ckpt = tmp_path / "heads4"
    checkpoint_of(model_ckpt, trainer_ptc("tiny", distributed_optimizer=False, heads=4, kv_heads=2))
    shutil.copytree(model_ckpt, tmp_path / "heads4-allowed")  # the allowed run saves step 3 (8 heads) there
    other_model = start_single("--steps", "3", "--ckpt", str(model_ckpt))
    allowed = start_single("--steps", "3", "--ckpt", str(tmp_path / "heads4-allowed"), "--allow-model-change",
                           "--log", str(tmp_path / "allowed.jsonl"))
    assert finish(start_single("--steps", "2", *base))[0] == 0
    write_tokens(data, seed=2)  # the same name and size, other tokens
    fp_b = hashlib.sha256(data.read_bytes()).hexdigest()
    rc, out = finish(start_single("--steps", "3", *base))
    assert rc == 2 and f"sha256:{fp_a}" in out and f"sha256:{fp_b}" in out and "--allow-data-change" in out, out
    assert "Traceback" not in out
    rc, out = finish(other_model)
    assert rc == 2 and "other model settings" in out and "heads: saved 4, requested 8" in out, out
    assert "kv_heads: saved 2, requested 4" in out and "--allow-model-change" in out, out
    assert finish(start_single("--steps", "3", *base, "--allow-data-change"))[0] == 0
    assert finish(start_single("--steps", "4", *base))[0] == 0  # step 3 was saved with the new data's fingerprint
    _, starts = read_log(log)
    assert [s["step"] for s in starts] == [0, 2, 3]
    rc, out = finish(allowed)
    assert rc == 0 and [s["step"] for s in read_log(tmp_path / "allowed.jsonl")[1]] == [2], out


def test_rescale_chooses_a_layout_without_layout_options_or_says_what_is_missing(tmp_path: Path) -> None:
    """Finding 15: rescale() without layout_options raised TypeError (rank_layouts() missing 4
    keyword arguments). The PTC's sequence length, precision and optimizer sharding and this
    machine's memory are defaults; the job's batch sizes must be given, and ConfigError says so."""
    import tenplex
    from tenplex.train import trainer_ptc

    ptc = trainer_ptc("tiny", distributed_optimizer=False)
    with pytest.raises(tenplex.ConfigError, match=r"missing: global_batch, micro_batch .*layout_options=dict"):
        tenplex.rescale(str(tmp_path), ptc, rank=0, world_size=2)
    res = tenplex.rescale(str(tmp_path), ptc, rank=0, world_size=4,
                          layout_options=dict(global_batch=8, micro_batch=2))
    assert res.fresh and res.cfg.world_size == 4
    assert res.cfg == tenplex.rescale(str(tmp_path), ptc, rank=0, world_size=4, layout_options=_options()).cfg
    # no URL: a fresh start that lists nothing (not the current directory)
    assert tenplex.rescale(None, ptc, rank=0, world_size=4, layout_options=_options()).fresh
    bare = tenplex.PTC(ptc.tensors.values(), num_layers=ptc.num_layers, objects=ptc.objects, meta={})
    with pytest.raises(tenplex.ConfigError, match="missing: global_batch, micro_batch, seq_len"):
        tenplex.rescale(None, bare, rank=0, world_size=2)


def test_corpus_fingerprint_names_the_content_and_is_cached(tmp_path: Path) -> None:
    """SHA-256 of the bytes, cached in a sidecar keyed by size, mtime, ctime and inode: other
    tokens under the same name and size (even with the mtime put back) get another fingerprint;
    an unchanged file is read from the cache, not hashed again."""
    import hashlib

    from tenplex.data.corpus import TokenCorpus

    path = tmp_path / "tokens.u16"
    write_tokens(path, seed=1)
    corpus = TokenCorpus(str(path), 64)
    first = corpus.fingerprint()
    assert first == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()
    sidecar = Path(str(path) + ".sha256")
    cached = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps({**cached, "sha256": "0" * 64}))  # a cache hit is visible as this value
    assert corpus.fingerprint() == "sha256:" + "0" * 64
    st = path.stat()
    with open(path, "r+b") as f:  # same size, other bytes, mtime restored
        f.write(b"\xff\x00")
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = corpus.fingerprint()
    assert again == "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest() != first


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_gives_bit_identical_steps(mode: str) -> None:
    """--recompute (torch.utils.checkpoint) changes what the backward pass keeps, not the numbers:
    losses, parameters and optimizer state after two steps equal those without it bit for bit."""
    import tenplex
    from tenplex.data.corpus import stdlib_corpus
    from tenplex.train import TrainConfig, Trainer, trainer_ptc
    from tenplex.train.parallel import Groups

    cfg = ParallelConfig()
    ptc = trainer_ptc("tiny", distributed_optimizer=False)
    corpus = stdlib_corpus(64)
    out = []
    for recompute in ("none", mode):
        tc = TrainConfig(steps=2, seed=7, recompute=recompute)
        fresh = tenplex.rescale(None, ptc, rank=0, world_size=1, parallel=cfg)
        trainer = Trainer(tc, ptc, Groups(cfg, 0, None, None, torch.device("cpu")), fresh, corpus)
        assert trainer.model.recompute == recompute
        losses = [trainer.train_step()[0] for _ in range(2)]
        out.append((losses, trainer.state_tensors()))
    (l0, s0), (l1, s1) = out
    assert l0 == l1
    assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0)
    with pytest.raises(tenplex.ConfigError, match="--recompute must be one of none, selective, full"):
        TrainConfig(recompute="most")
