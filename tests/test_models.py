"""Model builders: tensor inventory, shapes, parameter counts, optimizer state, presets, errors."""

from __future__ import annotations

import pytest
import torch
from conftest import examples, model_kwargs, random_global
from hypothesis import given, settings

from tenplex import ConfigError, LayoutError, ParallelConfig, Replicated, Split, model_ptc
from tenplex.errors import SpecError
from tenplex.layout.models import PRESETS, ModelSpec, model_spec, optimizer_names


def gpt_params(L, h, v, s, f=None):
    f = f or 4 * h
    per_layer = (3 * h * h + 3 * h) + (h * h + h) + (f * h + f) + (h * f + h) + 4 * h
    return v * h + s * h + L * per_layer + 2 * h


def llama_params(L, h, heads, kv, f, v, tied=False):
    hd = h // heads
    per_layer = (heads * hd + 2 * kv * hd) * h + h * heads * hd + 3 * h * f + 2 * h
    return v * h * (1 if tied else 2) + L * per_layer + h


def test_gpt_inventory():
    ptc = model_ptc(arch="gpt", num_layers=2, hidden=8, heads=2, vocab=11, seq_len=5, optimizer=False,
                    dtype=torch.float32)
    assert list(ptc.tensors)[:2] == ["embedding.word", "embedding.position"]
    layer0 = [n.removeprefix("layers.0.") for n in ptc.tensors if n.startswith("layers.0.")]
    assert layer0 == ["ln1.weight", "ln1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
                      "attn.proj.bias", "ln2.weight", "ln2.bias", "mlp.fc1.weight", "mlp.fc1.bias",
                      "mlp.fc2.weight", "mlp.fc2.bias"]
    assert list(ptc.tensors)[-2:] == ["final_norm.weight", "final_norm.bias"]
    assert "lm_head.weight" not in ptc.tensors  # tied by default
    t = ptc.tensors
    assert t["embedding.word"].shape == (11, 8) and t["embedding.word"].placement == "both"
    assert t["embedding.word"].tp == Split(0, pad_multiple=128)
    assert t["embedding.position"].shape == (5, 8) and t["embedding.position"].tp == Replicated()
    assert t["embedding.position"].placement == "first"
    assert t["layers.1.attn.qkv.weight"].shape == (24, 8)
    assert t["layers.1.attn.qkv.weight"].tp == Split(0, blocks=(8, 8, 8))
    assert t["layers.1.attn.qkv.bias"].tp == Split(0, blocks=(8, 8, 8))
    assert t["layers.1.attn.proj.weight"].shape == (8, 8) and t["layers.1.attn.proj.weight"].tp == Split(1)
    assert t["layers.1.mlp.fc1.weight"].shape == (32, 8) and t["layers.1.mlp.fc1.weight"].tp == Split(0)
    assert t["layers.1.mlp.fc1.bias"].tp == Split(0)
    assert t["layers.1.mlp.fc2.weight"].shape == (8, 32) and t["layers.1.mlp.fc2.weight"].tp == Split(1)
    assert t["layers.1.mlp.fc2.bias"].tp == Replicated()
    assert all(t[n].placement == 1 for n in t if n.startswith("layers.1."))
    assert t["final_norm.weight"].placement == "last"
    assert ptc.numel() == gpt_params(2, 8, 11, 5)
    assert ptc.objects == ()


def test_llama_inventory_gqa():
    ptc = model_ptc(arch="llama", num_layers=3, hidden=16, heads=4, kv_heads=2, ffn_hidden=24, vocab=10,
                    optimizer=False)
    t = ptc.tensors
    layer = [n.removeprefix("layers.2.") for n in t if n.startswith("layers.2.")]
    assert layer == ["attn_norm.weight", "attn.qkv.weight", "attn.proj.weight", "mlp_norm.weight",
                     "mlp.gate_up.weight", "mlp.down.weight"]
    assert "embedding.position" not in t  # RoPE
    assert t["layers.0.attn.qkv.weight"].shape == (16 + 8 + 8, 16)
    assert t["layers.0.attn.qkv.weight"].tp == Split(0, blocks=(16, 8, 8))
    assert t["layers.0.mlp.gate_up.weight"].shape == (48, 16)
    assert t["layers.0.mlp.gate_up.weight"].tp == Split(0, blocks=(24, 24))
    assert t["layers.0.mlp.down.weight"].shape == (16, 24) and t["layers.0.mlp.down.weight"].tp == Split(1)
    assert t["embedding.word"].placement == "first"  # untied by default
    assert t["lm_head.weight"].placement == "last" and t["lm_head.weight"].shape == (10, 16)
    assert all(s.dtype == torch.bfloat16 for s in t.values())
    assert ptc.numel() == llama_params(3, 16, 4, 2, 24, 10)


def test_llama_tied():
    ptc = model_ptc(arch="llama", num_layers=1, hidden=8, heads=2, vocab=10, tied_embeddings=True,
                    optimizer=False)
    assert "lm_head.weight" not in ptc.tensors
    assert ptc.tensors["embedding.word"].placement == "both"
    assert ptc.numel() == llama_params(1, 8, 2, 2, 32, 10, tied=True)


def test_gpt_untied():
    ptc = model_ptc(arch="gpt", num_layers=1, hidden=8, heads=2, vocab=10, tied_embeddings=False, optimizer=False)
    assert ptc.tensors["embedding.word"].placement == "first"
    assert ptc.tensors["lm_head.weight"].placement == "last"


@pytest.mark.parametrize("preset, expected", [
    ("gpt3-175b", 174_604_259_328),
    ("llama3-8b", 8_030_261_248),   # the published parameter count of Llama 3 8B
    ("llama3-70b", 70_553_706_496),  # the published parameter count of Llama 3 70B
])
def test_preset_parameter_counts(preset, expected):
    spec = model_spec(preset)
    assert spec.num_params() == expected
    assert model_ptc(preset, optimizer=False).numel() == expected


def test_preset_175b_formula():
    assert model_spec("gpt3-175b").num_params() == gpt_params(96, 12288, 50257, 2048)


def test_all_presets_build_and_split():
    for name in PRESETS:
        ptc = model_ptc(name)
        spec = model_spec(name)
        assert ptc.meta["preset"] == name
        assert ptc.meta["model"] == spec.to_json()
        ptc.check(ParallelConfig(tp=1, pp=min(4, spec.num_layers)))
    tiny = model_spec("tiny")
    for tp in (1, 2, 4):
        tiny.check_tp(tp)
        model_ptc("tiny").check(ParallelConfig(tp=tp, pp=4))


def test_optimizer_state_bf16():
    ptc = model_ptc(arch="gpt", num_layers=1, hidden=8, heads=2, vocab=10, seq_len=4)  # bf16 by default
    params = [n for n in ptc.tensors if not n.startswith("optimizer.")]
    assert len(ptc) == 4 * len(params)
    for p in params:
        names = optimizer_names(p)
        assert names == {s: f"optimizer.{s}.{p}" for s in ("main", "exp_avg", "exp_avg_sq")}
        for state, n in names.items():
            spec, pspec = ptc.tensors[n], ptc.tensors[p]
            assert spec.dtype == torch.float32 and pspec.dtype == torch.bfloat16
            assert (spec.shape, spec.tp, spec.placement) == (pspec.shape, pspec.tp, pspec.placement)
            assert spec.dp_sharded is False
    assert ptc.objects == ("optimizer.step",)
    assert ptc.meta["optimizer"] is True and ptc.meta["distributed_optimizer"] is False
    # bytes: 2 (param) + 3 * 4 (main, exp_avg, exp_avg_sq) per parameter
    assert ptc.nbytes == ptc.numel() // 4 * (2 + 12)


def test_optimizer_state_fp32_has_no_master_copy():
    ptc = model_ptc(arch="llama", num_layers=1, hidden=8, heads=2, vocab=10, dtype="float32",
                    distributed_optimizer=True)
    params = [n for n in ptc.tensors if not n.startswith("optimizer.")]
    assert not any(n.startswith("optimizer.main.") for n in ptc.tensors)
    assert len(ptc) == 3 * len(params)
    assert all(ptc.tensors[n].dp_sharded == n.startswith("optimizer.") for n in ptc.tensors)
    assert ptc.meta["distributed_optimizer"] is True
    assert ptc.tensors["embedding.word"].dtype == torch.float32


@settings(max_examples=examples(40))
@given(model_kwargs())
def test_meta_and_spec_json(kw):
    ptc = model_ptc(**kw)
    spec = ModelSpec.from_json(ptc.meta["model"])
    assert spec == model_spec(**{k: v for k, v in kw.items() if k not in ("optimizer", "distributed_optimizer")})
    assert ptc.meta["tp_divides"] == {"heads": kw["heads"], "kv_heads": kw["kv_heads"],
                                      "ffn_hidden": kw["ffn_hidden"]}
    assert ptc.num_layers == kw["num_layers"]
    assert spec.head_dim * spec.heads == spec.hidden
    for tp in (1, 2, 3, 4, 8):
        pv = spec.padded_vocab(tp)
        assert pv % (kw["vocab_pad"] * tp) == 0 and kw["vocab"] <= pv < kw["vocab"] + kw["vocab_pad"] * tp
        assert ptc.tensors["embedding.word"].padded_rows(tp) == pv
    n_params = sum(s.numel for n, s in ptc.tensors.items() if not n.startswith("optimizer."))
    assert n_params == spec.num_params()
    if kw["arch"] == "gpt":
        assert n_params == gpt_params(kw["num_layers"], kw["hidden"], kw["vocab"], kw["seq_len"], kw["ffn_hidden"]) + (
            0 if spec.tied_embeddings else kw["vocab"] * kw["hidden"])
    else:
        assert n_params == llama_params(kw["num_layers"], kw["hidden"], kw["heads"], kw["kv_heads"],
                                        kw["ffn_hidden"], kw["vocab"], tied=spec.tied_embeddings)


def test_layout_errors_name_the_constraint():
    ptc = model_ptc(arch="llama", num_layers=2, hidden=24, heads=6, kv_heads=2, ffn_hidden=20, vocab=10)
    g = random_global(ptc)
    with pytest.raises(LayoutError, match=r"tp=4 does not divide heads=6 \(6 % 4 = 2\)"):
        ptc.shard(g, ParallelConfig(tp=4))
    with pytest.raises(LayoutError, match=r"tp=3 does not divide kv_heads=2 \(2 % 3 = 2\)"):
        ptc.check(ParallelConfig(tp=3))
    ptc2 = model_ptc(arch="llama", num_layers=2, hidden=16, heads=4, kv_heads=4, ffn_hidden=6, vocab=10)
    with pytest.raises(LayoutError, match=r"tp=4 does not divide ffn_hidden=6 \(6 % 4 = 2\)"):
        ptc2.check(ParallelConfig(tp=4))
    ptc2.check(ParallelConfig(tp=2))
    with pytest.raises(LayoutError, match="does not divide heads=6"):
        model_spec(arch="llama", num_layers=1, hidden=24, heads=6, kv_heads=2, vocab=5).check_tp(4)


def test_pp_larger_than_layers_is_config_error():
    ptc = model_ptc("tiny")
    with pytest.raises(ConfigError, match="pp=5 is larger than the model's 4 layers"):
        ptc.check(ParallelConfig(pp=5))
    with pytest.raises(ConfigError, match="pp=5 is larger than the model's 4 layers"):
        ptc.shard(random_global(ptc), ParallelConfig(pp=5))
    with pytest.raises(ConfigError, match=r"stages 1\+1 = 2 layers but the model has 4"):
        ptc.check(ParallelConfig(pp=2, stages=(1, 1)))
    ptc.check(ParallelConfig(pp=5, stages=(1, 0, 1, 0, 2)))


@pytest.mark.parametrize("kw, msg", [
    (dict(arch="bert", num_layers=1, hidden=4, heads=1, vocab=4), "arch must be 'gpt' or 'llama'"),
    (dict(arch="gpt", num_layers=0, hidden=4, heads=1, vocab=4), "num_layers must be a positive integer"),
    (dict(arch="gpt", num_layers=1, hidden=10, heads=4, vocab=4), r"hidden=10 is not divisible by heads=4"),
    (dict(arch="llama", num_layers=1, hidden=8, heads=4, kv_heads=3, vocab=4), "must be a multiple of kv_heads=3"),
    (dict(arch="gpt", num_layers=1, hidden=8, heads=4, kv_heads=2, vocab=4), "no grouped-query attention"),
    (dict(arch="gpt", num_layers=1, hidden=8, heads=4, vocab=4, vocab_pad=0), "vocab_pad must be a positive"),
])
def test_model_spec_errors(kw, msg):
    with pytest.raises(ValueError, match=msg):
        model_spec(**kw)


def test_model_spec_lookup_errors():
    with pytest.raises(ValueError, match="unknown model preset 'nope'"):
        model_spec("nope")
    with pytest.raises(ValueError, match=r"dimensions \['hidden', 'heads'\]"):
        model_spec(num_layers=2, vocab=4)
    # Keywords override a preset; the defaults fill in.
    spec = model_spec("tiny", num_layers=2)
    assert spec.num_layers == 2 and spec.hidden == 64 and spec.kv_heads == 4 and spec.vocab_pad == 8
    gpt = model_spec(num_layers=1, hidden=8, heads=2, vocab=4)
    assert gpt.arch == "gpt" and gpt.ffn_hidden == 32 and gpt.kv_heads == 2 and gpt.tied_embeddings is True
    assert model_spec(arch="llama", num_layers=1, hidden=8, heads=2, vocab=4).tied_embeddings is False


def test_model_ptc_takes_a_model_spec() -> None:
    """A ModelSpec gives the same collection as its preset; keyword dimensions override it."""
    by_name, by_spec = model_ptc("tiny"), model_ptc(model_spec("tiny"))
    assert by_name.tensors == by_spec.tensors and by_name.meta["model"] == by_spec.meta["model"]
    assert model_ptc(model_spec("tiny"), num_layers=2).meta["model"]["num_layers"] == 2


# ---------------------------------------------------------------------------------------------
# hyperparameters and source config (issue 29 item 5): stated, unstated, compared, carried
# ---------------------------------------------------------------------------------------------
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}
SOURCE = {"model_type": "llama", "rope_parameters": {**LLAMA3_SCALING, "rope_theta": 500000.0}, "bos_token_id": 498}


def test_spec_json_leaves_unstated_hyperparameters_out_and_round_trips_stated_ones() -> None:
    from tenplex.layout.models import NORM_EPS, ROPE_THETA, model_differences

    plain = model_spec("tiny")
    assert set(plain.to_json()) == {"arch", "num_layers", "hidden", "heads", "vocab", "kv_heads", "ffn_hidden",
                                    "seq_len", "tied_embeddings", "dtype", "vocab_pad"}  # as before the fields existed
    full = model_spec("tiny", norm_eps=1e-6, rope_theta=5e5, rope_scaling=LLAMA3_SCALING, source_config=SOURCE)
    assert ModelSpec.from_json(full.to_json()) == full and hash(full) == hash(ModelSpec.from_json(full.to_json()))
    assert full.source_config == SOURCE and full.source_config is not SOURCE  # a copy: the caller's dict may change
    assert plain.resolved().norm_eps == NORM_EPS and plain.resolved().rope_theta == ROPE_THETA
    assert full.resolved() == full
    assert model_ptc(full, optimizer=False).meta["model"] == full.to_json()
    # a request that leaves them unstated accepts the checkpoint's; a stated other value is another model
    assert model_differences(full.to_json(), plain.to_json()) == []
    assert model_differences(full.to_json(), model_spec("tiny", rope_theta=ROPE_THETA).to_json()) == [
        "rope_theta: saved 500000.0, requested 10000.0"]
    # a checkpoint written before the fields existed computed with tenplex's defaults
    assert model_differences(plain.to_json(), model_spec("tiny", norm_eps=NORM_EPS).to_json()) == []
    assert model_differences(plain.to_json(), model_spec("tiny", norm_eps=1e-6).to_json()) == [
        "norm_eps: saved 1e-05, requested 1e-06"]
    assert model_differences(full.to_json(), model_spec("tiny", source_config={**SOURCE, "bos_token_id": 1}).to_json()
                             ) == ["source_config: differs in ['bos_token_id']"]


def test_carried_fills_what_a_spec_leaves_unstated_from_the_same_model_only() -> None:
    full = model_spec("tiny", norm_eps=1e-6, rope_theta=5e5, rope_scaling=LLAMA3_SCALING, source_config=SOURCE)
    plain = model_spec("tiny")
    assert plain.carried(full) == full
    assert model_spec("tiny", seq_len=32).carried(full) == ModelSpec(**{**_fields(full), "seq_len": 32})
    changed = model_spec("tiny", rope_theta=1e4)  # stated: kept, the rest carried
    assert changed.carried(full) == ModelSpec(**{**_fields(full), "rope_theta": 1e4})
    assert model_spec("tiny", heads=4, kv_heads=2).carried(full) is None  # another model: nothing carried
    assert full.carried(plain) == full


def _fields(spec: ModelSpec) -> dict:
    return {f: getattr(spec, f) for f in spec.__dataclass_fields__}


@pytest.mark.parametrize("kw, msg", [
    (dict(norm_eps=0.0), "norm_eps must be a positive finite number"),
    (dict(rope_theta=float("nan")), "rope_theta must be a positive finite number"),
    (dict(norm_eps="1e-5"), "norm_eps must be a positive finite number"),
    (dict(rope_scaling=[1, 2]), "rope_scaling must be a JSON object"),
    (dict(source_config={"x": object()}), "source_config must be plain JSON"),
])
def test_hyperparameter_errors(kw, msg) -> None:
    with pytest.raises(SpecError, match=msg):
        model_spec("tiny", **kw)


def test_gpt_has_no_rope() -> None:
    with pytest.raises(SpecError, match="learned positions, no RoPE"):
        ModelSpec(arch="gpt", num_layers=1, hidden=8, heads=2, vocab=11, rope_theta=1e4)


def test_model_ptc_takes_model_spec_fields_and_names_them_for_anything_else() -> None:
    """#30 item 4: model_ptc's 18 parameters are a preset or ModelSpec plus ModelSpec's fields; a
    misspelt one is a SpecError listing the fields (it was a TypeError)."""
    spec = model_spec("tiny")
    assert model_ptc(spec, num_layers=2).fingerprint() == model_ptc("tiny", num_layers=2).fingerprint()
    assert model_ptc("tiny", hidden=None).fingerprint() == model_ptc("tiny").fingerprint()  # None: not given
    with pytest.raises(SpecError, match=r"unknown model dimensions \['layers'\]; a ModelSpec has arch, num_layers"):
        model_ptc("tiny", layers=2)
