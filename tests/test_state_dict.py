"""Torch-native state dicts (#17): ``tenplex.layout.state_layout`` and ``tenplex.native.state_dict``.

Pure (one process, hypothesis): random tensors placed on random named meshes (Shard on any dim,
Replicate, FSDP2-over-TP ``StridedShard``; uneven and empty shards; 0-d to 3-d) saved under one
``StateLayout`` with ``tenplex.checkpoint.save`` for every rank and loaded under another: bit
exact, every element written once with balanced writers, and each load reads exactly the bytes
its plan needs (checksum blocks included). Real DTensors (one spawned gloo world of 4 that saves
FSDP2-over-TP model and AdamW state, then re-forms as worlds of 2 and 3 that load it).
Mismatches, disagreeing ranks and failing saves raise the documented errors; a tampered
``state_layout`` in a re-sealed manifest is never loaded silently (tally area "checkpoint").
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tenplex
from conftest import examples
from hostile import Tally
from spawned import free_port, run_spawned
import tenplex.checkpoint.part_reader as reader_mod
from tenplex.checkpoint import load, open_sealed_json, plan_reads, read_manifest, read_part_chunks, save, seal_json, writer_assignment
from tenplex.checkpoint.catalog import list_steps, read_manifest_at
from tenplex.checkpoint.format import Binding, panel_block
from tenplex.checkpoint.load import ReadOptions, read_shard
from tenplex.checkpoint.part_reader import PartReader, Scatter
from tenplex.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointValueError,
    CheckpointWriteError,
)
from tenplex.layout.mesh import NamedMesh, Replicate, Shard, StridedShard, local_box
from tenplex.layout.ptc import PTC, Panels, dtype_to_str
from tenplex.layout.state_layout import PANELS, Placed, StateLayout, panel_cuts, placement_text, spec_for
from tenplex.native.state_dict import _InPlace, load_state_dict, save_state_dict, state_layout_of

DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.uint8, torch.bool, torch.float64)


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------
def global_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Distinct bit patterns per element (random, so a misplaced element shows)."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(0, 200, shape, generator=g).to(dtype)


def local_of(g: torch.Tensor, placed: Placed, rank: int) -> torch.Tensor:
    """Job rank ``rank``'s local tensor of ``g``: what FSDP2 over TP stores (right to left)."""
    coords = placed.mesh.coords(placed.ranks.index(rank))
    box = local_box(tuple(g.shape), placed.mesh, placed.placements, coords, right_to_left=True)
    if not box:
        return g.clone()
    idx = [torch.tensor([i for r in ranges for i in r], dtype=torch.long) for ranges in box]
    return g[torch.meshgrid(*idx, indexing="ij")].clone()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (dtype, shape and every byte)."""
    return (a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def descriptions(layout: StateLayout, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> list[dict]:
    """Every rank's ``{key: description}`` as ``tenplex.native.state_dict`` gathers them from DTensors."""
    out: list[dict] = [{} for _ in range(layout.world_size)]
    for name, placed in layout.tensors:
        shape, dtype = shapes[name]
        desc = (list(shape), dtype_to_str(dtype), [list(d) for d in placed.mesh.dims],
                [placement_text(p) for p in placed.placements], list(placed.ranks))
        for r in placed.ranks:
            out[r][name] = desc
    return out


# ---------------------------------------------------------------------------------------------
# strategies: a tensor's placement on its own mesh, over a job of some world size
# ---------------------------------------------------------------------------------------------
@st.composite
def placed_on(draw: st.DrawFn, ndim: int, world: int) -> Placed:
    """A mesh (1-3 dims, at most ``world`` ranks) with Shard / Replicate on each dim, where a
    Shard of a dim that mesh dims to its right shard too may become FSDP2's StridedShard; or
    FSDP2 over TP itself, ``[StridedShard(0, tp), Shard(0)]`` on ``[dp_shard, tp]`` (HSDP too)."""
    if ndim and world >= 4 and draw(st.integers(0, 1)) == 0:
        tp = draw(st.integers(2, min(4, world // 2)))
        dp = draw(st.integers(2, world // tp))
        hsdp = world >= 2 * dp * tp and draw(st.booleans())
        mesh = NamedMesh(((("dp_replicate", 2),) if hsdp else ()) + (("dp_shard", dp), ("tp", tp)))
        placements = ((Replicate(),) if hsdp else ()) + (StridedShard(0, tp), Shard(0))
        return Placed(mesh, placements, draw(st.permutations(range(world)))[: mesh.world_size])
    sizes: list[int] = []
    for _ in range(draw(st.integers(1, 3))):
        room = world // math.prod(sizes or [1])
        if room < 1:
            break
        sizes.append(draw(st.integers(1, min(4, room))))
    mesh = NamedMesh(tuple((f"m{i}", s) for i, s in enumerate(sizes)))
    kinds = [draw(st.integers(0, ndim)) if ndim else 0 for _ in sizes]  # 0: Replicate, d + 1: Shard(d)
    placements: list[Any] = []
    for i, k in enumerate(kinds):
        if not k:
            placements.append(Replicate())
            continue
        right = math.prod(sizes[j] for j in range(i + 1, len(sizes)) if kinds[j] == k)
        strided = right > 1 and draw(st.booleans())
        placements.append(StridedShard(k - 1, right) if strided else Shard(k - 1))
    ranks = draw(st.permutations(range(world)))[: mesh.world_size]
    return Placed(mesh, tuple(placements), tuple(ranks))


@st.composite
def reshard_cases(draw: st.DrawFn, panels: bool = False) -> tuple[Any, ...]:
    """(shapes, saving layout, loading layout); ``panels``: also a panel count per tensor of >= 2
    dims (dim 1 a multiple of it, the tensors saved in ``Panels`` order), as a fourth element."""
    n = draw(st.integers(1, 3))
    shapes = {}
    counts: dict[str, int] = {}
    for i in range(n):
        ndim = draw(st.integers(2, 3)) if panels else draw(st.integers(0, 3))
        shape = tuple(draw(st.lists(st.integers(0, 9), min_size=ndim, max_size=ndim)))
        if ndim:  # rows that FSDP2 over TP splits unevenly more often
            shape = (draw(st.one_of(st.integers(0, 17), st.sampled_from([7, 9, 13, 17]))),) + shape[1:]
        if panels and ndim >= 2:
            count = draw(st.integers(1, 4))
            shape = (shape[0], count * draw(st.integers(0, 4))) + shape[2:]
            counts[f"t{i}"] = count
        shapes[f"t{i}"] = (shape, draw(st.sampled_from(DTYPES)))
    layouts = []
    for _ in range(2):
        world = draw(st.integers(1, 8))
        placed = {}
        for name, (shape, _) in shapes.items():
            if draw(st.integers(0, 4)) == 0:  # a plain tensor some ranks hold whole
                k = draw(st.integers(1, world))
                placed[name] = Placed.replicated(draw(st.permutations(range(world)))[:k])
            else:
                placed[name] = draw(placed_on(len(shape), world))
        layouts.append(StateLayout.of(world, placed))
    if panels:
        return shapes, layouts[0], layouts[1], counts
    return shapes, layouts[0], layouts[1]


def _save_all(url: str, shapes: dict, layout: StateLayout, seed: int, *, step: int = 1,
              objects: dict | None = None, panels: dict[str, int] | None = None) -> tuple[PTC, dict[str, torch.Tensor]]:
    """Save every rank's part of ``layout`` from one process; the collection and global tensors.
    ``panels``: tensors saved in the panel order of that many panels instead of ``spec_for``'s."""
    ptc, again = state_layout_of(descriptions(layout, shapes))
    assert again.placed == layout.placed
    specs = [dataclasses.replace(s, tp=Panels(1, panels[s.name])) if s.name in (panels or {}) else s
             for s in ptc.tensors.values()]
    ptc = PTC(specs, num_layers=0, objects=sorted(objects or {}), meta={"kind": "state_dict"})
    globals_ = {name: global_tensor(shape, dtype, seed + i) for i, (name, (shape, dtype)) in enumerate(shapes.items())}
    for rank in range(layout.world_size):
        shard: dict[str, Any] = {name: local_of(globals_[name], p, rank) for name, p in layout.tensors
                                 if rank in p.ranks}
        if rank == 0:
            shard.update(objects or {})
        save(url, ptc, layout, rank, shard, step=step, extra={"seed": seed})
    return ptc, globals_


# ---------------------------------------------------------------------------------------------
# 1. pure: save under layout A, load under layout B, one process
# ---------------------------------------------------------------------------------------------
def blocks_once(items: Any) -> int:
    """Bytes of the union of the items' block-rounded spans, chunk by chunk."""
    spans: dict[tuple[int, str, int], list[tuple[int, int]]] = {}
    for i in items:
        if i.b > i.a:
            spans.setdefault((i.writer, i.tensor, i.chunk_start), []).append(i.span)
    total = 0
    for pieces in spans.values():
        end = 0
        for lo, hi in sorted(pieces):
            total += max(0, hi - max(lo, end))
            end = max(end, hi)
    return total


def check_writers(ptc: PTC, layout: StateLayout, sdir: Path) -> None:
    """Every element written exactly once (replicas deduplicated), by the files on disk too, and
    each writer's load at most its last chunk above that of every other holder of that chunk."""
    writers = writer_assignment(ptc, layout)
    for name, spec in ptc.tensors.items():
        chunks = sorted((s, n) for cs in writers.values() for t, _, s, n in cs if t == name)
        assert sum(n for _, n in chunks) == spec.numel, name
        assert all(n > 0 for _, n in chunks)
        assert all(s + n <= s2 for (s, n), (s2, _) in zip(chunks, chunks[1:])), (name, chunks)  # disjoint
    on_disk: dict[str, int] = {}
    for rank in range(layout.world_size):
        chunks = read_part_chunks(str(sdir), rank)
        got = sorted((c["tensor"], c["start"], c["length"]) for c in chunks)
        assert got == sorted((t, s, n) for t, _, s, n in writers[rank]), rank
        for c in chunks:
            on_disk[c["tensor"]] = on_disk.get(c["tensor"], 0) + c["length"]
    assert on_disk == {n: s.numel for n, s in ptc.tensors.items() if s.numel}
    # balance (the greedy's invariant): when w took its last chunk it had the least load of that
    # chunk's holders, whose loads only grew since
    load_ = {w: sum(n * ptc.tensors[t].itemsize for t, _, _, n in cs) for w, cs in writers.items()}
    for w, cs in writers.items():
        if not cs:
            continue
        t, _, s, n = cs[-1]
        table = layout.holder_table(ptc.tensors[t])
        holders = set(table.rank[(table.start <= s) & (table.start + table.length >= s + n)].tolist())
        assert w in holders
        last = n * ptc.tensors[t].itemsize
        assert all(load_[w] - last <= load_[h] for h in holders), (w, holders, load_)


@given(reshard_cases(), st.integers(0, 2**16))
@settings(max_examples=examples(40))
def test_save_under_one_layout_load_under_another(case: tuple, seed: int) -> None:
    _reshard_round_trip(*case, seed)


@given(reshard_cases(panels=True), st.integers(0, 2**16))
@settings(max_examples=examples(40))
def test_panels_save_under_one_layout_load_under_another(case: tuple, seed: int) -> None:
    """The same with 2-D and 3-D tensors in panel order (any panel count dividing dim 1, uneven row
    and column splits included), loaded both into new tensors and in place (``load_state_dict``'s sink)."""
    shapes, saved, new, counts = case
    _reshard_round_trip(shapes, saved, new, seed, counts)


def _reshard_round_trip(shapes: dict, saved: StateLayout, new: StateLayout, seed: int,
                        panels: dict[str, int] | None = None) -> None:
    with tempfile.TemporaryDirectory() as url:
        ptc, globals_ = _save_all(url, shapes, saved, seed, objects={"step": seed, "groups": [{"lr": 0.5}]},
                                  panels=panels)
        assert all(ptc.tensors[n].panels == c for n, c in (panels or {}).items())
        sdir = next(Path(url).iterdir())
        check_writers(ptc, saved, sdir)
        for rank in range(new.world_size):
            res = load(url, new, rank)
            assert res.step == 1 and res.extra == {"seed": seed} and res.saved_layout == saved
            assert res.shard.pop("step") == seed and res.shard.pop("groups") == [{"lr": 0.5}]
            mine = [name for name, p in new.tensors if rank in p.ranks]
            assert sorted(res.shard) == sorted(mine)
            for name in mine:
                want = local_of(globals_[name], new.placed[name], rank)
                assert same(res.shard[name], want), (name, rank)
            items = plan_reads(res.ptc, saved, new, rank)
            exact = sum(local_of(globals_[n], new.placed[n], rank).numel() * globals_[n].element_size() for n in mine)
            assert res.stats.bytes_needed == exact == sum(i.length * i.itemsize for i in items)
            # local files: exactly the blocks planned, each once (pieces sharing a block read it once)
            assert res.stats.bytes_read == blocks_once(items)
            # each read rounds out to whole checksum blocks at its two ends, at most
            assert res.stats.bytes_read <= exact + sum(2 * (i.block - 1) for i in items)
            if panels:  # in place, into the caller's tensors (pre-filled with other values)
                locals_ = {n: torch.zeros_like(local_of(globals_[n], new.placed[n], rank)) for n in mine}
                sink = _InPlace(locals_, new, rank)
                got = load(url, new, rank, options=ReadOptions(sink=sink, check=sink.bind))
                assert got.stats.bytes_needed == exact
                for name in mine:
                    assert got.shard[name] is locals_[name]
                    assert same(locals_[name], local_of(globals_[name], new.placed[name], rank)), (name, rank)


def test_named_reshards() -> None:
    """FSDP2 over TP with uneven rows (9 rows on dp_shard=2,tp=2 and dp_shard=4,tp=2; 3 rows on dp_shard=2,tp=4), HSDP,
    a sub-mesh (a pipeline stage), a 0-d and an empty tensor: saved, loaded under other meshes."""
    m22, m24 = NamedMesh.parse("dp_shard=2,tp=2"), NamedMesh.parse("dp_shard=2,tp=4")
    shapes = {"w": ((9, 5), torch.float32), "v": ((3, 4), torch.bfloat16), "h": ((7, 3, 2), torch.float16),
              "u": ((9, 4), torch.float32), "u3": ((7, 3), torch.float64),
              "stage1": ((6, 2), torch.float32), "s": ((), torch.int64), "e": ((0, 4), torch.float32)}
    saved = StateLayout.of(8, {
        "w": Placed(m22, (StridedShard(0, 2), Shard(0)), range(4)),
        "v": Placed(m24, (StridedShard(0, 4), Shard(0)), range(8)),
        # where FSDP2's storage and DTensor's StridedShard arithmetic differ (row 8 at (3, 1), not (3, 0))
        "u": Placed(NamedMesh.parse("dp_shard=4,tp=2"), (StridedShard(0, 2), Shard(0)), range(8)),
        "u3": Placed(NamedMesh.parse("dp_shard=3,tp=2"), (StridedShard(0, 2), Shard(0)), (7, 6, 5, 4, 3, 2)),
        "h": Placed(NamedMesh.parse("r=2,s=2,tp=2"), (Replicate(), StridedShard(0, 2), Shard(0)), range(8)),
        "stage1": Placed(NamedMesh.parse("dp=2,tp=2"), (Shard(0), Shard(1)), (4, 5, 6, 7)),
        "s": Placed.replicated(range(8)),
        "e": Placed(m22, (Shard(0), Shard(1)), range(4)),
    })
    loads = [
        StateLayout.of(2, {n: Placed(NamedMesh.parse("tp=2"), (Shard(1 if len(s) > 1 else 0),) if s else
                                     (Replicate(),), (1, 0)) for n, (s, _) in shapes.items()}),
        StateLayout.of(3, {n: Placed(NamedMesh.parse("fsdp=3"), (Shard(0),) if s else (Replicate(),), (0, 1, 2))
                           for n, (s, _) in shapes.items()}),
        StateLayout.of(1, {n: Placed.replicated([0]) for n in shapes}),
    ]
    with tempfile.TemporaryDirectory() as url:
        ptc, globals_ = _save_all(url, shapes, saved, 3)
        check_writers(ptc, saved, next(Path(url).iterdir()))
        for new in loads:
            for rank in range(new.world_size):
                res = load(url, new, rank)
                for name, p in new.tensors:
                    assert same(res.shard[name], local_of(globals_[name], p, rank)), (name, rank)
                assert res.stats.bytes_read == blocks_once(plan_reads(res.ptc, saved, new, rank))
        # the one-rank load read every byte of every tensor once: no amplification beyond blocks
        res = load(url, loads[2], 0)
        assert res.stats.bytes_needed == sum(t.numel() * t.element_size() for t in globals_.values())


def test_replicated_writes_are_balanced() -> None:
    """Tensors every rank holds whole: each written once, max per-rank bytes <= min + the largest chunk."""
    shapes = {f"t{i}": ((i + 1, 3), torch.float32) for i in range(12)}
    layout = StateLayout.of(5, {n: Placed.replicated(range(5)) for n in shapes})
    ptc, _ = state_layout_of(descriptions(layout, shapes))
    writers = writer_assignment(ptc, layout)
    per = [sum(n * 4 for *_, n in writers[r]) for r in range(5)]
    largest = max(n * 4 for cs in writers.values() for *_, n in cs)
    assert sum(per) == sum(s.nbytes for s in ptc.tensors.values())
    assert max(per) <= min(per) + largest, per


def test_ranks_disagreeing_on_a_key_are_named() -> None:
    layout = StateLayout.of(2, {"model.w": Placed(NamedMesh.parse("dp=2"), (Shard(0),), (0, 1))})
    descs = descriptions(layout, {"model.w": ((4, 2), torch.float32)})
    descs[1]["model.w"] = ([5, 2], *descs[1]["model.w"][1:])
    with pytest.raises(CheckpointValueError, match=r"model\.w: ranks disagree on its global shape: rank 0 has shape "
                                                   r"\[4, 2\].*rank 1 has shape \[5, 2\]"):
        state_layout_of(descs)
    descs = descriptions(layout, {"model.w": ((4, 2), torch.float32)})
    descs[1]["model.w"] = (descs[1]["model.w"][0], "bfloat16", *descs[1]["model.w"][2:])
    with pytest.raises(CheckpointValueError, match=r"model\.w: ranks disagree on its dtype: rank 0 has shape \[4, 2\] "
                                                   r"float32.* but rank 1 has shape \[4, 2\] bfloat16"):
        state_layout_of(descs)
    descs = descriptions(layout, {"model.w": ((4, 2), torch.float32)})
    del descs[1]["model.w"]  # a DTensor of a 2-rank mesh that one rank leaves out
    with pytest.raises(CheckpointValueError, match=r"model\.w is a DTensor on ranks \[0, 1\] but ranks \[0\]"):
        state_layout_of(descs)


# ---------------------------------------------------------------------------------------------
# 3. one process, no torch.distributed: save_state_dict / load_state_dict and their errors
# ---------------------------------------------------------------------------------------------
def _sd(seed: int, fill: float | None = None) -> dict[str, Any]:
    def t(shape: tuple[int, ...], dtype: torch.dtype, i: int) -> torch.Tensor:
        g = global_tensor(shape, dtype, seed + i)
        return g if fill is None else torch.full_like(g, fill)

    return {"model": {"w": t((5, 3), torch.float32, 0), "b": t((3,), torch.bfloat16, 1),
                      "deep": {"x": t((2, 0, 4), torch.float32, 2), "n": t((), torch.int64, 3)}},
            "optim": {"state": {"w": {"exp_avg": t((5, 3), torch.float32, 4)}},
                      "param_groups": [{"lr": 0.1 * (seed + 1), "params": ["model.w"]}]},
            "step": seed, "rng": [seed, "x"]}


def _tensors(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    from tenplex.native.state_dict import flatten_state_dict

    return {k: v for k, (_, _, v) in flatten_state_dict(sd).items() if isinstance(v, torch.Tensor)}


def test_single_process_round_trip_in_place(tmp_path: Path) -> None:
    url = str(tmp_path)
    src = _sd(1)
    r = save_state_dict(src, url, step=3, extra={"loss": 1.25})
    assert r.step == 3 and r.rank == 0
    save_state_dict(_sd(2), url, step=5)
    dst = _sd(0, fill=0.0)
    ptrs = {k: v.data_ptr() for k, v in _tensors(dst).items()}
    res = load_state_dict(dst, url, step=3)
    assert res.step == 3 and res.extra == {"loss": 1.25} and res.skipped == ()
    for k, v in _tensors(src).items():
        got = _tensors(dst)[k]
        assert same(got, v), k
        assert got.data_ptr() == ptrs[k], f"{k} was replaced, not filled in place"
    assert dst["step"] == 1 and dst["rng"] == [1, "x"] and dst["optim"]["param_groups"] == src["optim"]["param_groups"]
    assert res.bytes_needed == sum(t.numel() * t.element_size() for t in _tensors(src).values())
    assert res.bytes_needed <= res.bytes_read
    newest = load_state_dict(_sd(0, fill=0.0), url)  # default: the newest step
    assert newest.step == 5
    # a non-contiguous destination (a transposed view) is filled through a temporary
    dst = _sd(0, fill=0.0)
    dst["model"]["w"] = torch.zeros(3, 5).t()
    load_state_dict(dst, url, step=3)
    assert torch.equal(dst["model"]["w"], src["model"]["w"])


@pytest.mark.parametrize("change", ["missing", "extra", "shape", "dtype", "kind"])
def test_mismatches_are_named_and_read_nothing(tmp_path: Path, change: str) -> None:
    url = str(tmp_path)
    save_state_dict(_sd(1), url, step=3)
    dst = _sd(0, fill=7.0)
    if change == "missing":  # a subset of the checkpoint's keys: refused under strict=True only
        del dst["model"]["b"]
        match = r"the state dict lacks 1 keys of the checkpoint, e\.g\. \['model\.b'\] \(strict=True"
    elif change == "extra":
        dst["model"]["new"] = torch.zeros(2)
        match = r"the checkpoint lacks 1 keys of the state dict, e\.g\. \['model\.new'\]"
    elif change == "shape":
        dst["model"]["w"] = torch.full((5, 4), 7.0)
        match = r"model\.w: the checkpoint has shape \[5, 3\] float32, the state dict \[5, 4\] float32"
    elif change == "dtype":
        dst["model"]["w"] = torch.full((5, 3), 7.0, dtype=torch.float64)
        match = r"model\.w: the checkpoint has shape \[5, 3\] float32, the state dict \[5, 3\] float64"
    else:
        dst["step"] = torch.zeros(1)
        match = r"\['step'\] are tensors on one side and other values on the other"
    before = {k: v.clone() for k, v in _tensors(dst).items()}
    with pytest.raises(CheckpointMismatchError, match=match):
        load_state_dict(dst, url, strict=True)
    for k, v in _tensors(dst).items():
        assert same(v, before[k]), f"{k} changed although the load was refused"
    assert dst["step"] is not None and (change == "kind" or dst["step"] == 0)


def test_partial_loads_read_only_their_keys_and_strict_refuses_them(tmp_path: Path) -> None:
    """As dcp.load: a state dict with a subset of the checkpoint's keys (torchtitan's
    exclude_from_loading drops the data loader and LR scheduler) loads those keys and reads no byte
    of the others; strict=True refuses it, naming the keys; a key the checkpoint lacks is refused."""
    url = str(tmp_path)
    src = _sd(1)
    save_state_dict(src, url, step=3)
    full = load_state_dict(_sd(0, fill=0.0), url)
    dst = _sd(0, fill=0.0)
    del dst["optim"], dst["rng"]
    res = load_state_dict(dst, url)
    assert res.step == 3 and dst["step"] == 1 and "optim" not in dst and "rng" not in dst
    for k, v in _tensors(dst).items():
        assert same(v, _tensors(src)[k]), k
    assert res.bytes_needed == sum(t.numel() * t.element_size() for t in _tensors(dst).values())
    assert res.bytes_needed < full.bytes_needed and res.bytes_read < full.bytes_read
    optim = _tensors({"optim": src["optim"]})["optim.state.w.exp_avg"]
    assert full.bytes_read - res.bytes_read >= optim.numel() * optim.element_size()
    # only the model's tensors: everything else of the checkpoint left alone
    model = {"model": _sd(0, fill=0.0)["model"]}
    load_state_dict(model, url)
    assert all(same(v, _tensors(src)[k]) for k, v in _tensors(model).items())
    with pytest.raises(CheckpointMismatchError, match=r"lacks 4 keys of the checkpoint, e\.g\. \['optim\.param_groups', "
                                                      r"'optim\.state\.w\.exp_avg', 'rng', 'step'\] \(strict=True"):
        load_state_dict({"model": _sd(0, fill=0.0)["model"]}, url, strict=True)
    load_state_dict(_sd(0, fill=0.0), url, strict=True)  # every key: strict loads it
    bad = {"model": _sd(0, fill=0.0)["model"], "dataloader": {"dp_rank_2": b"x"}}
    with pytest.raises(CheckpointMismatchError, match=r"the checkpoint lacks 1 keys of the state dict, e\.g\. "
                                                      r"\['dataloader\.dp_rank_2'\]"):
        load_state_dict(bad, url)


class _Counter:
    """A Stateful that is not a module: its state_dict() holds a tensor and a number; records loads."""

    def __init__(self, seed: int) -> None:
        self.buf = global_tensor((4, 3), torch.float32, seed)
        self.n = seed
        self.loaded: list[dict[str, Any]] = []

    def state_dict(self) -> dict[str, Any]:
        return {"buf": self.buf, "n": self.n, "nested": {"k": self.n * 2}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loaded.append(sd)
        self.n = sd["n"]


def _stateful_job(seed: int, fill: float | None = None) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    if fill is not None:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(fill)
    return {"model": model, "counter": _Counter(seed), "step": seed}


def test_stateful_values_saved_and_loaded_as_dcp_does(tmp_path: Path) -> None:
    """Top-level Stateful values (a module, an object with state_dict/load_state_dict) are saved as
    their state_dict() under their key, with the keys dcp.save gives them; a load fills their
    state_dict() in place (the module's own parameters) and then calls their load_state_dict with the
    filled dict. Before: a module was pickled as one opaque object, and a load replaced the caller's
    module by a copy, leaving the model the job trains unchanged."""
    import torch.distributed.checkpoint as dcp

    src = _stateful_job(1)
    url = str(tmp_path / "tenplex")
    save_state_dict(src, url, step=2)
    dcp.save(_stateful_job(1), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    md = dcp.FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    ptc = read_manifest(url)["ptc"]
    assert set(ptc.tensors) | set(ptc.objects) == set(md.state_dict_metadata)
    assert "model.0.weight" in ptc.tensors and "counter.buf" in ptc.tensors

    dst = _stateful_job(5, fill=0.0)
    model, counter = dst["model"], dst["counter"]
    ptrs = [p.data_ptr() for p in model.parameters()] + [counter.buf.data_ptr()]
    load_state_dict(dst, url)
    assert dst["model"] is model and dst["counter"] is counter, "a Stateful value was replaced, not loaded into"
    for (k, got), ref in zip(model.state_dict().items(), src["model"].state_dict().values()):
        assert same(got, ref), k
    assert [p.data_ptr() for p in model.parameters()] + [counter.buf.data_ptr()] == ptrs
    assert same(counter.buf, src["counter"].buf) and counter.n == 1 and dst["step"] == 1
    assert len(counter.loaded) == 1 and counter.loaded[0]["buf"] is counter.buf
    assert counter.loaded[0]["nested"] == {"k": 2}
    # DCP reads the same Stateful state dict from the tenplex checkpoint too
    from tenplex.checkpoint.dcp_storage import TenplexStorageReader

    again = _stateful_job(7, fill=0.0)
    dcp.load(again, storage_reader=TenplexStorageReader(url), no_dist=True)
    assert all(same(a, b) for a, b in zip(again["model"].state_dict().values(), src["model"].state_dict().values()))
    # tenplex's test is the protocol's own isinstance (without importing DCP)
    from torch.distributed.checkpoint.stateful import Stateful

    from tenplex.native.state_dict import is_stateful

    assert all(is_stateful(v) == isinstance(v, Stateful) for v in (*src.values(), {}, torch.zeros(1), object()))


def test_bad_saves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = str(tmp_path / "ck")
    for step in (-1, 2**70, 1.5, "3"):
        with pytest.raises(CheckpointValueError):
            save_state_dict(_sd(1), url, step=step)  # type: ignore[arg-type]
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())
    with pytest.raises(CheckpointValueError, match="not a string"):
        save_state_dict({1: torch.zeros(1)}, url, step=1)
    with pytest.raises(CheckpointValueError, match="flatten to the key 'a.b'"):
        save_state_dict({"a": {"b": torch.zeros(1)}, "a.b": 1}, url, step=1)

    import tenplex.native.state_dict as tsd

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise OSError("disk full")

    monkeypatch.setattr(tsd, "save", broken)
    with pytest.raises(CheckpointWriteError, match=r"failed on 1 of 1 ranks: rank 0: OSError: disk full"):
        save_state_dict(_sd(1), url, step=1)


# ---------------------------------------------------------------------------------------------
# 4. hostile: a tampered state_layout in a re-sealed manifest
# ---------------------------------------------------------------------------------------------
_H_SHAPES = {"a": ((5, 3), torch.float32), "b": ((4,), torch.bfloat16), "c": ((3, 2), torch.float32)}
_H_SAVED = StateLayout.of(4, {
    "a": Placed(NamedMesh.parse("dp=2,tp=2"), (StridedShard(0, 2), Shard(0)), (0, 1, 2, 3)),
    "b": Placed.replicated((1, 3)),
    "c": Placed(NamedMesh.parse("tp=2"), (Shard(1),), (2, 0)),
})
_H_NEW = StateLayout.of(1, {n: Placed.replicated([0]) for n in _H_SHAPES})


def _h_outcome(url: str, ref: Any) -> str:
    try:
        res = load(url, _H_NEW, 0)
    except CheckpointCorruptError:
        return "detected"
    except CheckpointError:
        return "refused"
    if res.step == ref.step and res.extra == ref.extra and set(res.shard) == set(ref.shard) and all(
            same(res.shard[k], v) if isinstance(v, torch.Tensor) else res.shard[k] == v
            for k, v in ref.shard.items()):
        return "identical"
    return "silent"


def _retarget(obj: dict[str, Any]) -> dict[str, Any]:
    """The manifest with ``layout`` naming its (tampered) state_layout when that parses, so the
    check that the two agree is not what catches the tampering."""
    try:
        return {**obj, "layout": str(StateLayout.from_json(obj["state_layout"]))}
    except (TypeError, ValueError, KeyError):
        return obj


def _tampered_layouts(sl: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    meshes, tensors = sl["meshes"], sl["tensors"]
    a_mesh = tensors[0][1]

    def with_mesh(i: int, mesh: list) -> dict[str, Any]:
        return {**sl, "meshes": [mesh if j == i else m for j, m in enumerate(meshes)]}

    def with_tensors(ts: list) -> dict[str, Any]:
        return {**sl, "tensors": ts}

    dims, ranks = meshes[a_mesh]
    return [
        ("a rank outside the world", with_mesh(a_mesh, [dims, [0, 1, 2, 4]])),
        ("a negative rank", with_mesh(a_mesh, [dims, [0, 1, 2, -1]])),
        ("a rank twice", with_mesh(a_mesh, [dims, [0, 1, 2, 2]])),
        ("fewer ranks than the mesh", with_mesh(a_mesh, [dims, [0, 1, 2]])),
        ("a smaller world", {**sl, "world_size": 3}),
        ("a placement on a dim the tensor lacks", with_tensors([[n, i, ["S2", "S0"] if n == "a" else p]
                                                               for n, i, p in tensors])),
        ("a placement of a 1-d tensor on dim 1", with_tensors([[n, i, ["S1"] if n == "b" else p]
                                                              for n, i, p in tensors])),
        ("a wrong split factor", with_tensors([[n, i, ["SS0/3", "S0"] if n == "a" else p] for n, i, p in tensors])),
        ("one placement for a 2-d mesh", with_tensors([[n, i, ["S0"] if n == "a" else p] for n, i, p in tensors])),
        ("an unknown placement", with_tensors([[n, i, ["P", "S0"] if n == "a" else p] for n, i, p in tensors])),
        ("a tensor left out", with_tensors([t for t in tensors if t[0] != "c"])),
        ("a tensor twice", with_tensors([*tensors, tensors[0]])),
        ("a tensor the collection lacks", with_tensors([*tensors, ["zz", a_mesh, ["R", "R"]]])),
        ("a mesh index out of range", with_tensors([[n, 9 if n == "a" else i, p] for n, i, p in tensors])),
        ("consistent, other placements", with_tensors([[n, i, ["S1", "S0"] if n == "a" else p]
                                                      for n, i, p in tensors])),
        ("consistent, other ranks", with_mesh(a_mesh, [dims, ranks[::-1]])),
        ("consistent, other mesh", with_mesh(a_mesh, [[[dims[0][0], 4], [dims[1][0], 1]], ranks])),
    ]


@pytest.mark.timeout(120)
def test_tampered_state_layout_is_never_loaded(tmp_path: Path) -> None:
    t = Tally.of("checkpoint")
    url = str(tmp_path)
    _save_all(url, _H_SHAPES, _H_SAVED, 11, objects={"step": 4})
    ref = load(url, _H_NEW, 0)
    path = next(tmp_path.iterdir()) / "manifest.json"
    raw = path.read_bytes()
    obj = open_sealed_json(raw, "manifest")
    assert StateLayout.from_json(obj["state_layout"]) == _H_SAVED
    for what, sl in _tampered_layouts(obj["state_layout"]):
        for retarget in (False, True):
            tampered = {**obj, "state_layout": sl}
            path.write_bytes(seal_json(_retarget(tampered) if retarget else tampered))
            o = _h_outcome(url, ref)
            t.record(o, f"state_layout: {what}{' (layout renamed)' if retarget else ''}")
            assert o == "detected", (what, retarget, o)
    # every leaf of the state layout replaced by hostile values of other types and ranges
    hostile = (None, True, -1, 0, 3, 2**70, 1.5, "", "x", "S0", [], {}, [1], {"a": 1})

    def leaves(o: Any, where: tuple = ()) -> Any:
        yield where
        if isinstance(o, dict):
            for k, v in o.items():
                yield from leaves(v, (*where, k))
        elif isinstance(o, list):
            for i, v in enumerate(o):
                yield from leaves(v, (*where, i))

    def replaced(o: Any, where: tuple, value: Any) -> Any:
        if not where:
            return value
        out = dict(o) if isinstance(o, dict) else list(o)
        out[where[0]] = replaced(o[where[0]], where[1:], value)
        return out

    for where in list(leaves(obj["state_layout"])):
        for value in hostile:
            tampered = {**obj, "state_layout": replaced(obj["state_layout"], where, value)}
            path.write_bytes(seal_json(_retarget(tampered)))
            o = _h_outcome(url, ref)
            t.record(o, f"state_layout.{'.'.join(map(str, where))} = {value!r}")
            assert o in ("detected", "refused", "identical"), (where, value, o)
    path.write_bytes(raw)
    assert _h_outcome(url, ref) == "identical"
    t.assert_none_silent()


# ---------------------------------------------------------------------------------------------
# 2. real DTensors: a gloo world of 4 saves, then re-forms as worlds of 2 and 3 that load
# ---------------------------------------------------------------------------------------------
_EXTRA = {"a": ((9, 6), torch.float32), "b": ((7, 5), torch.bfloat16), "c": ((11,), torch.float32),
          "e": ((10, 3), torch.float32)}


def _model(mesh: Any, tp: bool, fsdp: str | None, lr: float, seed: int) -> tuple[Any, Any]:
    """Linear(30, 17), Linear(17, 9) (uneven on purpose): TP (column- then row-wise) on ``mesh["tp"]``
    when ``tp``, FSDP2 on ``mesh[fsdp]`` when given; AdamW."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(30, 17), nn.Linear(17, 9))
    if tp:
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
    if fsdp:
        fully_shard(model, mesh=mesh[fsdp])
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def _full(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in _tensors(sd).items()}


def _diff(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> list[str]:
    bad = [k for k in sorted(set(got) | set(ref)) if k not in got or k not in ref or not same(got[k], ref[k])]
    return [f"{k}: {tuple(got[k].shape) if k in got else None} vs {tuple(ref[k].shape) if k in ref else None}"
            for k in bad]


def _save_world(rank: int, url: str, res: dict[str, Any]) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model, optim = _model(mesh, True, "dp_shard", 0.01, 0)
    for i in range(2):  # no forward: torch's TP cannot run 17 features on 2 ranks, but it can store them
        for p in model.parameters():
            p.grad = p.detach() * (0.5 + i)
        optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    g = {k: global_tensor(s, d, i) for i, (k, (s, d)) in enumerate(_EXTRA.items())}
    sd = {"model": model_sd, "optim": optim_sd,
          "x": {"a": distribute_tensor(g["a"], mesh, [TShard(0), TShard(1)]),
                "b": distribute_tensor(g["b"], mesh, [TReplicate(), TShard(0)]),
                "c": g["c"],  # a plain tensor every rank holds
                "e": distribute_tensor(g["e"], mesh, [TShard(0), TShard(0)]),
                "meta": {"names": ["a", "b"], "n": 3}},
          "step": 7, "groups": [{"lr": 0.25}]}
    res["placements"] = sorted({f"{k}: {v.placements}" for k, v in _tensors(sd).items() if hasattr(v, "placements")})
    r = save_state_dict(sd, url, step=3, extra={"loss": 0.5, "ranks": 4})
    res["written"] = r.bytes_written
    full = _full(sd)
    if rank == 0:
        torch.save({"tensors": full, "param_groups": optim_sd["param_groups"]}, f"{url}/../reference.pt")
    dist.barrier()


def _load_world(rank: int, world: int, url: str, res: dict[str, Any]) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor import distribute_tensor

    ref = torch.load(f"{url}/../reference.pt", weights_only=True)
    if world == 2:  # one rank's failure fails every rank, none is left waiting in a collective
        errors = []
        bad: dict[Any, Any] = {1: torch.zeros(2)} if rank == 1 else {"ok": torch.zeros(2)}
        try:
            save_state_dict(bad, f"{url}-bad", step=1)
        except CheckpointValueError as e:
            errors.append(str(e))
    if world == 2:  # TP only
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        model, optim = _model(mesh, True, None, 0.5, 1)
        x = {"a": [TShard(1)], "b": [TReplicate()], "e": [TShard(0)]}
    else:  # FSDP2 over 3 ranks (17 rows: 6, 6, 5)
        mesh = init_device_mesh("cpu", (3,), mesh_dim_names=("dp_shard",))
        model, optim = _model(mesh, False, "dp_shard", 0.5, 1)
        x = {"a": [TShard(0)], "b": [TShard(1)], "e": [TReplicate()]}
    model_sd, optim_sd = get_state_dict(model, optim)  # creates the optimizer state to load into
    zeros = {k: torch.zeros(s, dtype=d) for k, (s, d) in _EXTRA.items()}
    sd = {"model": model_sd, "optim": optim_sd,
          "x": {**{k: distribute_tensor(zeros[k], mesh, p) for k, p in x.items()}, "c": zeros["c"],
                "meta": {"names": None, "n": 0}},  # nested dicts are flattened (as DCP does): same keys
          "step": 0, "groups": None}
    if world == 2:  # a mismatch on rank 1 only: rank 0 raises too instead of waiting for it
        c = sd["x"]["c"]
        if rank == 1:
            sd["x"]["c"] = torch.zeros(12)
        try:
            load_state_dict(sd, url)
        except CheckpointMismatchError as e:
            errors.append(str(e))
        sd["x"]["c"] = c
        res["collective_errors"] = errors
    ptrs = {k: (v.to_local() if hasattr(v, "to_local") else v).data_ptr() for k, v in _tensors(sd).items()}
    r = load_state_dict(sd, url)
    res["load"] = (r.step, r.extra, r.bytes_read, r.bytes_needed)
    res["in_place"] = all((v.to_local() if hasattr(v, "to_local") else v).data_ptr() == ptrs[k]
                          for k, v in _tensors(sd).items())
    want = ref["tensors"]
    res["diff_loaded"] = _diff(_full(sd), want)
    res["objects"] = (sd["step"], sd["groups"], sd["x"]["meta"], sd["optim"]["param_groups"] == ref["param_groups"])
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    model_sd2, optim_sd2 = get_state_dict(model, optim)
    res["diff_set"] = _diff(_full({"model": model_sd2, "optim": optim_sd2}),
                            {k: v for k, v in want.items() if not k.startswith("x.")})
    res["lr"] = [g["lr"] for g in optim.param_groups]
    dist.barrier()


def _world_worker(rank: int, ports: tuple[int, int, int], url: str, out: Any) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    for phase, world in (("save", 4), ("load2", 2), ("load3", 3)):
        if rank >= world:
            continue
        res: dict[str, Any] = {"error": None, "seconds": 0.0}
        t0 = time.perf_counter()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[world - 2 if world < 4 else 2]}",
                                rank=rank, world_size=world)
        try:
            if phase == "save":
                _save_world(rank, url, res)
            else:
                _load_world(rank, world, url, res)
        except BaseException as e:  # reported to the parent, which fails the test with it
            import traceback

            res["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2500:]}"
        finally:
            res["seconds"] = time.perf_counter() - t0
            out.put((phase, rank, res))
            dist.destroy_process_group()
        if res["error"]:
            return


@pytest.mark.timeout(180)
def test_real_dtensors_save_in_4_load_in_2_and_3(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    ports = (free_port(), free_port(), free_port())
    results = run_spawned(_world_worker, [(r, ports, url) for r in range(4)], expect=9, timeout=150)
    errors = [f"{phase} rank {r}: {res['error']}" for (phase, r), res in results.items() if res["error"]]
    assert not errors, "\n".join(errors)
    placements = results[("save", 0)]["placements"]
    assert any("_StridedShard" in p for p in placements), placements  # FSDP2 over TP really was saved
    for (phase, rank), res in sorted(results.items()):
        if phase == "save":
            continue
        assert not res["diff_loaded"], (phase, rank, res["diff_loaded"])
        assert not res["diff_set"], (phase, rank, res["diff_set"])
        assert res["in_place"], (phase, rank)
        step, extra, read, needed = res["load"]
        assert (step, extra) == (3, {"loss": 0.5, "ranks": 4}) and needed <= read
        assert res["objects"] == (7, [{"lr": 0.25}], {"names": ["a", "b"], "n": 3}, True), res["objects"]
        assert res["lr"] == [0.01], res["lr"]
        if phase == "load2":
            save_error, load_error = res["collective_errors"]
            assert "state dict key 1 under 'the top level' is not a string" in save_error
            assert (rank == 1) != ("saving step 1" in save_error and "failed on 1 of 2 ranks: rank 1:" in save_error)
            assert "x.c: the checkpoint has shape [11] float32, the state dict [12] float32" in load_error
            assert (rank == 1) != ("failed on 1 of 2 ranks: rank 1: CheckpointMismatchError" in load_error)
    print("\n" + ", ".join(f"{ph}/{r}: {res['seconds']:.1f}s" for (ph, r), res in sorted(results.items())))


def test_load_into_parameters_that_require_grad(tmp_path: Path) -> None:
    """A state dict of the module's parameters themselves (``named_parameters``, ``keep_vars=True``):
    filled in place without autograd, in memory order and through a temporary (a transposed view)."""
    src = torch.nn.Linear(3, 4)
    save_state_dict({"w": src.weight, "t": src.weight.t(), "b": src.bias}, str(tmp_path), step=1)
    dst = torch.nn.Linear(3, 4)
    tp = torch.nn.Parameter(torch.zeros(4, 3).t())
    sd = {"w": dst.weight, "t": tp, "b": dst.bias}
    ptr = dst.weight.data_ptr()
    load_state_dict(sd, str(tmp_path))
    assert sd["w"] is dst.weight and dst.weight.data_ptr() == ptr and dst.weight.requires_grad
    assert torch.equal(dst.weight, src.weight) and torch.equal(dst.bias, src.bias) and torch.equal(tp, src.weight.t())
    assert dst.weight.grad_fn is None and tp.grad_fn is None


def test_spec_for_panels_rule_and_in_place_round_trip(tmp_path: Path) -> None:
    """``spec_for`` puts big 2-D tensors (64 x 64 and up, columns a multiple of 8) in panel order,
    small ones and 1-D ones not; ``save_state_dict`` / ``load_state_dict`` round-trip them in place."""
    assert spec_for("w", (64, 64), "float32", (Shard(0),)).panels == PANELS
    assert spec_for("w", (64, 64, 2), "float32", (Shard(1),)).panels == PANELS
    assert spec_for("w", (64, 64, 2), "float32", (Shard(2),)).split_dim == 2
    assert spec_for("w", (63, 64), "float32", (Shard(1),)).split_dim == 1
    assert spec_for("w", (64, 60), "float32", (Replicate(),)).panels is None
    assert spec_for("w", (4096,), "float32", (Shard(0),)).panels is None
    odd = spec_for("w2", (224, 669), "float32", (Shard(1),)).tp  # unequal panels on the TP 2, 4, 8 cuts
    assert odd == panel_cuts(669) and odd.edges == (0, 84, 168, 252, 335, 336, 420, 504, 588, 669)
    assert spec_for("w", (64, 64), "float32", (Shard(0),)).to_json()["tp"] == {"kind": "panels", "dim": 1, "count": 8}
    sd = {"w": global_tensor((96, 64), torch.float32, 1), "e": global_tensor((128, 72), torch.bfloat16, 2),
          "b": global_tensor((64,), torch.float32, 3), "o": global_tensor((64, 669), torch.float32, 4)}
    save_state_dict(sd, str(tmp_path), step=1)
    into = {k: torch.zeros_like(v) for k, v in sd.items()}
    ptrs = {k: v.data_ptr() for k, v in into.items()}
    res = load_state_dict(into, str(tmp_path))
    assert res.bytes_read == res.bytes_needed == sum(v.numel() * v.element_size() for v in sd.values())
    for k in sd:
        assert same(into[k], sd[k]) and into[k].data_ptr() == ptrs[k], k


# ---------------------------------------------------------------------------------------------
# panel-ordered tensors read in place: Scatter copies, staging windows, block alignment
# ---------------------------------------------------------------------------------------------
@given(st.integers(1, 40), st.integers(1, 3), st.sampled_from([1, 2, 4]), st.integers(0, 2),
       st.lists(st.integers(1, 200), min_size=1, max_size=30))
@settings(max_examples=examples(60))
def test_scatter_puts_any_flat_range_in_panel_order(rows: int, width: int, count: int, shard: int,
                                                    cuts: list[int]) -> None:
    """``Scatter.put`` of the flat (panel order) buffer in pieces of any sizes, across part, panel and
    row boundaries, lays out exactly what ``from_local_flat`` does, through torch views and through
    numpy byte views (``panel_byte_views``; columns split by ``tp=3``: parts
    of partial and whole panels)."""
    shape = (rows, 3 * count * width)
    layout = StateLayout.of(3, {"w": Placed(NamedMesh.parse("tp=3"), (Shard(1),), (0, 1, 2))})
    spec = dataclasses.replace(spec_for("w", shape, "float32", (Shard(1),)), tp=Panels(1, count))
    g = global_tensor(shape, torch.float32, rows)
    local = local_of(g, layout.placed["w"], shard)
    flat = layout.to_local_flat(spec, shard, local)
    for views in ("torch", "numpy bytes"):  # panel_views, and panel_byte_views (what loads in place use)
        out = torch.full_like(local, float("nan"))
        parts = (layout.panel_views(spec, shard, out) if views == "torch" else
                 layout.panel_byte_views(spec, shard, out.shape, out.view(-1).view(torch.uint8).numpy()))
        scatter = Scatter(parts, torch.float32)
        pos = 0
        for n in cuts * (1 + flat.numel() // max(1, sum(cuts))):
            if pos >= flat.numel():
                break
            scatter.put(pos, flat[pos : pos + n])
            pos += len(flat[pos : pos + n])
        scatter.put(pos, flat[pos:])
        assert same(out, local), views


@given(st.integers(1, 40), st.integers(64, 400).filter(lambda c: c % PANELS), st.sampled_from([2, 3, 4, 8]),
       st.data())
@settings(max_examples=examples(40))
def test_unequal_panels_local_flat_matches_the_table(rows: int, cols: int, tp: int, data: st.DataObject) -> None:
    """Unequal panels (``panel_cuts`` of a column count not a multiple of ``PANELS``): each rank's local
    flat buffer (``to_local_flat``) is the global canonical order at its segments, ``from_local_flat``
    and ``Scatter`` over both view kinds undo it, and a TP 2 / 4 / 8 column shard is whole panels (one
    segment per panel)."""
    shape = (rows, cols)
    mesh = NamedMesh.parse(f"tp={tp}")
    layout = StateLayout.of(tp, {"w": Placed(mesh, (Shard(1),), tuple(range(tp)))})
    spec = dataclasses.replace(spec_for("w", shape, "float32", (Shard(1),)), tp=panel_cuts(cols))
    g = global_tensor(shape, torch.float32, rows)
    canon = spec.to_canonical(g)
    assert torch.equal(spec.from_canonical(canon), g)
    shard = data.draw(st.integers(0, tp - 1))
    local = local_of(g, layout.placed["w"], shard)
    flat = layout.to_local_flat(spec, shard, local)
    segs = layout.segments(spec, shard)
    assert sum(n for _, _, n in segs) == flat.numel()
    assert all(torch.equal(flat[lo:lo + n], canon[st_:st_ + n]) for lo, st_, n in segs)
    if tp != 3 and local.numel():  # whole panels, all rows: one run of the stored order
        cols_held = local_box(shape, mesh, (Shard(1),), (shard,))[1]
        assert all(r.start in spec.tp.edges and r.stop in spec.tp.edges for r in cols_held) and len(segs) == 1
    assert same(layout.from_local_flat(spec, shard, flat), local)
    for views in ("torch", "numpy bytes"):
        out = torch.full_like(local, float("nan"))
        parts = (layout.panel_views(spec, shard, out) if views == "torch" else
                 layout.panel_byte_views(spec, shard, out.shape, out.view(-1).view(torch.uint8).numpy()))
        scatter = Scatter(parts, torch.float32)
        for pos in range(0, flat.numel(), 37):
            scatter.put(pos, flat[pos:pos + 37])
        assert same(out, local), views


def test_panel_loads_in_place_read_exactly_their_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Panel-ordered tensors (R a multiple of 8) saved under row, column and no split load under the
    others in place, bit exact, reading exactly the bytes they need (checksum blocks are rows of a
    panel that divide R / 8); through staging windows smaller than a piece, over a filesystem
    that is not local (one range per piece), with the concurrent remote path, and through a reader
    that cannot scatter (temporaries)."""
    monkeypatch.setattr(reader_mod, "_STAGE", 16 << 10)  # windows of a 64 KiB panel, and runs of pieces
    shapes = {"w": ((256, 512), torch.float32), "e": ((256, 512), torch.bfloat16)}  # blocks: 32 rows
    m4, m2, m22 = NamedMesh.parse("dp_shard=4"), NamedMesh.parse("tp=2"), NamedMesh.parse("dp_shard=2,tp=2")

    def on(mesh: NamedMesh, placements: tuple) -> StateLayout:
        return StateLayout.of(mesh.world_size, {n: Placed(mesh, placements, tuple(range(mesh.world_size)))
                                                for n in shapes})

    layouts = {"fsdp4": on(m4, (Shard(0),)), "tp2cols": on(m2, (Shard(1),)), "tp2rows": on(m2, (Shard(0),)),
               "fsdp2xtp2": on(m22, (Shard(0), Shard(1))), "whole": on(NamedMesh.parse("dp=1"), (Replicate(),))}
    for saved_name in ("fsdp4", "tp2cols", "whole"):
        url = str(tmp_path / saved_name)
        ptc, globals_ = _save_all(url, shapes, layouts[saved_name], 7, panels={n: PANELS for n in shapes})
        assert all(panel_block(s) for s in ptc.tensors.values())
        for new_name, new in layouts.items():
            for rank in range(new.world_size):
                want = {n: local_of(globals_[n], new.placed[n], rank) for n in shapes}
                locals_ = {n: torch.zeros_like(t) for n, t in want.items()}
                sink = _InPlace(locals_, new, rank)
                got = load(url, new, rank, options=ReadOptions(sink=sink, check=sink.bind))
                needed = sum(t.numel() * t.element_size() for t in want.values())
                assert got.stats.bytes_needed == needed == got.stats.bytes_read, (saved_name, new_name, rank)
                assert all(same(locals_[n], want[n]) and got.shard[n] is locals_[n] for n in shapes)
    # the other readers' paths, on one pair (rows from columns and the reverse)
    mem = fsspec.filesystem("memory")
    for saved_name, new_name in (("tp2cols", "fsdp2xtp2"), ("fsdp4", "tp2cols")):
        url = f"memory://panels-{saved_name}"
        _save_all(url, shapes, layouts[saved_name], 3, panels={n: PANELS for n in shapes})
        ptc, globals_ = _save_all(str(tmp_path / "ref"), shapes, layouts[saved_name], 3, step=2,
                                  panels={n: PANELS for n in shapes})
        new = layouts[new_name]
        sdir = list_steps(url)[-1].path
        manifest = read_manifest_at(mem, sdir)
        for how in ("sync", "concurrent", "temporaries"):
            for rank in range(new.world_size):
                want = {n: local_of(globals_[n], new.placed[n], rank) for n in shapes}
                locals_ = {n: torch.zeros_like(t) for n, t in want.items()}
                sink = _InPlace(locals_, new, rank)
                sink.bind(manifest.full().ptc)
                reader = PartReader(mem, sdir, concurrent=how == "concurrent")
                reader.bind(Binding.of(manifest))
                if how == "temporaries":
                    reader.scatters = False
                shard, needed = read_shard(manifest.full().ptc, manifest.layout, new, rank, reader, sink=sink)
                assert needed == sum(t.numel() * t.element_size() for t in want.values())
                assert all(same(locals_[n], want[n]) and shard[n] is locals_[n] for n in shapes), (how, rank)
        mem.rm(url, recursive=True)
