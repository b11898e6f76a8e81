"""PTC: shard/unshard round trips, partition specs checked against plain torch slicing,
DP fragments, placement, JSON round trips and error cases."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from conftest import assert_same, canonical_flat, examples, layouts, model_kwargs, random_global
from hypothesis import given, settings
from hypothesis import strategies as st

from tenplex import PTC, LayoutError, ParallelConfig, Replicated, Split, TensorSpec, model_ptc
from tenplex.errors import SpecError
from tenplex.layout.ptc import PAD, Layout, Panels, SegmentTable, dtype_from_str, dtype_to_str
from tenplex.layout.state_layout import StateLayout


@st.composite
def model_and_layout(draw, max_world=16):
    kw = draw(model_kwargs())
    cfg = draw(layouts(kw, max_world=max_world))
    return kw, cfg


def _tp_shard_manual(spec: TensorSpec, g: torch.Tensor, tp: int, t: int) -> torch.Tensor:
    """TP rank t's shard of global tensor g, computed with plain torch slicing (natural shape)."""
    if not isinstance(spec.tp, Split):
        return g
    d = spec.tp.dim
    if spec.tp.blocks is not None:
        parts, start = [], 0
        for b in spec.tp.blocks:
            block = g.narrow(d, start, b)
            parts.append(torch.chunk(block, tp, dim=d)[t])
            start += b
        return torch.cat(parts, dim=d)
    if spec.tp.pad_multiple is not None:
        rows = g.shape[d]
        unit = spec.tp.pad_multiple * tp
        padded = -(-rows // unit) * unit
        pad_shape = list(g.shape)
        pad_shape[d] = padded - rows
        g = torch.cat([g, torch.zeros(pad_shape, dtype=g.dtype)], dim=d)
    per = g.shape[d] // tp
    return g.narrow(d, t * per, per)


# -- round trips on model builders --------------------------------------------------------------
@settings(max_examples=examples(60))
@given(model_and_layout(), st.integers(0, 2**16))
def test_model_shard_unshard_round_trip(kl, seed):
    kw, cfg = kl
    ptc = model_ptc(**kw)
    g = random_global(ptc, seed)
    shards = ptc.shard(g, cfg)
    assert sorted(shards) == list(range(cfg.world_size))
    back = ptc.unshard(shards, cfg)
    assert set(back) == set(g)
    for name in ptc.tensors:
        assert_same(back[name], g[name], name)
    for obj in ptc.objects:
        assert back[obj] == g[obj]
    # Local shapes match the spec, every shard holds exactly the tensors of its stage.
    for rank, shard in shards.items():
        names = ptc.rank_tensors(cfg, rank)
        assert [n for n in shard if n in ptc.tensors] == names
        for name in names:
            assert tuple(shard[name].shape) == ptc.local_shape(name, cfg), name
            assert shard[name].dtype == ptc.tensors[name].dtype


@settings(max_examples=examples(60))
@given(model_and_layout(), st.integers(0, 2**16))
def test_model_shards_match_manual_torch_slicing(kl, seed):
    """Every non-DP-sharded shard equals plain torch slicing of the global tensor (fused blocks
    give [q_t; k_t; v_t] / [gate_t; up_t], Split(1) gives torch.chunk along dim 1, vocab
    padding gives zero rows)."""
    kw, cfg = kl
    ptc = model_ptc(**kw)
    g = random_global(ptc, seed)
    shards = ptc.shard(g, cfg)
    for rank, shard in shards.items():
        c = cfg.coords(rank)
        for name in ptc.rank_tensors(cfg, rank):
            spec = ptc.tensors[name]
            if spec.dp_sharded:
                continue
            assert_same(shard[name], _tp_shard_manual(spec, g[name], cfg.tp, c.tp), f"{name} rank {rank}")


@settings(max_examples=examples(40))
@given(model_and_layout(), st.integers(0, 2**16))
def test_vocab_padding(kl, seed):
    kw, cfg = kl
    kw = {**kw, "optimizer": False}
    ptc = model_ptc(**kw)
    g = random_global(ptc, seed)
    shards = ptc.shard(g, cfg)
    vocab, pad = kw["vocab"], kw["vocab_pad"]
    for name in ("embedding.word", "lm_head.weight"):
        if name not in ptc.tensors:
            continue
        spec = ptc.tensors[name]
        padded = spec.padded_rows(cfg.tp)
        assert padded % (pad * cfg.tp) == 0
        assert vocab <= padded < vocab + pad * cfg.tp
        per = padded // cfg.tp
        for rank in range(cfg.world_size):
            if name not in shards[rank]:
                continue
            t = cfg.coords(rank).tp
            local = shards[rank][name]
            assert tuple(local.shape) == (per, kw["hidden"])
            lo, hi = t * per, (t + 1) * per
            real = max(0, min(hi, vocab) - lo)
            assert_same(local[:real], g[name][lo : lo + real], name)
            assert not local[real:].any(), f"{name}: padding rows of TP rank {t} are not zero"


def test_vocab_padding_fixed_example():
    ptc = model_ptc("tiny", optimizer=False)  # vocab 259, pad 8
    for tp, padded in ((1, 264), (2, 272), (4, 288)):
        cfg = ParallelConfig(tp=tp)
        assert ptc.tensors["embedding.word"].padded_rows(tp) == padded
        assert ptc.local_shape("embedding.word", cfg) == (padded // tp, 64)
    g = random_global(ptc, 3)
    shards = ptc.shard(g, ParallelConfig(tp=4))
    last = shards[3]["lm_head.weight"]  # rows 216..287; real rows 216..258
    assert_same(last[:43], g["lm_head.weight"][216:])
    assert torch.count_nonzero(last[43:]) == 0
    segs = ptc.segments("lm_head.weight", ParallelConfig(tp=4), 3)
    assert segs == [(0, 216 * 64, 43 * 64), (43 * 64, PAD, 29 * 64)]


def test_fused_qkv_gqa_fixed_example():
    ptc = model_ptc(arch="llama", num_layers=1, hidden=16, heads=4, kv_heads=2, ffn_hidden=8, vocab=10,
                    dtype=torch.float32, optimizer=False)
    g = random_global(ptc, 1)
    qkv = g["layers.0.attn.qkv.weight"]  # q: 16 rows, k: 8 rows, v: 8 rows (head_dim 4)
    assert qkv.shape == (32, 16)
    gate_up = g["layers.0.mlp.gate_up.weight"]
    assert gate_up.shape == (16, 16)
    cfg = ParallelConfig(tp=2)
    shards = ptc.shard(g, cfg)
    for t in range(2):
        q_t, k_t, v_t = qkv[0:16][8 * t : 8 * t + 8], qkv[16:24][4 * t : 4 * t + 4], qkv[24:32][4 * t : 4 * t + 4]
        assert_same(shards[t]["layers.0.attn.qkv.weight"], torch.cat([q_t, k_t, v_t]))
        gate_t, up_t = gate_up[:8][4 * t : 4 * t + 4], gate_up[8:][4 * t : 4 * t + 4]
        assert_same(shards[t]["layers.0.mlp.gate_up.weight"], torch.cat([gate_t, up_t]))
        assert_same(shards[t]["layers.0.attn.proj.weight"], torch.chunk(g["layers.0.attn.proj.weight"], 2, 1)[t])
        assert_same(shards[t]["layers.0.mlp.down.weight"], torch.chunk(g["layers.0.mlp.down.weight"], 2, 1)[t])
        assert_same(shards[t]["layers.0.attn_norm.weight"], g["layers.0.attn_norm.weight"])
    # Segments of TP rank 1 in canonical order: one per block.
    row = 16
    assert ptc.segments("layers.0.attn.qkv.weight", cfg, 1) == [
        (0, 8 * row, 8 * row), (8 * row, 20 * row, 4 * row), (12 * row, 28 * row, 4 * row)]


@settings(max_examples=examples(40))
@given(model_and_layout(), st.integers(0, 2**16))
def test_split_dim1_is_torch_chunk(kl, seed):
    kw, cfg = kl
    ptc = model_ptc(**{**kw, "optimizer": False})
    g = random_global(ptc, seed)
    shards = ptc.shard(g, cfg)
    dim1 = [n for n, s in ptc.tensors.items() if isinstance(s.tp, Split) and s.tp.dim == 1]
    assert dim1 and all(n.endswith(("proj.weight", "fc2.weight", "down.weight")) for n in dim1)
    for rank in range(cfg.world_size):
        t = cfg.coords(rank).tp
        for name in dim1:
            if name in shards[rank]:
                assert_same(shards[rank][name], torch.chunk(g[name], cfg.tp, dim=1)[t], name)


@settings(max_examples=examples(50))
@given(model_and_layout(), st.integers(0, 2**16))
def test_dp_fragments(kl, seed):
    """Distributed optimizer: fragments of equal length whose concatenation over DP (padding
    stripped) is the TP shard's canonical flat form; the padding is zero."""
    kw, cfg = kl
    kw = {**kw, "optimizer": True, "distributed_optimizer": True}
    ptc = model_ptc(**kw)
    plain = model_ptc(**{**kw, "distributed_optimizer": False})
    assert set(ptc.tensors) == set(plain.tensors)
    g = random_global(ptc, seed)
    shards, plain_shards = ptc.shard(g, cfg), plain.shard(g, cfg)
    opt = [n for n, s in ptc.tensors.items() if s.dp_sharded]
    assert opt and all(n.startswith("optimizer.") for n in opt)
    assert all(not s.dp_sharded for n, s in ptc.tensors.items() if not n.startswith("optimizer."))
    for name in opt:
        spec = ptc.tensors[name]
        n = spec.tp_local_numel(cfg.tp)
        frag = -(-n // cfg.dp)
        for pp in ptc.stages_of(name, cfg):
            for t in range(cfg.tp):
                frags = [shards[cfg.rank(pp=pp, dp=d, tp=t)][name] for d in range(cfg.dp)]
                assert all(f.shape == (frag,) for f in frags), name
                joined = torch.cat(frags)
                assert len(joined) >= n and len(joined) - n < cfg.dp
                assert not joined[n:].any(), f"{name}: DP padding is not zero"
                tp_shard = plain_shards[cfg.rank(pp=pp, dp=0, tp=t)][name]
                assert_same(joined[:n], canonical_flat(spec, tp_shard), name)


@settings(max_examples=examples(40))
@given(model_and_layout())
def test_tied_embedding_placement(kl):
    kw, cfg = kl
    ptc = model_ptc(**kw)
    tied = ptc.meta["model"]["tied_embeddings"]
    assert tied == (kw["tied_embeddings"] if kw["tied_embeddings"] is not None else kw["arch"] == "gpt")
    first, last = 0, cfg.pp - 1
    for rank in range(cfg.world_size):
        stage = cfg.coords(rank).pp
        names = set(ptc.rank_tensors(cfg, rank))
        assert ("embedding.word" in names) == (stage == first or (tied and stage == last))
        assert ("lm_head.weight" in names) == (not tied and stage == last)
        assert ("final_norm.weight" in names) == (stage == last)
        if kw["optimizer"]:
            assert ("optimizer.exp_avg.embedding.word" in names) == ("embedding.word" in names)
    assert ("lm_head.weight" in ptc.tensors) == (not tied)
    assert ptc.stages_of("embedding.word", cfg) == ((0,) if cfg.pp == 1 or not tied else (0, cfg.pp - 1))


@settings(max_examples=examples(40))
@given(model_and_layout())
def test_layers_follow_stages(kl):
    kw, cfg = kl
    ptc = model_ptc(**kw)
    stage_of = cfg.stage_of_layers(kw["num_layers"])
    for name, spec in ptc.tensors.items():
        if isinstance(spec.placement, int):
            assert ptc.stages_of(name, cfg) == (stage_of[spec.placement],)
            assert f"layers.{spec.placement}." in name
    # Every rank's real bytes sum to the collection's bytes times the replication.
    total = sum(ptc.rank_nbytes(cfg, r) for r in range(cfg.world_size))
    expected = 0
    for name, spec in ptc.tensors.items():
        copies = len(ptc.stages_of(name, cfg)) * (1 if spec.dp_sharded else cfg.dp)
        copies *= cfg.tp if isinstance(spec.tp, Replicated) else 1
        expected += copies * spec.nbytes
    assert total == expected


@settings(max_examples=examples(40))
@given(model_and_layout())
def test_holders_cover_every_element(kl):
    kw, cfg = kl
    ptc = model_ptc(**kw)
    for name, spec in ptc.tensors.items():
        tab = ptc.holders(name, cfg)
        count = np.zeros(spec.numel, dtype=np.int64)
        for s, ln in zip(tab.start, tab.length):
            count[s : s + ln] += 1
        copies = len(ptc.stages_of(name, cfg)) * (1 if spec.dp_sharded else cfg.dp)
        copies *= cfg.tp if isinstance(spec.tp, Replicated) else 1
        assert (count == copies).all(), name
        assert set(tab.rank.tolist()) <= set(range(cfg.world_size))


# -- hand-written PTC -----------------------------------------------------------------------------
def custom_ptc() -> PTC:
    return PTC(
        [
            TensorSpec("a", (6, 4, 3), torch.float32, Split(1), placement=0),
            TensorSpec("b", (10,), torch.float64, Split(0, pad_multiple=3), placement="last", dp_sharded=True),
            TensorSpec("c", (5, 7), torch.bfloat16, Replicated(), placement="all", dp_sharded=True),
            TensorSpec("d", (4, 12), torch.float16, Split(1, blocks=(4, 8)), placement=1),
            TensorSpec("e", (3,), torch.int64, placement="both"),
            TensorSpec("f", (2, 3, 4), torch.int32, Split(2), placement="first", dp_sharded=True),
            TensorSpec("g", (7, 4), torch.uint8, Split(0, pad_multiple=2), placement=2),
            TensorSpec("h", (), torch.float32, placement=2),
            TensorSpec("i", (4, 2), torch.bool, Split(0), placement="all"),
        ],
        num_layers=3,
        objects=("step", "rng"),
        meta={"note": "custom"},
    )


@st.composite
def custom_layouts(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    dp = draw(st.integers(1, 4))
    if draw(st.booleans()):
        pp = draw(st.integers(1, 3))
        stages = None
    else:
        pp = draw(st.integers(1, 4))
        cuts = sorted(draw(st.lists(st.integers(0, 3), min_size=pp - 1, max_size=pp - 1)))
        b = [0, *cuts, 3]
        stages = tuple(y - x for x, y in zip(b, b[1:]))
    return ParallelConfig(dp=dp, tp=tp, pp=pp, stages=stages)


@settings(max_examples=examples(60))
@given(custom_layouts(), st.integers(0, 2**16))
def test_custom_ptc_round_trip(cfg, seed):
    ptc = custom_ptc()
    g = random_global(ptc, seed)
    shards = ptc.shard(g, cfg)
    back = ptc.unshard(shards, cfg)
    for name in ptc.tensors:
        assert_same(back[name], g[name], name)
    assert back["step"] == g["step"] and back["rng"] == g["rng"]
    for rank, shard in shards.items():
        c = cfg.coords(rank)
        assert shard["step"] == g["step"]
        for name in ptc.rank_tensors(cfg, rank):
            spec = ptc.tensors[name]
            assert tuple(shard[name].shape) == spec.local_shape(cfg)
            if not spec.dp_sharded:
                assert_same(shard[name], _tp_shard_manual(spec, g[name], cfg.tp, c.tp), name)
            else:
                # Rebuild the fragment by hand from the manual TP shard.
                flat = canonical_flat(spec, _tp_shard_manual(spec, g[name], cfg.tp, c.tp))
                frag = -(-flat.numel() // cfg.dp)
                padded = torch.cat([flat, torch.zeros(frag * cfg.dp - flat.numel(), dtype=flat.dtype)])
                assert_same(shard[name], padded[c.dp * frag : (c.dp + 1) * frag], name)
    # Placement of the hand-written specs.
    stage_of = cfg.stage_of_layers(3)
    for rank in range(cfg.world_size):
        stage = cfg.coords(rank).pp
        names = set(ptc.rank_tensors(cfg, rank))
        assert ("a" in names) == (stage == stage_of[0])
        assert ("d" in names) == (stage == stage_of[1])
        assert ("g" in names) == ("h" in names) == (stage == stage_of[2])
        assert ("b" in names) == (stage == cfg.pp - 1)
        assert ("e" in names) == (stage in (0, cfg.pp - 1))
        assert ("f" in names) == (stage == 0)
        assert "c" in names and "i" in names


def test_custom_ptc_blocks_dim1_fixed():
    ptc = custom_ptc()
    g = random_global(ptc, 5)
    cfg = ParallelConfig(tp=2, pp=3)
    shards = ptc.shard(g, cfg)
    d = g["d"]
    for t in range(2):
        rank = cfg.rank(pp=1, tp=t)
        expected = torch.cat([d[:, 2 * t : 2 * t + 2], d[:, 4 + 4 * t : 8 + 4 * t]], dim=1)
        assert_same(shards[rank]["d"], expected)
    # g: 7 rows padded to 8 (pad_multiple 2 * tp 2); TP rank 1 holds rows 4..6 and one zero row.
    g_last = shards[cfg.rank(pp=2, tp=1)]["g"]
    assert_same(g_last[:3], g["g"][4:])
    assert g_last[3].tolist() == [0, 0, 0, 0]


def test_ptc_docstring_example():
    ptc = PTC([TensorSpec("w", (8, 4), tp=Split(0), placement=0)], num_layers=1)
    w = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    shards = ptc.shard({"w": w}, ParallelConfig(tp=2))
    assert_same(shards[0]["w"], w[:4])
    assert_same(shards[1]["w"], w[4:])


# -- JSON and identity ----------------------------------------------------------------------------
@settings(max_examples=examples(40))
@given(model_kwargs())
def test_json_round_trip_models(kw):
    ptc = model_ptc(**kw)
    text = json.dumps(ptc.to_json())
    back = PTC.from_json(json.loads(text))
    assert back.fingerprint() == ptc.fingerprint()
    assert back.diff(ptc) == []
    assert list(back.tensors) == list(ptc.tensors)
    assert all(back.tensors[n] == ptc.tensors[n] for n in ptc.tensors)
    assert back.num_layers == ptc.num_layers and back.objects == ptc.objects and back.meta == ptc.meta


def test_json_round_trip_custom():
    ptc = custom_ptc()
    back = PTC.from_json(json.loads(json.dumps(ptc.to_json())))
    assert back.fingerprint() == ptc.fingerprint()
    assert [back.tensors[n] for n in back] == [ptc.tensors[n] for n in ptc]
    assert back.objects == ("step", "rng") and back.meta == {"note": "custom"} and back.num_layers == 3


def test_fingerprint_sensitive_to_specs_not_meta():
    ptc = custom_ptc()
    same = PTC(ptc.tensors.values(), num_layers=3, meta={"other": 1})
    assert same.fingerprint() == ptc.fingerprint()
    specs = list(ptc.tensors.values())
    for change in (
        dict(shape=(6, 4, 4)),
        dict(dtype=torch.float64),
        dict(tp=Split(0)),
        dict(tp=Replicated()),
        dict(placement=1),
        dict(dp_sharded=True),
        dict(name="a2"),
    ):
        other = PTC([dataclasses.replace(specs[0], **change), *specs[1:]], num_layers=3)
        assert other.fingerprint() != ptc.fingerprint(), change
        assert other.diff(ptc), change
    a = model_ptc("tiny")
    b = model_ptc("tiny", vocab=260)
    assert a.fingerprint() != b.fingerprint()
    assert any("embedding.word" in line for line in a.diff(b))
    c = model_ptc("tiny", num_layers=5)
    assert any("only in the other" in line for line in a.diff(c))


def test_dtype_strings():
    for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool"):
        dt = dtype_from_str(name)
        assert dtype_to_str(dt) == name
        assert dtype_from_str("torch." + name) is dt
    with pytest.raises(ValueError, match="unsupported dtype"):
        dtype_from_str("complex64")
    with pytest.raises(ValueError, match="unsupported dtype"):
        dtype_to_str(torch.complex64)


# -- validation and errors ----------------------------------------------------------------------------
def test_tensor_spec_validation():
    with pytest.raises(ValueError, match="non-empty name"):
        TensorSpec("", (2,))
    with pytest.raises(ValueError, match="negative size"):
        TensorSpec("x", (2, -1))
    with pytest.raises(ValueError, match="placement"):
        TensorSpec("x", (2,), placement="middle")
    with pytest.raises(ValueError, match="placement"):
        TensorSpec("x", (2,), placement=-1)
    with pytest.raises(ValueError, match="placement"):
        TensorSpec("x", (2,), placement=True)
    with pytest.raises(ValueError, match="split dim 2 but the tensor has 2 dims"):
        TensorSpec("x", (2, 3), tp=Split(2))
    with pytest.raises(ValueError, match=r"blocks 1\+2 = 3 but dim 0 has size 4"):
        TensorSpec("x", (4, 3), tp=Split(0, blocks=(1, 2)))
    with pytest.raises(ValueError, match="Split.dim"):
        Split(-1)
    with pytest.raises(ValueError, match="positive sizes"):
        Split(0, blocks=(2, 0))
    with pytest.raises(ValueError, match="not both"):
        Split(0, blocks=(2,), pad_multiple=2)
    with pytest.raises(ValueError, match="pad_multiple"):
        Split(0, pad_multiple=0)
    spec = TensorSpec("x", [4, 3], placement=0)
    assert spec.shape == (4, 3) and spec.numel == 12 and spec.nbytes == 48
    assert TensorSpec("y", (4, 3), torch.bfloat16).nbytes == 24


def test_ptc_validation():
    a = TensorSpec("a", (2,), placement=1)
    with pytest.raises(ValueError, match="listed twice"):
        PTC([a, a])
    with pytest.raises(ValueError, match="num_layers=1 but a tensor belongs to layer 1"):
        PTC([a], num_layers=1)
    with pytest.raises(ValueError, match="both as tensor and object"):
        PTC([a], objects=("a",))
    assert PTC([a]).num_layers == 2
    assert PTC([TensorSpec("b", (2,))]).num_layers == 0
    ptc = PTC([a, TensorSpec("b", (3,), torch.float16)], objects=("s",))
    assert len(ptc) == 2 and list(ptc) == ["a", "b"] and "a" in ptc and "s" not in ptc
    assert ptc.nbytes == 2 * 4 + 3 * 2 and ptc.numel() == 5


def test_check_tp_error_names_the_tensor():
    spec = TensorSpec("w", (6, 4), tp=Split(0), placement=0)
    with pytest.raises(LayoutError, match=r"tp=4 does not divide dim of size 6 along dim 0 of w.*6 % 4 = 2"):
        spec.check_tp(4)
    blocks = TensorSpec("qkv", (12, 2), tp=Split(0, blocks=(8, 2, 2)), placement=0)
    with pytest.raises(LayoutError, match="does not divide block of size 2"):
        blocks.check_tp(4)
    # Vocabulary padding makes any tp work.
    TensorSpec("v", (7, 2), tp=Split(0, pad_multiple=1)).check_tp(4)
    ptc = PTC([spec])
    with pytest.raises(LayoutError):
        ptc.shard({"w": torch.zeros(6, 4)}, ParallelConfig(tp=4))


def test_shard_and_unshard_errors():
    ptc = custom_ptc()
    g = random_global(ptc, 0)
    cfg = ParallelConfig(dp=2, tp=2)
    with pytest.raises(KeyError, match="lacks 1 tensors"):
        ptc.shard({k: v for k, v in g.items() if k != "a"}, cfg)
    with pytest.raises(ValueError, match=r"a: global tensor has shape \(6, 4\)"):
        ptc.shard({**g, "a": torch.zeros(6, 4)}, cfg)
    shards = ptc.shard(g, cfg)
    # DP replicas make rank 0 redundant for plain tensors, but DP-sharded "b" needs it: rank 0
    # (dp=0, tp=0) alone holds b's canonical elements 0..2 (TP rank 0 holds 0..5 of 10).
    partial = {r: s for r, s in shards.items() if r != 0}
    with pytest.raises(ValueError, match=r"cannot unshard b: no rank holds elements from \(0, 3\)"):
        ptc.unshard(partial, cfg)
    # Without DP sharding a single DP replica is enough.
    plain = PTC([dataclasses.replace(s, dp_sharded=False) for s in ptc.tensors.values()], num_layers=3)
    pshards = plain.shard(g, cfg)
    back = plain.unshard({r: pshards[r] for r in (0, 1)}, cfg)
    for name in plain.tensors:
        assert_same(back[name], g[name], name)


def test_shard_casts_to_spec_dtype():
    ptc = PTC([TensorSpec("w", (4,), torch.bfloat16, Split(0))])
    w = torch.tensor([1.5, 2.25, -3.0, 4.0], dtype=torch.float64)
    shards = ptc.shard({"w": w}, ParallelConfig(tp=2))
    assert shards[1]["w"].dtype == torch.bfloat16
    assert shards[1]["w"].tolist() == [-3.0, 4.0]


def test_unequal_panels_spec_json_canonical_order_and_validation() -> None:
    """Panels with edges: encoded with ``edges`` (equal ones exactly as before), stored panel after
    panel, each row-major; edges must rise from 0 to dim 1."""
    spec = TensorSpec("w", (3, 7, 2), tp=Panels(1, 3, (0, 4, 5, 7)))
    assert spec.panels == (0, 4, 5, 7) and not spec.natural
    assert spec.to_json()["tp"] == {"kind": "panels", "dim": 1, "count": 3, "edges": [0, 4, 5, 7]}
    assert TensorSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    t = torch.arange(42.0).reshape(3, 7, 2)
    flat = spec.to_canonical(t)
    assert torch.equal(flat, torch.cat([t[:, 0:4].reshape(-1), t[:, 4:5].reshape(-1), t[:, 5:7].reshape(-1)]))
    assert torch.equal(spec.from_canonical(flat), t)
    for count, edges in ((2, (0, 4, 5, 7)), (3, (1, 4, 5, 7)), (3, (0, 5, 4, 7))):
        with pytest.raises(SpecError, match="edges"):
            Panels(1, count, edges)
    with pytest.raises(SpecError, match="edges"):
        TensorSpec("w", (3, 8), tp=Panels(1, 3, (0, 4, 5, 7)))


def test_panels_spec_json_round_trip_and_refused_by_parallel_config() -> None:
    spec = TensorSpec("w", (6, 8, 2), tp=Panels(1, 4))
    assert spec.panels == 4 and not spec.natural and spec.split_dim is None
    assert TensorSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert spec.to_json()["tp"] == {"kind": "panels", "dim": 1, "count": 4}
    a, b = PTC([spec]), PTC([TensorSpec("w", (6, 8, 2))])
    assert a.fingerprint() != b.fingerprint() and a.diff(b)
    t = torch.arange(96.0).reshape(6, 8, 2)
    flat = spec.to_canonical(t)
    assert torch.equal(flat, t.reshape(6, 4, 2, 2).permute(1, 0, 2, 3).reshape(-1))
    assert torch.equal(spec.from_canonical(flat), t)
    with pytest.raises(SpecError, match="ParallelConfig layout cannot split"):
        a.check(ParallelConfig(tp=2))
    with pytest.raises(SpecError, match="ParallelConfig"):
        a.holders("w", ParallelConfig(dp=2))
    with pytest.raises(SpecError, match="ParallelConfig"):
        a.to_local_flat("w", t)
    for bad in (dict(dim=0, count=2), dict(count=0)):
        with pytest.raises(SpecError):
            Panels(**bad)
    with pytest.raises(SpecError, match="panels need"):
        TensorSpec("w", (6, 6), tp=Panels(1, 4))
    with pytest.raises(SpecError, match="panels"):
        TensorSpec.from_json({**spec.to_json(), "tp": {"kind": "panels", "dim": 1}})


class _Backwards:
    """A layout of another kind: ``cfg``'s answers with the ranks numbered backwards."""

    def __init__(self, cfg: ParallelConfig) -> None:
        self.cfg, self.world_size = cfg, cfg.world_size

    def _r(self, rank: int) -> int:
        return self.world_size - 1 - rank

    def check(self, ptc: PTC) -> None:
        self.cfg.check(ptc)

    def rank_tensors(self, ptc: PTC, rank: int) -> list[str]:
        return self.cfg.rank_tensors(ptc, self._r(rank))

    def holder_table(self, spec: TensorSpec, num_layers: int = 0) -> SegmentTable:
        t = self.cfg.holder_table(spec, num_layers)
        rank = self.world_size - 1 - t.rank
        order = np.argsort(rank, kind="stable")
        return SegmentTable.from_columns(rank[order], t.local[order], t.start[order], t.length[order])

    def segments(self, spec: TensorSpec, rank: int) -> list[tuple[int, int, int]]:
        return self.cfg.segments(spec, self._r(rank))

    def local_shape(self, spec: TensorSpec, rank: int) -> tuple[int, ...]:
        return self.cfg.local_shape(spec, self._r(rank))

    def to_local_flat(self, spec: TensorSpec, rank: int, local: torch.Tensor) -> torch.Tensor:
        return self.cfg.to_local_flat(spec, self._r(rank), local)

    def from_local_flat(self, spec: TensorSpec, rank: int, flat: torch.Tensor) -> torch.Tensor:
        return self.cfg.from_local_flat(spec, self._r(rank), flat)


def test_ptc_asks_any_layout_through_the_layout_protocol() -> None:
    """#30 item 2: ParallelConfig and StateLayout are ``ptc.Layout``s and PTC asks only the protocol
    (it dispatched on ``isinstance(cfg, ParallelConfig)`` and took anything else for a StateLayout), so a
    layout of a third kind shards, unshards and reports holders bit-exactly."""
    assert isinstance(ParallelConfig(dp=2), Layout) and isinstance(StateLayout(1, ()), Layout)
    ptc = model_ptc("tiny", num_layers=4, distributed_optimizer=True)
    g = random_global(ptc, seed=3)
    cfg = ParallelConfig(dp=2, tp=2, pp=2)
    back = _Backwards(cfg)
    assert isinstance(back, Layout)
    want, got = ptc.shard(g, cfg), ptc.shard(g, back)
    for rank in range(cfg.world_size):
        assert list(got[rank]) == list(want[cfg.world_size - 1 - rank])
        for name in ptc.tensors:
            if name in got[rank]:
                assert torch.equal(got[rank][name], want[cfg.world_size - 1 - rank][name])
    back_global = ptc.unshard(got, back)
    for name in ptc.tensors:
        assert_same(back_global[name], g[name], name)
    name = next(iter(ptc.tensors))
    assert sorted(ptc.holders(name, back).rank.tolist()) == sorted(
        cfg.world_size - 1 - r for r in ptc.holders(name, cfg).rank.tolist())
    assert sum(ptc.rank_nbytes(back, r) for r in range(cfg.world_size)) == sum(
        ptc.rank_nbytes(cfg, r) for r in range(cfg.world_size))
