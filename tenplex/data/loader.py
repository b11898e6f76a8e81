"""Elastic data for torch loaders: a batch sampler, an iterable dataset and a loader whose state reshards.

The position in the data is one integer, the samples consumed globally (``DataState.consumed``): the
global batch of a step is the next ``global_batch`` positions of tenplex's order (seeded shuffle,
epochs: :mod:`tenplex.data.partition`), and DP rank ``i`` of ``dp`` reads its slice of it
(``replica_slice``: equal slices, or whole micro-batches as evenly as they go when ``dp`` does not
divide the batch). The state is the ``DataState`` as JSON, the same on every rank, so the state N
ranks saved loads into M ranks and the run continues with the next global batch: every position of
the run is consumed exactly once, in the order of an uninterrupted run. With ``order="feistel"`` (the
default here) an id at any position is computed without the epoch's permutation, so a restore at
10^9 samples costs one batch's ids.

- :class:`ElasticBatchSampler`: a ``batch_sampler`` for any map-style dataset (``__len__`` and
  ``__getitem__``): one batch per step, this rank's slice; its iterator is stateful, which is what
  torchdata's ``StatefulDataLoader`` snapshots (prefetched indices are not counted there).
- :class:`ElasticIterable`: the same stream as an ``IterableDataset``; worker ``w`` of ``W`` reads
  steps ``w, w + W, ...``, and its ``state_dict`` (per worker, taken at its batch boundaries by
  ``StatefulDataLoader``) records the next step it reads.
- :class:`ElasticLoader`: a ``torch.utils.data.DataLoader`` over either, with worker processes, whose
  position follows the batches the loop received (a prefetched batch is not counted as seen), and
  :meth:`ElasticLoader.batch_for` for a loop that reads its position from ``ElasticRuntime``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import select
import threading
from collections.abc import Callable, Iterator, Sized
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, Sampler, get_worker_info

from ..errors import DataStateError
from .partition import DataState, checked_int, ids_at, rank_positions, replica_slice, stream_end

#: Steps whose ids a sampler's iteration computes in one call, at most (see ``_Cursor._fill``) ...
AHEAD = 256
#: ... and ids (a rank's large batches: a fill stays a few milliseconds).
AHEAD_IDS = 1 << 14

__all__ = ["ElasticBatchSampler", "ElasticIterable", "ElasticLoader", "loader_state", "rank_step_ids"]

log = logging.getLogger(__name__)


def loader_state(source: Sized | int, global_batch: int, seed: int = 0, shuffle: bool = True) -> DataState:
    """The start of a run over ``source`` (a dataset, or its number of samples) in the "feistel" order."""
    n = source if isinstance(source, int) else len(source)
    return DataState(n, global_batch, seed=seed, shuffle=shuffle, order="feistel")


def _end(data: DataState, num_epochs: int | None) -> int:
    """Where an iteration starting at ``data.consumed`` ends (``stream_end``)."""
    return stream_end(data.num_samples, data.global_batch, data.consumed, num_epochs)


def _next_position(pos: int, global_batch: int, end: int) -> int:
    return min(pos + global_batch, end)


def _step_positions(data: DataState, pos: int, end: int, dp: tuple[int, int, int]) -> np.ndarray:
    """Global positions DP rank ``dp[1]`` of ``dp[0]`` (micro-batch ``dp[2]``) reads of the global batch
    at position ``pos`` (one cut short by ``end`` split as evenly as it goes, the first ranks taking one more)."""
    size, rank, micro = dp
    g = data.global_batch
    if pos + g <= end:
        first, count = replica_slice(g, size, rank, micro)
    else:
        q, r = divmod(end - pos, size)
        first, count = rank * q + min(rank, r), q + (rank < r)
    return np.arange(pos + first, pos + first + count, dtype=np.int64)


def rank_step_ids(data: DataState, pos: int, end: int, dp: tuple[int, int, int]) -> np.ndarray:
    """Sample ids DP rank ``dp[1]`` of ``dp[0]`` (micro-batch ``dp[2]``) reads of the global batch at
    position ``pos`` (one cut short by ``end`` is split as evenly as it goes, the first ranks taking one
    more). Pure, O(batch)."""
    return ids_at(_step_positions(data, pos, end, dp), data.num_samples, data.seed, data.shuffle, data.order)


def _loaded(current: DataState, sd: dict[str, Any]) -> DataState:
    """A saved position for a stream of ``current``'s dataset and global batch (the saved order and seed)."""
    if not isinstance(sd, dict) or "data" not in sd:
        raise DataStateError(f"not a tenplex loader state (no 'data' entry): {sd!r:.200}")
    saved = DataState.from_json(dict(sd["data"]))
    if saved.num_samples != current.num_samples:
        raise DataStateError(f"the state is of a dataset of {saved.num_samples} samples, this one has "
                             f"{current.num_samples}: load it into a loader over the same dataset")
    return dataclasses.replace(saved, global_batch=current.global_batch)


class _Cursor:
    """An iteration of an :class:`ElasticBatchSampler`: stateful (``StatefulDataLoader`` snapshots it).

    A batch costs a position compare, a slice and an int store (about a plain ``BatchSampler``'s cost: the
    main process of a loader with workers shares the cores with them); the sampler's ``DataState`` is
    made from that int only when read. A move of the sampler (``data`` set, ``load_state_dict``,
    ``reshard``) or a position other than the one computed next drops the ids computed ahead.

    Ids are computed in as few calls as go: the first batch's alone when the cursor is made (a restore
    pays one batch; a ``DataLoader`` makes its sampler's iterator before it starts its workers, so this
    runs before they share the cores and before the fork makes every page the main process then writes
    a copy-on-write fault), then ``AHEAD`` steps a call. With workers running on 2 cores a fill cost the
    main process 350-530 us whatever its size up to 4096 ids (40-125 us before they start): doubling
    from one step, as before, made 9 fills over the benchmark's 385-batch pass, 3.3 ms; now 2, 1.2 ms."""

    def __init__(self, sampler: ElasticBatchSampler) -> None:
        self.sampler = sampler
        self.end = _end(sampler.data, sampler.num_epochs)
        self._ids: list[int] = []  # the ids of the steps computed ahead, back to back ...
        self._cuts: list[int] = [0]  # ... step j's at [_cuts[j], _cuts[j + 1])
        self._step = 0  # the next step's j
        self._next = -1  # the next step's position
        self._moves = sampler.moves
        self._span = 1  # steps the next fill computes: 1 after a (re)start, then AHEAD (at most AHEAD_IDS ids)
        if sampler.position < self.end:
            self._fill(sampler.position)
            self._next = sampler.position

    def __iter__(self) -> _Cursor:
        return self

    def __next__(self) -> list[int]:
        s = self.sampler
        pos = s.position
        j = self._step
        if pos != self._next or s.moves != self._moves or j + 1 >= len(self._cuts):
            if pos >= self.end:
                raise StopIteration
            if j + 1 < len(self._cuts) or s.moves != self._moves:  # a jump (a restore, a reshard): the first
                self._span = 1  # batch comes first
            self._fill(pos)
            j = 0
        ids = self._ids[self._cuts[j] : self._cuts[j + 1]]  # made now, one list a batch (as BatchSampler)
        self._step = j + 1
        s.position = self._next = _next_position(pos, s.global_batch, self.end)
        if not ids:  # this rank's share of a final partial batch is empty
            raise StopIteration
        return ids

    def _fill(self, pos: int) -> None:
        """The ids of the next ``_span`` steps from ``pos`` in one ``ids_at`` call (the order's cost per
        call, not per id, dominates at loader batch sizes: 300 us a batch of 16 one at a time; a restore
        computes its first batch alone). A pure function of the position: handing them out later
        changes nothing."""
        s = self.sampler
        d = s.data
        g = d.global_batch
        stop = min(pos + self._span * g, self.end)
        size, rank, micro = s.layout
        ids = ids_at(rank_positions(pos, stop, g, size, rank, micro), d.num_samples, d.seed, d.shuffle,
                     d.order).tolist()
        full, tail = divmod(stop - pos, g)
        per = replica_slice(g, size, rank, micro)[1]  # a whole step's; a cut-short last one takes the rest
        self._ids, self._cuts, self._step = ids, list(range(0, full * per + 1, per)), 0
        if tail:
            self._cuts.append(len(ids))
        self._moves = s.moves
        self._span = min(AHEAD, max(1, AHEAD_IDS // per))

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sampler.load_state_dict(sd)
        self.end = _end(self.sampler.data, self.sampler.num_epochs)
        self._cuts, self._step = [0], 0


class ElasticBatchSampler(Sampler[list[int]]):
    """This DP rank's slice of every global batch of the order, from ``data.consumed`` on.

    ``DataLoader(dataset, batch_sampler=ElasticBatchSampler(loader_state(dataset, 64), dp, rank))``.
    An iteration runs to the end of the epoch it starts in (whole global batches, the last reaching
    into the next epoch as the trainer's do), or with ``num_epochs`` to ``num_epochs * num_samples``
    (the final partial batch split as evenly as it goes); the next iteration continues from there.
    ``data.consumed`` is the position after the batches handed out (to a loader that prefetches,
    ahead of the loop: :class:`ElasticLoader` and ``StatefulDataLoader`` track the loop's).
    """

    def __init__(self, data: DataState, dp_size: int = 1, dp_rank: int = 0, *, micro_batch: int | None = None,
                 num_epochs: int | None = None) -> None:
        super().__init__()
        self.moves = 0  # counts the sampler's moves (data set, reshard): an iteration's ids ahead are stale
        self.data, self.num_epochs = data, num_epochs
        self.micro_batch = micro_batch
        self.reshard(dp_size, dp_rank)

    @property
    def data(self) -> DataState:
        """The position after the batches handed out (``position`` as a ``DataState``, made when read)."""
        if self._data.consumed != self.position:
            self._data = self._data.at(self.position)
        return self._data

    @data.setter
    def data(self, value: DataState) -> None:
        self._data, self.position, self.global_batch = value, value.consumed, value.global_batch
        self.moves += 1

    def reshard(self, dp_size: int, dp_rank: int, data: DataState | None = None) -> None:
        """Read as rank ``dp_rank`` of ``dp_size`` from now on (from ``data``'s position when given)."""
        if data is not None:
            self.data = _loaded(self.data, {"data": data.to_json()})
        replica_slice(self.data.global_batch, dp_size, dp_rank, self.micro_batch or 1)  # checks the split
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.moves += 1

    @property
    def layout(self) -> tuple[int, int, int]:
        """(DP size, DP rank, micro-batch) of the split (micro-batch 1 unless given: any DP size)."""
        return self.dp_size, self.dp_rank, self.micro_batch or 1

    def __iter__(self) -> Iterator[list[int]]:
        return _Cursor(self)

    def __len__(self) -> int:
        """Batches left in this iteration for this rank."""
        pos, g = self.data.consumed, self.data.global_batch
        end = _end(self.data, self.num_epochs)
        steps = -(-(end - pos) // g)
        tail = (end - pos) % g
        return steps - (1 if tail and tail // self.dp_size == 0 and self.dp_rank >= tail else 0)

    def state_dict(self) -> dict[str, Any]:
        """The position (JSON): the same on every rank at a step boundary, whatever the DP size."""
        return {"data": self.data.to_json()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Continue from a saved position (saved under any DP size; this sampler's own split)."""
        self.data = _loaded(self.data, sd)


class ElasticIterable(IterableDataset):
    """The samples of an :class:`ElasticBatchSampler`'s batches, read from ``dataset`` as an iterable.

    Batch it by ``batch_size`` (this rank's share of a global batch): ``DataLoader(it, batch_size=
    it.batch_size, num_workers=W)``; worker ``w`` reads steps ``w, w + W, ...`` of the iteration, which
    the loader's round robin returns in step order. In a worker, ``state_dict`` is that worker's next
    step (``StatefulDataLoader`` keeps the one of its last batch the loop received).
    """

    def __init__(self, dataset: Any, sampler: ElasticBatchSampler, *, split_workers: bool = True) -> None:
        super().__init__()
        self.dataset, self.sampler, self.split_workers = dataset, sampler, split_workers
        self._cursor: dict[str, int] | None = None  # in an iteration: next, stride, end, taken, batch

    def set_epoch(self, epoch: int) -> None:
        """Accepted for a Hugging Face ``IterableDataset``'s interface (torchtitan calls it on a resume):
        the epoch is part of the position, which ``load_state_dict`` sets."""

    @property
    def batch_size(self) -> int:
        """Samples this rank reads of each whole global batch."""
        s = self.sampler
        return replica_slice(s.data.global_batch, *s.layout)[1]

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info() if self.split_workers else None
        w, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        s = self.sampler
        g = s.data.global_batch
        cur = self._cursor
        if cur is not None and (cur["stride"], cur["batch"]) != (workers, g):
            raise DataStateError(f"a worker's state of a loader with {cur['stride']} workers and global batch "
                                 f"{cur['batch']} loaded into one with {workers} and {g}: its steps would not line "
                                 "up; load the loop's position (ElasticLoader.state_dict) instead")
        if cur is None:
            cur = {"next": s.data.consumed + w * g, "stride": workers, "end": _end(s.data, s.num_epochs), "taken": 0,
                   "batch": g}
        self._cursor = cur
        while cur["next"] < cur["end"]:
            ids = rank_step_ids(s.data, cur["next"], cur["end"], s.layout).tolist()
            if not ids:  # this rank's share of a final partial batch is empty
                cur["next"] += cur["stride"] * g
            for j in range(cur["taken"], len(ids)):
                sample = self.dataset[ids[j]]
                # counted before it is yielded: at a batch boundary the state is the next step's start
                if j + 1 == len(ids):
                    cur["next"], cur["taken"] = cur["next"] + cur["stride"] * g, 0
                else:
                    cur["taken"] = j + 1
                yield sample
        self._cursor = None
        s.data = s.data.at(cur["end"])

    def state_dict(self) -> dict[str, Any]:
        """The position; inside an iteration also this worker's next step (``cursor``)."""
        sd: dict[str, Any] = self.sampler.state_dict()
        if self._cursor is not None:
            sd["cursor"] = dict(self._cursor)
            sd["dp"] = list(self.sampler.layout)
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sampler.load_state_dict(sd)
        cursor = sd.get("cursor")
        if cursor is None:
            self._cursor = None
            return
        cursor = {k: checked_int(f"cursor {k}", cursor[k], 0, 1 << 62)
                  for k in ("next", "stride", "end", "taken", "batch")}
        if cursor["taken"] and list(sd.get("dp", ())) != list(self.sampler.layout):
            raise DataStateError(f"the state is {cursor['taken']} samples into a step of DP layout {sd.get('dp')}: "
                                 f"it resumes only under that layout, not {list(self.sampler.layout)}")
        self._cursor = cursor


class ElasticLoader:
    """A ``DataLoader`` over an :class:`ElasticBatchSampler` (map-style ``dataset``) or an
    :class:`ElasticIterable` whose position is the batches the loop received.

    ``loader_kwargs`` go to ``DataLoader`` (``num_workers``, ``collate_fn``, ``pin_memory``,
    ``persistent_workers``: over a map-style dataset one DataLoader serves every iteration, reshard and
    load, so persistent workers start once).
    ``state_dict()`` is the position after the last batch ``__iter__`` returned: batches the workers
    prefetched are not in it. An iteration left early (``break``) resumes there on the next one.
    """

    def __init__(self, dataset: Any, sampler: ElasticBatchSampler | None = None, **loader_kwargs: Any) -> None:
        if isinstance(dataset, ElasticIterable):
            self.sampler = dataset.sampler
        elif sampler is None:
            raise DataStateError("a map-style dataset needs its ElasticBatchSampler: ElasticLoader(dataset, sampler)")
        else:
            self.sampler = sampler
        if loader_kwargs.get("num_workers"):  # the workers end with this process, however it ends
            loader_kwargs = {**loader_kwargs, "worker_init_fn": functools.partial(
                _die_with, os.getpid(), loader_kwargs.get("worker_init_fn"))}
        self.dataset, self.kwargs = dataset, loader_kwargs
        self.data = self.sampler.data  # the loop's position
        self._live: Iterator[Any] | None = None  # batch_for's iteration
        # map-style: one DataLoader for good (its workers get indices only, the sampler stays here), so
        # persistent_workers=True keeps the workers across epochs, loads and reshards
        self._map_loader = None if isinstance(dataset, ElasticIterable) else \
            DataLoader(dataset, batch_sampler=self.sampler, **loader_kwargs)

    def _loader(self) -> DataLoader:
        if self._map_loader is not None:
            return self._map_loader
        assert isinstance(self.dataset, ElasticIterable)
        self.dataset.load_state_dict(self.state_dict())  # from the loop's position, no worker cursor
        return DataLoader(self.dataset, batch_size=self.dataset.batch_size, **self.kwargs)

    def __iter__(self) -> Iterator[Any]:
        self.sampler.data = self.data
        end = _end(self.data, self.sampler.num_epochs)
        for batch in self._loader():
            self._pos = _next_position(self._pos, self._data.global_batch, end)
            yield batch
        self.data = self.data.at(end)

    @property
    def data(self) -> DataState:
        """The loop's position: after the last batch ``__iter__`` returned (a ``DataState`` made from the
        position when read, not one a batch: 1.3 us of the main process a batch)."""
        if self._data.consumed != self._pos:
            self._data = self._data.at(self._pos)
        return self._data

    @data.setter
    def data(self, value: DataState) -> None:
        self._data, self._pos = value, value.consumed

    def __len__(self) -> int:
        self.sampler.data = self.data
        return len(self.sampler)

    def state_dict(self) -> dict[str, Any]:
        """The loop's position (JSON-able, the same on every rank at a step boundary)."""
        return {"data": self.data.to_json()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Continue from a position saved under any DP size."""
        self.data = _loaded(self.data, sd)
        self._live = None

    def reshard(self, dp_size: int, dp_rank: int, data: DataState | None = None) -> None:
        """Read as rank ``dp_rank`` of ``dp_size`` from the next iteration on (from ``data`` when given)."""
        self.sampler.reshard(dp_size, dp_rank)
        if data is not None:
            self.load_state_dict({"data": data.to_json()})
        self._live = None

    def batch_for(self, data: DataState, dp_size: int, dp_rank: int) -> Any:
        """The batch of the step at ``data`` for rank ``dp_rank`` of ``dp_size`` (``ElasticRuntime``'s
        ``rt.data``, ``rt.dp_size``, ``rt.dp_rank``): the running iteration's next one, or after a
        recovery moved the position or the layout, the first of a new iteration from there."""
        if self._live is None or data.consumed != self.data.consumed or \
                (dp_size, dp_rank) != (self.sampler.dp_size, self.sampler.dp_rank):
            self.reshard(dp_size, dp_rank, data)
            self._live = iter(self)
        try:
            return next(self._live)
        except StopIteration:
            self._live = iter(self)  # the next epoch
            return next(self._live)


def _die_with(owner: int, user_init: Callable[[int], None] | None, worker_id: int) -> None:
    """A loader worker's ``worker_init_fn``: end the worker when process ``owner`` (the loader's) is gone.
    torch's own check compares the worker's parent pid with the one it started under, and a worker
    started from a forkserver (as one must be, not forked from a process holding the job's sockets)
    has the forkserver as its parent: a SIGKILLed trainer's workers lived on, each holding a copy of
    the dataset, until the machine stopped (tests/test_data_loader_runtime.py). Then the user's own."""
    try:
        fd = os.pidfd_open(owner)
    except ProcessLookupError:  # gone before this worker started
        os._exit(0)
    except (AttributeError, OSError):  # no pidfd (not Linux >= 5.3): torch's own check only
        fd = None
    if fd is not None:
        def watch() -> None:
            select.select([fd], [], [])  # readable once the owner has exited
            log.warning("loader worker %d: its loader's process %d is gone; exiting", worker_id, owner)
            os._exit(0)

        threading.Thread(target=watch, name="tenplex-loader-owner", daemon=True).start()
    if user_init is not None:
        user_init(worker_id)
