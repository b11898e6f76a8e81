"""Side tasks in pipeline bubbles: only inside waits, consistent snapshots, unchanged training."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

import tenplex
from tenplex.elastic.bubbles import BubbleRuntime, SnapshotTask
from tenplex.train.launch import free_port
from tenplex.train.schedule import Op

from spawned import log_tails, rank_env, start_trainer, wait_procs


class _Work:
    """A receive that completes ``delay`` seconds after it was posted; like gloo, it reports
    completion only once waited on."""

    def __init__(self, delay: float) -> None:
        self.t_done = time.perf_counter() + delay

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        time.sleep(max(0.0, self.t_done - time.perf_counter()))


class _Task:
    name = "count"

    def __init__(self, step_s: float, units: int) -> None:
        self.step_s, self.left, self.calls = step_s, units, []

    def step(self) -> None:
        t0 = time.perf_counter()
        time.sleep(self.step_s)
        self.calls.append((t0, time.perf_counter()))
        self.left -= 1

    def is_finished(self) -> bool:
        return self.left <= 0



class _Uneven(_Task):
    """Steps of two costs (e.g. a checkpoint index write among bucket copies); says which is next."""

    name = "uneven"

    def __init__(self, costs: list[float]) -> None:
        super().__init__(0.0, len(costs))
        self.costs = costs

    @property
    def next_step_s(self) -> float:
        return self.costs[len(self.calls)]

    def step(self) -> None:
        self.step_s = self.costs[len(self.calls)]
        super().step()


def test_runtime_trusts_a_tasks_next_step_estimate() -> None:
    """A 20 ms step among 1 ms steps must wait for a bubble that has 20 ms left: an average of
    past steps would start it with 5 ms left and hold the stage 15 ms past its bubble."""
    rt = BubbleRuntime(margin=1.2, profile_iterations=1)
    task = _Uneven([0.001] * 5 + [0.02] + [0.001] * 200)
    rt.register(task)
    op = Op("F", 0, True)
    rt(op, _Work(0.012))  # profiling
    for it in range(1, 5):
        rt.begin_iteration(it)
        rt(op, _Work(0.012))
    assert 5 <= len(task.calls) and all(b - a < 0.015 for a, b in task.calls)  # the long step never ran
    rt(op, _Work(0.05))  # a bubble this long is not in the profile: the profile says 12 ms
    assert all(b - a < 0.015 for a, b in task.calls)


def test_profile_grows_slowly_when_side_tasks_ran() -> None:
    """A wait that ran side tasks and still waited may lengthen the bubble profile by at most
    ``growth`` per iteration (side work can itself delay the data on a busy CPU)."""
    rt = BubbleRuntime(profile_iterations=1, growth=1.05)
    task = _Task(step_s=0.001, units=10**6)
    rt.register(task)
    op = Op("F", 0, True)
    rt(op, _Work(0.01))
    base = rt.bubbles[("F", 0)].ema
    for _ in range(3):
        rt(op, _Work(0.04))  # tasks run for about 10 ms, then the stage waits 30 ms more
    assert rt.bubbles[("F", 0)].ema <= base * 1.05**3 * (1 + 1e-9)  # uncapped: about 2.8x base


def test_side_steps_get_their_own_stream_only_on_cuda() -> None:
    assert BubbleRuntime(device="cpu").stream is None and BubbleRuntime().stream is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_side_steps_run_on_a_lowest_priority_stream() -> None:
    """A user task's kernels go to the runtime's side stream, not the training stream."""
    rt = BubbleRuntime(profile_iterations=1, device="cuda")
    seen: list = []

    class OnStream(_Task):
        name = "stream"

        def step(self) -> None:
            seen.append(torch.cuda.current_stream())
            torch.ones(1024, device="cuda").sum()  # a kernel, launched where the task is
            super().step()

    rt.register(OnStream(0.001, 50))
    op = Op("F", 0, True)
    rt(op, _Work(0.01))
    rt.begin_iteration(1)
    rt(op, _Work(0.01))
    assert seen and all(s == rt.stream for s in seen)
    assert rt.stream.priority == max(torch.cuda.Stream.priority_range())
    assert torch.cuda.current_stream() != rt.stream  # restored after each step


def test_runtime_runs_tasks_only_inside_profiled_bubbles() -> None:
    rt = BubbleRuntime(margin=1.2, profile_iterations=2)
    task = _Task(step_s=0.002, units=10**6)
    rt.register(task)
    op = Op("F", 0, True)
    for it in range(2):  # profiling: no task runs yet
        rt.begin_iteration(it)
        rt(op, _Work(0.03))
    assert task.calls == []
    late = []
    for it in range(2, 6):
        rt.begin_iteration(it)
        t0 = time.perf_counter()
        work = _Work(0.03)
        rt(op, work)
        late.append(time.perf_counter() - work.t_done)
    waits = [(s.start, s.end) for s in rt.spans if s.kind == "wait"]
    assert task.calls, "no side-task step ran in 30 ms bubbles"
    for a, b in task.calls:  # every step lies inside a wait
        assert any(w0 <= a and b <= w1 for w0, w1 in waits)
    assert max(late) < 0.03  # the side task never held the stage far past its bubble (scheduler jitter aside)
    # a bubble shorter than a task step gets no task
    short = BubbleRuntime(profile_iterations=1)
    slow = _Task(step_s=0.05, units=5)
    slow.expected_step_s = 0.05  # what the task says of itself before it has been measured
    short.register(slow)
    for it in range(3):
        short(op, _Work(0.005))
    assert slow.calls == []


def test_snapshot_task_copies_exactly_and_double_buffers() -> None:
    done = []
    task = SnapshotTask(bucket_bytes=1000, on_complete=lambda step, snap: done.append((step, snap)))
    state = {"a": torch.randn(100, 7), "b": torch.arange(50, dtype=torch.float32)}
    task.begin(5, state)
    for _ in range(2):
        task.step()
    assert not task.is_finished()
    snap = task.finish()
    assert task.bubble_bytes > 0 and task.blocking_bytes > 0
    assert task.bubble_bytes + task.blocking_bytes == sum(t.numel() * 4 for t in state.values())
    assert all(torch.equal(snap[n], state[n]) for n in state) and done[0][0] == 5
    state["a"].add_(1.0)  # the next step changes the state; the first snapshot must not change
    task.begin(6, state)
    while not task.is_finished():
        task.step()
    snap2 = task.finish()
    assert not torch.equal(done[0][1]["a"], snap2["a"])
    assert torch.equal(snap2["a"], state["a"])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bubble_snapshots_match_checkpoints_and_leave_losses_unchanged(tmp_path: Path) -> None:
    store, out, ckpt, log = tmp_path / "store", tmp_path / "out", tmp_path / "ckpt", tmp_path / "log.jsonl"
    common = ["--model", "tiny", "--global-batch", "8", "--micro-batch", "2"]

    def world(main: str, argv: list[str], tag: str) -> None:  # 2 ranks as torchrun starts them, forked
        port = free_port()
        procs = [start_trainer(argv, tmp_path / f"{tag}{r}.log", {**os.environ, "OMP_NUM_THREADS": "1",
                                                                   **rank_env(r, 2, port)}, main=main)
                 for r in range(2)]
        assert wait_procs(procs, 240) == [0, 0], log_tails(tmp_path, f"{tag}*.log")

    world("tenplex.train.bubble_bench:main", ["--worker", "--mode", "bubbles", "--layout", "dp=1,tp=1,pp=2",
                                              "--rounds", "1", "--warmup", "1", "--store-dir", str(store),
                                              "--out", str(out), *common], "bench")
    world("tenplex.train.run:main", ["--parallel", "dp=1,tp=1,pp=2", "--steps", "6", "--seed", "1234", "--lr",
                                     "3e-3", "--ckpt", str(ckpt), "--ckpt-every", "1", "--keep-last", "10", "--log",
                                     str(log), *common], "train")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    plain = [json.loads(line)["loss"] for line in log.read_text().splitlines() if '"loss"' in line]
    bubble_losses = [s["loss"] for s in next(r for r in ranks if r["rank"] == 0)["steps"]]
    assert bubble_losses == plain  # side tasks do not change training
    assert ranks[0]["snapshots"]["bubbles"] == 6 and sum(r["bubble_bytes"]["bubbles"] for r in ranks) > 0
    for r in ranks:  # side-task steps only inside waits
        waits = [(a, b) for _, kind, a, b, _ in r["spans"] if kind == "wait"]
        for _, kind, a, b, _ in r["spans"]:
            if kind.startswith("task:"):
                assert any(w0 <= a and b <= w1 for w0, w1 in waits)
    cfg = tenplex.ParallelConfig(pp=2)
    for step in (3, 5):  # snapshot "step s" = the state after s steps, equal to the checkpoint of step s
        for rank in range(2):
            snap = tenplex.load(str(store), cfg, rank, step=step).shard
            ref = tenplex.load(str(ckpt), cfg, rank, step=step).shard
            for name, t in ref.items():
                if isinstance(t, torch.Tensor):
                    assert torch.equal(snap[name], t), (step, rank, name)
