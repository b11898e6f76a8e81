"""Side-task memory budgets, the bubble windows report, and the CUDA copy stream of snapshots."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest
import torch

import tenplex
from tenplex.checkpoint.format import ROW_BLOCK_MIN
from tenplex.elastic.bubbles import BubbleRuntime, SideTaskMemoryError, SnapshotTask, StoreWriteTask, side_task_memory_budget
from tenplex.planning.memory import estimate_memory
from tenplex.train.schedule import Op
from tenplex.train.trainer import trainer_ptc

from test_bubbles import _Work


class _Task:
    expected_step_s = 1e-4

    def __init__(self, name: str, memory_bytes: int) -> None:
        self.name, self.memory_bytes, self.steps = name, memory_bytes, 0

    def step(self) -> None:
        self.steps += 1

    def is_finished(self) -> bool:
        return self.steps >= 5


def _state() -> dict[str, torch.Tensor]:
    return {"a": torch.randn(300, 7), "b": torch.arange(500, dtype=torch.float64), "c": torch.randn(3)}


def test_task_over_budget_is_refused_with_a_clear_message() -> None:
    rt = BubbleRuntime(memory_budget="1KiB", stage=1)
    rt.register(_Task("small", 600))
    with pytest.raises(SideTaskMemoryError, match=r"'big' needs 500 B but stage 1's side-task memory budget of "
                       r"1024 B has 424 B left \(granted: small 600 B\)"):
        rt.register(_Task("big", 500))
    assert [t.name for t in rt.tasks] == ["small"] and rt.memory_free == 424
    rt.register(_Task("fits", 400))  # what is left is still usable
    assert rt.memory_free == 24
    with pytest.raises(SideTaskMemoryError):  # a snapshot needs at least one host copy of the state
        BubbleRuntime(memory_budget=100).register(SnapshotTask(state_bytes=101))


def test_task_growing_past_its_grant_gets_no_bubble_time(caplog: pytest.LogCaptureFixture) -> None:
    rt = BubbleRuntime(memory_budget=1000, profile_iterations=1)
    task = _Task("grows", 100)
    rt.register(task)
    op = Op("F", 0, True)
    rt(op, _Work(0.01))  # profiling
    task.memory_bytes = 2000
    with caplog.at_level(logging.WARNING, logger="tenplex.elastic.bubbles"):
        rt(op, _Work(0.01))
    assert task.steps == 0 and "more than its 100 B grant" in caplog.text
    task.memory_bytes = 100
    rt(op, _Work(0.01))
    assert task.steps > 0


def test_snapshot_under_a_small_budget_uses_one_buffer_set_and_stays_exact() -> None:
    state = _state()
    size = sum(t.nbytes for t in state.values())
    roomy, tight = SnapshotTask(bucket_bytes=512, state_bytes=size), SnapshotTask(bucket_bytes=512, state_bytes=size)
    BubbleRuntime(memory_budget=4 * size).register(roomy)
    rt = BubbleRuntime(memory_budget=size + size // 2)
    rt.register(tight)
    assert roomy.buffer_sets == 2 and roomy.memory_bytes == 2 * size
    assert tight.buffer_sets == 1 and rt.grants["snapshot"] == size
    for step in range(3):
        tight.begin(step, state)
        tight.step()
        snap = tight.finish()
        assert snap is not None and all(torch.equal(snap[n], state[n]) for n in state)
        assert tight.memory_bytes == size  # never a second set
        state["a"].add_(1.0)
    # the size learnt at begin() is checked against the limit too
    late = SnapshotTask()
    BubbleRuntime(memory_budget=size - 1).register(late)  # size unknown: it reserves what is left
    assert late.memory_limit == size - 1
    with pytest.raises(SideTaskMemoryError, match="needs one host copy of the state"):
        late.begin(0, state)


def test_store_write_under_a_small_budget_uses_smaller_buckets_and_equals_the_checkpoint(tmp_path: Path) -> None:
    ptc = trainer_ptc("tiny", distributed_optimizer=False)
    cfg = tenplex.ParallelConfig()
    gen = torch.Generator().manual_seed(0)
    shard = {n: torch.randn(ptc.local_shape(n, cfg), generator=gen).to(ptc.tensors[n].dtype)
             for n in ptc.rank_tensors(cfg, 0)}
    shard.update({"optimizer.step": 3, "data": {"consumed": 24}})
    full = StoreWriteTask(str(tmp_path / "a"), ptc, cfg, 0)
    task = StoreWriteTask(str(tmp_path / "b"), ptc, cfg, 0)
    assert full.memory_bytes > 0  # some tensors are split on dim 1: their buckets are copied
    budget = full.memory_bytes - full.bucket_bytes + 8192  # the row margin and buckets of 8 KiB
    rt = BubbleRuntime(memory_budget=budget)
    rt.register(task)
    assert task.bucket_bytes < full.bucket_bytes and task.memory_bytes <= budget
    for t in (full, task):
        t.begin(3, shard)
        steps = 0
        while not t.is_finished():
            t.step()
            steps += 1
        t.finish()
        t.close()
        if t is task:
            assert steps > full_steps
        full_steps = steps
    tenplex.save(str(tmp_path / "ref"), ptc, cfg, 0, shard, step=3)
    ref = tenplex.load(str(tmp_path / "ref"), cfg, 0, step=3).shard
    for root in ("a", "b"):
        got = tenplex.load(str(tmp_path / root), cfg, 0, step=3).shard
        for name, t in ref.items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(got[name], t), (root, name)
    with pytest.raises(SideTaskMemoryError):  # not even one checksum block fits (blocks are >= ROW_BLOCK_MIN)
        BubbleRuntime(memory_budget=ROW_BLOCK_MIN - 1).register(StoreWriteTask(str(tmp_path / "c"), ptc, cfg, 0))


def test_windows_report_start_expected_length_and_side_task_memory() -> None:
    rt = BubbleRuntime(memory_budget=10_000, profile_iterations=1, stage=1)
    rt.register(_Task("t", 4_000))
    ops = [Op("F", 0, True), Op("B", 0, True)]
    for it in range(3):
        rt.begin_iteration(it)
        for op in ops:
            time.sleep(0.005)  # compute before the wait
            rt(op, _Work(0.01))
    last = [w for w in rt.windows if w.iteration == 2]
    assert [w.position for w in last] == ["F0", "B0"]
    for w in last:
        assert w.stage == 1 and w.expected_s > 0.005 and w.measured_s is not None and w.measured_s > 0.005
        assert w.memory_bytes == 10_000 and w.memory_free == 6_000
    assert last[0].start_s < last[1].start_s and last[0].start_s >= 0.004
    assert all(w.expected_s == 0.0 for w in rt.windows if w.iteration == 0)  # still profiling
    fc = rt.forecast()
    assert [(w.iteration, w.position, w.measured_s) for w in fc] == [(3, "F0", None), (3, "B0", None)]
    assert fc[0].start_s < fc[1].start_s and all(w.memory_free == 6_000 for w in fc)
    assert set(fc[0].to_json()) >= {"stage", "iteration", "start_s", "expected_s", "memory_bytes"}


def test_budget_from_the_memory_estimator() -> None:
    cfg = tenplex.ParallelConfig(pp=2)
    est = estimate_memory("tiny", cfg, seq_len=64, micro_batch=2, num_microbatches=4, precision="fp32")
    for stage in range(2):
        assert side_task_memory_budget(est, stage, "1GiB") == int(0.8 * 2**30) - est.stages[stage].total_bytes
    assert side_task_memory_budget(est, 0, 1000) == 0  # nothing left: no side task fits


def test_cpu_snapshot_uses_no_stream_and_plain_buffers() -> None:
    state = _state()
    task = SnapshotTask(bucket_bytes=256)
    task.begin(0, state)
    task.step()
    snap = task.finish()
    assert task._stream is None and task._copied is None
    assert snap is not None and all(not t.is_pinned() and torch.equal(snap[n], state[n]) for n, t in snap.items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_snapshot_copies_on_a_lowest_priority_stream_into_pinned_buffers() -> None:
    state = {n: t.cuda() for n, t in _state().items()}
    task = SnapshotTask(bucket_bytes=256)
    task.begin(0, state)
    assert task._stream is not None and task._stream.priority == max(torch.cuda.Stream.priority_range())
    while not task.is_finished():
        task.step()
    snap = task.finish()
    assert snap is not None and all(t.is_pinned() and t.device.type == "cpu" for t in snap.values())
    assert all(torch.equal(snap[n], state[n].cpu()) for n in state)
    for t in state.values():  # the optimizer step after finish() must not leak into the snapshot
        t.add_(1)
    torch.cuda.synchronize()
    assert all(not torch.equal(snap[n], state[n].cpu()) for n in state)


def test_store_write_keeps_begin_cheap_and_publishes_in_the_next_bubble(tmp_path: Path) -> None:
    """begin() only records the shard (it is on the critical path); the file is laid out in a
    bubble step, and a finished snapshot becomes visible in the next iteration's first step."""
    ptc = trainer_ptc("tiny", distributed_optimizer=False)
    cfg = tenplex.ParallelConfig()
    gen = torch.Generator().manual_seed(1)

    def shard(step: int) -> dict:
        out: dict = {n: torch.randn(ptc.local_shape(n, cfg), generator=gen).to(ptc.tensors[n].dtype)
                     for n in ptc.rank_tensors(cfg, 0)}
        return {**out, "optimizer.step": step, "data": {"consumed": 8 * step}}

    root = str(tmp_path / "store")
    task = StoreWriteTask(root, ptc, cfg, 0)
    s1, s2 = shard(1), shard(2)
    task.begin(1, s1)
    assert not (tmp_path / "store").exists()  # nothing written by begin()
    while not task.is_finished():
        task.step()
    task.finish()
    assert task.completed == 0 and not [i for i in tenplex.checkpoint.list_steps(root) if i.complete]
    task.begin(2, s2)
    with pytest.raises(RuntimeError, match="before finish"):
        task.begin(3, s2)
    task.step()  # the first bubble step of the next iteration publishes snapshot 1
    assert task.completed == 1 and [i.step for i in tenplex.checkpoint.list_steps(root) if i.complete] == [1]
    task.finish()  # no more bubbles: the rest of snapshot 2 blocking
    task.close()
    assert task.completed == 2
    assert [i.step for i in tenplex.checkpoint.list_steps(root) if i.complete] == [1, 2]
    for step, sh in ((1, s1), (2, s2)):  # the same bytes as tenplex.save (padding rows are not stored)
        tenplex.save(str(tmp_path / "ref"), ptc, cfg, 0, sh, step=step)
        want = tenplex.load(str(tmp_path / "ref"), cfg, 0, step=step).shard
        got = tenplex.load(root, cfg, 0, step=step).shard
        for name, t in want.items():
            if isinstance(t, torch.Tensor):
                assert torch.equal(got[name], t), (step, name)


def test_store_write_cost_model_is_not_thrown_by_small_buckets(tmp_path: Path) -> None:
    """The next bucket's expected time is a byte-weighted rate: a few-KiB bucket that costs the
    per-call overhead must not price a 1 MiB bucket at many ms (it would then never fit a bubble
    and never be measured again); the blocking leftovers in finish() are measured too."""
    ptc = trainer_ptc("tiny", distributed_optimizer=False)
    cfg = tenplex.ParallelConfig()
    task = StoreWriteTask(str(tmp_path / "store"), ptc, cfg, 0)
    task._measure("bucket", 1e-3, 1 << 20)  # 1 MiB in 1 ms
    task._measure("bucket", 3e-4, 4096)  # a norm weight: 4 KiB, mostly per-call overhead
    rate = task._cost["byte"]
    assert 1e-3 * 0.9 / (1 << 20) < rate < 1.5e-3 / (1 << 20), rate  # still about 1 ms per MiB
    # a stuck-high estimate comes down through measured blocking leftovers
    task._measure("bucket", 1.0, 1 << 20)  # one bucket preempted for a second
    high = task._cost["byte"]
    for _ in range(5):
        task._measure("bucket", 20e-3, 20 << 20, count=20)  # finish(): 20 MiB in 20 ms
    assert task._cost["byte"] < high / 5
    # finish() feeds the model: after a snapshot written entirely blocking, the next one's
    # layout and buckets have estimates (the publish step is first measured in the second finish)
    task2 = StoreWriteTask(str(tmp_path / "store2"), ptc, cfg, 0)

    def shard(step: int) -> dict:
        zeros = {n: torch.zeros(ptc.local_shape(n, cfg), dtype=ptc.tensors[n].dtype) for n in ptc.rank_tensors(cfg, 0)}
        return {**zeros, "optimizer.step": step, "data": {"consumed": 8 * step}}

    task2.begin(1, shard(1))
    assert task2.next_step_s is None  # nothing measured yet
    task2.finish()
    task2.begin(2, shard(2))
    task2.step()  # publishes snapshot 1
    assert task2.next_step_s == task2._cost["open"] > 0  # measured in finish()
    task2.step()  # lays out snapshot 2
    assert task2.next_step_s is not None and 0 < task2.next_step_s < 0.5  # a bucket, from finish()'s leftovers
    task2.finish()
    task2.close()
    assert task2.completed == 2
