"""DCP checkpoints imported with their partitioning kept (#17 item 6): ``Boxes`` placements, the
chunk layout of DCP metadata, and a sharded DCP checkpoint loaded back through tenplex."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

import tenplex
from tenplex.checkpoint import read_manifest
from tenplex.checkpoint.dcp_import import dcp_chunk_layout, import_dcp
from tenplex.cli import main as cli_main
from tenplex.errors import CheckpointError, LayoutError, SpecError
from tenplex.layout.mesh import NamedMesh, Shard, box_segments
from tenplex.layout.ptc import PTC, Replicated, Split
from tenplex.layout.state_layout import Boxes, Placed, StateLayout, spec_for

from spawned import free_port, gloo_env, here, in_env, reap, worker_context

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------------------------
# Boxes (pure)
# ---------------------------------------------------------------------------------------------
def test_boxes_segments_json_and_checks() -> None:
    quads = Boxes(((0, (0, 0), (4, 3)), (1, (0, 3), (4, 3)), (2, (4, 0), (4, 3)), (3, (4, 3), (4, 3))))
    cols = Boxes(((0, (0, 0), (8, 2)), (1, (0, 2), (8, 4))))
    rows = Boxes(((1, (0, 0), (3, 6)), (0, (3, 0), (5, 6))))
    assert spec_for("q", (8, 6), "float32", quads).tp == Replicated()
    assert spec_for("c", (8, 6), "float32", cols).tp == Split(1)
    assert spec_for("r", (8, 6), "float32", rows).tp == Replicated()
    specs = [spec_for(n, (8, 6), "float32", b) for n, b in (("q", quads), ("c", cols), ("r", rows))]
    specs.append(spec_for("p", (8, 6), "float32", (Shard(0),)))
    layout = StateLayout.of(4, {"q": quads, "c": cols, "r": rows,
                                "p": Placed(NamedMesh((("dp", 2),)), (Shard(0),), (2, 3))})
    ptc = PTC(specs, num_layers=0)
    layout.check(ptc, complete=True)
    assert StateLayout.from_json(layout.to_json()) == layout
    # every element once, each rank's segments in the box's own flat order
    for spec in specs:
        table = layout.holder_table(spec)
        assert int(table.length.sum()) == spec.numel
        assert sorted(table.start.tolist()) == sorted(set(table.start.tolist()))
    assert layout.segments(specs[0], 1) == [(0, 3, 3), (3, 9, 3), (6, 15, 3), (9, 21, 3)]
    assert layout.segments(specs[1], 1) == [(0, 16, 32)]  # dim 1 first: columns 2..5 are one run
    assert layout.local_shape(specs[0], 3) == (4, 3)
    assert layout.holds("c", 1) and not layout.holds("c", 2)
    assert StateLayout.from_json(layout.to_json()).digest() == layout.digest()


@pytest.mark.parametrize("chunks, match", [
    ((), "at least one chunk"),
    (((0, (0,), (1, 1)),), "one per dim"),
    (((0, (0,), (1,)), (0, (1,), (1,))), "two chunks"),
    (((-1, (0,), (1,)),), "integers >= 0"),
    (((0, (0.5,), (1,)),), "integers >= 0"),
    ("nonsense", "triples"),
])
def test_boxes_refuse_malformed_chunks(chunks: object, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        Boxes(chunks)  # type: ignore[arg-type]


def test_boxes_outside_the_shape_or_not_covering_it_are_layout_errors() -> None:
    spec = spec_for("w", (4, 4), "float32", Boxes(((0, (0, 0), (4, 4)),)))
    with pytest.raises(LayoutError, match="reaches outside"):
        StateLayout.of(1, {"w": Boxes(((0, (0, 0), (5, 4)),))}).check(PTC([spec], num_layers=0))
    with pytest.raises(LayoutError, match="no rank of the layout holds element"):
        StateLayout.of(1, {"w": Boxes(((0, (0, 0), (2, 4)),))}).check(PTC([spec], num_layers=0), complete=True)
    with pytest.raises(LayoutError, match="lives on ranks"):
        StateLayout.of(1, {"w": Boxes(((1, (0, 0), (4, 4)),))})
    with pytest.raises(SpecError, match="not integers"):
        Boxes.from_json(["boxes", [[0, [0], ["x"]]]])
    with pytest.raises(SpecError, match=r"\['boxes'"):
        Boxes.from_json(["boxes", 3])
    with pytest.raises(LayoutError, match="lie in"):
        box_segments((4,), ((range(2, 6),),), (0,))


def test_box_segments_matches_numpy() -> None:
    shape, box, order = (3, 4, 5), ((range(1, 3),), (range(0, 4),), (range(2, 4),)), (2, 0, 1)
    local, start, length = box_segments(shape, box, order)
    full = np.arange(np.prod(shape)).reshape(shape).transpose(order)  # natural indices in canonical order
    want = full[2:4, 1:3, 0:4].reshape(-1)  # the box, flattened in canonical order
    got = np.concatenate([np.arange(s, s + n) for s, n in zip(start, length)])
    assert full.reshape(-1)[got].tolist() == want.tolist()
    assert local.tolist() == np.concatenate([[0], np.cumsum(length)[:-1]]).tolist()


# ---------------------------------------------------------------------------------------------
# DCP metadata -> chunk layout (pure, fake storage infos)
# ---------------------------------------------------------------------------------------------
def _metadata(entries: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], str]]], shapes: dict[str, tuple],
              objects: dict[str, str]):  # type: ignore[no-untyped-def]
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
        TensorStorageMetadata)

    sd, storage = {}, {}
    for name, chunks in entries.items():
        sd[name] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shapes[name]),
                                         [ChunkStorageMetadata(torch.Size(o), torch.Size(z)) for o, z, _ in chunks])
        for o, _, f in chunks:
            storage[MetadataIndex(name, torch.Size(o))] = SimpleNamespace(relative_path=f)
    for name, f in objects.items():
        sd[name] = BytesStorageMetadata()
        storage[MetadataIndex(name)] = SimpleNamespace(relative_path=f)
    return Metadata(state_dict_metadata=sd, storage_data=storage)


def test_dcp_chunk_layout_one_pseudo_rank_per_file() -> None:
    md = _metadata({"model.w": [((0, 0), (2, 4), "__0_0.distcp"), ((2, 0), (2, 4), "__1_0.distcp")],
                    "model.v": [((0, 0), (4, 1), "__1_0.distcp"), ((0, 1), (4, 3), "__1_0.distcp")]},
                   {"model.w": (4, 4), "model.v": (4, 4)}, {"model.step": "__0_0.distcp"})
    ptc, layout, chunks, byte_items = dcp_chunk_layout(md, strip_prefix="model.")
    assert set(ptc.tensors) == {"w", "v"} and list(ptc.objects) == ["step"]
    assert layout.placed["w"] == Boxes(((0, (0, 0), (2, 4)), (1, (2, 0), (2, 4))))
    # two chunks of v in one file: the second gets a rank of its own after the files' ranks
    assert layout.placed["v"] == Boxes(((1, (0, 0), (4, 1)), (2, (0, 1), (4, 3))))
    assert layout.world_size == 3 and ptc.tensors["v"].tp == Split(1)
    assert [c.rank for c in chunks] == [0, 1, 1, 2] and [n for n, _ in byte_items] == ["step"]
    bad = _metadata({"w": [((0, 0), (2, 4), "__0_0.distcp")]}, {"w": (4, 4)}, {})
    with pytest.raises(CheckpointError, match="do not tile"):
        dcp_chunk_layout(bad)


# ---------------------------------------------------------------------------------------------
# a sharded DCP checkpoint written by 2 gloo ranks, imported and loaded back
# ---------------------------------------------------------------------------------------------
def _global_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"cols": torch.randn(6, 5, generator=g), "rows": torch.randn(5, 3, generator=g).to(torch.bfloat16),
            "plain": torch.arange(7, dtype=torch.int64), "scalar": torch.tensor(2.5)}


def _save_worker(rank: int, world: int, port: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor import distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        g = _global_state()
        sd = {"model": {"cols": distribute_tensor(g["cols"], mesh, [TShard(1)]),
                        "rows": distribute_tensor(g["rows"], mesh, [TShard(0)]), "plain": g["plain"]},
              "scalar": g["scalar"], "extra": {"step": 3, "name": "run"}}
        dcp.save(sd, checkpoint_id=path)
        from tenplex.checkpoint.dcp_storage import TenplexStorageWriter

        dcp.save(sd, storage_writer=TenplexStorageWriter(path + "_tenplex", step=1))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_dcp_import_keeps_chunks_and_loads_anywhere(tmp_path: Path) -> None:
    src = tmp_path / "dcp"
    ctx, port = worker_context(), free_port()
    with gloo_env():
        procs = [ctx.Process(target=in_env, args=(*here(), _save_worker, r, 2, port, str(src))) for r in range(2)]
    for p in procs:
        p.start()
    reap(procs, timeout=90)
    assert [p.exitcode for p in procs] == [0, 0], "a saving rank failed (its traceback is in the captured stderr)"
    res = import_dcp(src, str(tmp_path / "t"))
    layout = res.layout
    assert isinstance(layout, StateLayout) and layout.world_size == 2
    assert layout.placed["model.cols"] == Boxes(((0, (0, 0), (6, 3)), (1, (0, 3), (6, 2))))
    assert res.ptc.tensors["model.cols"].tp == Split(1) and res.ptc.tensors["model.rows"].dtype == torch.bfloat16
    g = _global_state()
    want = {"model.cols": g["cols"], "model.rows": g["rows"], "model.plain": g["plain"], "scalar": g["scalar"]}
    payload = sum(t.numel() * t.element_size() for t in want.values())
    assert sum(s.nbytes for s in res.ptc.tensors.values()) == payload
    sd = {"model": {k.split(".")[1]: torch.zeros_like(v) for k, v in want.items() if k.startswith("model.")},
          "scalar": torch.zeros(()), "extra": {"step": None, "name": None}}
    got = tenplex.load_state_dict(sd, str(tmp_path / "t"))
    assert got.bytes_read == got.bytes_needed == payload
    assert all(torch.equal(sd["model"][k.split(".")[1]], v) for k, v in want.items() if k.startswith("model."))
    assert torch.equal(sd["scalar"], g["scalar"]) and sd["extra"] == {"step": 3, "name": "run"}
    # DCP's own save and load through the tenplex format, from 2 ranks, read back in one process
    import torch.distributed.checkpoint as dcp

    from tenplex.checkpoint.dcp_storage import TenplexStorageReader

    direct = str(tmp_path / "dcp_tenplex")
    layout = StateLayout.from_json(read_manifest(direct)["state_layout"])
    assert layout.placed["model.cols"] == Boxes(((0, (0, 0), (6, 3)), (1, (0, 3), (6, 2))))
    for url in (direct, str(tmp_path / "t")):
        back = {"model": {k.split(".")[1]: torch.zeros_like(v) for k, v in want.items() if k.startswith("model.")},
                "scalar": torch.zeros(()), "extra": {"step": None, "name": None}}
        dcp.load(back, storage_reader=TenplexStorageReader(url), no_dist=True)
        assert all(torch.equal(back["model"][k.split(".")[1]], v) for k, v in want.items() if k.startswith("model."))
        assert torch.equal(back["scalar"], g["scalar"]) and back["extra"] == {"step": 3, "name": "run"}
    # the CLI keeps the partitioning by default too; --no-keep-partitioning imports whole tensors
    assert cli_main(["import", str(src), str(tmp_path / "c"), "--json"]) == 0
    assert "state_layout" in read_manifest(str(tmp_path / "c"))
    assert cli_main(["import", str(src), str(tmp_path / "n"), "--no-keep-partitioning", "--json"]) == 0
    assert "state_layout" not in read_manifest(str(tmp_path / "n"))


def test_kept_partitioning_import_from_a_url_passes_storage_options(tmp_path: Path, recfs) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(4, 3), "n": torch.arange(5), "meta": {"epoch": 2}}
    dcp.save(dict(state), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    recfs().put(str(tmp_path / "dcp"), "recfs://dcp", recursive=True)
    recfs.calls.clear()
    opts = {"endpoint_url": "http://127.0.0.1:5000", "anon": False}
    res = import_dcp("recfs://dcp", str(tmp_path / "t"), source_storage_options=opts)
    assert recfs.calls and all(c == opts for c in recfs.calls), recfs.calls
    assert isinstance(res.layout, StateLayout)
    sd = {"w": torch.zeros(4, 3), "n": torch.zeros(5, dtype=torch.int64), "meta": {"epoch": None}}
    tenplex.load_state_dict(sd, str(tmp_path / "t"))
    assert torch.equal(sd["w"], state["w"]) and torch.equal(sd["n"], state["n"]) and sd["meta"] == {"epoch": 2}


# ---------------------------------------------------------------------------------------------
# DCP's own save / load through the tenplex format (tenplex.checkpoint.dcp_storage)
# ---------------------------------------------------------------------------------------------
def test_dcp_save_and_load_through_tenplex_storage(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from tenplex.checkpoint.dcp_storage import TenplexStorageReader, TenplexStorageWriter

    g = torch.Generator().manual_seed(3)
    sd = {"model": {"w": torch.randn(6, 4, generator=g), "b": torch.randn(4, generator=g).to(torch.bfloat16)},
          "n": torch.arange(5), "step": torch.tensor(7.0), "meta": {"epoch": 2, "name": "run"}}
    url = str(tmp_path / "t")
    dcp.save(sd, storage_writer=TenplexStorageWriter(url, step=4), no_dist=True)
    assert read_manifest(url)["step"] == 4
    back = {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4, dtype=torch.bfloat16)},
            "n": torch.zeros(5, dtype=torch.int64), "step": torch.zeros(()), "meta": {"epoch": None, "name": None}}
    dcp.load(back, storage_reader=TenplexStorageReader(url), no_dist=True)
    assert torch.equal(back["model"]["w"], sd["model"]["w"]) and torch.equal(back["model"]["b"], sd["model"]["b"])
    assert torch.equal(back["n"], sd["n"]) and torch.equal(back["step"], sd["step"])
    assert back["meta"] == {"epoch": 2, "name": "run"}
    # and tenplex's own loader reads what DCP wrote
    again = {"model": {"w": torch.zeros(6, 4), "b": torch.zeros(4, dtype=torch.bfloat16)},
             "n": torch.zeros(5, dtype=torch.int64), "step": torch.zeros(()), "meta": {"epoch": None, "name": None}}
    tenplex.load_state_dict(again, url)
    assert torch.equal(again["model"]["w"], sd["model"]["w"]) and again["meta"]["name"] == "run"
