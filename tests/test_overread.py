"""Read amplification between DTensor layouts (#29 item 2): every byte a load reads (data, CRC words,
manifest, rank indexes, objects) stays within ``BOUND`` of the tensor bytes it needs, in every direction
between the layouts real jobs use.

Pure (one process, hypothesis): a Llama-like set of weights (rows and columns drawn, uneven row counts
included) saved with ``tenplex.checkpoint.save`` under one ``StateLayout`` from every rank and loaded
under another: FSDP2 over N ranks -> M ranks (uneven shards), TP row/column shards -> FSDP2 x TP
(``StridedShard``), FSDP2 x TP -> FSDP2, and DCP boxes of TP2 x FSDP2 (a torchtitan import keeps them)
-> TP2/TP4. Checked: bit exact, and ``LoadStats.bytes_read + LoadStats.metadata_bytes`` at most
``BOUND`` times ``bytes_needed`` on every rank that needs at least ``MIN_RANK_BYTES`` (format version 2
read 1.18-1.52x of data alone here, version 4 up to 1.06x in all).

Run as a script to print the three cases of issue 29 (FSDP2 4 -> 3 of a small Llama with AdamW state,
TP2 -> dp2 x tp2, torchtitan's TP2 x FSDP2 fixture -> TP4) and two with an odd FFN size (669: unequal
panels) with data and total ratios.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import examples
from recording_fs import CountingFileSystem
from spawned import free_port, run_spawned
import tenplex.checkpoint.format as format_mod
import tenplex.checkpoint.writer as writer_mod
from tenplex.checkpoint import PartWriter, load, open_sealed_json, save
from tenplex.checkpoint.format import prefix_words
from tenplex.errors import CheckpointCorruptError
from tenplex.layout.mesh import NamedMesh, Replicate, Shard, StridedShard, local_box
from tenplex.layout.ptc import PTC
from tenplex.layout.state_layout import Boxes, Placed, StateLayout, spec_for

BOUND = 1.02
"""All bytes read (data, CRC words, manifest, rank indexes, objects) over tensor bytes needed, per rank,
for ranks that need at least ``MIN_RANK_BYTES``: issue 29's goal. Format version 5 (prefix CRC words,
panel blocks of one panel row) reads 1.008-1.014x on the issue's cases (data 1.0000-1.0023x; version 4:
1.011-1.062x, data up to 1.040x) and at most 1.008x over the property's sweep; what is left is the
manifest every rank reads whole (0.8 %), the objects file (0.06 %), the indexes of the writers read
(430 bytes each) and two CRC words per piece read (0.05-0.27 %)."""
MIN_RANK_BYTES = 1 << 20
"""The property's smallest rank: about 17 KB of a load's metadata is fixed whatever the rank needs (the
manifest, 15.6 KB for the issue's 70-tensor state, grows with the tensor count; the objects file, 1.3 KB;
an index of 430 bytes per writer read), so a rank needing 1 MB spends 1.7 % on it and one needing much
less cannot stay within ``BOUND``."""
TITAN = Path(__file__).resolve().parent / "fixtures" / "titan" / "partial_dtensor"

Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


def _global(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _local(g: torch.Tensor, placed: Any, rank: int) -> torch.Tensor:
    """``rank``'s local tensor of ``g`` (FSDP2 over TP as FSDP2 stores it; a box as DCP stores it)."""
    if isinstance(placed, Boxes):
        return g[tuple(slice(r[0].start, r[0].stop) for r in placed.box(rank))].clone()
    box = local_box(tuple(g.shape), placed.mesh, placed.placements, placed.mesh.coords(placed.ranks.index(rank)),
                    right_to_left=True)
    idx = [torch.tensor([i for r in ranges for i in r], dtype=torch.long) for ranges in box]
    return g[torch.meshgrid(*idx, indexing="ij")].clone()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape)
            and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def reshard(shapes: Shapes, saved: StateLayout, new: StateLayout, seed: int = 1) -> list[tuple[int, int, int]]:
    """Save ``shapes`` under ``saved`` (every rank, this process), load every rank of ``new``; checks bit
    exactness and returns ``(bytes_needed, bytes_read, metadata_bytes)`` per loading rank."""
    specs = [spec_for(n, s, d, saved.placed[n] if isinstance(saved.placed[n], Boxes) else saved.placed[n].placements)
             for n, (s, d) in shapes.items()]
    ptc = PTC(specs, num_layers=0, meta={"kind": "state_dict"})
    globals_ = {n: _global(s, d, seed + i) for i, (n, (s, d)) in enumerate(shapes.items())}
    out = []
    with tempfile.TemporaryDirectory() as url:
        for rank in range(saved.world_size):
            shard = {n: _local(globals_[n], p, rank) for n, p in saved.tensors if rank in p.ranks}
            save(url, ptc, saved, rank, shard, step=1, save_id="0000abcd")
        for rank in range(new.world_size):
            res = load(url, new, rank)
            for name, p in new.tensors:
                if rank in p.ranks:
                    assert _same(res.shard[name], _local(globals_[name], p, rank)), (name, rank)
            s = res.stats
            out.append((s.bytes_needed, s.bytes_read, s.metadata_bytes))
    return out


# ---------------------------------------------------------------------------------------------
# layouts real jobs use
# ---------------------------------------------------------------------------------------------
COL, ROW = 0, 1  # TP colwise (Shard(0) of the weight) / rowwise (Shard(1))


def fsdp(shapes: Shapes, n: int) -> StateLayout:
    mesh = NamedMesh((("dp_shard", n),))
    return StateLayout.of(n, {k: Placed(mesh, (Shard(0),), range(n)) for k in shapes})


def tp(shapes: Shapes, kinds: dict[str, int | None], n: int) -> StateLayout:
    mesh = NamedMesh((("tp", n),))
    return StateLayout.of(n, {k: Placed(mesh, (Shard(kinds[k]),), range(n)) if kinds[k] is not None
                              else Placed.replicated(range(n)) for k in shapes})


def fsdp_tp(shapes: Shapes, kinds: dict[str, int | None], dp: int, t: int) -> StateLayout:
    """FSDP2 over ``dp`` of TP over ``t`` (torch's placements: ``StridedShard`` for a colwise weight)."""
    mesh = NamedMesh((("dp_shard", dp), ("tp", t)))
    out = {}
    for k in shapes:
        kind = kinds[k]
        pl = ((StridedShard(0, t), Shard(0)) if kind == COL else (Shard(0), Shard(1)) if kind == ROW
              else (Shard(0), Replicate()))
        out[k] = Placed(mesh, pl, range(dp * t))
    return StateLayout.of(dp * t, out)


def boxes_of(layout: StateLayout, shapes: Shapes) -> StateLayout:
    """``layout``'s distinct local boxes as DCP stores them (one per holder, first holder writes):
    what ``tenplex import`` of a DCP checkpoint keeps."""
    out = {}
    for k, p in layout.tensors:
        seen: dict[tuple[Any, ...], int] = {}
        for r in p.ranks:
            box = local_box(shapes[k][0], p.mesh, p.placements, p.mesh.coords(p.ranks.index(r)), right_to_left=True)
            if all(len(ranges) == 1 and len(ranges[0]) for ranges in box):
                seen.setdefault(tuple((x[0].start, len(x[0])) for x in box), r)
        out[k] = Boxes(tuple((r, tuple(a for a, _ in b), tuple(n for _, n in b)) for b, r in seen.items()))
    return StateLayout.of(layout.world_size, out)


def llama(layers: int, hidden: int, inter: int, vocab: int, adam: bool = True) -> tuple[Shapes, dict[str, int | None]]:
    """A Llama's weights (and AdamW's two states of each) with their TP kind."""
    base: dict[str, tuple[tuple[int, ...], int | None]] = {
        "embed.weight": ((vocab, hidden), None), "norm.weight": ((hidden,), None), "head.weight": ((vocab, hidden), COL)}
    for i in range(layers):
        p = f"layers.{i}."
        base |= {p + "wq": ((hidden, hidden), COL), p + "wk": ((hidden // 2, hidden), COL),
                 p + "wv": ((hidden // 2, hidden), COL), p + "wo": ((hidden, hidden), ROW),
                 p + "w1": ((inter, hidden), COL), p + "w3": ((inter, hidden), COL), p + "w2": ((hidden, inter), ROW),
                 p + "norm1": ((hidden,), None), p + "norm2": ((hidden,), None)}
    shapes: Shapes = {}
    kinds: dict[str, int | None] = {}
    for k, (shape, kind) in base.items():
        for suffix in ("", ".exp_avg", ".exp_avg_sq") if adam else ("",):
            shapes[k + suffix], kinds[k + suffix] = (shape, torch.float32), kind
    return shapes, kinds


# ---------------------------------------------------------------------------------------------
# the property
# ---------------------------------------------------------------------------------------------
@st.composite
def cases(draw: st.DrawFn, odd_ffn: bool = False) -> tuple[Shapes, StateLayout, StateLayout]:
    """A 2-layer Llama with AdamW state (hidden 128-320, uneven vocabulary sizes, FFN sizes a multiple of
    8 as real models' are, or any with ``odd_ffn``: 4-12 MB) and a pair of layouts from one of the
    families real jobs move between; loading ranks need >= 1 MB each."""
    hidden = 8 * draw(st.integers(16, 40))
    ffn = draw(st.integers(2 * hidden, 3 * hidden)) if odd_ffn else 8 * draw(st.integers(hidden // 4, 3 * hidden // 8))
    shapes, kinds = llama(2, hidden, ffn, draw(st.integers(1000, 2100)))
    family = draw(st.sampled_from(["fsdp", "tp->fsdp_tp", "fsdp_tp->fsdp", "boxes->tp"]))
    if family == "fsdp":
        return shapes, fsdp(shapes, draw(st.integers(1, 8))), fsdp(shapes, draw(st.integers(1, 4)))
    if family == "tp->fsdp_tp":
        return shapes, tp(shapes, kinds, draw(st.sampled_from([2, 4]))), fsdp_tp(shapes, kinds, 2, 2)
    if family == "fsdp_tp->fsdp":
        return shapes, fsdp_tp(shapes, kinds, draw(st.integers(2, 3)), 2), fsdp(shapes, draw(st.integers(1, 4)))
    saved = boxes_of(fsdp_tp(shapes, kinds, 2, 2), shapes)
    return shapes, saved, tp(shapes, kinds, draw(st.sampled_from([2, 4])))


def _within_bound(rows: list[tuple[int, int, int]]) -> None:
    assert any(needed >= MIN_RANK_BYTES for needed, _, _ in rows)  # the property is never vacuous
    for rank, (needed, read, meta) in enumerate(rows):
        if needed >= MIN_RANK_BYTES:
            assert read + meta <= BOUND * needed, \
                f"rank {rank} read {read} + {meta} metadata bytes for {needed} needed ({(read + meta) / needed:.4f}x)"


@given(cases())
@settings(max_examples=examples(6), deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_loads_read_at_most_bound_times_their_bytes(case: tuple[Shapes, StateLayout, StateLayout]) -> None:
    shapes, saved, new = case
    _within_bound(reshard(shapes, saved, new))


@given(cases(odd_ffn=True))
@settings(max_examples=examples(4), deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_odd_ffn_sizes_read_at_most_bound_times_their_bytes(case: tuple[Shapes, StateLayout, StateLayout]) -> None:
    """FFN sizes not a multiple of ``PANELS`` (unequal panels on the TP cuts) keep ``BOUND`` too."""
    shapes, saved, new = case
    _within_bound(reshard(shapes, saved, new))


# ---------------------------------------------------------------------------------------------
# issue 29's cases, by name
# ---------------------------------------------------------------------------------------------
def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x.rstrip(",")) for x in path.read_text().splitlines()[1:-1]]


def _placement(text: str) -> Any:
    nums = list(map(int, re.findall(r"\d+", text)))
    if text.startswith("Replicate"):
        return Replicate()
    return StridedShard(*nums) if text.startswith("_StridedShard") else Shard(nums[0])


def titan(config: str) -> tuple[Shapes, StateLayout, StateLayout]:
    """torchtitan's own state dict (tests/fixtures/titan): its shapes, the DCP boxes it saved under
    ``config`` and its placements under ``config``."""
    entries: dict[str, dict[int, dict[str, Any]]] = {}
    for f in sorted((TITAN / config).glob("placements/titan_checkpoint.rank*.json")):
        rank = int(re.findall(r"rank(\d+)", f.name)[0])
        for e in _lines(f):
            if e["type"] == "DTensor":
                entries.setdefault(e["key"], {})[rank] = e
    shapes = {k: (tuple(v[min(v)]["global_shape"]), getattr(torch, v[min(v)]["dtype"])) for k, v in entries.items()}
    placed = {}
    for k, per in entries.items():
        e = per[min(per)]
        mesh = NamedMesh(tuple(zip(e["mesh_dim_names"], e["mesh_shape"])))
        ranks = [r for row in e["mesh_ranks"] for r in (row if isinstance(row, list) else [row])]
        placed[k] = Placed(mesh, tuple(_placement(p) for p in e["placements"]), ranks)
    layout = StateLayout.of(4, placed)
    return shapes, boxes_of(layout, shapes), layout


def named_cases() -> dict[str, tuple[Shapes, StateLayout, StateLayout]]:
    shapes, kinds = llama(3, 96, 256, 1003)
    titan_shapes, titan_saved, _ = titan("tp2_fsdp2")
    odd, odd_kinds = llama(2, 224, 669, 1003)  # w2 (224, 669): TP2 cuts its columns at 335, TP4 at 168/336/504
    return {"FSDP2 4 -> 3": (shapes, fsdp(shapes, 4), fsdp(shapes, 3)),
            "TP2 -> dp2 x tp2": (shapes, tp(shapes, kinds, 2), fsdp_tp(shapes, kinds, 2, 2)),
            "torchtitan TP2 x FSDP2 -> TP4": (titan_shapes, titan_saved, titan("tp4")[2]),
            "FFN 669 TP2 -> dp2 x tp2": (odd, tp(odd, odd_kinds, 2), fsdp_tp(odd, odd_kinds, 2, 2)),
            "FFN 669 TP2 x FSDP2 boxes -> TP4": (odd, boxes_of(fsdp_tp(odd, odd_kinds, 2, 2), odd),
                                                 tp(odd, odd_kinds, 4))}


def test_issue_cases_read_at_most_bound() -> None:
    for name, (shapes, saved, new) in named_cases().items():
        for rank, (needed, read, meta) in enumerate(reshard(shapes, saved, new)):
            assert read + meta <= BOUND * needed, \
                f"{name} rank {rank}: read {read} + {meta} metadata for {needed} ({(read + meta) / needed:.4f}x)"


@pytest.mark.parametrize("version", [2, 3, 4])
def test_older_versions_still_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: int) -> None:
    """A checkpoint written as format version 2 (4 KiB+ blocks, the old panel rule) or 3 (row blocks),
    both with the chunks and their hex CRCs in the index, or 4 (block and group words at the data file's
    end), loads under another layout bit for bit: its blocks are checked by the rule of its own version,
    against its own CRCs."""
    shapes, _ = llama(1, 96, 256, 1003, adam=False)
    saved, new = fsdp(shapes, 4), fsdp(shapes, 3)
    ptc = PTC([spec_for(n, s, d, saved.placed[n].placements) for n, (s, d) in shapes.items()], num_layers=0)
    globals_ = {n: _global(s, d, i) for i, (n, (s, d)) in enumerate(shapes.items())}
    with monkeypatch.context() as m:  # the writer of that version: its tag and its block rule
        m.setattr(format_mod, "VERSION", version)
        for rank in range(4):
            save(str(tmp_path), ptc, saved, rank, {n: _local(globals_[n], p, rank) for n, p in saved.tensors},
                 step=1, save_id="0000abcd")
    sdir = next(tmp_path.iterdir())
    idx = open_sealed_json((sdir / "rank-00000.json").read_bytes(), "index")
    assert idx["version"] == version
    if version < 4:
        assert all(len(c["crc32"]) % 8 == 0 for c in idx["chunks"])
        assert (min(c["block"] for c in idx["chunks"]) >= 4096) == (version == 2)
    for rank in range(3):
        res = load(str(tmp_path), new, rank)
        for name, p in new.tensors:
            assert _same(res.shard[name], _local(globals_[name], p, rank)), (name, rank)
    assert format_mod.VERSION == 5  # and new saves write version 5


# ---------------------------------------------------------------------------------------------
# version 5's prefix words
# ---------------------------------------------------------------------------------------------
@given(st.integers(1, 6), st.randoms(use_true_random=False))
@settings(max_examples=examples(20), deadline=None)
def test_prefix_words_written_in_any_order_check_any_run_of_blocks(pieces: int, rnd: Any) -> None:
    """Version 5: a part's CRC table holds, per block, ``crc32(chunk[:end of block], seed) ^ seed``,
    whether its chunks were checksummed in one pass or in pieces out of order (bubble snapshots write
    buckets; ``write_at``), so any run of whole blocks [lo, hi) checks with the two words at its ends."""
    shapes, _ = llama(1, 96, 256, 203, adam=False)
    layout = fsdp(shapes, 2)
    ptc = PTC([spec_for(n, s, d, layout.placed[n].placements) for n, (s, d) in shapes.items()], num_layers=0)
    flats = {n: ptc.to_local_flat(n, _local(_global(s, d, i), layout.placed[n], 1), layout, 1)
             for i, (n, (s, d)) in enumerate(shapes.items())}
    with tempfile.TemporaryDirectory() as d:
        fs = fsspec.filesystem("file")
        parts = [PartWriter(fs, d, ptc, layout, 1, step=3, save_id="0000abcd") for _ in range(2)]
        raws = []
        for i, c in enumerate(parts[0].chunks):
            raw = memoryview(flats[c.tensor][c.local : c.local + c.length]
                             .contiguous().view(torch.uint8).numpy()).cast("B")
            raws.append(raw)
            parts[0].checksum(i, 0, raw)
            cuts = sorted({0, c.nbytes, *(rnd.randrange(0, c.nbytes, c.block) for _ in range(pieces))})
            order = list(zip(cuts, cuts[1:]))
            rnd.shuffle(order)
            for a, b in order:
                parts[1].checksum(i, a, raw[a:b])
        table = parts[0].crc_table()
        assert parts[1].crc_table() == table
        seed, words, at = parts[0].seed, np.frombuffer(table, dtype=">u4").tolist(), 0
        assert any(c.block < 256 for c in parts[0].chunks)  # panel rows of 48 bytes: one a block
        for c, raw in zip(parts[0].chunks, raws):
            n = -(-c.nbytes // c.block)
            assert words[at : at + n] == [zlib.crc32(raw[: min((j + 1) * c.block, c.nbytes)], seed) ^ seed
                                          for j in range(n)]
            k0 = rnd.randrange(n)
            k1 = rnd.randrange(k0, n) + 1
            lo, hi = k0 * c.block, min(k1 * c.block, c.nbytes)
            first, last = prefix_words(c.block, lo, hi)
            start = seed if first is None else words[at + first] ^ seed
            assert zlib.crc32(raw[lo:hi], start) == words[at + last] ^ seed
            at += n


def test_a_data_file_of_another_attempt_fails_a_read_inside_its_chunks(tmp_path: Path) -> None:
    """Version 5's prefix words are stored XOR the part's seed (step, save id, rank): a read that starts
    inside a chunk, checked against words of the same (foreign) file, still fails when the data file
    and its table come from another attempt of the same layout."""
    shapes = {k: v for k, v in llama(1, 96, 256, 1003, adam=False)[0].items() if len(v[0]) == 2}
    saved, new = fsdp(shapes, 4), fsdp(shapes, 3)  # matrices only: a vector's chunk is one block, read whole
    ptc = PTC([spec_for(n, s, d, saved.placed[n].placements) for n, (s, d) in shapes.items()], num_layers=0)
    for step in (1, 2):
        g = {n: _global(s, d, 10 * step + i) for i, (n, (s, d)) in enumerate(shapes.items())}
        for rank in range(4):
            save(str(tmp_path), ptc, saved, rank, {n: _local(g[n], p, rank) for n, p in saved.tensors},
                 step=step, save_id=f"0000000{step}")
    dirs = sorted(tmp_path.iterdir())
    (dirs[1] / "rank-00001.safetensors").write_bytes((dirs[0] / "rank-00001.safetensors").read_bytes())
    with pytest.raises(CheckpointCorruptError, match="checksum mismatch"):
        load(str(tmp_path), new, 1, step=2)  # rank 1 of 3 reads rows inside rank 1 of 4's chunks


# ---------------------------------------------------------------------------------------------
# real FSDP2: 4 gloo ranks save, 3 load (uneven shards), bytes counted by the filesystem
# ---------------------------------------------------------------------------------------------
GLOO_MODEL = (2, 128, 264, 1001)  # layers, hidden, FFN, vocab: 1001 / 4 and / 3 and 264 / 3 are uneven


def _fsdp_state(world: int, seed: int) -> tuple[Any, dict[str, Any]]:
    """The weights of ``llama(*GLOO_MODEL)`` as parameters of one module, FSDP2 over ``world`` ranks,
    with AdamW state after one step (gradients set by hand); the model and its state dict."""
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    shapes, _ = llama(*GLOO_MODEL, adam=False)
    model = nn.Module()
    model.w = nn.ParameterDict({k.replace(".", "_"): nn.Parameter(torch.randn(s)) for k, (s, _) in shapes.items()})
    fully_shard(model, mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",)))
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = p.detach() * 0.5
    optim.step()
    model_sd, optim_sd = get_state_dict(model, optim)
    return model, {"model": model_sd, "optim": optim_sd}


def _fsdp_worker(rank: int, ports: tuple[int, int], url: str, out: Any) -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from tenplex.native.state_dict import load_state_dict, save_state_dict

    torch.set_num_threads(1)
    for phase, world, port in (("save", 4, ports[0]), ("load", 3, ports[1])):
        if rank >= world:
            continue
        res: dict[str, Any] = {"error": None}
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            _, sd = _fsdp_state(world, 0 if phase == "save" else 1)
            if phase == "save":
                save_state_dict(sd, url, step=1)
            else:
                full_before = {k: v.full_tensor() for k, v in sd["model"].items() if isinstance(v, DTensor)}
                CountingFileSystem.bytes = 0
                got = load_state_dict(sd, f"countfs://{url}")
                res.update(bytes_read=got.bytes_read, bytes_needed=got.bytes_needed, fs_bytes=CountingFileSystem.bytes,
                           metadata=got.stats.metadata_bytes if got.stats else None,
                           changed=sum(not torch.equal(v.full_tensor(), full_before[k])
                                       for k, v in sd["model"].items() if isinstance(v, DTensor)))
            full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sd["model"].items()}  # collective
            if rank == 0:
                torch.save(full, f"{url}-{phase}.pt")
        except BaseException as e:  # reported to the parent, which fails the test with it
            import traceback

            res["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2500:]}"
        finally:
            out.put((phase, rank, res))
            dist.destroy_process_group()
        if res["error"]:
            return


@pytest.mark.timeout(180)
def test_fsdp2_4_to_3_reads_its_bytes_counted_by_the_filesystem(tmp_path: Path) -> None:
    """Real FSDP2 (torch's ``fully_shard``, gloo): 4 ranks save model and AdamW state with
    ``save_state_dict``, 3 ranks load it through a filesystem that counts every byte it returns:
    the counts equal tenplex's (data plus metadata), the model is the saved one bit for bit, and each
    rank's reads, metadata included, stay within ``BOUND`` of its tensor bytes (version 2: 1.27-1.49x of
    data alone)."""
    url = str(tmp_path / "ck")
    ports = (free_port(), free_port())
    results = run_spawned(_fsdp_worker, [(r, ports, url) for r in range(4)], expect=7, timeout=150)
    errors = [f"{phase} rank {r}: {res['error']}" for (phase, r), res in results.items() if res["error"]]
    assert not errors, "\n".join(errors)
    saved, loaded = (torch.load(f"{url}-{phase}.pt", weights_only=True) for phase in ("save", "load"))
    assert saved.keys() == loaded.keys() and all(_same(saved[k], loaded[k]) for k in saved)
    for r in range(3):
        res = results[("load", r)]
        assert res["changed"] > 0  # the load really replaced the other seed's values
        assert res["fs_bytes"] == res["bytes_read"] + res["metadata"], res  # every byte fetched is counted
        assert res["fs_bytes"] <= BOUND * res["bytes_needed"], (r, res["fs_bytes"] / res["bytes_needed"], res)
    print("\n" + "; ".join(f"rank {r}: data {results[('load', r)]['bytes_read'] / results[('load', r)]['bytes_needed']:.4f}x "
                           f"all {results[('load', r)]['fs_bytes'] / results[('load', r)]['bytes_needed']:.4f}x"
                           for r in range(3)))


if __name__ == "__main__":
    for name, (shapes, saved, new) in named_cases().items():
        rows = reshard(shapes, saved, new)
        need, read, meta = (sum(col) for col in zip(*rows))
        worst, worst_total = max(r / n for n, r, _ in rows), max((r + m) / n for n, r, m in rows)
        print(f"{name}: needed {need} data {read} ({read / need:.4f}x, worst rank {worst:.4f}x) "
              f"metadata {meta} total {(read + meta) / need:.4f}x (worst rank {worst_total:.4f}x)")
