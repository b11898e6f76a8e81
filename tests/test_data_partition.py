"""Pure tests of the remaining-sample partitioning (tenplex.data.partition)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

from tenplex.data import (
    DataState,
    DataStateError,
    global_batch_ids,
    ids_at,
    rank_batch_ids,
    rank_positions,
    remaining_ids,
    replica_samples,
    sample_order,
    stream_end,
)


@st.composite
def streams(draw: st.DrawFn) -> tuple[DataState, int]:
    n = draw(st.integers(1, 60))
    dp = draw(st.integers(1, 6))
    g = dp * draw(st.integers(1, 5))
    state = DataState(num_samples=n, global_batch=g, seed=draw(st.integers(0, 3)), shuffle=draw(st.booleans()),
                      consumed=draw(st.integers(0, 3 * n)))
    return state, dp


def _views(state: DataState, dp: int, **kw: object) -> list[np.ndarray]:
    return [remaining_ids(state, dp, r, **kw) for r in range(dp)]  # type: ignore[arg-type]


@settings(max_examples=examples(200))
@given(streams(), st.sampled_from([None, 0, 1, 2, 4]))
def test_union_is_remaining_global_order(sd: tuple[DataState, int], epochs: int | None) -> None:
    state, dp = sd
    end = stream_end(state.num_samples, state.global_batch, state.consumed, epochs)
    pos = [rank_positions(state.consumed, end, state.global_batch, dp, r) for r in range(dp)]
    allpos = np.concatenate(pos)
    # every position in [progress, end) exactly once
    assert np.array_equal(np.sort(allpos), np.arange(state.consumed, end))
    for p in pos:
        assert np.all(np.diff(p) > 0), "a rank consumes its positions in increasing order"
    # rebuild the global order batch by batch from the rank slices: same as the global order
    views = _views(state, dp, num_epochs=epochs)
    g, per = state.global_batch, state.global_batch // dp
    full = (end - state.consumed) // g
    rebuilt = [v[b * per:(b + 1) * per] for b in range(full) for v in views] + [v[full * per:] for v in views]
    expect = ids_at(np.arange(state.consumed, end), state.num_samples, state.seed, state.shuffle)
    assert np.array_equal(np.concatenate(rebuilt) if rebuilt else np.zeros(0, np.int64), expect)


@settings(max_examples=examples(150))
@given(streams())
def test_default_end_is_whole_batches_through_the_epoch(sd: tuple[DataState, int]) -> None:
    state, dp = sd
    n, g, p = state.num_samples, state.global_batch, state.consumed
    end = stream_end(n, g, p)
    epoch_end = (p // n + 1) * n
    assert (end - p) % g == 0 and epoch_end <= end < epoch_end + g
    views = _views(state, dp)
    assert len({len(v) for v in views}) == 1, "whole batches: every rank has as many samples"
    # the first batch of each rank is the existing rank_batch_ids, and so on for later batches
    per = g // dp
    s = state
    for b in range(min(3, (end - p) // g)):
        for r in range(dp):
            assert np.array_equal(views[r][b * per:(b + 1) * per], rank_batch_ids(s, dp, r))
        s = s.advance()


@settings(max_examples=examples(150))
@given(streams(), st.integers(1, 6), st.integers(0, 4))
def test_repartition_neither_skips_nor_repeats(sd: tuple[DataState, int], dp2: int, steps: int) -> None:
    """Consume some batches under dp, rescale to dp2 at that progress: the global sequence is unchanged."""
    state, dp = sd
    g = dp * dp2 * (state.global_batch // dp)  # divisible by both
    state = DataState(state.num_samples, g, state.seed, state.shuffle, state.consumed)
    end = state.consumed + (steps + 3) * g
    before = [remaining_ids(state, dp, r, end=state.consumed + steps * g) for r in range(dp)]
    after_state = state.advance(steps)
    after = [remaining_ids(after_state, dp2, r, end=end) for r in range(dp2)]
    consumed = []
    for views, d, nb in ((before, dp, steps), (after, dp2, 3)):
        per = g // d
        consumed += [v[b * per:(b + 1) * per] for b in range(nb) for v in views]
    expect = ids_at(np.arange(state.consumed, end), state.num_samples, state.seed, state.shuffle)
    assert np.array_equal(np.concatenate(consumed), expect)


@settings(max_examples=examples(100))
@given(streams(), st.integers(1, 5))
def test_final_partial_batch_split_evenly(sd: tuple[DataState, int], epochs: int) -> None:
    state, dp = sd
    end = epochs * state.num_samples
    if end <= state.consumed:
        assert all(len(v) == 0 for v in _views(state, dp, num_epochs=epochs))
        return
    rem = (end - state.consumed) % state.global_batch
    lens = [len(rank_positions(state.consumed, end, state.global_batch, dp, r)) for r in range(dp)]
    full = (end - state.consumed) // state.global_batch * (state.global_batch // dp)
    assert [x - full for x in lens] == [len(a) for a in np.array_split(np.arange(rem), dp)]


@settings(max_examples=examples(50))
@given(st.integers(1, 200), st.integers(0, 5), st.integers(0, 4))
def test_epochs_are_permutations_and_no_shuffle_is_index_order(n: int, seed: int, epoch: int) -> None:
    assert np.array_equal(np.sort(sample_order(n, seed, epoch)), np.arange(n))
    pos = np.arange(epoch * n, (epoch + 2) * n)
    assert np.array_equal(ids_at(pos, n, seed, shuffle=False), pos % n)
    assert np.array_equal(ids_at(pos, n, seed)[:n], sample_order(n, seed, epoch))


def test_existing_api_unchanged() -> None:
    s = DataState(num_samples=10, global_batch=4, seed=1, consumed=8)
    ids = global_batch_ids(s)
    assert np.array_equal(ids, ids_at(np.arange(8, 12), 10, 1))
    assert np.array_equal(rank_batch_ids(s, 2, 1), ids[2:])
    assert DataState.from_json(s.to_json()) == s


def test_errors_say_how_to_fix() -> None:
    with pytest.raises(ValueError, match="not divisible by dp=3"):
        rank_positions(0, 10, 4, 3, 0)
    with pytest.raises(ValueError, match=r"dp_rank must be in \[0, 2\)"):
        rank_positions(0, 10, 4, 2, 2)
    with pytest.raises(ValueError, match="before the progress"):
        rank_positions(10, 4, 4, 2, 0)
    with pytest.raises(ValueError, match="not divisible"):
        rank_batch_ids(DataState(num_samples=10, global_batch=4), 3, 0)
    assert stream_end(10, 4, 25, num_epochs=2) == 25  # past the last epoch: nothing remains


def test_large_dataset_is_vectorised() -> None:
    s = DataState(num_samples=2_000_000, global_batch=1024, seed=3, consumed=123 * 1024)
    ids = remaining_ids(s, 8, 5)
    assert len(ids) == (stream_end(s.num_samples, 1024, s.consumed) - s.consumed) // 8
    pos = rank_positions(s.consumed, stream_end(s.num_samples, 1024, s.consumed), 1024, 8, 5)
    in_epoch = ids[pos < s.num_samples]  # the last batch may reach into the next epoch
    assert len(np.unique(in_epoch)) == len(in_epoch)


@pytest.mark.parametrize("field, value, match", [
    ("num_samples", 0, "no samples"), ("num_samples", 2.0, "must be an integer"), ("global_batch", True, "integer"),
    ("global_batch", 0, "global_batch must be >= 1"), ("consumed", -1, "consumed must be >= 0"),
    ("consumed", 1e300, "integer"), ("consumed", 1 << 70, "consumed must be <="), ("seed", "x", "integer"),
    ("seed", -1, "seed must be >= 0"), ("seed", 1 << 64, "seed must be <="), ("shuffle", "no", "true or false"),
    ("shuffle", 1, "true or false"), ("source", 5, "string"),
])
def test_data_state_rejects_wrong_types_and_ranges(field: str, value: object, match: str) -> None:
    kw: dict[str, object] = {"num_samples": 10, "global_batch": 4, field: value}
    with pytest.raises(DataStateError, match=match):
        DataState(**kw)  # type: ignore[arg-type]


def test_data_state_takes_numpy_integers_as_ints() -> None:
    s = DataState(num_samples=np.int64(10), global_batch=np.int32(4), seed=np.uint64(3), shuffle=np.bool_(True))
    assert type(s.num_samples) is int and type(s.seed) is int and s.shuffle is True
    assert DataState.from_json(json.loads(json.dumps(s.to_json()))) == s


def test_partition_arguments_are_type_checked() -> None:
    with pytest.raises(DataStateError, match="dp must be an integer"):
        rank_positions(0, 8, 4, 2.0, 0)  # type: ignore[arg-type]
    with pytest.raises(DataStateError, match="dp must be >= 1"):
        rank_positions(0, 8, 4, 0, 0)
    with pytest.raises(DataStateError, match="num_epochs must be an integer"):
        stream_end(10, 4, 0, num_epochs=1.5)  # type: ignore[arg-type]


# -- uneven splits: whole micro-batches over DP replicas (issue #20) ----------------------------
@settings(max_examples=examples(150))
@given(st.integers(1, 24), st.integers(1, 4), st.integers(1, 24), st.integers(0, 200), st.booleans())
def test_uneven_split_sees_every_sample_of_a_step_once(micro_batches: int, mb: int, dp: int, consumed: int,
                                                       shuffle: bool) -> None:
    """replica_samples with a micro-batch size: contiguous slices in replica order that rebuild the
    global batch (every sample exactly once, the same order as an even split), counts differing by at
    most one micro-batch, equal to the plain split whenever dp x micro-batch divides the batch, and
    the micro-batch counts ``tenplex.planning.layouts.batch_split`` plans with."""
    from tenplex.planning.layouts import batch_split

    g = micro_batches * mb
    state = DataState(num_samples=97, global_batch=g, seed=3, shuffle=shuffle, consumed=consumed)
    if dp > micro_batches:
        with pytest.raises(DataStateError, match="cannot each take a micro-batch"):
            replica_samples(g, dp, mb)
        return
    split = replica_samples(g, dp, mb)
    assert sum(split) == g and all(n % mb == 0 and n > 0 for n in split)
    assert max(split) - min(split) <= mb and list(split) == sorted(split, reverse=True)
    assert tuple(n // mb for n in split) == batch_split(g, mb, dp)
    if g % (dp * mb) == 0:
        assert split == replica_samples(g, dp)
    parts = [rank_batch_ids(state, dp, r, mb) for r in range(dp)]
    assert [len(p) for p in parts] == list(split)
    assert np.array_equal(np.concatenate(parts), global_batch_ids(state))
    # the views a mount shows: every whole batch split the same way, positions once each
    end = consumed + 3 * g
    pos = [rank_positions(consumed, end, g, dp, r, mb) for r in range(dp)]
    assert np.array_equal(np.sort(np.concatenate(pos)), np.arange(consumed, end))
    views = [remaining_ids(state, dp, r, end=end, micro_batch=mb) for r in range(dp)]
    offs = np.concatenate([[0], np.cumsum(split)])
    rebuilt = [views[r][b * split[r]:(b + 1) * split[r]] for b in range(3) for r in range(dp)]
    assert np.array_equal(np.concatenate(rebuilt), ids_at(np.arange(consumed, end), 97, 3, shuffle))
    assert offs[-1] == g


def test_uneven_split_refuses_a_partial_micro_batch() -> None:
    with pytest.raises(DataStateError, match="not a multiple of micro_batch 2"):
        replica_samples(9, 3, 2)
    with pytest.raises(DataStateError, match="not divisible by dp=3"):
        replica_samples(8, 3)
