"""Checkpoints on fsspec URLs: resharding round trips, bytes read, atomic steps, corruption.

Every filesystem used here is either a fresh temporary directory or an in-memory store that
is emptied before and after each test, so tests do not see each other's checkpoints.
"""

from __future__ import annotations

import json
import os
import random
import re
import tempfile
import time
import uuid
import zlib
from collections import defaultdict
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.memory import MemoryFile, MemoryFileSystem
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tenplex import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ParallelConfig,
    model_ptc,
)
from tenplex.checkpoint.format import CRC_GROUP, CRC_TABLE, chunk_block, crc_concat, crc_spans
from tenplex.checkpoint import (
    list_steps,
    load,
    open_sealed_json,
    read_manifest,
    read_part_chunks,
    save,
    seal_json,
    writer_assignment,
)

KIB64 = 64 * 1024


# ---------------------------------------------------------------------------------------------
# filesystems
# ---------------------------------------------------------------------------------------------
class CountingMemFS(MemoryFileSystem):
    """An in-memory filesystem of its own (``countmem://``) that records every read.

    ``reads`` holds ``(path, start, end, nbytes)`` for each ``cat_file`` and each ``read`` on a
    file opened for reading, ``nbytes`` being the bytes actually returned.
    """

    protocol = "countmem"
    store: dict = {}
    pseudo_dirs = [""]
    reads: list[tuple[str, int | None, int | None, int]] = []

    @classmethod
    def _strip_protocol(cls, path):
        if isinstance(path, str):
            path = path.removeprefix("countmem://")
        return super()._strip_protocol(path)

    def cat_file(self, path, start=None, end=None, **kwargs):
        data = super().cat_file(path, start=start, end=end, **kwargs)
        type(self).reads.append((self._strip_protocol(path), start, end, len(data)))
        return data

    async def _cat_file(self, path, start=None, end=None, **kwargs):  # pragma: no cover - sync fs
        return self.cat_file(path, start=start, end=end, **kwargs)

    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode=mode, **kwargs)
        if mode != "rb":
            return f
        return _CountingFile(self._strip_protocol(path), f.getvalue())

    @classmethod
    def reset(cls) -> None:
        cls.store.clear()
        cls.pseudo_dirs[:] = [""]
        cls.reads.clear()


class _CountingFile(MemoryFile):
    def __init__(self, path, data):
        super().__init__(None, path, data)

    def read(self, n=-1):
        start = self.tell()
        data = super().read(n)
        CountingMemFS.reads.append((self.path, start, start + len(data), len(data)))
        return data


fsspec.register_implementation("countmem", CountingMemFS, clobber=True)


def _clear_memory() -> None:
    mem = fsspec.filesystem("memory")
    mem.store.clear()
    mem.pseudo_dirs[:] = [""]
    CountingMemFS.reset()


@pytest.fixture(autouse=True)
def clean_memory_filesystems():
    _clear_memory()
    yield
    _clear_memory()


@pytest.fixture(params=["local", "memory"])
def url(request, tmp_path):
    """A checkpoint URL on a local directory (given as file:// URL) or in memory."""
    if request.param == "local":
        return f"file://{tmp_path}/ckpt"
    return f"memory://ckpt-{uuid.uuid4().hex[:8]}"


def _fs_root(url: str):
    return fsspec.core.url_to_fs(url)


def _read_bytes(url: str, rel: str) -> bytes:
    fs, root = _fs_root(url)
    return fs.cat_file(_resolve(fs, root, rel))


def _write_bytes(url: str, rel: str, data: bytes) -> None:
    fs, root = _fs_root(url)
    fs.pipe_file(_resolve(fs, root, rel), data)


def _rm(url: str, rel: str) -> None:
    fs, root = _fs_root(url)
    fs.rm(_resolve(fs, root, rel))


def _step(step: int) -> str:
    """Glob of a step's save-attempt directories (``step-<12 digits>-<save id>``)."""
    return f"step-{step:012d}-*"


def _sdir(fs, root: str, step: int) -> str:
    """The single save-attempt directory of ``step`` under ``root``."""
    found = fs.glob(f"{root}/{_step(step)}")
    assert len(found) == 1, found
    return found[0].rstrip("/")


def _resolve(fs, root: str, rel: str) -> str:
    head, _, tail = rel.partition("/")
    step = int(head.split("-")[1])
    return f"{_sdir(fs, root, step)}/{tail}"


# ---------------------------------------------------------------------------------------------
# models, data, comparisons
# ---------------------------------------------------------------------------------------------
def random_bits(ptc, seed: int, step_value: int = 0) -> dict:
    """Global state whose tensors hold arbitrary bit patterns (NaN payloads, infinities, -0.0),
    so that any value conversion on the way would show up as a byte difference."""
    g = torch.Generator().manual_seed(seed)
    out: dict = {}
    for name, spec in ptc.tensors.items():
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[spec.itemsize]
        info = torch.iinfo(bits)
        raw = torch.randint(info.min, info.max, spec.shape, generator=g, dtype=torch.int64).to(bits)
        out[name] = raw.view(spec.dtype)
    for obj in ptc.objects:
        out[obj] = step_value
    return out


def bits_of(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_shard_equal(got: dict, want: dict, where: str = "") -> None:
    assert set(got) == set(want), f"{where}: keys differ: {sorted(set(got) ^ set(want))}"
    for name, w in want.items():
        g = got[name]
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor), f"{where}: {name} is {type(g)}"
            assert g.dtype == w.dtype, f"{where}: {name} dtype {g.dtype} != {w.dtype}"
            assert tuple(g.shape) == tuple(w.shape), f"{where}: {name} shape {tuple(g.shape)} != {tuple(w.shape)}"
            assert bits_of(g) == bits_of(w), f"{where}: {name} differs"
        else:
            assert g == w, f"{where}: object {name}: {g!r} != {w!r}"


def save_all(url, ptc, cfg, glob, *, step, extra=None, ranks=None, keep_last=None, **kw):
    shards = ptc.shard(glob, cfg)
    results = {}
    for r in ranks if ranks is not None else range(cfg.world_size):
        results[r] = save(url, ptc, cfg, r, shards[r], step=step, extra=extra, keep_last=keep_last, **kw)
    return shards, results


def tiny_ptc(**kw):
    args = dict(arch="llama", num_layers=4, hidden=16, heads=8, kv_heads=4, ffn_hidden=16, vocab=37,
                vocab_pad=2, seq_len=8, dtype=torch.float32)
    args.update(kw)
    return model_ptc(**args)


def data_file_sizes(url: str, step: int) -> dict[int, int]:
    """Bytes of tensor data (header and CRC table excluded) in every rank's safetensors file."""
    fs, root = _fs_root(url)
    out = {}
    for path in fs.ls(_sdir(fs, root, step), detail=False):
        m = re.search(r"rank-(\d{5})\.safetensors$", path)
        if m:
            raw = fs.cat_file(path)
            header_len = int.from_bytes(raw[:8], "little")
            entry = json.loads(raw[8 : 8 + header_len]).get(CRC_TABLE)
            out[int(m.group(1))] = (entry["data_offsets"][0] if entry else len(raw) - 8 - header_len)
    return out


# ---------------------------------------------------------------------------------------------
# 1. round trips A -> B
# ---------------------------------------------------------------------------------------------
@st.composite
def model_and_layouts(draw):
    arch = draw(st.sampled_from(["gpt", "llama"]))
    heads = draw(st.sampled_from([2, 4]))
    kv_heads = heads if arch == "gpt" else draw(st.sampled_from([k for k in (1, 2, 4) if heads % k == 0]))
    head_dim = draw(st.sampled_from([2, 4]))
    ffn = draw(st.sampled_from([4, 8, 12]))
    num_layers = draw(st.integers(1, 4))
    kwargs = dict(
        arch=arch, num_layers=num_layers, hidden=heads * head_dim, heads=heads, kv_heads=kv_heads,
        ffn_hidden=ffn, vocab=draw(st.integers(3, 40)), vocab_pad=draw(st.integers(1, 4)), seq_len=8,
        tied_embeddings=draw(st.booleans()), dtype=draw(st.sampled_from([torch.float32, torch.bfloat16])),
        distributed_optimizer=draw(st.booleans()),
    )
    ptc = model_ptc(**kwargs)
    tps = [t for t in (1, 2, 4) if heads % t == 0 and kv_heads % t == 0 and ffn % t == 0]

    def layout():
        tp = draw(st.sampled_from(tps))
        pp = draw(st.integers(1, min(num_layers, 8 // tp, 3)))
        dp = draw(st.integers(1, max(1, 8 // (tp * pp))))
        stages = None
        if pp > 1 and draw(st.booleans()):
            cuts = sorted(draw(st.lists(st.integers(0, num_layers), min_size=pp - 1, max_size=pp - 1)))
            bounds = [0, *cuts, num_layers]
            stages = tuple(b - a for a, b in zip(bounds, bounds[1:]))
        return ParallelConfig(dp=dp, tp=tp, pp=pp, stages=stages)

    return kwargs, ptc, layout(), layout(), draw(st.integers(0, 2**31 - 1))


def _round_trip(url, ptc, a, b, seed):
    glob = random_bits(ptc, seed, step_value=seed % 1000)
    extra = {"seed": seed, "layout": str(a), "rng": torch.arange(3), "nested": [1, (2, "x")]}
    shards_a, results = save_all(url, ptc, a, glob, step=seed % 50, extra=extra)
    assert sum(r.chunks for r in results.values()) > 0
    want = ptc.shard(glob, b)
    for r in range(b.world_size):
        res = load(url, b, r, ptc=ptc)
        assert res.step == seed % 50
        assert res.saved_layout == a
        assert res.ptc.fingerprint() == ptc.fingerprint()
        assert_shard_equal(res.shard, want[r], f"{a} -> {b} rank {r}")
        assert res.shard["optimizer.step"] == seed % 1000
        assert res.extra["seed"] == seed and res.extra["layout"] == str(a)
        assert res.extra["nested"] == [1, (2, "x")]
        assert torch.equal(res.extra["rng"], torch.arange(3))
        assert res.stats.bytes_needed == ptc.rank_nbytes(b, r)
        assert res.stats.bytes_read >= res.stats.bytes_needed
    # and back again: the loaded B shards unshard to the original global tensors
    back = ptc.unshard({r: load(url, b, r).shard for r in range(b.world_size)}, b)
    for name in ptc.tensors:
        assert bits_of(back[name]) == bits_of(glob[name]), name


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_and_layouts())
def test_round_trip_local(case):
    _, ptc, a, b, seed = case
    with tempfile.TemporaryDirectory() as d:
        _round_trip(os.path.join(d, "ckpt"), ptc, a, b, seed)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_and_layouts())
def test_round_trip_memory(case):
    _, ptc, a, b, seed = case
    try:
        _round_trip(f"memory://rt-{uuid.uuid4().hex[:8]}", ptc, a, b, seed)
    finally:
        _clear_memory()


@pytest.mark.parametrize(
    "a,b",
    [
        (ParallelConfig(tp=2), ParallelConfig(tp=4)),
        (ParallelConfig(dp=2, tp=4, pp=2), ParallelConfig(dp=1, tp=1, pp=1)),
        (ParallelConfig(pp=3, stages=(1, 0, 3)), ParallelConfig(dp=2, pp=2, stages=(3, 1))),
        (ParallelConfig(dp=4), ParallelConfig(dp=3, tp=2)),
    ],
    ids=str,
)
@pytest.mark.parametrize("dist", [False, True], ids=["adam", "distopt"])
def test_round_trip_fixed_layouts(url, a, b, dist):
    """Scale up, down, uneven stages (with an empty stage) and DP changes, bf16 with fp32 master."""
    ptc = tiny_ptc(dtype=torch.bfloat16, distributed_optimizer=dist, tied_embeddings=True)
    _round_trip(url, ptc, a, b, seed=1234)


def test_rank_with_no_tensors_round_trips(url):
    """A middle stage without layers holds nothing; it still saves a (empty) part and loads objects."""
    ptc = tiny_ptc()
    cfg = ParallelConfig(pp=3, stages=(2, 0, 2))
    glob = random_bits(ptc, 5, step_value=9)
    assert ptc.rank_tensors(cfg, 1) == []
    _, results = save_all(url, ptc, cfg, glob, step=3)
    assert results[1].chunks == 0
    res = load(url, cfg, 1)
    assert res.shard == {"optimizer.step": 9}
    assert res.stats.bytes_read == res.stats.bytes_needed == 0
    assert_shard_equal(load(url, cfg, 2).shard, ptc.shard(glob, cfg)[2])


def test_save_accepts_other_dtype_and_device_layout_of_shard(url):
    """Shards are converted to the PTC dtype; a non-contiguous shard is saved by value."""
    ptc = tiny_ptc(num_layers=1)
    cfg = ParallelConfig(tp=2)
    glob = random_bits(ptc, 2)
    glob = {k: (v.nan_to_num(0.0, 0.0, 0.0) if isinstance(v, torch.Tensor) else v) for k, v in glob.items()}
    shards = ptc.shard(glob, cfg)
    for r in range(2):
        shard = dict(shards[r])
        w = shard["layers.0.attn.proj.weight"]  # (16, 8)
        shard["layers.0.attn.proj.weight"] = w.t().contiguous().t()  # same values, transposed strides
        assert not shard["layers.0.attn.proj.weight"].is_contiguous()
        shard["final_norm.weight"] = shard["final_norm.weight"].double()
        save(url, ptc, cfg, r, shard, step=1)
    for r in range(2):
        got = load(url, cfg, r).shard
        assert got["final_norm.weight"].dtype == torch.float32
        assert_shard_equal(got, shards[r])


# ---------------------------------------------------------------------------------------------
# 2. bytes read
# ---------------------------------------------------------------------------------------------
def medium_ptc(**kw):
    args = dict(arch="gpt", num_layers=4, hidden=256, heads=4, vocab=1000, seq_len=64, dtype=torch.float32)
    args.update(kw)
    return model_ptc(**args)


def crc_table_start(path: str) -> int:
    """Where the CRC table (``CRC_TABLE``, format version 4) of in-memory data file ``path`` begins
    (its size when it has none): read from the stored bytes, uncounted."""
    raw = CountingMemFS.store[path].getvalue()
    n = int.from_bytes(raw[:8], "little")
    entry = json.loads(raw[8 : 8 + n]).get(CRC_TABLE)
    return 8 + n + entry["data_offsets"][0] if entry else len(raw)


def data_reads(since: int = 0):
    """The reads of tensor bytes (of data files, before their CRC tables) since ``since``."""
    return [r for r in CountingMemFS.reads[since:] if r[0].endswith(".safetensors") and r[1] < crc_table_start(r[0])]


def _check_load_reads(url, ptc, cfg, glob, ratios: list[float]):
    fs, root = _fs_root(url)
    step = list_steps(url)[-1].step
    sdir = _sdir(fs, root, step)
    sizes = {p: fs.size(p) for p in fs.ls(sdir, detail=False) if p.endswith(".safetensors")}
    want = ptc.shard(glob, cfg)
    for r in range(cfg.world_size):
        mark = len(CountingMemFS.reads)
        res = load(url, cfg, r)
        assert_shard_equal(res.shard, want[r], f"rank {r}")
        st_ = res.stats
        reads = data_reads(mark)
        # (a) the filesystem saw exactly the data bytes the loader reports
        assert sum(n for *_, n in reads) == st_.bytes_read
        assert len(reads) == st_.ranges
        # (b) nothing missing, at most two partial checksum blocks of overhead per range
        assert st_.bytes_needed == ptc.rank_nbytes(cfg, r)
        assert st_.bytes_needed <= st_.bytes_read <= st_.bytes_needed + st_.ranges * 2 * KIB64
        ratios.append(st_.bytes_read / st_.bytes_needed)
        # (d) every read is a byte range of one chunk, never a whole file, and in total this
        # rank reads less of each file than the file holds
        per_file = defaultdict(int)
        for path, start, end, n in reads:
            assert start is not None and end is not None, f"unranged read of {path}"
            assert n == end - start < sizes[path], f"read {n} bytes of {path} ({sizes[path]} bytes)"
            per_file[path] += n
        for path, n in per_file.items():
            assert n < sizes[path], f"rank {r} read {n} of {sizes[path]} bytes of {path}"
        # metadata is accounted separately and is small next to the data
        data = set(data_reads(mark))
        meta = sum(n for r in CountingMemFS.reads[mark:] if r not in data for n in r[3:])
        assert meta >= st_.metadata_bytes > 0


def test_bytes_read_tp2_to_tp4_medium_model():
    ptc = medium_ptc()
    assert len(ptc) > 100 and ptc.nbytes > 30 * 2**20
    url = "countmem://medium"
    glob = random_bits(ptc, 11)
    a, b = ParallelConfig(tp=2), ParallelConfig(tp=4)
    save_all(url, ptc, a, glob, step=1)
    CountingMemFS.reads.clear()
    ratios: list[float] = []
    _check_load_reads(url, ptc, b, glob, ratios)
    # (c) a TP 2 -> 4 load reads less than 10% more than it needs
    assert len(ratios) == 4 and max(ratios) < 1.1, ratios


def test_bytes_read_pp_only_touches_needed_files():
    """Under PP, a new stage reads only the files of old ranks holding its layers."""
    ptc = tiny_ptc(hidden=64, ffn_hidden=128, tied_embeddings=False)
    url = "countmem://pp"
    glob = random_bits(ptc, 3)
    save_all(url, ptc, ParallelConfig(pp=2), glob, step=7)
    CountingMemFS.reads.clear()
    new = ParallelConfig(pp=4)
    res = load(url, new, 0)  # embedding + layer 0: all on old stage 0 = old rank 0
    touched = {p.rsplit("/", 1)[-1] for p, *_ in data_reads()}
    assert touched == {"rank-00000.safetensors"}
    assert_shard_equal(res.shard, ptc.shard(glob, new)[0])
    CountingMemFS.reads.clear()
    res = load(url, new, 3)  # layer 3, final norm, lm head: all on old rank 1
    assert {p.rsplit("/", 1)[-1] for p, *_ in data_reads()} == {"rank-00001.safetensors"}
    assert res.stats.bytes_read <= res.stats.bytes_needed + res.stats.ranges * 2 * KIB64
    ratios: list[float] = []
    _check_load_reads(url, ptc, ParallelConfig(tp=2, pp=2, stages=(1, 3)), glob, ratios)


def test_dp_replicas_written_once_and_balanced():
    """(e) dp=4 replicas: every byte written once, spread evenly; loads still read ~ what they need."""
    ptc = medium_ptc()
    url = "countmem://dp"
    glob = random_bits(ptc, 4)
    cfg = ParallelConfig(dp=4)
    _, results = save_all(url, ptc, cfg, glob, step=2)
    sizes = data_file_sizes(url, 2)
    assert sorted(sizes) == [0, 1, 2, 3]
    assert sum(sizes.values()) == ptc.nbytes  # not 4x: each replicated interval written once
    per_rank = np.array([sizes[r] for r in range(4)], dtype=float)
    assert per_rank.max() / per_rank.mean() < 1.5, per_rank
    assert all(res.chunks > 0 for res in results.values())
    # files are the data plus a header; bytes_written counts at least the file
    fs, root = _fs_root(url)
    for r, res in results.items():
        assert res.bytes_written >= fs.size(f"{_sdir(fs, root, 2)}/rank-{r:05d}.safetensors") > sizes[r]
    # the writer assignment covers every byte once and matches what was written
    assignment = writer_assignment(ptc, cfg)
    for r in range(4):
        nbytes = sum(ln * ptc.tensors[name].itemsize for name, _, _, ln in assignment[r])
        assert nbytes == sizes[r]
    CountingMemFS.reads.clear()
    ratios: list[float] = []
    _check_load_reads(url, ptc, ParallelConfig(tp=2), glob, ratios)
    assert max(ratios) < 1.1, ratios


def test_tied_and_dp_sharded_state_written_once():
    """Tied embeddings on first and last stage and distributed-optimizer fragments: no byte twice."""
    ptc = tiny_ptc(arch="gpt", hidden=32, heads=4, kv_heads=None, ffn_hidden=None, tied_embeddings=True,
                   dtype=torch.bfloat16, distributed_optimizer=True)
    url = "countmem://tied"
    cfg = ParallelConfig(dp=3, tp=2, pp=2)
    glob = random_bits(ptc, 8)
    save_all(url, ptc, cfg, glob, step=0)
    sizes = data_file_sizes(url, 0)
    assert len(sizes) == cfg.world_size
    assert sum(sizes.values()) == ptc.nbytes
    ratios: list[float] = []
    _check_load_reads(url, ptc, ParallelConfig(dp=2, tp=4), glob, ratios)


def test_local_load_reads_partial_ranges(tmp_path):
    """On local files the loader reads mmap slices; its own count still stays near what it needs."""
    ptc = medium_ptc(num_layers=2)
    url = str(tmp_path / "ckpt")
    glob = random_bits(ptc, 6)
    save_all(url, ptc, ParallelConfig(tp=2), glob, step=1)
    file_bytes = sum(data_file_sizes(url, 1).values())
    b = ParallelConfig(tp=4)
    for r in range(4):
        res = load(url, b, r)
        assert_shard_equal(res.shard, ptc.shard(glob, b)[r])
        s = res.stats
        assert s.bytes_needed <= s.bytes_read <= s.bytes_needed + s.ranges * 2 * KIB64
        assert s.bytes_read / s.bytes_needed < 1.1
        assert s.bytes_read < 0.3 * file_bytes


# ---------------------------------------------------------------------------------------------
# 3. atomicity and steps
# ---------------------------------------------------------------------------------------------
CFG2 = ParallelConfig(tp=2, pp=2)


def test_latest_complete_step_and_interrupted_save(url):
    ptc = tiny_ptc()
    g = {s: random_bits(ptc, s, step_value=s) for s in (1, 2, 3)}
    save_all(url, ptc, CFG2, g[1], step=1, extra="one")
    save_all(url, ptc, CFG2, g[2], step=2, extra="two")
    # step 3: rank 2 dies before saving
    save_all(url, ptc, CFG2, g[3], step=3, extra="three", ranks=[0, 1, 3])
    infos = list_steps(url)
    assert [(i.step, i.complete, i.ranks_done) for i in infos] == [(1, True, 4), (2, True, 4), (3, False, 3)]
    assert all(i.layout == CFG2 and i.world_size == 4 for i in infos)
    fs, root = _fs_root(url)
    for i in infos:
        files = [p for p in fs.ls(_sdir(fs, root, i.step), detail=False) if p.endswith(".safetensors")]
        assert i.nbytes == sum(fs.size(p) for p in files) > 0
    res = load(url, CFG2, 0)
    assert res.step == 2 and res.extra == "two" and res.shard["optimizer.step"] == 2
    assert_shard_equal(res.shard, ptc.shard(g[2], CFG2)[0])
    with pytest.raises(CheckpointNotFoundError, match=r"step 3 .* is incomplete"):
        load(url, CFG2, 0, step=3)
    with pytest.raises(CheckpointNotFoundError, match=r"step 99 .* does not exist"):
        load(url, CFG2, 0, step=99)
    with pytest.raises(CheckpointNotFoundError):
        read_manifest(url, step=3)
    # explicit older step still loads
    res1 = load(url, ParallelConfig(dp=2), 1, step=1)
    assert res1.step == 1 and res1.extra == "one"
    assert_shard_equal(res1.shard, ptc.shard(g[1], ParallelConfig(dp=2))[1])
    assert read_manifest(url)["step"] == 2
    # the missing rank finishes: step 3 becomes the latest
    save(url, ptc, CFG2, 2, ptc.shard(g[3], CFG2)[2], step=3, extra="three")
    assert list_steps(url)[-1].complete
    assert load(url, CFG2, 0).step == 3


def test_load_reads_the_manifests_of_the_step_it_loads_only(url, monkeypatch):
    """A load verifies the manifests of the newest step first and of older steps only when every newer
    attempt fails, not every kept step's: with 5 complete steps kept under an incomplete newer one, a load
    reads the manifests of those two steps, not of all 6 (each costs 25-100 ms: 1.3 s of a 100-tensor
    load with 50 kept; #29 item 3)."""
    import tenplex.checkpoint.catalog as reader_mod

    ptc = tiny_ptc()
    g = {s: random_bits(ptc, s, step_value=s) for s in range(1, 6)}
    for s in g:
        save_all(url, ptc, CFG2, g[s], step=s, extra=s)
    save_all(url, ptc, CFG2, random_bits(ptc, 9), step=6, ranks=[0, 1, 3])  # incomplete newest
    read: list[int] = []
    real = reader_mod.read_manifest_at

    def counting(fs, sdir, **kw):
        read.append(int(re.search(r"step-(\d+)", sdir).group(1)))
        return real(fs, sdir, **kw)

    monkeypatch.setattr(reader_mod, "read_manifest_at", counting)
    res = load(url, CFG2, 0)
    assert res.step == 5 and res.extra == 5 and sorted(read) == [5, 6]
    assert_shard_equal(res.shard, ptc.shard(g[5], CFG2)[0])
    read.clear()
    res = load(url, ParallelConfig(dp=2), 1, step=2)
    assert res.step == 2 and read == [2]
    assert_shard_equal(res.shard, ptc.shard(g[2], ParallelConfig(dp=2))[1])
    read.clear()
    assert read_manifest(url)["step"] == 5 and sorted(read) == [5, 6]
    assert [i.step for i in list_steps(url)] == [1, 2, 3, 4, 5, 6]  # listing still scans every attempt


def test_deleted_rank_index_makes_step_incomplete(url):
    ptc = tiny_ptc()
    save_all(url, ptc, CFG2, random_bits(ptc, 1, 1), step=10)
    save_all(url, ptc, CFG2, random_bits(ptc, 2, 2), step=20)
    _rm(url, f"{_step(20)}/rank-00003.json")
    infos = {i.step: i for i in list_steps(url)}
    assert infos[10].complete and not infos[20].complete and infos[20].ranks_done == 3
    assert load(url, CFG2, 3).step == 10
    with pytest.raises(CheckpointNotFoundError, match="incomplete"):
        load(url, CFG2, 3, step=20)


def test_missing_manifest_or_objects_makes_step_incomplete(url):
    ptc = tiny_ptc()
    cfg = ParallelConfig(tp=2)
    save_all(url, ptc, cfg, random_bits(ptc, 1, 1), step=1)
    save_all(url, ptc, cfg, random_bits(ptc, 2, 2), step=2)
    save_all(url, ptc, cfg, random_bits(ptc, 3, 3), step=3)
    _rm(url, f"{_step(3)}/manifest.json")
    _rm(url, f"{_step(2)}/objects.pt")
    infos = list_steps(url)
    assert [i.complete for i in infos] == [True, False, False]
    assert infos[2].layout is None and infos[2].world_size is None
    res = load(url, cfg, 1)
    assert res.step == 1 and res.shard["optimizer.step"] == 1


def test_incomplete_newer_step_never_shadows_previous(url):
    """While the ranks of step 2 save one by one, load() keeps returning step 1."""
    ptc = tiny_ptc()
    cfg = ParallelConfig(dp=2, tp=2)
    g1, g2 = random_bits(ptc, 1, 1), random_bits(ptc, 2, 2)
    save_all(url, ptc, cfg, g1, step=1)
    shards2 = ptc.shard(g2, cfg)
    for i, r in enumerate([3, 0, 2, 1]):  # rank 0 (manifest) neither first nor last
        assert load(url, cfg, 0).step == 1
        assert list_steps(url)[-1].step == (1 if i == 0 else 2)
        save(url, ptc, cfg, r, shards2[r], step=2)
    res = load(url, cfg, 0)
    assert res.step == 2
    assert_shard_equal(res.shard, shards2[0])


def test_no_checkpoint_at_url(url):
    with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint"):
        load(url, ParallelConfig(), 0)
    assert list_steps(url) == []
    with pytest.raises(CheckpointNotFoundError):
        read_manifest(url)


def test_only_incomplete_steps_raise_not_found(url):
    ptc = tiny_ptc()
    save_all(url, ptc, CFG2, random_bits(ptc, 1), step=5, ranks=[0, 1, 2])
    with pytest.raises(CheckpointNotFoundError, match="1 incomplete"):
        load(url, CFG2, 0)


def test_keep_last_leaves_newest_steps(url):
    ptc = tiny_ptc(num_layers=2)
    cfg = ParallelConfig(tp=2)
    for step in (100, 200, 300, 400):
        # rank 0 saves last, so it prunes once the step is complete
        save_all(url, ptc, cfg, random_bits(ptc, step, step), step=step, keep_last=2, ranks=[1, 0])
    infos = list_steps(url)
    assert [(i.step, i.complete) for i in infos] == [(300, True), (400, True)]
    res = load(url, cfg, 1)
    assert res.step == 400 and res.shard["optimizer.step"] == 400
    assert load(url, cfg, 0, step=300).shard["optimizer.step"] == 300
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        load(url, cfg, 0, step=200)


def test_keep_last_never_removes_the_last_good_step_during_a_save(url):
    """When rank 0 saves first, the new step is not complete yet, so rank 0 keeps the K newest
    complete steps besides it: a crash during the save still leaves K good steps."""
    ptc = tiny_ptc(num_layers=2)
    cfg = ParallelConfig(tp=2)
    for step in (1, 2, 3, 4):
        save_all(url, ptc, cfg, random_bits(ptc, step, step), step=step, keep_last=2, ranks=[0, 1])
    infos = list_steps(url)
    assert all(i.complete for i in infos)
    assert {3, 4} <= {i.step for i in infos} <= {2, 3, 4}  # at most one extra step while rank 0 prunes
    # a save of step 5 whose rank 1 never finishes: the two newest good steps must survive
    save_all(url, ptc, cfg, random_bits(ptc, 5, 5), step=5, keep_last=2, ranks=[0])
    infos = {i.step: i.complete for i in list_steps(url)}
    assert infos[3] and infos[4] and not infos[5] and 1 not in infos and 2 not in infos
    res = load(url, cfg, 0)
    assert res.step == 4 and res.shard["optimizer.step"] == 4
    assert load(url, cfg, 1, step=3).shard["optimizer.step"] == 3
    # keep_last=1 with a complete step
    save_all(url, ptc, cfg, random_bits(ptc, 6, 6), step=6, keep_last=1, ranks=[1, 0])
    assert [i.step for i in list_steps(url)] == [6]


def test_keep_last_never_removes_a_save_under_way_after_a_rollback(tmp_path):
    """Issue 29 item 6, the class: after a rollback to step 20 a job saves step 30 while steps
    40-60 of the earlier run are complete. Rank 0's part lands first and its prune (keep_last 2)
    removed the attempt of step 30 as older than the kept ones while rank 1 still wrote into
    it: rank 1's publish found its temporary file gone."""
    from tenplex.checkpoint.format import step_dir
    from tenplex.checkpoint.writer import PartWriter

    url = str(tmp_path / "ckpt")
    ptc = tiny_ptc(num_layers=2)
    cfg = ParallelConfig(tp=2)
    for step in (40, 50, 60):
        save_all(url, ptc, cfg, random_bits(ptc, step, step), step=step, keep_last=3, save_id="0000aaaa")
    glob = random_bits(ptc, 30, 30)
    shards = ptc.shard(glob, cfg)
    part = PartWriter(fsspec.filesystem("file"), step_dir(url, 30, "0000bbbb"), ptc, cfg, 1, step=30,
                      save_id="0000bbbb")
    part.begin()
    part.stream({n: ptc.to_local_flat(n, shards[1][n], cfg, 1) for n in ptc.rank_tensors(cfg, 1)})
    time.sleep(0.01)  # a later manifest than the kept steps'
    save(url, ptc, cfg, 0, shards[0], step=30, keep_last=2, save_id="0000bbbb")  # rank 0's prune: 40 goes
    part.publish()  # before: FileNotFoundError, the attempt removed under it
    assert_shard_equal(load(url, cfg, 1, step=30).shard, shards[1], "rank 1")
    assert [i.step for i in list_steps(url)] == [30, 50, 60]


def test_bad_keep_last_and_step(url):
    ptc = tiny_ptc(num_layers=1)
    cfg = ParallelConfig()
    shard = ptc.shard(random_bits(ptc, 0), cfg)[0]
    with pytest.raises(ValueError, match="keep_last"):
        save(url, ptc, cfg, 0, shard, step=1, keep_last=0)
    # rejected before anything is written
    assert list_steps(url) == []
    for bad in (-1, 1.5, "3"):
        with pytest.raises(ValueError, match="step"):
            save(url, ptc, cfg, 0, shard, step=bad)


# ---------------------------------------------------------------------------------------------
# 4. corruption and mismatches
# ---------------------------------------------------------------------------------------------
def _chunk(url, step, rank, tensor):
    idx = json.loads(_read_bytes(url, f"{_step(step)}/rank-{rank:05d}.json"))
    fs, root = _fs_root(url)
    sdir = _resolve(fs, root, _step(step))
    chunks = [c for c in read_part_chunks(fs.unstrip_protocol(sdir), rank) if c["tensor"] == tensor]
    assert chunks, f"rank {rank} wrote no chunk of {tensor}"
    return idx, chunks[0]


def _no_result(fn, exc, match):
    """Call fn expecting ``exc``; return the exception (nothing is returned on error)."""
    result = None
    with pytest.raises(exc, match=match) as info:
        result = fn()
    assert result is None
    return info.value


def test_truncated_data_file(url):
    ptc = tiny_ptc()
    cfg = ParallelConfig(tp=2)
    save_all(url, ptc, cfg, random_bits(ptc, 1), step=1)
    rel = f"{_step(1)}/rank-00001.safetensors"
    raw = _read_bytes(url, rel)
    _write_bytes(url, rel, raw[: len(raw) - 100])
    err = _no_result(lambda: load(url, cfg, 1), CheckpointCorruptError, "truncated")
    assert "rank-00001.safetensors" in str(err)
    # the truncated file still makes the step "complete" by its markers, so there is no silent
    # fallback: the caller learns of the damage
    assert list_steps(url)[-1].complete


def test_missing_data_file_with_index(url):
    ptc = tiny_ptc()
    cfg = ParallelConfig(tp=2)
    save_all(url, ptc, cfg, random_bits(ptc, 1), step=1)
    _rm(url, f"{_step(1)}/rank-00000.safetensors")
    _no_result(lambda: load(url, cfg, 0), CheckpointCorruptError, "missing")


def test_flipped_byte_fails_checksum_only_where_read(url):
    ptc = tiny_ptc(hidden=64, ffn_hidden=128)
    cfg = ParallelConfig(tp=2)
    glob = random_bits(ptc, 1)
    save_all(url, ptc, cfg, glob, step=1)
    # a weight split by TP: rank 1's chunk is needed by new rank 1 only
    name = "layers.2.mlp.down.weight"
    _, chunk = _chunk(url, 1, 1, name)
    rel = f"{_step(1)}/rank-00001.safetensors"
    raw = bytearray(_read_bytes(url, rel))
    pos = chunk["offset"] + chunk["length"] * 4 // 2
    raw[pos] ^= 0x5A
    _write_bytes(url, rel, bytes(raw))
    err = _no_result(lambda: load(url, cfg, 1), CheckpointCorruptError, "checksum")
    assert name in str(err)
    # rank 0 never reads the damaged block and loads fine
    assert_shard_equal(load(url, cfg, 0).shard, ptc.shard(glob, cfg)[0])
    # a layout that needs the damaged bytes from a smaller piece also detects it
    _no_result(lambda: load(url, ParallelConfig(tp=4), 3), CheckpointCorruptError, "checksum")


def test_flipped_byte_in_block_read_only_partly_is_detected(url):
    """The loader verifies whole checksum blocks even when it needs only a few elements of one."""
    ptc = tiny_ptc(hidden=64, ffn_hidden=128)
    save_all(url, ptc, ParallelConfig(), random_bits(ptc, 2), step=1)
    name = "layers.0.mlp.gate_up.weight"  # (256, 64) fp32 = 64 KiB: blocks of one 256-byte row (version 3)
    _, chunk = _chunk(url, 1, 0, name)
    assert chunk["block"] == chunk_block(ptc.tensors[name], 64 << 10) == 256
    rel = f"{_step(1)}/rank-00000.safetensors"
    raw = bytearray(_read_bytes(url, rel))
    # new TP=2 rank 0 needs the first half of gate and of up (block-aligned), rank 1 the second
    # halves; corrupt the very last byte of gate's first half, which rank 0 needs
    raw[chunk["offset"] + 128 * 64 * 4 // 2 - 1] ^= 1
    _write_bytes(url, rel, bytes(raw))
    _no_result(lambda: load(url, ParallelConfig(tp=2), 0), CheckpointCorruptError, "checksum")
    load(url, ParallelConfig(tp=2), 1)  # does not touch that block


def test_garbage_manifest(url):
    ptc = tiny_ptc()
    cfg = ParallelConfig(tp=2)
    save_all(url, ptc, cfg, random_bits(ptc, 1, 1), step=1)
    save_all(url, ptc, cfg, random_bits(ptc, 2, 2), step=2)
    _write_bytes(url, f"{_step(2)}/manifest.json", b'{"format": "tenplex-checkpoint", "vers')
    infos = list_steps(url)
    assert [(i.step, i.complete) for i in infos] == [(1, True), (2, False)]
    # an unreadable step is never loaded: the latest readable one is
    res = load(url, cfg, 0)
    assert res.step == 1 and res.shard["optimizer.step"] == 1
    _no_result(lambda: load(url, cfg, 0, step=2), CheckpointError, "step 2")
    # with nothing else to fall back on, load raises
    _rm(url, f"{_step(1)}/manifest.json")
    _no_result(lambda: load(url, cfg, 0), CheckpointError, "no complete checkpoint")


def test_not_a_tenplex_manifest(url):
    """Changed on purpose for format version 2: an edited manifest fails its digest; a sealed
    manifest of another version and a version-1 manifest (no digests) are refused by name."""
    ptc = tiny_ptc()
    cfg = ParallelConfig()
    save_all(url, ptc, cfg, random_bits(ptc, 1), step=1)
    rel = f"{_step(1)}/manifest.json"
    m = open_sealed_json(_read_bytes(url, rel), rel)
    _write_bytes(url, rel, json.dumps({**m, "version": 99}).encode())
    _no_result(lambda: load(url, cfg, 0), CheckpointCorruptError, "digest")
    _write_bytes(url, rel, seal_json({**m, "version": 99}))
    err = _no_result(lambda: load(url, cfg, 0), CheckpointError, "version 99 is not supported")
    assert not isinstance(err, CheckpointCorruptError)
    _write_bytes(url, rel, json.dumps({**m, "version": 1}).encode())
    _no_result(lambda: load(url, cfg, 0), CheckpointError, "format version 1")


def test_garbage_rank_index_and_objects(url):
    ptc = tiny_ptc()
    cfg = ParallelConfig(tp=2)
    save_all(url, ptc, cfg, random_bits(ptc, 1), step=1)
    _write_bytes(url, f"{_step(1)}/rank-00001.json", b"\x00\x01garbage")
    _no_result(lambda: load(url, cfg, 1), CheckpointCorruptError, "not valid JSON")
    save_all(url, ptc, cfg, random_bits(ptc, 2), step=2)
    _write_bytes(url, f"{_step(2)}/objects.pt", b"not a torch file")
    _no_result(lambda: load(url, cfg, 0, step=2), CheckpointCorruptError, "objects.pt")


def test_manifest_of_another_model(url):
    ptc = tiny_ptc()
    cfg = ParallelConfig(tp=2)
    save_all(url, ptc, cfg, random_bits(ptc, 1), step=1)
    for other in (tiny_ptc(hidden=32), tiny_ptc(dtype=torch.bfloat16), tiny_ptc(num_layers=3),
                  tiny_ptc(distributed_optimizer=True)):
        err = _no_result(lambda: load(url, cfg, 0, ptc=other), CheckpointMismatchError, "another model")
        assert "step 1" in str(err)
    # the same model rebuilt from scratch matches
    assert load(url, cfg, 0, ptc=tiny_ptc()).step == 1


def test_layout_the_model_cannot_take(url):
    ptc = tiny_ptc()
    save_all(url, ptc, ParallelConfig(tp=2), random_bits(ptc, 1), step=1)
    with pytest.raises(ValueError, match="tp=3"):
        load(url, ParallelConfig(tp=3), 0)
    with pytest.raises(ValueError, match="rank 4"):
        load(url, ParallelConfig(tp=2, dp=2), 4)


# ---------------------------------------------------------------------------------------------
# 5. shard validation on save
# ---------------------------------------------------------------------------------------------
def _rank_files(url, step):
    fs, root = _fs_root(url)
    dirs = fs.glob(f"{root}/{_step(step)}")
    if not dirs:
        return []
    names = [p.rsplit("/", 1)[-1] for d in dirs for p in fs.ls(d, detail=False)]
    return sorted(n for n in names if n.startswith("rank-") or n in ("manifest.json", "objects.pt"))


def test_save_rejects_wrong_shape(url):
    ptc = tiny_ptc()
    cfg = ParallelConfig(tp=2)
    shard = dict(ptc.shard(random_bits(ptc, 1), cfg)[1])
    shard["layers.1.attn.proj.weight"] = torch.zeros(16, 16)  # full tensor instead of (16, 8)
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.proj\.weight.*\(16, 16\).*\(16, 8\)"):
        save(url, ptc, cfg, 1, shard, step=1)
    assert _rank_files(url, 1) == []
    assert list_steps(url) == []  # no phantom step left behind


def test_save_rejects_missing_tensor(url):
    ptc = tiny_ptc()
    cfg = ParallelConfig(pp=2)
    shard = dict(ptc.shard(random_bits(ptc, 1), cfg)[1])
    del shard["final_norm.weight"]
    with pytest.raises(ValueError, match=r"lacks.*final_norm\.weight"):
        save(url, ptc, cfg, 1, shard, step=1)
    assert _rank_files(url, 1) == []
    assert list_steps(url) == []  # no phantom step left behind
    # a shard of the wrong stage lacks that stage's tensors too
    with pytest.raises(ValueError, match="lacks"):
        save(url, ptc, cfg, 1, ptc.shard(random_bits(ptc, 1), cfg)[0], step=1)


def test_save_rejects_bad_rank_and_layout(url):
    ptc = tiny_ptc()
    shard = ptc.shard(random_bits(ptc, 1), ParallelConfig())[0]
    with pytest.raises(ValueError, match="rank 2"):
        save(url, ptc, ParallelConfig(tp=2), 2, shard, step=1)
    with pytest.raises(ValueError, match="tp=8"):
        save(url, ptc, ParallelConfig(tp=8), 0, shard, step=1)
    assert _rank_files(url, 1) == []
    assert list_steps(url) == []  # no phantom step left behind


# ---------------------------------------------------------------------------------------------
# 6. save attempts: an interrupted save of step N never mixes with a later save of step N
# ---------------------------------------------------------------------------------------------
def test_resave_after_restart_does_not_mix_attempts(url, monkeypatch):
    ptc = tiny_ptc()
    old_cfg, new_cfg = ParallelConfig(tp=2), ParallelConfig(dp=2)
    stale = random_bits(ptc, 1, step_value=5)
    fresh = random_bits(ptc, 2, step_value=5)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    save(url, ptc, old_cfg, 1, ptc.shard(stale, old_cfg)[1], step=5)  # rank 0 never finishes
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    shards = ptc.shard(fresh, new_cfg)
    for r in range(new_cfg.world_size):
        save(url, ptc, new_cfg, r, shards[r], step=5)
    infos = [i for i in list_steps(url) if i.step == 5]
    assert len(infos) == 2 and [i.complete for i in infos] == [False, True]
    assert infos[0].save_id != infos[1].save_id
    want = ptc.shard(fresh, old_cfg)
    for r in range(old_cfg.world_size):
        assert_shard_equal(load(url, old_cfg, r).shard, want[r], f"rank {r}")


def test_explicit_save_id_is_validated(url):
    ptc = tiny_ptc()
    cfg = ParallelConfig()
    shard = ptc.shard(random_bits(ptc, 1), cfg)[0]
    with pytest.raises(ValueError, match="save_id"):
        save(url, ptc, cfg, 0, shard, step=1, save_id="not-hex!")
    save(url, ptc, cfg, 0, shard, step=1, save_id="0123abcd")
    assert [i.save_id for i in list_steps(url)] == ["0123abcd"]


# ---------------------------------------------------------------------------------------------
# 7. integrity (issue #15): every byte checked, bound to its step and attempt
# ---------------------------------------------------------------------------------------------
def _flip_bit(url, rel, find: bytes, at: int, bit: int) -> None:
    """Flip ``bit`` of byte ``at`` of the first occurrence of ``find`` in file ``rel``."""
    raw = bytearray(_read_bytes(url, rel))
    raw[raw.index(find) + at] ^= bit
    _write_bytes(url, rel, bytes(raw))


def _copy(url, src_rel, dst_rel) -> None:
    _write_bytes(url, dst_rel, _read_bytes(url, src_rel))


def test_flipped_step_or_shape_in_the_manifest_is_detected(url):
    """A flip turning "step": 20 into 22, or a shape [16] into [18], used to load silently."""
    ptc = tiny_ptc()
    cfg = ParallelConfig(tp=2)
    save_all(url, ptc, cfg, random_bits(ptc, 20, 20), step=20)
    rel = f"{_step(20)}/manifest.json"
    raw = _read_bytes(url, rel)
    _flip_bit(url, rel, b'"step":20', len(b'"step":2'), 0x02)  # '0' -> '2'
    assert b'"step":22' in _read_bytes(url, rel)
    _no_result(lambda: load(url, cfg, 0), CheckpointCorruptError, "digest mismatch")
    bad = bytearray(raw)
    pos = raw.index(b'"shape":[16]') + len(b'"shape":[1')
    bad[pos] ^= 0x0E  # '6' -> '8'
    _write_bytes(url, rel, bytes(bad))
    _no_result(lambda: load(url, cfg, 0), CheckpointCorruptError, "digest mismatch")
    with pytest.raises(CheckpointCorruptError):
        read_manifest(url)
    info = list_steps(url)[-1]
    assert not info.complete and "digest" in info.problem
    # with an intact older step, the load falls back and says why
    _write_bytes(url, rel, raw)
    save_all(url, ptc, cfg, random_bits(ptc, 19, 19), step=19)
    _write_bytes(url, rel, bytes(bad))
    res = load(url, cfg, 1)
    assert res.step == 19 and res.shard["optimizer.step"] == 19
    assert [(s, why) for s, _, why in res.skipped] == [(20, info.problem)]


def test_flipped_objects_byte_is_detected(url):
    """torch.load ignores the zip CRCs: a flip turned the data seed 1234 into 1235 unnoticed."""
    ptc = tiny_ptc()
    cfg = ParallelConfig()
    save_all(url, ptc, cfg, random_bits(ptc, 1, 1), step=1, extra={"data_seed": 1234})
    assert load(url, cfg, 0).extra == {"data_seed": 1234}
    rel = f"{_step(1)}/objects.pt"
    _flip_bit(url, rel, b"M\xd2\x04", 1, 0x01)  # the pickled 1234 (BININT2) -> 1235
    err = _no_result(lambda: load(url, cfg, 0), CheckpointCorruptError, "objects.pt: SHA-256 differs")
    assert "step 1" in str(err)


def test_parts_copied_from_another_step_are_refused(url):
    """Copying a rank's index and data, the objects or the manifest of step 10 into step 20 used
    to load step 20 with 55 wrong tensors or step-10 counters."""
    ptc = tiny_ptc()
    g10, g20 = random_bits(ptc, 10, 10), random_bits(ptc, 20, 20)
    save_all(url, ptc, CFG2, g10, step=10)
    save_all(url, ptc, CFG2, g20, step=20)
    whole = ParallelConfig()  # its one rank reads every part
    want10 = ptc.shard(g10, whole)[0]
    cases = {
        ("rank-00001.json", "rank-00001.safetensors"): "step is 10 but the manifest and directory say 20",
        ("objects.pt",): "objects.pt: SHA-256 differs",
        ("manifest.json",): "step 10 differs from its directory's step 20",
        ("rank-00002.safetensors",): "checksum mismatch",
    }
    for files, why in cases.items():
        saved = {f: _read_bytes(url, f"{_step(20)}/{f}") for f in files}
        for f in files:
            _copy(url, f"{_step(10)}/{f}", f"{_step(20)}/{f}")
        res = load(url, whole, 0)
        assert res.step == 10 and res.shard["optimizer.step"] == 10, files
        assert_shard_equal(res.shard, want10, str(files))
        ((step, _, reason),) = res.skipped
        assert step == 20 and why in reason, (files, reason)
        _no_result(lambda: load(url, whole, 0, step=20), CheckpointCorruptError, "step 20")
        for f, data in saved.items():
            _write_bytes(url, f"{_step(20)}/{f}", data)
    assert load(url, CFG2, 0).step == 20


def test_resave_with_a_reused_save_id_never_mixes_attempts(url):
    """A relaunch with the same run id reused the save id: with only rank 0 finished before,
    the re-save overwrote files in place and mixed two attempts (54 of 81 tensors)."""
    ptc = tiny_ptc()
    g10, old, new = random_bits(ptc, 10, 10), random_bits(ptc, 1, 20), random_bits(ptc, 2, 20)
    save_all(url, ptc, CFG2, g10, step=10)
    save(url, ptc, CFG2, 0, ptc.shard(old, CFG2)[0], step=20, save_id="00c0ffee")  # only rank 0 finishes
    fs, root = _fs_root(url)
    sdir = _sdir(fs, root, 20)
    before = {p: fs.cat_file(p) for p in fs.ls(sdir, detail=False)}
    shards = ptc.shard(new, CFG2)
    with pytest.raises(CheckpointError, match="save id 00c0ffee was used by an earlier save"):
        save(url, ptc, CFG2, 0, shards[0], step=20, save_id="00c0ffee")
    for r in (1, 2, 3):  # the relaunch's other ranks complete the attempt
        save(url, ptc, CFG2, r, shards[r], step=20, save_id="00c0ffee")
    assert all(fs.cat_file(p) == data for p, data in before.items()), "a re-save changed an existing file"
    info = [i for i in list_steps(url) if i.step == 20][0]
    assert not info.complete and "reused" in info.problem
    want = ptc.shard(g10, CFG2)
    for r in range(CFG2.world_size):
        res = load(url, CFG2, r)
        assert res.step == 10 and res.skipped[0][:2] == (20, "00c0ffee")
        assert_shard_equal(res.shard, want[r])
    _no_result(lambda: load(url, CFG2, 0, step=20), CheckpointCorruptError, "reused")
    # an attempt that was complete is left intact but marked too: a re-save of it could be
    # completing an attempt of its own other ranks
    save_all(url, ptc, CFG2, new, step=30, save_id="0000beef")
    with pytest.raises(CheckpointError, match="was used by an earlier save"):
        save(url, ptc, CFG2, 2, shards[2], step=30, save_id="0000beef")
    assert load(url, CFG2, 0).step == 10


_RESAVE_CHILD = r"""
import os, sys, time, torch
import tenplex.checkpoint as ckpt
import tenplex.checkpoint.writer as ckpt_writer
from tenplex import ParallelConfig, model_ptc
root, ready = sys.argv[1], sys.argv[2]
ptc = model_ptc(arch="llama", num_layers=4, hidden=16, heads=8, kv_heads=4, ffn_hidden=16, vocab=37, vocab_pad=2,
                seq_len=8, dtype=torch.float32)
cfg = ParallelConfig(tp=2, pp=2)
g = {n: torch.full(s.shape, 7.0) for n, s in ptc.tensors.items()}
g["optimizer.step"] = 20
publish = ckpt_writer.publish
def hang(fs, tmp, path):
    if path.endswith("rank-00002.safetensors"):
        open(ready, "w").close()
        time.sleep(600)  # SIGKILLed here, its data written under a temporary name
    return publish(fs, tmp, path)
ckpt_writer.publish = hang
shards = ptc.shard(g, cfg)
for r in range(4):
    try:
        ckpt.save(root, ptc, cfg, r, shards[r], step=20, save_id="00c0ffee")
    except ckpt.CheckpointError as e:
        print("refused", r, e, flush=True)
"""


@pytest.mark.timeout(120)
def test_sigkill_during_a_resave_falls_back_to_the_intact_step(tmp_path):
    """A SIGKILL during a re-save under a reused save id made 3 of 6 loads fail instead of
    falling back to the intact earlier step."""
    import signal
    import subprocess
    import sys
    import time

    url = str(tmp_path / "ckpt")
    ptc = tiny_ptc()
    g10 = random_bits(ptc, 10, 10)
    save_all(url, ptc, CFG2, g10, step=10)
    save(url, ptc, CFG2, 0, ptc.shard(random_bits(ptc, 1, 20), CFG2)[0], step=20, save_id="00c0ffee")
    ready = tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", _RESAVE_CHILD, url, str(ready)], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert child.poll() is None, child.stdout.read()
            assert time.monotonic() < deadline, "the re-save never reached rank 2's data"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        out = child.communicate(timeout=30)[0]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert "refused 0" in out and child.returncode == -signal.SIGKILL
    loads = [(cfg, r) for cfg in (CFG2, ParallelConfig(dp=2)) for r in range(cfg.world_size)]
    assert len(loads) == 6
    for cfg, r in loads:
        res = load(url, cfg, r)
        assert res.step == 10 and res.skipped and res.skipped[0][0] == 20
        assert_shard_equal(res.shard, ptc.shard(g10, cfg)[r], f"{cfg} rank {r}")


def test_damaged_newest_step_falls_back_to_the_intact_one(url):
    """One flipped data bit in step 20 made every restart exit 1 although step 19 was intact."""
    ptc = tiny_ptc(hidden=64, ffn_hidden=128)
    cfg = ParallelConfig(tp=2)
    g19, g20 = random_bits(ptc, 19, 19), random_bits(ptc, 20, 20)
    save_all(url, ptc, cfg, g19, step=19)
    save_all(url, ptc, cfg, g20, step=20)
    _, chunk = _chunk(url, 20, 1, "layers.2.mlp.down.weight")
    rel = f"{_step(20)}/rank-00001.safetensors"
    raw = bytearray(_read_bytes(url, rel))
    raw[chunk["offset"] + 17] ^= 0x10
    _write_bytes(url, rel, bytes(raw))
    res = load(url, cfg, 1, ptc=ptc)
    assert res.step == 19 and res.extra is None
    assert_shard_equal(res.shard, ptc.shard(g19, cfg)[1])
    ((step, sid, why),) = res.skipped
    assert step == 20 and sid == list_steps(url)[-1].save_id and "checksum mismatch" in why
    assert res.stats.bytes_read >= res.stats.bytes_needed == ptc.rank_nbytes(cfg, 1)
    # rank 0 never reads the damaged block: it loads step 20 (see docs/format.md, "Choosing a step")
    assert load(url, cfg, 0).step == 20
    _no_result(lambda: load(url, cfg, 1, step=20), CheckpointCorruptError, "checksum mismatch")


def test_tiered_load_falls_back_across_tiers_on_malformed_metadata(tmp_path):
    """A malformed index in the local tier used to raise instead of reading the storage tier's copy."""
    from tenplex.store import Tier, load_tiered

    ptc = tiny_ptc()
    new = ParallelConfig(dp=2)
    local, storage = tmp_path / "local", tmp_path / "storage"
    g19, g20 = random_bits(ptc, 19, 19), random_bits(ptc, 20, 20)
    for root in (local, storage):  # the same attempts in both tiers
        save_all(str(root), ptc, CFG2, g19, step=19, save_id="0000aaaa")
        save_all(str(root), ptc, CFG2, g20, step=20, save_id="0000bbbb")
    tiers = [Tier("local", str(local), "local"), Tier("storage", str(storage), "storage")]
    want20, want19 = ptc.shard(g20, new), ptc.shard(g19, new)
    clean = load_tiered(tiers, new, 0, ptc=ptc, rounds=False)
    assert clean.bytes_by_kind["storage"] == 0 and clean.result.step == 20
    sdir = local / "step-000000000020-0000bbbb"
    cases = {  # file, bytes to find, bit: a malformed index (valid JSON, wrong value), manifest, objects
        "rank-00001.json": (b'"rank":1', 0x02),
        "manifest.json": (b'"world_size":4', 0x01),
        "objects.pt": (b"data.pkl", 0x01),
    }
    for name, (find, bit) in cases.items():
        raw = (sdir / name).read_bytes()
        bad = bytearray(raw)
        bad[raw.index(find) + len(find) - 1] ^= bit
        (sdir / name).write_bytes(bytes(bad))
        for r in range(new.world_size):
            got = load_tiered(tiers, new, r, ptc=ptc, rounds=False)
            assert got.result.step == 20 and got.result.skipped == (), name
            assert_shard_equal(got.result.shard, want20[r], f"{name} rank {r}")
        assert got.bytes_by_kind["storage"] > 0 or name != "rank-00001.json"
        # damaged in both tiers: no intact copy of step 20, so step 19 from the tiers
        (storage / sdir.name / name).write_bytes(bytes(bad))
        got = load_tiered(tiers, new, 1, ptc=ptc, rounds=False)
        assert got.result.step == 19 and [s for s, _, _ in got.result.skipped] == [20]
        assert_shard_equal(got.result.shard, want19[1], name)
        with pytest.raises(CheckpointCorruptError, match="step 20"):
            load_tiered(tiers, new, 1, ptc=ptc, step=20, rounds=False)
        (sdir / name).write_bytes(raw)
        (storage / sdir.name / name).write_bytes(raw)


def test_other_model_settings_are_refused_unless_allowed(url, tmp_path):
    """A checkpoint of tiny with heads=4, kv_heads=2 has the tensor shapes of tiny with 8 heads,
    so the fingerprint matched and it loaded into the other model."""
    from tenplex import model_ptc, rescale
    from tenplex.store import Tier, load_tiered

    saved, other = model_ptc("tiny", heads=4, kv_heads=2), model_ptc("tiny")
    assert saved.fingerprint() == other.fingerprint()
    cfg = ParallelConfig(tp=2)
    save_all(url, saved, cfg, random_bits(saved, 1, 1), step=1)
    err = _no_result(lambda: load(url, cfg, 0, ptc=other), CheckpointMismatchError, "other model settings")
    assert "heads: saved 4, requested 8" in str(err) and "kv_heads: saved 2, requested 4" in str(err)
    assert "allow_meta_change=True" in str(err)
    res = load(url, cfg, 0, ptc=other, allow_meta_change=True)
    assert res.step == 1 and res.ptc.meta["model"]["heads"] == 4
    assert load(url, cfg, 0, ptc=saved).step == 1
    with pytest.raises(CheckpointMismatchError, match="heads"):
        rescale(url, other, rank=0, world_size=2, parallel=cfg)
    assert rescale(url, other, rank=0, world_size=2, parallel=cfg, allow_meta_change=True).step == 1
    local = str(tmp_path / "tier")
    save_all(local, saved, cfg, random_bits(saved, 1, 1), step=1)
    with pytest.raises(CheckpointMismatchError, match="heads"):
        load_tiered([Tier("local", local, "local")], cfg, 0, ptc=other)
    assert load_tiered([Tier("local", local, "local")], cfg, 0, ptc=other, allow_meta_change=True).result.step == 1


def test_save_validates_step_and_extra_up_front(url):
    """save(step=10**12) returned and the step was then invisible; an extra holding a numpy
    float saved fine and the load then called the checkpoint corrupt."""
    from tenplex.errors import CheckpointValueError

    ptc = tiny_ptc()
    cfg = ParallelConfig(tp=2)
    shards = ptc.shard(random_bits(ptc, 1, 1), cfg)
    for bad in (10**12, -1, True, 2.0):
        with pytest.raises(CheckpointValueError, match="step"):
            save(url, ptc, cfg, 0, shards[0], step=bad)
    for r in (0, 1):  # every rank refuses, although only rank 0 writes extra
        with pytest.raises(CheckpointValueError, match=r"extra\['loss'\] = .*1\.5.* \(numpy\.float64\).*float\(x\)"):
            save(url, ptc, cfg, r, shards[r], step=1, extra={"seed": 3, "loss": np.float64(1.5)})
    with pytest.raises(ValueError, match=r"extra\['hist'\]\[1\]"):
        save(url, ptc, cfg, 0, shards[0], step=1, extra={"hist": [1.0, np.int64(2)]})
    assert list_steps(url) == [] and _rank_files(url, 1) == []
    for r in (0, 1):
        save(url, ptc, cfg, r, shards[r], step=np.int64(10**12 - 1), extra={"loss": 1.5})
    res = load(url, cfg, 0)
    assert res.step == 10**12 - 1 and res.extra == {"loss": 1.5}


def test_rescale_falls_back_and_never_starts_fresh_over_damage(url):
    from tenplex import rescale

    ptc = tiny_ptc()
    cfg = ParallelConfig(tp=2)
    save_all(url, ptc, cfg, random_bits(ptc, 19, 19), step=19, extra={"at": 19})
    save_all(url, ptc, ParallelConfig(dp=2), random_bits(ptc, 20, 20), step=20, extra={"at": 20})
    _flip_bit(url, f"{_step(20)}/rank-00000.json", b'"chunks"', 1, 0x01)
    res = rescale(url, ptc, rank=1, world_size=2, parallel=cfg)
    assert res.step == 19 and res.extra == {"at": 19} and res.previous == cfg
    assert [s for s, _, _ in res.skipped] == [20] and "passed over step 20" in res.summary()
    assert rescale(url, ptc, rank=0, world_size=2, parallel=cfg, step=19).skipped == ()
    with pytest.raises(CheckpointCorruptError, match="step 20"):
        rescale(url, ptc, rank=0, world_size=2, parallel=cfg, step=20)
    with pytest.raises(CheckpointNotFoundError, match="step 7"):
        rescale(url, ptc, rank=0, world_size=2, parallel=cfg, step=7)
    _flip_bit(url, f"{_step(19)}/manifest.json", b'"layout"', 1, 0x01)
    with pytest.raises(CheckpointCorruptError):  # checkpoints exist, none usable: no silent fresh start
        rescale(url, ptc, rank=0, world_size=2, parallel=cfg)


def _nonce_worker(launch: int, rank: int, port: int, out: Any) -> None:
    """A rank of a launch of 2: its default save id, from a background thread (as a background save)
    and from the main thread."""
    import datetime
    import threading

    import torch.distributed as dist

    from tenplex import model_ptc
    from tenplex.checkpoint import default_save_id

    res: dict[str, Any] = {"error": None}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        ptc, cfg = model_ptc("tiny"), ParallelConfig(tp=2)
        box: list[str] = []
        th = threading.Thread(target=lambda: box.append(default_save_id(cfg, ptc)))
        th.start()
        th.join()
        res["ids"] = [box[0], default_save_id(cfg, ptc)]
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # reported to the parent, which fails the test with it
        res["error"] = f"{type(e).__name__}: {e}"
    out.put((launch, rank, res))


@pytest.mark.timeout(180)
def test_default_save_id_is_shared_by_a_launch_and_differs_between_launches(tmp_path, monkeypatch):
    """The id hashed run id, restart count, layout and model only, so a relaunch with the same
    run id reused it. Under a process group every rank derives the same id, from a background
    thread too, and another launch with the same environment gets another one. (Workers forked
    from the session's forkserver: ``spawned.run_spawned``.)"""
    from spawned import free_port, run_spawned

    for k, v in {"TORCHELASTIC_RUN_ID": "job", "TORCHELASTIC_RESTART_COUNT": "0", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(k, v)
    # the two launches side by side (each on its own port): the same environment, other process groups
    ports = [free_port(), free_port()]
    got = run_spawned(_nonce_worker, [(launch, r, port) for launch, port in enumerate(ports) for r in range(2)],
                      expect=4, timeout=150)
    assert all(not res["error"] for res in got.values()), got
    launches = []
    for launch in range(2):
        ids = [got[(launch, r)]["ids"] for r in range(2)]
        assert len({i for pair in ids for i in pair}) == 1, ids  # one id per launch
        launches.append(ids[0][0])
    assert launches[0] != launches[1]


def _agree_worker(rank: int, port: int, url: str, out_dir: str, blind: str, out: Any) -> None:
    """A rank that rescales before the process group (as the trainer does), then agrees on the step.
    ``blind`` ("late", "never"; "" for neither): rank 1 first reads an empty directory instead of
    ``url`` (a store that did not answer in time); "late" puts the checkpoint there before the
    agreement, "never" leaves it empty."""
    import datetime
    import shutil

    import torch.distributed as dist

    from tenplex.elastic import agree_on_step, rescale

    res_out: dict[str, Any] = {"error": None}
    try:
        ptc = model_ptc(arch="llama", num_layers=4, hidden=64, heads=8, kv_heads=4, ffn_hidden=128, vocab=37,
                        vocab_pad=2, seq_len=8, dtype=torch.float32)
        cfg = ParallelConfig(tp=2)
        if blind and rank == 1:
            seen = f"{out_dir}/blind"
            os.makedirs(seen)
            res = rescale(seen, ptc, rank=rank, world_size=2, parallel=cfg)
            if blind == "late":
                shutil.copytree(url, seen, dirs_exist_ok=True)
            url = seen
        else:
            res = rescale(url, ptc, rank=rank, world_size=2, parallel=cfg)
        before = res.step
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=60))
        res = agree_on_step(res, url, ptc)
        torch.save(res.shard, f"{out_dir}/shard-{rank}.pt")
        res_out["steps"] = [before, res.step]
        dist.destroy_process_group()
    except BaseException as e:  # reported to the parent, which fails the test with it
        res_out["error"] = f"{type(e).__name__}: {e}"
    out.put((rank, res_out))


@pytest.mark.timeout(180)
def test_ranks_that_saw_different_damage_agree_on_one_step(tmp_path):
    """Damage only rank 1 reads makes rank 1 fall back alone; agree_on_step (real gloo ranks)
    brings rank 0 back to the same step. (Ranks forked from the session's forkserver:
    ``spawned.run_spawned``.)"""
    from spawned import free_port, run_spawned

    ptc = tiny_ptc(hidden=64, ffn_hidden=128)
    cfg = ParallelConfig(tp=2)
    url = str(tmp_path / "ckpt")
    g19 = random_bits(ptc, 19, 19)
    save_all(url, ptc, cfg, g19, step=19)
    save_all(url, ptc, cfg, random_bits(ptc, 20, 20), step=20)
    _, chunk = _chunk(url, 20, 1, "layers.2.mlp.down.weight")
    rel = f"{_step(20)}/rank-00001.safetensors"
    raw = bytearray(_read_bytes(url, rel))
    raw[chunk["offset"] + 5] ^= 0x01
    _write_bytes(url, rel, bytes(raw))
    port = free_port()
    got = run_spawned(_agree_worker, [(r, port, url, str(tmp_path), "") for r in range(2)], expect=2, timeout=150)
    assert all(not res["error"] for res in got.values()), got
    steps = [got[r]["steps"] for r in range(2)]
    assert steps == [[20, 19], [19, 19]], steps
    want = ptc.shard(g19, cfg)
    for r in range(2):
        assert_shard_equal(torch.load(tmp_path / f"shard-{r}.pt", weights_only=True), want[r], f"rank {r}")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("blind", ["late", "never"])
def test_a_rank_that_sees_no_checkpoint_never_makes_the_others_start_fresh(tmp_path, blind):
    """Rank 1 first finds nothing (its store did not answer in time) while rank 0 resumed from
    step 20. Before, the agreement took the oldest step, "fresh", and both started fresh: the job's
    state was dropped with a warning (a restarted torchrun job under load logged "fresh start").
    Now rank 1 looks again under rank 0's layout: "late" (the store answers now) it loads step 20
    bit for bit; "never", the ranks raise CheckpointNotFoundError naming rank 1."""
    from spawned import free_port, run_spawned

    ptc = tiny_ptc(hidden=64, ffn_hidden=128)
    cfg = ParallelConfig(tp=2)
    url = str(tmp_path / "ckpt")
    g20 = random_bits(ptc, 20, 20)
    save_all(url, ptc, cfg, g20, step=20)
    port = free_port()
    got = run_spawned(_agree_worker, [(r, port, url, str(tmp_path), blind) for r in range(2)], expect=2, timeout=150)
    if blind == "never":  # (run_spawned stops at the first rank that reports an error)
        assert got and all(res["error"].startswith("CheckpointNotFoundError: rank(s) [1] found no checkpoint step up "
                                                   "to 20") for res in got.values()), got
        return
    assert all(not res["error"] for res in got.values()), got
    assert [got[r]["steps"] for r in range(2)] == [[20, 20], [0, 20]]
    want = ptc.shard(g20, cfg)
    for r in range(2):
        assert_shard_equal(torch.load(tmp_path / f"shard-{r}.pt", weights_only=True), want[r], f"rank {r}")


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 5000), st.sampled_from([1, 3, 256, 512]), st.data())
def test_crc_spans_cover_a_read_and_group_words_combine(nbytes: int, block: int, data: st.DataObject) -> None:
    """Format version 4: the block, group and block words ``crc_spans`` picks for bytes [lo, hi) of a
    chunk check exactly those bytes, in order, each group whole inside them; and a group's word,
    combined from its blocks' words (``crc_concat``, as the writer does), is the CRC32 of its bytes."""
    nblocks = -(-nbytes // block)
    k0 = data.draw(st.integers(0, nblocks - 1))
    k1 = data.draw(st.integers(k0 + 1, nblocks))
    lo, hi = k0 * block, min(k1 * block, nbytes)
    (a0, a1), (g0, g1), (t0, t1) = crc_spans(nbytes, block, lo, hi)
    group = block * CRC_GROUP
    pieces = [(a * block, min(b * block, nbytes)) for a, b in ((a0, a1),) if b > a]
    pieces += [(g * group, min((g + 1) * group, nbytes)) for g in range(g0, g1)]
    pieces += [(a * block, min(b * block, nbytes)) for a, b in ((t0, t1),) if b > a]
    assert pieces[0][0] == lo and pieces[-1][1] == hi and all(p[1] == q[0] for p, q in zip(pieces, pieces[1:]))
    raw, seed = bytes(random.Random(nbytes).randrange(256) for _ in range(nbytes)), 0x1234567
    for g in range(g0, g1):
        end = min((g + 1) * group, nbytes)
        words = [zlib.crc32(raw[p : min(p + block, nbytes)], seed) for p in range(g * group, end, block)]
        acc = words[0]
        for k, w in enumerate(words[1:], 1):
            acc = crc_concat(acc, w, min(block, nbytes - g * group - k * block), seed)
        assert acc == zlib.crc32(raw[g * group : end], seed)
