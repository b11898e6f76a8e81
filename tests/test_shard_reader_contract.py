"""The ``ShardReader`` contract, run by every implementation against a real backend.

``tenplex.checkpoint.part_reader.ShardReader`` is what executes a read plan; three classes implement it
and share no tests: ``PartReader`` (local files through ``preadv``, any fsspec filesystem through
ranged reads, remote ones coalesced and in flight), ``TieredReader`` (a rank's part from the first
tier that has it; here a real ``tenplex store serve`` process read over HTTP) and ``RoundsReader``
(the tiered reader following a recovery schedule). In the style of fsspec's and DCP's contract
suites, one set of properties is asserted for each, on a checkpoint saved under one layout and read
under others:

* the bytes a plan reads are the saved tensors' bytes, bit for bit, for pieces cut anywhere in a
  chunk and for whole files up to their last byte; ``on_read`` reports every item once;
* an empty plan reads nothing (no callback, counters at zero);
* ``bytes_read`` counts at least the elements' bytes and at most the plan's (rounded out to checksum
  blocks; coalesced remote reads may add gaps of 0.5 % at most); ``ranges`` at least one per file
  touched and not more than one per item;
* a missing data file is a ``CheckpointError`` (which names the step's part), not a silent zero.

Backends: a local directory, a moto S3 server on 127.0.0.1 (``s3fs``), and a host store process
on 127.0.0.1 (one of each per module, a fresh checkpoint per test; stopped at the end).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from conftest import moto_s3
from spawned import free_port
from test_checkpoint import assert_shard_equal, random_bits, save_all

from tenplex.checkpoint import Binding, PartReader, ShardReader, list_steps, plan_reads
from tenplex.checkpoint.catalog import read_manifest_at
from tenplex.checkpoint.format import writer_assignment
from tenplex.checkpoint.read_plan import shard_buffers
from tenplex.errors import CheckpointError
from tenplex.layout.config import ParallelConfig
from tenplex.layout.models import model_ptc
from tenplex.store import HostStore, Tier, peer_storage_options
from tenplex.store.recovery import RoundsReader, TieredReader
from tenplex.store.tiers import find_usable
from tenplex.train.launch import StoreProcess

pytestmark = pytest.mark.timeout(120)

OLD = ParallelConfig(dp=2, tp=2)
#: pieces cut inside chunks (TP 2 -> 4), whole parts of several writers (one rank), stages (PP 2)
NEW = (ParallelConfig(tp=4), ParallelConfig(), ParallelConfig(tp=2, pp=2))
TOKEN = "contract-token"


def small_ptc():  # noqa: ANN201
    return model_ptc(arch="gpt", num_layers=2, hidden=64, heads=4, vocab=200, seq_len=16, dtype=torch.float32)


@dataclass
class Backend:
    """A saved checkpoint and how to build a fresh reader of it (the same for every read)."""

    name: str
    ptc: Any
    glob: dict[str, Any]
    fs: fsspec.AbstractFileSystem  # where the step's files are, for the test to inspect and remove
    sdir: str
    make: Callable[[], ShardReader]

    def binding(self) -> Binding:
        return Binding.of(read_manifest_at(self.fs, self.sdir), writer_assignment(self.ptc, OLD))

    def data_files(self) -> list[str]:
        return sorted(p for p in self.fs.ls(self.sdir, detail=False) if p.endswith(".safetensors"))


def _saved(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any], str]:
    ptc = small_ptc()
    glob = random_bits(ptc, 11)
    save_all(url, ptc, OLD, glob, step=1, **({"storage_options": storage_options} if storage_options else {}))
    return ptc, glob, list_steps(url, storage_options=storage_options)[-1].path


@pytest.fixture(scope="module")
def s3_server() -> Iterator[dict[str, Any]]:
    """One moto server for the module (each test writes under a prefix of its own)."""
    with moto_s3() as opts:
        yield opts


@pytest.fixture(scope="module")
def store_server(runtime: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """One ``tenplex store serve`` process for the module: (its root, its URL); each test snapshots
    a step of its own into it."""
    root, port = str(tmp_path_factory.mktemp("store") / "host0"), free_port()
    url = f"http://127.0.0.1:{port}"
    proc = StoreProcess(root, port, [url], token=TOKEN, keep_last=1000)
    try:
        yield root, url
    finally:
        proc.stop()


_steps = itertools.count(1)


def _store(root: str, url: str, rounds: bool) -> Backend:
    """The checkpoint snapshotted into the store at a fresh step and read back over HTTP as a peer
    tier (what a recovering host does)."""
    ptc = small_ptc()
    glob = random_bits(ptc, 11)
    host, step = HostStore(root, url, TOKEN), next(_steps)
    for r, shard in ptc.shard(glob, OLD).items():
        host.snapshot(ptc, OLD, r, shard, step=step, replicate=False)
    tiers = [Tier(f"peer:{url}", url, "peer", peer_storage_options(TOKEN))]
    (usable,) = [u for u in find_usable(tiers) if u.step == step]
    sdir = os.path.join(root, os.path.basename(usable.attempt.dirs[tiers[0].name].rstrip("/")))
    if rounds:  # no schedule: the reader says why and reads in plan order (its contract is the same)
        def make() -> ShardReader:
            return RoundsReader(tiers, usable.attempt, None, "no schedule", max_workers=4, barrier=False)
    else:
        def make() -> ShardReader:
            return TieredReader(tiers, usable.attempt)
    return Backend("rounds (store)" if rounds else "tiered (store)", ptc, glob, fsspec.filesystem("file"), sdir, make)


def _fresh(request: pytest.FixtureRequest, kind: str, tmp_path: Path) -> Backend:
    """A newly saved checkpoint in backend ``kind``."""
    if kind == "local":
        ptc, glob, sdir = _saved(str(tmp_path / "ck"))
        fs = fsspec.filesystem("file")
        return Backend("local files", ptc, glob, fs, sdir, lambda: PartReader(fs, sdir))
    if kind == "s3":
        opts = request.getfixturevalue("s3_server")
        ptc, glob, sdir = _saved(f"s3://ckpt/{tmp_path.name}", opts)
        fs = fsspec.filesystem("s3", **opts)
        return Backend("s3 (moto)", ptc, glob, fs, sdir, lambda: PartReader(fs, sdir))
    root, url = request.getfixturevalue("store_server")
    return _store(root, url, rounds=kind == "store-rounds")


_SHARED: dict[str, Backend] = {}


@pytest.fixture(params=["local", "s3", "store", "store-rounds"])
def backend(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Backend:
    """A checkpoint in each backend, saved once per module: the tests that only read share it."""
    kind = request.param
    if kind not in _SHARED:
        _SHARED[kind] = _fresh(request, kind, tmp_path_factory.mktemp(f"shared-{kind}"))
    return _SHARED[kind]


@pytest.fixture(params=["local", "s3", "store", "store-rounds"])
def own_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    """A checkpoint of this test's own in each backend (for a test that damages it)."""
    return _fresh(request, request.param, tmp_path)


def _read(b: Backend, new: ParallelConfig, rank: int, items: Any = None) -> tuple[dict, ShardReader, list[int], Any]:
    plan = plan_reads(b.ptc, OLD, new, rank) if items is None else items
    buffers = shard_buffers(b.ptc, new, rank)
    reader = b.make()
    reader.bind(b.binding())
    done: list[int] = []
    try:
        reader.read_items(plan, buffers, rank=rank, on_read=done.append)
    finally:
        reader.close()
    shard = {n: b.ptc.from_local_flat(n, new, buffers[n]) for n in b.ptc.rank_tensors(new, rank)}
    return shard, reader, done, plan


@pytest.mark.parametrize("new", NEW, ids=str)
def test_a_plan_reads_the_saved_bytes_bit_for_bit(backend: Backend, new: ParallelConfig) -> None:
    """Every new rank's plan fills its buffers with exactly the saved tensors' bytes (NaN payloads and
    -0.0 included: ``random_bits``), pieces cut inside chunks and whole files alike; every item is
    reported once; the counters hold the planned bytes and their checksum blocks, no more."""
    want = backend.ptc.shard(backend.glob, new)
    for r in range(new.world_size):
        shard, reader, done, plan = _read(backend, new, r)
        assert_shard_equal(shard, {n: t for n, t in want[r].items() if n in backend.ptc.tensors},
                           f"{backend.name} rank {r} under {new}")
        assert sorted(done) == list(range(len(plan))), (backend.name, r)
        needed = sum(item.length * item.itemsize for item in plan)  # the elements' own bytes
        planned = sum(item.nbytes for item in plan)  # rounded out to checksum blocks
        assert needed <= reader.bytes_read <= planned * 1.005, (backend.name, r, needed, planned, reader.bytes_read)
        files = {item.writer for item in plan}
        assert len(files) <= reader.ranges <= len(plan), (backend.name, r, reader.ranges, len(plan))


def test_one_rank_reads_every_file_to_its_end(backend: Backend) -> None:
    """Under one rank the plan covers every data file up to its last tensor byte: the whole
    checkpoint comes back, and bytes read equal the checkpoint's tensor bytes (nothing read twice)."""
    one = ParallelConfig()
    shard, reader, done, plan = _read(backend, one, 0)
    assert_shard_equal(shard, {n: t for n, t in backend.ptc.shard(backend.glob, one)[0].items()
                               if n in backend.ptc.tensors}, backend.name)
    assert {item.writer for item in plan} == set(range(OLD.world_size))
    assert reader.bytes_read == sum(item.nbytes for item in plan), backend.name


def test_an_empty_plan_reads_nothing(backend: Backend) -> None:
    _, reader, done, _ = _read(backend, NEW[0], 0, items=())
    assert done == [] and reader.bytes_read == 0 and reader.ranges == 0, backend.name


def test_a_missing_data_file_is_a_checkpoint_error(own_backend: Backend) -> None:
    """A plan that needs a removed data file fails with a ``CheckpointError``; the items of the
    other files it read before are the saved bytes (no partial garbage reported as read)."""
    b = own_backend
    b.fs.rm(b.data_files()[0])
    with pytest.raises(CheckpointError):
        _read(b, ParallelConfig(), 0)
