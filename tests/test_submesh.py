"""Tensors on sub-meshes (#29 item 1): a replica per sub-mesh saved once, loaded under any layout.

FSDP2 over the ``dp`` dim of a ``(dp, tp)`` mesh leaves a module that TP does not split (the
embedding, the head, the norms: what Hugging Face TP plans leave alone) sharded on the 1-D ``dp``
sub-mesh, and ranks 0, 2 hold it on {0, 2} while ranks 1, 3 hold it on {1, 3}: one replica per TP
rank, which DCP saves once. ``save_state_dict`` refused it with two identical descriptions.

Pure: ``merge_replicas`` over random root meshes, slices (flattened groups of dims included) and
placements gives every rank the local box its own sub-mesh gave it, on the root's dim names when
the replicas span whole root dims; the descriptions of 8 virtual ranks (real DeviceMeshes on
torch's fake process group: sub-meshes, ``_flatten``, HSDP, a pipeline stage); disagreeing ranks
are refused naming the field that differs. Real: spawned gloo worlds save a Llama-style model
(examples/native_llama.py) under FSDP2 over ``dp`` of ``(dp, tp)`` with an untied non-TP
embedding and head, under ``(dp=1, tp=2)``, HSDP, and HSDP x TP over torchtitan's flattened
``dp_shard_cp``, and one process without torch.distributed; and a ``transformers``
``Qwen2ForCausalLM`` (tied embeddings) under FSDP2 x TP (a TP plan on the attention and MLP
projections only), ``(dp=1, tp=2)``, FSDP2 over 4 and one process. Every layout loads every other
one's checkpoint: bit for bit, ``bytes_read`` against ``bytes_needed``.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from spawned import free_port, run_spawned
from tenplex.errors import CheckpointValueError, LayoutError
from tenplex.layout.mesh import NamedMesh, Replicate, Shard, StridedShard, local_box
from tenplex.layout.state_layout import Placed, StateLayout, merge_replicas
from tenplex.native.state_dict import describe_state_dict, load_state_dict, save_state_dict, state_layout_of
from tenplex.planning.assignment import locality_order

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "examples"))


# ---------------------------------------------------------------------------------------------
# 1. pure: merge_replicas
# ---------------------------------------------------------------------------------------------
@st.composite
def sliced(draw: st.DrawFn) -> tuple[NamedMesh, tuple[int, ...], list[Placed], bool]:
    """A root mesh (job ranks permuted or not), a slice of it along whole dims and adjacent groups
    of dims (a ``_flatten``-ed dim), placements on the slice, and the parts: the slice at some
    coordinates of the dims it leaves out (all of them, one, or a product of whole dims and fixed
    ones, as FSDP2 on a pipeline stage gives). Also whether the parts are a product (liftable)."""
    sizes = draw(st.lists(st.integers(1, 3), min_size=2, max_size=4))
    root = NamedMesh(tuple((f"r{i}", s) for i, s in enumerate(sizes)))
    ranks = tuple(range(root.world_size))
    if draw(st.booleans()):
        ranks = tuple(draw(st.permutations(ranks)))
    # the slice: consecutive groups of root dims, each group one sub dim, at least one dim left out
    groups: list[tuple[int, ...]] = []
    j = 0
    while j < root.ndim:
        if draw(st.booleans()):
            width = draw(st.integers(1, root.ndim - j))
            groups.append(tuple(range(j, j + width)))
            j += width
        else:
            j += 1
    inside = {j for g in groups for j in g}
    if not groups or len(inside) == root.ndim:
        groups = [(0,)]
        inside = {0}
    sub = NamedMesh(tuple((f"r{g[0]}" if len(g) == 1 else f"flat{g[0]}", math.prod(sizes[j] for j in g))
                           for g in groups))
    kinds = [draw(st.integers(0, 2)) for _ in groups]  # 0: Replicate, 1: Shard(0), 2: Shard(1)
    placements: list[Any] = []
    for i, k in enumerate(kinds):
        if not k:
            placements.append(Replicate())
            continue
        right = math.prod(sub.sizes[m] for m in range(i + 1, sub.ndim) if kinds[m] == k)
        placements.append(StridedShard(k - 1, right) if right > 1 and draw(st.booleans()) else Shard(k - 1))
    outside = [j for j in range(root.ndim) if j not in inside]
    chosen = {j: (list(range(sizes[j])) if draw(st.booleans()) else [draw(st.integers(0, sizes[j] - 1))])
              for j in outside}
    product = True
    combos = [()]
    for j in outside:
        combos = [c + (v,) for c in combos for v in chosen[j]]
    if len(combos) > 1 and draw(st.integers(0, 4)) == 0:  # a set of replicas that is not a product
        keep = draw(st.lists(st.sampled_from(combos), min_size=1, max_size=len(combos), unique=True))
        product = len(keep) == len(combos)
        combos = keep
    grid = torch.tensor(ranks).reshape(sizes)
    parts = []
    for combo in combos:
        where: list[Any] = [slice(None)] * root.ndim
        for j, v in zip(outside, combo):
            where[j] = v
        parts.append(Placed(sub, tuple(placements), tuple(grid[tuple(where)].reshape(-1).tolist())))
    return root, ranks, parts, product


def _boxes(placed: Placed, shape: tuple[int, ...]) -> dict[int, Any]:
    return {r: local_box(shape, placed.mesh, placed.placements, placed.mesh.coords(i), right_to_left=True)
            for i, r in enumerate(placed.ranks)}


@settings(max_examples=examples(150))
@given(case=sliced(), shape=st.tuples(st.integers(0, 11), st.integers(0, 7)), hint=st.booleans())
def test_merged_replicas_give_every_rank_its_own_box(case: tuple, shape: tuple[int, int], hint: bool) -> None:
    root, ranks, parts, product = case
    merged = merge_replicas(list(reversed(parts)), (root, ranks) if hint else None)
    assert sorted(merged.ranks) == sorted(r for p in parts for r in p.ranks)
    want: dict[int, Any] = {}
    for p in parts:
        want.update(_boxes(p, shape))
    assert _boxes(merged, shape) == want
    if len(parts) == 1:
        assert merged == parts[0]
    elif hint and product:  # on the root's dim names: remesh and the manifest name them as the job does
        assert set(merged.mesh.names) <= set(root.names) | set(parts[0].mesh.names), merged
        assert "replica" not in merged.mesh.names
    elif not hint:
        assert merged.mesh.names[0] == "replica" and merged.mesh.sizes[0] == len(parts)


def test_merge_replicas_refuses_what_is_not_a_replica() -> None:
    dp = NamedMesh.parse("dp=2")
    with pytest.raises(LayoutError, match=r"same mesh dims and placements.*\['S0'\] on dp=2.*\['R'\] on dp=2"):
        merge_replicas([Placed(dp, (Shard(0),), (0, 2)), Placed(dp, (Replicate(),), (1, 3))])
    with pytest.raises(LayoutError, match=r"job rank 2 is in two sub-meshes"):
        merge_replicas([Placed(dp, (Shard(0),), (0, 2)), Placed(dp, (Shard(0),), (2, 3))])


def _desc(shape: list[int], dims: list | None, placements: list | None, ranks: list | None,
          dtype: str = "float32", root: list | None = None) -> tuple[Any, ...]:
    return (shape, dtype, dims, placements, ranks, root)


def test_the_issue_case_merges_and_real_disagreements_name_their_field() -> None:
    """The descriptions ranks 0-3 gave for FSDP2 over ``dp`` of ``(dp, tp)`` (the embedding on {0, 2}
    and {1, 3}) are one placement; a field that really differs is named, and no two texts match."""
    root = [[["dp", 2], ["tp", 2]], [0, 1, 2, 3]]
    subs = [[0, 2], [1, 3], [0, 2], [1, 3]]
    descs = [{"tok.weight": _desc([1003, 96], [["dp", 2]], ["S0"], subs[r], root=root)} for r in range(4)]
    ptc, layout = state_layout_of(descs)
    assert layout.placed["tok.weight"] == Placed(NamedMesh.parse("dp=2,tp=2"), (Shard(0), Replicate()), (0, 1, 2, 3))
    new = layout.remesh({"dp": 1, "tp": 2})  # the in-process rescale's prediction and its survivors' order
    assert new.placed["tok.weight"].placements == (Shard(0), Replicate())
    order = locality_order(ptc, layout, new, [1, 2, 3])
    # new ranks 0 and 1 each need all rows: on rank 1 (rows ..501) and one of 2, 3 (rows 502..), not on both of those
    assert sorted(order) == [1, 2, 3] and 1 in order[:2] and set(order[:2]) & {2, 3}, order
    for r in range(4):  # without the root mesh (another torch, hand-built meshes): a replica dim first
        descs[r]["tok.weight"] = descs[r]["tok.weight"][:5]
    _, layout = state_layout_of(descs)
    assert layout.placed["tok.weight"] == Placed(NamedMesh.parse("replica=2,dp=2"), (Replicate(), Shard(0)),
                                                 (0, 2, 1, 3))
    base = _desc([1003, 96], [["dp", 2]], ["S0"], [0, 2], root=root)
    changes = {"global shape": (0, [1003, 95]), "dtype": (1, "bfloat16"), "mesh dims": (2, [["dp_shard", 2]]),
               "placements": (3, ["R"]), "mesh's job ranks": (4, [2, 1])}
    for field, (i, value) in changes.items():
        other = base[:i] + (value,) + base[i + 1:]
        descs = [{"w": base}, {"w": other}, {"w": base}, {"w": other}]
        if field == "mesh's job ranks":
            descs = [{"w": base}, {"w": base}, {"w": other}, {"w": other}]  # {0, 2} and {2, 1} overlap
        with pytest.raises(CheckpointValueError) as err:
            state_layout_of(descs)
        text = str(err.value)
        assert text.startswith(f"w: ranks disagree on its {field}"), text
        if field == "mesh's job ranks":  # the same dims and placements on overlapping ranks: not replicas
            assert "job rank 2 is in two sub-meshes" in text, text
        mine, theirs = text.split(" but rank ")[-1].split(" has ", 1)[1], text.split(" but rank ")[-2]
        assert theirs.split(" has ", 1)[1] != mine.split("; every")[0], text  # two texts that differ


# ---------------------------------------------------------------------------------------------
# 2. real DeviceMeshes of 8 virtual ranks (torch's fake process group): what _describe says
# ---------------------------------------------------------------------------------------------
def _virtual_descriptions(build: Any, world: int = 8) -> list[dict[str, tuple[Any, ...]]]:
    """Every virtual rank's descriptions of the DTensors ``build(mesh)`` returns ({key: DTensor}),
    on ``init_device_mesh("cpu", (2, 2, 2), ("dp_replicate", "dp_shard", "tp"))``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tenplex.native.state_dict import _describe

    out = []
    for rank in range(world):
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
        try:
            mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
            meshes: dict[int, Any] = {}
            out.append({k: _describe(v, None, meshes, root=True) for k, v in build(mesh).items()})
        finally:
            dist.destroy_process_group()
    return out


def test_virtual_ranks_on_sub_meshes_flattened_hsdp_and_stages() -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS

    def on(mesh: Any, placements: list, rows: int = 10) -> DTensor:
        return DTensor.from_local(torch.zeros(1, 4), mesh, placements, run_check=False,
                                  shape=torch.Size([rows, 4]), stride=(4, 1))

    def build(mesh: Any) -> dict[str, DTensor]:
        flat = mesh["dp_replicate", "dp_shard"]._flatten("dp")  # torchtitan's dp / dp_shard_cp style
        stage = mesh["dp_replicate"].get_local_rank() == 0  # a "stage": the dp_replicate=0 half only
        out = {"flat": on(flat, [TS(0)]), "hsdp": on(mesh["dp_replicate", "dp_shard"], [TR(), TS(0)]),
               "shard_only": on(mesh["dp_shard"], [TS(0)]), "tp_only": on(mesh["tp"], [TS(0)]),
               "whole": on(mesh, [TR(), TS(0), TS(0)])}
        if stage:
            out["stage"] = on(mesh["dp_shard"], [TS(0)])
        return out

    _, layout = state_layout_of(_virtual_descriptions(build))
    got = {k: (str(p.mesh), p.placements, p.ranks) for k, p in layout.tensors}
    everyone = tuple(range(8))
    assert got["flat"] == ("dp=4,tp=2", (Shard(0), Replicate()), everyone)
    assert got["hsdp"] == ("dp_replicate=2,dp_shard=2,tp=2", (Replicate(), Shard(0), Replicate()), everyone)
    assert got["shard_only"] == ("dp_replicate=2,dp_shard=2,tp=2", (Replicate(), Shard(0), Replicate()), everyone)
    assert got["tp_only"] == ("dp_replicate=2,dp_shard=2,tp=2", (Replicate(), Replicate(), Shard(0)), everyone)
    assert got["whole"] == ("dp_replicate=2,dp_shard=2,tp=2", (Replicate(), Shard(0), Shard(0)), everyone)
    assert got["stage"] == ("dp_shard=2,tp=2", (Shard(0), Replicate()), (0, 1, 2, 3))  # the stage's ranks only
    # what an in-process rescale predicts (a flattened dim or a stage's sub-mesh it cannot: LayoutError)
    named = StateLayout.of(8, {k: layout.placed[k] for k in ("hsdp", "shard_only", "tp_only", "whole")})
    new = named.remesh({"dp_replicate": 1, "dp_shard": 2, "tp": 2})
    assert new.placed["shard_only"].placements == (Replicate(), Shard(0), Replicate())
    assert new.placed["tp_only"].placements == (Replicate(), Replicate(), Shard(0))


# ---------------------------------------------------------------------------------------------
# 3. real worlds: every layout loads every other one's checkpoint
# ---------------------------------------------------------------------------------------------
LLAMA_LAYOUTS = {  # name: (world, mesh dims, what parallelizes it)
    "dp2_tp2": (4, (("dp", 2), ("tp", 2)), "fsdp_tp"),
    "dp1_tp2": (2, (("dp", 1), ("tp", 2)), "fsdp_tp"),
    "hsdp": (4, (("dp_replicate", 2), ("dp_shard", 2)), "hsdp"),
    "flat_hsdp_tp": (4, (("dp_replicate", 2), ("dp_shard", 1), ("cp", 1), ("tp", 2)), "flat"),
    "single": (1, (), None),
}
QWEN_LAYOUTS = {
    "dp2_tp2": (4, (("dp", 2), ("tp", 2)), "fsdp_tp"),
    "dp1_tp2": (2, (("dp", 1), ("tp", 2)), "fsdp_tp"),
    "dp4": (4, (("dp", 4),), "fsdp"),
    "single": (1, (), None),
}
MAX_OVER_READ = 3.0
"""bytes_read / bytes_needed of this tiny model's loads (2.68 at worst: shards of a few KB against
4 KiB checksum blocks); #29 item 2 brings every direction to 1.02."""
QWEN_PLAN = {"self_attn.q_proj": "col", "self_attn.k_proj": "col", "self_attn.v_proj": "col",
             "self_attn.o_proj": "row", "mlp.gate_proj": "col", "mlp.up_proj": "col", "mlp.down_proj": "row"}
LLAMA_PLAN = {"attention.wq": "col", "attention.wk": "col", "attention.wv": "col", "attention.wo": "row",
              "feed_forward.w1": "col", "feed_forward.w3": "col", "feed_forward.w2": "row"}


def _build(kind: str, layout: tuple, seed: int) -> tuple[Any, Any]:
    """The model (``llama``: native_llama's tiny, untied; ``qwen``: a tiny transformers Qwen2ForCausalLM,
    tied embeddings) parallelized as ``layout`` says (TP on the blocks' projections only, embedding,
    head and norms left alone; FSDP2 per block and on the root), and AdamW with its state created
    by two steps of made-up gradients (different per seed)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    world, dims, how = layout
    torch.manual_seed(seed)
    if kind == "llama":
        import native_llama as nl

        model = nl.Llama(nl.PRESETS["tiny"]).init_weights(seed)
        blocks, plan = list(model.layers.values()), LLAMA_PLAN
    else:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        cfg = Qwen2Config(vocab_size=1003, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                          max_position_embeddings=64)
        model = Qwen2ForCausalLM(cfg)
        blocks, plan = list(model.model.layers), QWEN_PLAN
    if how is not None:
        mesh = init_device_mesh("cpu", tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
        if how == "flat":  # torchtitan: FSDP over (dp_replicate, dp_shard_cp), dp_shard_cp = dp_shard x cp
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            dp_mesh = mesh["dp_replicate", "dp_shard_cp"]
        else:
            dp_mesh = {"fsdp_tp": "dp", "fsdp": "dp", "hsdp": ("dp_replicate", "dp_shard")}[how]
            dp_mesh = mesh[dp_mesh]
        styles = {"col": ColwiseParallel, "row": RowwiseParallel}
        for block in blocks:
            if "tp" in dict(dims):
                parallelize_module(block, mesh["tp"], {k: styles[v]() for k, v in plan.items()})
            fully_shard(block, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=False)
    for i in range(2):
        for p in model.parameters():
            p.grad = p.detach() * (0.5 + i + seed)
        optim.step()
    return model, optim


def _state(model: Any, optim: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optim)
    return {"model": model_sd, "optim": optim_sd}


def _full(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of the state dict whole, by flat key (a collective for DTensors, in key order)."""
    from torch.distributed.tensor import DTensor

    from tenplex.native.state_dict import flatten_state_dict

    leaves = flatten_state_dict(sd)
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, (_, _, v) in sorted(leaves.items()) if isinstance(v, torch.Tensor)}


def _bitwise_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))

    return [k for k in sorted(set(got) | set(want)) if k not in got or k not in want or not same(got[k], want[k])]


def _save(kind: str, name: str, layout: tuple, root: Path, seed: int) -> dict[str, Any]:
    model, optim = _build(kind, layout, seed)
    sd = _state(model, optim)
    save_state_dict(sd, str(root / name), step=seed)
    full = _full(sd)
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(full, root / f"{name}.ref.pt")
    return {"placements": sorted({f"{k}: {v.device_mesh.mesh_dim_names} {v.placements}" for k, v in
                                  _flat_tensors(sd).items() if hasattr(v, "placements")})}


def _flat_tensors(sd: dict[str, Any]) -> dict[str, Any]:
    from tenplex.native.state_dict import flatten_state_dict

    return {k: v for k, (_, _, v) in flatten_state_dict(sd).items() if isinstance(v, torch.Tensor)}


def _load_all(kind: str, name: str, layouts: dict[str, tuple], root: Path) -> dict[str, Any]:
    """Build ``name``'s layout once and load every other layout's checkpoint into it."""
    model, optim = _build(kind, layouts[name], 99)
    sd = _state(model, optim)
    _, described = describe_state_dict(sd)  # what an in-process rescale plans from, and predicts on other meshes
    out: dict[str, Any] = {"described": {k: (str(p.mesh), p.placements, p.ranks) for k, p in described.tensors
                                         if ("embed" in k or "output" in k or "lm_head" in k) and
                                         not k.endswith(".step")}}  # not AdamW's step counters: plain tensors
    if name == "dp2_tp2":
        out["remeshed"] = {k: described.remesh({"dp": 1, "tp": 2}).placed[k].placements for k in out["described"]}
    for src in layouts:
        if src == name:
            continue
        r = load_state_dict(sd, str(root / src))
        want = torch.load(root / f"{src}.ref.pt", weights_only=True)
        out[src] = {"diff": _bitwise_diff(_full(sd), want), "step": r.step, "read": r.bytes_read,
                    "needed": r.bytes_needed}
    return out


def _worlds_worker(rank: int, kind: str, worlds: list[tuple[str, str, int, int]], layouts: dict[str, tuple],
                   root: Path, out: Any) -> None:
    """``_world_worker`` for each ``(phase, name, port, seed)`` of ``worlds`` in turn, in this one process
    (a process imports transformers once), until one fails."""
    for phase, name, port, seed in worlds:
        if rank < layouts[name][0] and _world_worker(rank, kind, phase, name, layouts, port, root, seed, out):
            return


def _world_worker(rank: int, kind: str, phase: str, name: str, layouts: dict[str, tuple], port: int, root: Path,
                  seed: int, out: Any) -> str | None:
    """One rank of ``name``'s world: it saves (``phase`` "save") or loads every other layout's checkpoint;
    its error, if any."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    res: dict[str, Any] = {"error": None}
    t0 = time.perf_counter()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=layouts[name][0])
    try:
        if phase == "save":
            res.update(_save(kind, name, layouts[name], root, seed=seed))
        else:
            res["loads"] = _load_all(kind, name, layouts, root)
    except BaseException as e:  # reported to the parent, which fails the test with it
        import traceback

        res["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2500:]}"
    finally:
        res["seconds"] = time.perf_counter() - t0
        out.put((phase, name, rank, res))
        dist.destroy_process_group()
    return res["error"]


def _every_direction(kind: str, layouts: dict[str, tuple],
                     root: Path) -> tuple[dict[tuple[str, str], float], dict[str, list[str]]]:
    """Save under every layout, load under every other: bit-exact; the read amplification by
    (saved, loaded) layout (the largest over the loading ranks) and the placements each saved.
    One set of processes forms the worlds in turn, but a world with a ``_flatten``-ed mesh gets new
    ones (torch 2.13 keeps the group names of a destroyed world, which that mesh then asks for)."""
    names = [n for n, (world, _, _) in layouts.items() if world > 1]
    single = [n for n, (world, _, _) in layouts.items() if world == 1]
    for n in single:  # one process, no torch.distributed: saved first, loaded last
        _save(kind, n, layouts[n], root, seed=len(names) + 1)
    worlds = [(phase, n, free_port(), i + 1) for phase in ("save", "load") for i, n in enumerate(names)]
    results: dict[tuple[str, str, int], dict[str, Any]] = {}
    groups: list[list[tuple[str, str, int, int]]] = []
    for w in worlds:
        if groups and layouts[w[1]][2] != "flat" and layouts[groups[-1][-1][1]][2] != "flat":
            groups[-1].append(w)
        else:
            groups.append([w])
    for group in groups:
        expect = sum(layouts[n][0] for _, n, _, _ in group)
        results.update(run_spawned(_worlds_worker, [(r, kind, group, layouts, root) for r in range(4)],
                                   expect=expect, timeout=240))
        errors = [f"{key}: {res['error']}" for key, res in results.items() if res["error"]]
        assert not errors, "\n".join(errors)
        assert len(results) == sum(layouts[n][0] for _, n, _, _ in worlds[:worlds.index(group[-1]) + 1])
    loads = {(name, rank): res["loads"] for (phase, name, rank), res in results.items() if phase == "load"}
    for n in single:
        loads[(n, 0)] = _load_all(kind, n, layouts, root)
    ratios: dict[tuple[str, str], float] = {}
    for (name, rank), got in sorted(loads.items()):
        assert sorted(set(got) - {"described", "remeshed"}) == sorted(set(layouts) - {name}), got
        if name == "dp2_tp2":  # the embedding and head FSDP2 shards on {0, 2} and {1, 3}: one placement
            assert len(got["described"]) >= 3, got["described"]  # weight, exp_avg, exp_avg_sq at least
            for key, (mesh, placements, ranks) in got["described"].items():
                assert (mesh, placements, ranks) == ("dp=2,tp=2", (Shard(0), Replicate()), (0, 1, 2, 3)), key
                assert got["remeshed"][key] == placements, (key, got["remeshed"][key])
        for src, r in ((s, r) for s, r in got.items() if s not in ("described", "remeshed")):
            assert not r["diff"], (f"{src} -> {name} rank {rank}", r["diff"])
            assert r["step"] == (single and src in single and len(names) + 1 or names.index(src) + 1)
            assert r["needed"] > 0 and r["read"] >= r["needed"], (src, name, rank, r)
            ratios[(src, name)] = max(ratios.get((src, name), 0.0), r["read"] / r["needed"])
    saved = {name: res["placements"] for (phase, name, rank), res in results.items() if phase == "save" and rank == 0}
    print("\n" + kind + " read/needed (saved -> loaded, worst rank): "
          + ", ".join(f"{a}->{b} {v:.3f}" for (a, b), v in sorted(ratios.items())))
    return ratios, saved


@pytest.mark.timeout(300)
def test_llama_sub_mesh_layouts_load_each_other(tmp_path: Path) -> None:
    ratios, saved = _every_direction("llama", LLAMA_LAYOUTS, tmp_path)
    # the issue's case really was saved: the untied embedding on the 1-D dp sub-mesh, the blocks 2-D
    assert any(p.startswith("model.tok_embeddings.weight: ('dp',) (Shard(dim=0),)") for p in saved["dp2_tp2"])
    assert any("model.layers.0.attention.wq.weight: ('dp', 'tp') (_StridedShard" in p for p in saved["dp2_tp2"])
    assert any("('dp_replicate', 'dp_shard_cp') (Replicate(), Shard(dim=0))" in p for p in saved["flat_hsdp_tp"])
    assert max(ratios.values()) < MAX_OVER_READ, ratios


@pytest.mark.timeout(300)
def test_transformers_qwen2_fsdp_tp_layouts_load_each_other(tmp_path: Path) -> None:
    ratios, saved = _every_direction("qwen", QWEN_LAYOUTS, tmp_path)
    assert any(p.startswith("model.model.embed_tokens.weight: ('dp',) (Shard(dim=0),)") for p in saved["dp2_tp2"])
    assert max(ratios.values()) < MAX_OVER_READ, ratios
