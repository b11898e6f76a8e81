"""Elastic data for torch loaders (tenplex.data.loader, the "feistel" order): every position of a run
read exactly once, in the order of an uninterrupted run, through DP changes (even and uneven), worker
processes, torchdata's StatefulDataLoader and tenplex's own checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from torchdata.stateful_dataloader import StatefulDataLoader

from tenplex.data import (
    DataState,
    DataStateError,
    ElasticBatchSampler,
    ElasticIterable,
    ElasticLoader,
    feistel_ids,
    ids_at,
    loader_state,
    rank_step_ids,
    remaining_ids,
    sample_order,
)


class Ids:
    """A map-style dataset whose sample ``i`` is ``i`` (so a batch says which samples it holds)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def reference(data: DataState, end: int) -> list[list[int]]:
    """The uninterrupted run's global batches from position 0 to ``end``."""
    order = ids_at(np.arange(end), data.num_samples, data.seed, data.shuffle, data.order).tolist()
    return [order[p : p + data.global_batch] for p in range(0, end, data.global_batch)]


def run_phase(loaders: list[Any], steps: int) -> list[list[int]]:
    """``steps`` global batches: every rank's next batch, ranks in order (one rank's loader at a time, so
    at most one rank's worker processes live), concatenated per step."""
    per_rank = []
    for loader in loaders:
        batches: list[list[int]] = []
        while len(batches) < steps:  # an iteration ends with its epoch: the next one continues
            for batch in loader:
                batches.append(batch.tolist())
                if len(batches) == steps:
                    break
        per_rank.append(batches)
    return [sum((rank[k] for rank in per_rank), []) for k in range(steps)]


def elastic_loaders(n: int, g: int, dp: int, workers: int, sd: dict[str, Any] | None,
                    iterable: bool = False) -> list[ElasticLoader]:
    out = []
    for r in range(dp):
        sampler = ElasticBatchSampler(loader_state(n, g, seed=3), dp, r)
        kw: dict[str, Any] = {"num_workers": workers, "prefetch_factor": 2} if workers else {}
        loader = ElasticLoader(ElasticIterable(Ids(n), sampler), **kw) if iterable else \
            ElasticLoader(Ids(n), sampler, **kw)
        if sd is not None:
            loader.load_state_dict(json.loads(json.dumps(sd)))  # the state is JSON
        out.append(loader)
    return out


@settings(max_examples=examples(200), deadline=None)
@given(n=st.integers(1, 3000), seed=st.integers(0, 2**64 - 1), epoch=st.integers(0, 10**6))
def test_the_feistel_order_is_a_permutation_of_every_size(n: int, seed: int, epoch: int) -> None:
    ids = feistel_ids(np.arange(n), n, seed, epoch)
    assert sorted(ids.tolist()) == list(range(n))
    assert np.array_equal(sample_order(n, seed, epoch, True, "feistel"), ids)


_M64, _GOLDEN = (1 << 64) - 1, 0x9E3779B97F4A7C15


def _splitmix(x: int) -> int:
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


def feistel_reference(position: int, n: int, seed: int, epoch: int) -> int:
    """The "feistel" order's definition one id at a time in Python ints (checkpoints name the order, so
    every way the library computes it must give these ids): round keys from splitmix64 of (seed, epoch),
    6 rounds on two ``half``-bit halves, cycle-walking back into ``[0, n)``."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    base = _splitmix((seed & _M64) ^ _splitmix(epoch + _GOLDEN & _M64))
    keys = [_splitmix(base + i * _GOLDEN & _M64) for i in range(6)]
    x = position
    while True:
        left, right = x >> half, x & mask
        for k in keys:
            left, right = right, (_splitmix(right + k & _M64) & mask) ^ left
        x = left << half | right
        if x < n:
            return x


@settings(max_examples=examples(200), deadline=None)
@given(n=st.one_of(st.integers(2, 1 << 24), st.integers(2, 1 << 40)), seed=st.integers(0, 2**64 - 1),
       epoch=st.integers(0, 10**6), data=st.data())
def test_every_way_the_feistel_order_is_computed_gives_its_definition(n: int, seed: int, epoch: int,
                                                                     data: st.DataObject) -> None:
    """A few ids (round functions computed per call) and a few thousand (the round functions looked up in
    a table when 2**half is small next to them) match the definition."""
    few = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=5))
    assert feistel_ids(np.array(few), n, seed, epoch).tolist() == [feistel_reference(p, n, seed, epoch) for p in few]
    start = data.draw(st.integers(0, max(0, n - 5000)))
    many = np.arange(start, min(n, start + 5000))
    got = feistel_ids(many, n, seed, epoch)
    check = data.draw(st.lists(st.integers(0, many.size - 1), min_size=1, max_size=20))
    assert [int(got[i]) for i in check] == [feistel_reference(int(many[i]), n, seed, epoch) for i in check]


@pytest.mark.parametrize("n", [(1 << 26) + 3, (1 << 32) - 1])
def test_the_feistel_order_of_a_large_dataset_asked_many_ids_at_once_gives_its_definition(n: int) -> None:
    """2**half round-table entries (8192 and 65536) are built when at least as many ids are asked."""
    many = np.arange(n - 70_000, n)
    got = feistel_ids(many, n, 11, 4)
    assert len(set(got.tolist())) == many.size and 0 <= got.min() and got.max() < n
    assert [int(got[i]) for i in range(0, many.size, 997)] == \
        [feistel_reference(int(many[i]), n, 11, 4) for i in range(0, many.size, 997)]


def test_the_feistel_order_at_a_billion_samples_is_computed_where_asked() -> None:
    n = 10**9
    window = feistel_ids(np.arange(5 * 10**8, 5 * 10**8 + 100_000), n, 7, 2)
    assert len(set(window.tolist())) == window.size and window.min() >= 0 and window.max() < n
    assert np.array_equal(window[1000:1010], feistel_ids(np.arange(5 * 10**8 + 1000, 5 * 10**8 + 1010), n, 7, 2))
    assert not np.array_equal(window, feistel_ids(np.arange(5 * 10**8, 5 * 10**8 + 100_000), n, 7, 3))
    # shuffled: consecutive positions land far apart (a mean gap near n/3, not 1)
    assert abs(np.abs(np.diff(window)).mean() / n - 1 / 3) < 0.01


def test_a_state_without_an_order_keeps_the_old_order_and_its_json() -> None:
    old = {"num_samples": 50, "global_batch": 10, "seed": 4, "shuffle": True, "consumed": 20, "source": ""}
    state = DataState.from_json(old)
    assert state.order == "pcg64" and state.to_json() == old
    pcg = np.random.Generator(np.random.PCG64([4, 0])).permutation(50)
    assert np.array_equal(remaining_ids(state, 2, 0), pcg[20:50].reshape(-1, 10)[:, :5].ravel())
    new = DataState.from_json({**old, "order": "feistel"})
    assert new.to_json()["order"] == "feistel" and not np.array_equal(remaining_ids(new, 1, 0), pcg[20:])
    assert np.array_equal(remaining_ids(new, 1, 0), feistel_ids(np.arange(20, 50), 50, 4, 0))
    with pytest.raises(DataStateError, match="order must be one of"):
        DataState.from_json({**old, "order": "random"})


@settings(max_examples=examples(60), deadline=None)
@given(n=st.integers(1, 200), g=st.integers(1, 12), seed=st.integers(0, 5),
       phases=st.lists(st.tuples(st.integers(1, 8), st.integers(1, 6)), min_size=1, max_size=5),
       iterable=st.booleans())
def test_any_dp_sequence_reads_every_position_once_in_order(n: int, g: int, seed: int,
                                                             phases: list[tuple[int, int]], iterable: bool) -> None:
    """In process (no workers): DP sizes that do not divide the batch included (uneven slices)."""
    phases = [(min(dp, g), steps) for dp, steps in phases]
    got: list[list[int]] = []
    sd = None
    for dp, steps in phases:
        loaders = elastic_loaders(n, g, dp, 0, sd, iterable)
        got += run_phase(loaders, steps)
        sd = loaders[0].state_dict()
        assert all(lo.state_dict() == sd for lo in loaders)  # the same on every rank
    total = sum(s for _, s in phases)
    assert sd is not None and sd["data"]["consumed"] == total * g
    data = loader_state(n, g, seed=3)
    assert got == reference(data, total * g)


def check_with_workers(dps: tuple[int, ...], workers: int, iterable: bool) -> None:
    n, g = 100, 20
    got: list[list[int]] = []
    sd = None
    for dp in dps:
        loaders = elastic_loaders(n, g, dp, workers, sd, iterable)
        got += run_phase(loaders, 3)
        sd = loaders[0].state_dict()
        if not iterable:  # the workers were handed batches the loop did not take: not in the state
            assert loaders[0].sampler.data.consumed > sd["data"]["consumed"]
    assert got == reference(loader_state(n, g, seed=3), 3 * len(dps) * g)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("iterable", [False, True])
@pytest.mark.parametrize("dps", [(8, 6, 8), (4, 3)])
def test_dp_changes_with_worker_processes_read_every_sample_once_in_order(dps: tuple[int, ...],
                                                                          iterable: bool) -> None:
    """DP 8 -> 6 -> 8 and 4 -> 3 over a global batch of 20 (8, 6 and 3 do not divide it: uneven slices)
    with 2 worker processes that prefetch, across an epoch end: the state follows the batches the loop
    received, never the prefetched ones."""
    check_with_workers(dps, 2, iterable)


@pytest.mark.timeout(120)
@settings(max_examples=examples(3), deadline=None)
@given(workers=st.integers(1, 3), iterable=st.booleans(),
       dps=st.lists(st.integers(1, 5), min_size=2, max_size=3).map(tuple))
def test_any_worker_count_and_dp_sequence_reads_every_sample_once(workers: int, iterable: bool,
                                                                  dps: tuple[int, ...]) -> None:
    check_with_workers(dps, workers, iterable)


def test_uneven_slices_differ_by_at_most_one_sample_and_cover_the_batch() -> None:
    sizes = [len(next(iter(lo))) for lo in elastic_loaders(40, 8, 3, 0, None)]
    assert sizes == [3, 3, 2]


def test_a_finite_run_ends_with_its_last_partial_batch_split_across_the_ranks() -> None:
    n, g, dp = 10, 4, 3  # 2 epochs: 20 positions, 5 global batches, the last one whole; then 3 epochs: 30, a tail of 2
    for epochs, end in ((2, 20), (3, 30)):
        seen: list[int] = []
        for r in range(dp):
            sampler = ElasticBatchSampler(loader_state(n, g, seed=1), dp, r, num_epochs=epochs)
            batches = list(sampler)
            assert len(batches) == len(ElasticBatchSampler(loader_state(n, g, seed=1), dp, r, num_epochs=epochs))
            seen += [i for b in batches for i in b]
        expected = ids_at(np.arange(end), n, 1, True, "feistel").tolist()
        assert sorted(seen) == sorted(expected) and len(seen) == end


@pytest.mark.parametrize("dp", [1, 5])
def test_batches_computed_ahead_are_the_positions_ids_and_a_move_drops_them(dp: int) -> None:
    """An iteration longer than a fill (AHEAD steps), ending in a partial batch, gives every rank its
    ``rank_step_ids`` at every position; a load or a reshard during the iteration continues from there."""
    n, g = 3001, 10  # 2 epochs: 6002 positions, the last global batch 2 samples
    data = loader_state(n, g, seed=7)
    for r in range(dp):
        sampler = ElasticBatchSampler(data, dp, r, num_epochs=2)
        batches = list(sampler)
        expected = [rank_step_ids(data, p, 2 * n, (dp, r, 1)).tolist() for p in range(0, 2 * n, g)]
        assert batches == [b for b in expected if b] and sampler.data.consumed == 2 * n
    sampler = ElasticBatchSampler(data, dp, 0, num_epochs=2)
    it = iter(sampler)
    for _ in range(300):
        next(it)
    sampler.load_state_dict({"data": {**data.to_json(), "consumed": 40}})
    assert next(it) == rank_step_ids(data, 40, 2 * n, (dp, 0, 1)).tolist()
    sampler.reshard(2, 1)
    assert next(it) == rank_step_ids(data, 50, 2 * n, (2, 1, 1)).tolist() and sampler.data.consumed == 60


def test_epochs_continue_where_the_last_iteration_ended() -> None:
    n, g = 10, 4
    loader = ElasticLoader(Ids(n), ElasticBatchSampler(loader_state(n, g, seed=2), 2, 0))
    first = [b.tolist() for b in loader]
    second = [b.tolist() for b in loader]
    assert len(first) == 3 and len(second) == 2  # [0, 12) then [12, 20): batches end at epoch ends or reach over
    order = ids_at(np.arange(20), n, 2, True, "feistel").tolist()
    assert first + second == [order[p : p + 2] for p in range(0, 20, 4)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("iterable", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_dataloaders_state_restores_under_another_dp_size(iterable: bool, workers: int) -> None:
    """torchdata's StatefulDataLoader with 0 or 2 workers: its own state_dict (saved by rank 0 of DP 4
    after 3 batches, with 2 workers batches prefetched past them) loads into every rank of DP 3 (uneven:
    3 does not divide 8) and the run continues with the next global batch."""
    n, g = 64, 8

    def loaders(dp: int) -> list[StatefulDataLoader]:
        out = []
        for r in range(dp):
            sampler = ElasticBatchSampler(loader_state(n, g, seed=5), dp, r)
            if iterable:
                ds = ElasticIterable(Ids(n), sampler)
                out.append(StatefulDataLoader(ds, batch_size=ds.batch_size, num_workers=workers))
            else:
                out.append(StatefulDataLoader(Ids(n), batch_sampler=sampler, num_workers=workers))
        return out

    def phase(group: list[StatefulDataLoader], steps: int) -> tuple[list[list[int]], dict[str, Any]]:
        per_rank, states = [], []
        for loader in group:
            it = iter(loader)
            per_rank.append([next(it).tolist() for _ in range(steps)])
            states.append(loader.state_dict())
            del it
        return [sum((b[k] for b in per_rank), []) for k in range(steps)], states[0]

    got, sd = phase(loaders(4), 3)
    new = loaders(3)
    for loader in new:
        loader.load_state_dict(sd)
    more, _ = phase(new, 3)
    assert got + more == reference(loader_state(n, g, seed=5), 6 * g)


def test_the_state_goes_through_tenplex_checkpoints(tmp_path: Path) -> None:
    """tenplex.save_state_dict / load_state_dict (one process): the loader as a Stateful value."""
    import tenplex

    n, g = 50, 6
    loader = elastic_loaders(n, g, 2, 0, None)[0]
    it = iter(loader)
    for _ in range(4):
        next(it)
    tenplex.save_state_dict({"loader": loader.state_dict(), "w": torch.ones(2)}, str(tmp_path), step=1)
    restored = elastic_loaders(n, g, 3, 0, None)
    for lo in restored:
        tenplex.load_state_dict({"loader": lo, "w": torch.zeros(2)}, str(tmp_path))
        assert lo.state_dict() == loader.state_dict()
    assert run_phase(restored, 2) == reference(loader_state(n, g, seed=3), 6 * g)[4:]


def test_a_state_of_another_dataset_is_refused() -> None:
    loader = elastic_loaders(50, 5, 1, 0, None)[0]
    with pytest.raises(DataStateError, match="dataset of 40 samples, this one has 50"):
        loader.load_state_dict({"data": loader_state(40, 5).to_json()})
    with pytest.raises(DataStateError, match="not a tenplex loader state"):
        loader.load_state_dict({"consumed": 3})


_OWNER = """
import os, sys, time
import torch
from tenplex.data import ElasticBatchSampler, ElasticLoader, loader_state

class Pids(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return os.getpid()

if __name__ == "__main__":
    loader = ElasticLoader(Pids(), ElasticBatchSampler(loader_state(64, 8)), num_workers=2, persistent_workers=True,
                           multiprocessing_context="forkserver")
    pids = set()
    for batch in loader:
        pids |= set(batch.tolist())
        if len(pids) == 2:
            break
    print(" ".join(map(str, sorted(pids))), flush=True)
    time.sleep(600)
"""


@pytest.mark.timeout(90)
def test_loader_workers_end_with_a_killed_trainer(tmp_path: Path) -> None:
    """A trainer's loader workers started from a forkserver (as examples/elastic_loader.py must) have the
    forkserver as parent, so torch's parent check never fires: SIGKILL the trainer and its workers must
    still end (ElasticLoader's worker init watches the trainer's pid), not live on with their dataset."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "owner.py"
    script.write_text(_OWNER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2 and proc.pid not in workers, workers
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        deadline = time.monotonic() + 20
        alive = workers
        while alive and time.monotonic() < deadline:
            time.sleep(0.1)
            alive = [p for p in workers if Path(f"/proc/{p}").exists()
                     and Path(f"/proc/{p}/status").read_text().find("State:\tZ") < 0]
        assert not alive, f"loader workers {alive} outlived their killed trainer"
    finally:
        proc.kill()
