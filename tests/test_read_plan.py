"""Read plans are data: ``plan_reads`` is pure, and executing a plan reads exactly the bytes it plans."""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import uuid
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_checkpoint import CountingMemFS, data_reads, assert_shard_equal, model_and_layouts, random_bits, save_all
import torch
from test_state_dict import blocks_once, descriptions

from tenplex.checkpoint import Binding, PartReader, ReadItem, list_steps, plan_reads
from tenplex.checkpoint.catalog import read_manifest_at
from tenplex.checkpoint.format import data_name, writer_assignment
from tenplex.checkpoint.read_plan import shard_buffers
from tenplex.layout.mesh import NamedMesh, Replicate, Shard, StridedShard
from tenplex.layout.ptc import PTC
from tenplex.layout.state_layout import Placed, StateLayout
from tenplex.native.state_dict import state_layout_of
from tenplex.urls import url_fs


def _no_io(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
    raise AssertionError("plan_reads did I/O")


def _check_plans(url: str, case) -> None:  # noqa: ANN001
    _, ptc, a, b, seed = case
    glob = random_bits(ptc, seed)
    save_all(url, ptc, a, glob, step=3)
    want = ptc.shard(glob, b)
    fs, _ = url_fs(url, None)
    sdir = list_steps(url)[-1].path
    manifest = read_manifest_at(fs, sdir)
    writers = writer_assignment(ptc, a)
    for r in range(b.world_size):
        fingerprint = ptc.fingerprint()
        mark = len(CountingMemFS.reads)
        with mock.patch("builtins.open", _no_io), mock.patch("os.open", _no_io), \
                mock.patch("fsspec.core.url_to_fs", _no_io):
            plan = plan_reads(ptc, a, b, r)
        # pure: same inputs, same plan (of frozen, hashable items), inputs untouched, nothing read
        assert plan == plan_reads(ptc, a, b, r, writers=writers) and len(set(plan)) == len(plan)
        assert ptc.fingerprint() == fingerprint and len(CountingMemFS.reads) == mark
        assert all(isinstance(item, ReadItem) for item in plan)
        if plan:
            with pytest.raises(dataclasses.FrozenInstanceError):
                plan[0].a = 0  # type: ignore[misc]
        assert sum(item.length * item.itemsize for item in plan) == ptc.rank_nbytes(b, r)

        # executing it: every item once, exactly the planned byte ranges of the planned files
        buffers = shard_buffers(ptc, b, r)
        reader = PartReader(fs, sdir)
        reader.bind(Binding.of(manifest, writers))
        done: list[int] = []
        reader.read_items(plan, buffers, rank=r, on_read=done.append)
        assert sorted(done) == list(range(len(plan)))
        planned = []
        for item in plan:
            lo, hi = item.span
            chunk = reader.index(item.writer)["by_key"][(item.tensor, item.chunk_start)]
            assert chunk["block"] == item.block
            planned.append((data_name(item.writer), chunk["offset"] + lo, chunk["offset"] + hi))
        reader.close()
        if not url.startswith("countmem://"):  # local files: a block shared by pieces is read once
            assert reader.bytes_read == blocks_once(plan) and reader.ranges <= len(plan)
        else:
            assert reader.bytes_read == sum(item.nbytes for item in plan)
            assert reader.ranges == len(plan)
        if url.startswith("countmem://"):
            reads = data_reads(mark)
            got = sorted((p.rsplit("/", 1)[-1], start, end) for p, start, end, _ in reads)
            assert got == sorted(planned) and sum(n for *_, n in reads) == reader.bytes_read
        shard = {name: ptc.from_local_flat(name, b, buffers[name]) for name in ptc.rank_tensors(b, r)}
        assert_shard_equal(shard, {n: t for n, t in want[r].items() if n in ptc.tensors}, f"{a} -> {b} rank {r}")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_and_layouts(), st.sampled_from(["local", "countmem"]))
def test_plan_reads_is_pure_and_executing_it_reads_exactly_the_plan(case, where) -> None:  # noqa: ANN001
    if where == "local":
        with tempfile.TemporaryDirectory() as d:
            _check_plans(os.path.join(d, "ckpt"), case)
        return
    try:
        _check_plans(f"countmem://plan-{uuid.uuid4().hex[:8]}", case)
    finally:
        CountingMemFS.reset()


def test_tensors_of_one_geometry_get_the_plan_each_gets_alone() -> None:
    """Loads compute holder classes, cuts, boxes and panel views once per geometry (shape, order,
    placement), and equal placements are one object in a layout: each tensor's reads must still be
    exactly those it gets in a collection of its own (the writer aside, which balancing picks), and
    every read's chunk one the assignment gives its writer. Pure, under 0.1 s."""
    hsdp = Placed(NamedMesh((("dp_replicate", 2), ("dp_shard", 2))), (Replicate(), Shard(0)), (0, 1, 2, 3))
    fsdp_tp = Placed(NamedMesh((("dp_shard", 2), ("tp", 2))), (StridedShard(0, 2), Shard(0)), (0, 1, 2, 3))
    cols = Placed(NamedMesh((("tp", 4),)), (Shard(1),), (0, 1, 2, 3))
    rows = Placed(NamedMesh((("tp", 4),)), (Shard(0),), (3, 2, 1, 0))
    shapes = {f"{kind}{i}": ({"w": (64, 64), "u": (24, 16), "v": (13,)}[kind], torch.float32) for i in range(4) for kind in "wuv"}
    shapes["odd"] = ((9, 16), torch.float32)
    old = StateLayout.of(4, {n: (hsdp if n[0] != "u" else fsdp_tp) for n in shapes})
    new = StateLayout.of(4, {n: (cols if n[0] == "w" else rows) for n in shapes})
    assert len({id(p) for _, p in new.tensors}) == 2 and new.placed["w0"] is new.placed["w3"]
    ptc, _ = state_layout_of(descriptions(old, shapes))
    writers = writer_assignment(ptc, old)
    assigned = {(name, start, ln): w for w, chunks in writers.items() for name, _, start, ln in chunks}
    for rank in range(4):
        plan = plan_reads(ptc, old, new, rank, writers=writers)
        assert all(assigned[(i.tensor, i.chunk_start, i.chunk_length)] == i.writer for i in plan)
        for name in shapes:
            alone = PTC([ptc.tensors[name]], num_layers=0)
            one = lambda lay: StateLayout.of(4, {name: lay.placed[name]})  # noqa: E731
            want = [dataclasses.replace(i, writer=0) for i in plan_reads(alone, one(old), one(new), rank)]
            got = [dataclasses.replace(i, writer=0) for i in plan if i.tensor == name]
            assert got == want and sum(i.length for i in got) == new.local_shape(ptc.tensors[name], rank)[0] * (
                math.prod(new.local_shape(ptc.tensors[name], rank)[1:]))
