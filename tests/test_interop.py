"""Import from DCP and Hugging Face checkpoints written by the real libraries; export back.

Every comparison is bit for bit: import -> load under another layout -> unshard must give
the source tensors, and export must give back the Hugging Face file's tensors.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import tenplex
from tenplex import ParallelConfig, model_ptc
from tenplex.checkpoint import read_manifest
from tenplex.checkpoint.auto_import import import_checkpoint
from tenplex.checkpoint.dcp_import import DcpNames, import_dcp
from tenplex.checkpoint.hf_export import export_hf, load_global
from tenplex.checkpoint.hf_import import import_hf
from tenplex.checkpoint.hf_mapping import hf_config_to_spec, hf_to_tenplex, tenplex_to_hf
from tenplex.checkpoint.import_source import detect_format
from tenplex.cli import main as cli_main
from tenplex.errors import CheckpointError, CheckpointNotFoundError, ConfigError

pytestmark = pytest.mark.timeout(120)

P = ParallelConfig.parse


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _random_state(ptc: tenplex.PTC, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s.shape, generator=g).to(s.dtype) for n, s in ptc.tensors.items()}


def _load_all(url: str, cfg: ParallelConfig) -> dict[str, torch.Tensor]:
    shards = {r: tenplex.load(url, cfg, r).shard for r in range(cfg.world_size)}
    ptc = read_manifest(url)["ptc"]
    return ptc.unshard(shards, cfg)


LLAMA_CFG = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=4, intermediate_size=128, vocab_size=259,
                 max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-5)
GPT2_CFG = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], n_embd=64, n_layer=4, n_head=8,
                vocab_size=259, n_positions=64)


def _hf_model(kind: str, out: Path) -> Path:
    """A small random HF model saved by transformers' save_pretrained (skips when unavailable)."""
    transformers = pytest.importorskip("transformers", reason="transformers not installed (optional test dep)")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "llama":
            cfg = {k: v for k, v in LLAMA_CFG.items() if k not in ("model_type", "architectures")}
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
        else:
            cfg = {k: v for k, v in GPT2_CFG.items() if k not in ("model_type", "architectures")}
            model = transformers.GPT2LMHeadModel(transformers.GPT2Config(**cfg))
        model.save_pretrained(str(out), safe_serialization=True)
    return out


def _hf_by_hand(kind: str, out: Path) -> Path:
    """HF-format files written with safetensors directly, following HF's names."""
    cfg = LLAMA_CFG if kind == "llama" else GPT2_CFG
    spec = hf_config_to_spec(cfg, torch.float32)
    ptc = model_ptc(arch=spec.arch, num_layers=spec.num_layers, hidden=spec.hidden, heads=spec.heads,
                    kv_heads=spec.kv_heads, ffn_hidden=spec.ffn_hidden, vocab=spec.vocab, seq_len=spec.seq_len,
                    tied_embeddings=spec.tied_embeddings, dtype=torch.float32, optimizer=False)
    out.mkdir(parents=True)
    save_file(tenplex_to_hf(_random_state(ptc), spec), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
@pytest.mark.parametrize("source", ["transformers", "by_hand"])
def test_hf_import_load_other_layout_export(tmp_path: Path, kind: str, source: str) -> None:
    src = (_hf_model if source == "transformers" else _hf_by_hand)(kind, tmp_path / "hf")
    assert detect_format(src) == "hf"
    hf = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    url = str(tmp_path / "tp")
    res = import_hf(src, url)
    assert res.layout == ParallelConfig() and res.source_format == "hf"
    spec = hf_config_to_spec(config, torch.float32)
    want = hf_to_tenplex(hf, spec)
    got = _load_all(url, P("dp=1,tp=2,pp=2"))
    assert set(got) == set(want)
    for n in want:
        assert _bits_equal(got[n], want[n]), n
    if kind == "llama":  # the [q; k; v] blocks are HF's q_proj, k_proj, v_proj rows (no rotary permutation)
        q = hf["model.layers.1.self_attn.q_proj.weight"]
        assert torch.equal(got["layers.1.attn.qkv.weight"][: q.shape[0]], q)
    else:  # Conv1D weights are transposed
        assert torch.equal(got["layers.0.mlp.fc1.weight"], hf["transformer.h.0.mlp.c_fc.weight"].t())
    path = export_hf(url, tmp_path / "out")
    back = load_file(str(path))
    skip = {"lm_head.weight"} if kind == "gpt2" else set()  # GPT-2's head is tied to wte
    keys = {k for k in hf if not k.endswith((".attn.bias", ".attn.masked_bias"))} - skip
    assert set(back) == keys
    for k in keys:
        assert _bits_equal(back[k], hf[k]), k
    assert hf_config_to_spec(json.loads((tmp_path / "out" / "config.json").read_text()), torch.float32) == spec


def test_exported_llama_loads_in_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers not installed (optional test dep)")
    src = _hf_model("llama", tmp_path / "hf")
    import_hf(src, str(tmp_path / "tp"), layout=P("dp=1,tp=2,pp=1"))
    export_hf(str(tmp_path / "tp"), tmp_path / "out")
    a = transformers.LlamaForCausalLM.from_pretrained(str(src)).eval()
    b = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    ids = torch.tensor([[1, 5, 9, 200, 3]])
    with torch.no_grad():
        assert torch.equal(a(ids).logits, b(ids).logits)


def _dcp_save(state: dict, path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


def test_dcp_import_model_with_optimizer(tmp_path: Path) -> None:
    ptc = model_ptc("tiny")
    state = _random_state(ptc, seed=3)
    _dcp_save(dict(state), tmp_path / "dcp")
    assert detect_format(tmp_path / "dcp") == "dcp"
    url = str(tmp_path / "tp")
    res = import_dcp(tmp_path / "dcp", url, names=DcpNames(model="tiny"), layout=P("dp=2,tp=1,pp=1"))
    assert res.ptc.fingerprint() == ptc.fingerprint()
    for cfg in ("dp=1,tp=4,pp=1", "dp=1,tp=2,pp=2"):
        got = _load_all(url, P(cfg))
        for n in state:
            assert _bits_equal(got[n], state[n]), (cfg, n)
    # a rank's shard equals the PTC's own sharding of the global tensors
    shard = tenplex.load(url, P("dp=1,tp=4,pp=1"), 3).shard
    ref = ptc.shard(state, P("dp=1,tp=4,pp=1"))[3]
    assert all(_bits_equal(shard[n], ref[n]) for n in ptc.tensors)


def test_dcp_import_generic_and_hf_names(tmp_path: Path) -> None:
    state = {"a.weight": torch.randn(5, 3), "b": torch.arange(7, dtype=torch.int64)}
    _dcp_save(dict(state), tmp_path / "g")
    import_dcp(tmp_path / "g", str(tmp_path / "tg"))
    got = _load_all(str(tmp_path / "tg"), P("dp=2,tp=2,pp=1"))
    assert all(_bits_equal(got[n], state[n]) for n in state)

    hf = load_file(str(_hf_by_hand("llama", tmp_path / "hf") / "model.safetensors"))
    _dcp_save(dict(hf), tmp_path / "h")
    with pytest.raises(ConfigError, match="hf_config"):
        import_dcp(tmp_path / "h", str(tmp_path / "x"))
    import_dcp(tmp_path / "h", str(tmp_path / "th"), names=DcpNames(hf_config=LLAMA_CFG), layout=P("tp=2"))
    _, glob, _ = load_global(str(tmp_path / "th"))
    want = hf_to_tenplex(hf, hf_config_to_spec(LLAMA_CFG, torch.float32))
    assert all(_bits_equal(glob[n], want[n]) for n in want)


def test_dcp_import_partial_optimizer_is_an_error(tmp_path: Path) -> None:
    ptc = model_ptc("tiny")
    state = {n: t for n, t in _random_state(ptc).items() if not n.startswith("optimizer.exp_avg_sq.layers.3")}
    _dcp_save(state, tmp_path / "d")
    with pytest.raises(CheckpointError, match="optimizer state for some parameters"):
        import_dcp(tmp_path / "d", str(tmp_path / "t"), names=DcpNames(model="tiny"))


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError):
        detect_format(tmp_path)
    with pytest.raises(ConfigError, match="model_type"):
        hf_config_to_spec({"model_type": "bert"}, torch.float32)
    src = _hf_by_hand("gpt2", tmp_path / "hf")
    hf = load_file(str(src / "model.safetensors"))
    hf["transformer.h.0.extra.weight"] = torch.zeros(1)
    save_file(hf, str(src / "model.safetensors"))
    with pytest.raises(CheckpointError, match="does not know"):
        import_hf(src, str(tmp_path / "t"))


def test_cli_import_export(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _hf_by_hand("llama", tmp_path / "hf")
    url = str(tmp_path / "tp")
    assert cli_main(["import", str(src), url, "--layout", "dp=1,tp=2,pp=1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["format"] == "hf" and out["layout"] == "dp=1,tp=2,pp=1"
    assert cli_main(["export", url, str(tmp_path / "out.safetensors")]) == 0
    a, b = load_file(str(src / "model.safetensors")), load_file(str(tmp_path / "out.safetensors"))
    assert set(a) == set(b) and all(_bits_equal(a[k], b[k]) for k in a)
    ptc = model_ptc("tiny")
    _dcp_save(_random_state(ptc), tmp_path / "dcp")
    assert cli_main(["import", str(tmp_path / "dcp"), str(tmp_path / "t2"), "--model", "tiny"]) == 0
    (tmp_path / "empty").mkdir()
    assert cli_main(["import", str(tmp_path / "empty"), str(tmp_path / "t3")]) == 2


def test_import_keeps_the_source_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """torchtitan's CheckpointManager writes step N to ``step-N``, HF's Trainer to ``checkpoint-N``:
    an import keeps that step unless told another (before: step 0 unless --step was given)."""
    state = {"tok.weight": torch.randn(6, 4), "train_state.step": 5}
    _dcp_save(dict(state), tmp_path / "titan" / "step-5")
    url = str(tmp_path / "t")
    res = import_checkpoint(tmp_path / "titan" / "step-5", url)
    assert res.step == 5 and [i.step for i in tenplex.list_steps(url)] == [5]
    sd = {"tok.weight": torch.zeros(6, 4), "train_state.step": 0}
    assert tenplex.load_state_dict(sd, url).step == 5 and torch.equal(sd["tok.weight"], state["tok.weight"])
    assert import_checkpoint(tmp_path / "titan" / "step-5", str(tmp_path / "t2"), step=2).step == 2
    assert import_dcp(tmp_path / "titan" / "step-5", str(tmp_path / "t2b")).step == 5
    _dcp_save(dict(state), tmp_path / "renamed")  # no step in the name: torchtitan's saved train_state.step
    assert import_checkpoint(tmp_path / "renamed", str(tmp_path / "t3")).step == 5
    assert import_dcp(tmp_path / "renamed", str(tmp_path / "t3b"), names=DcpNames(keep_partitioning=False)).step == 5
    _dcp_save({"tok.weight": state["tok.weight"]}, tmp_path / "plain")
    assert import_checkpoint(tmp_path / "plain", str(tmp_path / "t4")).step == 0  # nothing says a step
    # the CLI: a titan step directory and an HF Trainer checkpoint directory
    assert cli_main(["import", str(tmp_path / "titan" / "step-5"), str(tmp_path / "c1"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 5
    assert [i.step for i in tenplex.list_steps(str(tmp_path / "c1"))] == [5]
    src = _hf_by_hand("llama", tmp_path / "hf" / "checkpoint-500")
    assert cli_main(["import", str(src), str(tmp_path / "c2"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 500
    assert cli_main(["import", str(src / "model.safetensors"), str(tmp_path / "c3"), "--step", "7", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == 7
    from tenplex.checkpoint.import_source import source_step  # the rule, pure

    assert [source_step(p) for p in ("run/step-5", "run/step-5/", "s3://b/step_12", "ck/checkpoint-500/model.safetensors",
                                     "ds/global_step30", "run/model", "run/step-5-x", "mystep-3")] == [
        5, 5, 12, 500, 30, None, None, None]


# ---------------------------------------------------------------------------------------------
# export writes a config.json that reproduces the model (#17 item 5)
# ---------------------------------------------------------------------------------------------
IDS = torch.tensor([[1, 5, 9, 200, 3, 17, 60, 33, 2, 250, 7, 8, 100, 120, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]])
# settings transformers' and tenplex's defaults both differ from: a lost field changes the logits
LLAMA_ODD = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, head_dim=8,
                 intermediate_size=128, vocab_size=259, max_position_embeddings=64, tie_word_embeddings=False,
                 rope_theta=500000.0, rms_norm_eps=1e-6, bos_token_id=256, eos_token_id=257)
GPT2_ODD = dict(n_embd=64, n_layer=2, n_head=8, vocab_size=259, n_positions=64, layer_norm_epsilon=1e-6,
                activation_function="gelu", bos_token_id=256, eos_token_id=257)


def _hf_cls(kind: str):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers", reason="transformers not installed (optional test dep)")
    transformers.logging.set_verbosity_error()
    return transformers.LlamaForCausalLM if kind == "llama" else transformers.GPT2LMHeadModel


def _from_pretrained(kind: str, path: Path):  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, info = _hf_cls(kind).from_pretrained(str(path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _logits(model, ids: torch.Tensor = IDS) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return model(ids).logits


def _save_pretrained(kind: str, kw: dict[str, Any], path: Path) -> Any:
    """A seeded transformers Llama or GPT-2 of config ``kw`` saved with ``save_pretrained`` at ``path``;
    returns the transformers module (skips where it is not installed)."""
    transformers = pytest.importorskip("transformers", reason="transformers not installed (optional test dep)")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**kw) if kind == "llama" else transformers.GPT2Config(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _hf_cls(kind)(config).save_pretrained(str(path))
    return transformers


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_export_writes_back_the_imported_hf_config(tmp_path: Path, kind: str) -> None:
    """An imported model with non-default RoPE base, norm epsilon, head_dim, activation and token ids
    exports to a model whose logits equal the original's (the export reuses the source config)."""
    _save_pretrained(kind, LLAMA_ODD if kind == "llama" else GPT2_ODD, tmp_path / "hf")
    import_hf(tmp_path / "hf", str(tmp_path / "tp"), layout=P("dp=1,tp=2,pp=2"))
    export_hf(str(tmp_path / "tp"), tmp_path / "out")
    src_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_cfg == src_cfg  # same dtype: nothing to update
    diff = (_logits(_from_pretrained(kind, tmp_path / "hf")) - _logits(_from_pretrained(kind, tmp_path / "out")))
    assert diff.abs().max().item() <= 1e-6


def test_export_updates_the_dtype_of_the_kept_config(tmp_path: Path) -> None:
    src = _hf_model("llama", tmp_path / "hf")
    import_hf(src, str(tmp_path / "tp"), dtype=torch.bfloat16)
    export_hf(str(tmp_path / "tp"), tmp_path / "out")
    src_cfg = json.loads((src / "config.json").read_text())
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    dkeys = [k for k in ("dtype", "torch_dtype") if k in src_cfg]
    assert dkeys and all(out_cfg[k] == "bfloat16" for k in dkeys)
    assert {k: v for k, v in out_cfg.items() if k not in dkeys} == {k: v for k, v in src_cfg.items() if k not in dkeys}


def test_dcp_import_with_hf_config_keeps_it_for_export(tmp_path: Path) -> None:
    cfg = {**LLAMA_CFG, "rope_theta": 500000.0, "rms_norm_eps": 1e-6, "bos_token_id": 256, "eos_token_id": 257}
    hf = load_file(str(_hf_by_hand("llama", tmp_path / "hf") / "model.safetensors"))
    _dcp_save(dict(hf), tmp_path / "h")
    import_dcp(tmp_path / "h", str(tmp_path / "t"), names=DcpNames(hf_config=cfg))
    export_hf(str(tmp_path / "t"), tmp_path / "out")
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: out_cfg[k] for k in cfg} == cfg


# Tiny models with transformers' own configs (the installed release's config.json keys): Llama 3 style
# (RoPE base 5e5 with llama3 scaling, eps 1e-5, bos/eos of Llama 3's vocabulary, untied head), a
# default-config Llama (eps 1e-6, RoPE base 1e4, bos 1 / eos 2) with and without tied embeddings, and
# a GPT-2 with a non-default epsilon. Every one differs from tenplex's own defaults somewhere.
_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=500)
HF_CONFIGS = {
    "llama3": ("llama", dict(_TINY, max_position_embeddings=256, rope_theta=500000.0, rms_norm_eps=1e-5,
                             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=64),
                             bos_token_id=498, eos_token_id=499, tie_word_embeddings=False)),
    "llama_default": ("llama", dict(_TINY)),
    "llama_tied": ("llama", dict(_TINY, tie_word_embeddings=True)),
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=500, n_positions=64, layer_norm_epsilon=1e-6,
                          bos_token_id=498, eos_token_id=499)),
}
IDS_500 = torch.tensor([[498, 5, 9, 200, 3, 17, 60, 33, 2, 250, 7, 8, 100, 120, 40, 41, 42, 43, 44, 45, 46, 47, 300,
                         499]])


def _job_resaves(url: str, cfg: ParallelConfig, own_ptc: bool, step: int) -> None:
    """What a job does: every rank of ``cfg`` loads its shard and saves it again with ``tenplex.save``
    (one rank after another in this process), with its own ``extra``; ``own_ptc``: the job builds
    its PTC from the model's dimensions (``model_ptc``) instead of saving with the loaded one."""
    saved = read_manifest(url)["ptc"]
    spec = saved.meta["model"]
    mine = model_ptc(arch=spec["arch"], num_layers=spec["num_layers"], hidden=spec["hidden"], heads=spec["heads"],
                     kv_heads=spec["kv_heads"], ffn_hidden=spec["ffn_hidden"], vocab=spec["vocab"],
                     seq_len=spec["seq_len"], tied_embeddings=spec["tied_embeddings"], dtype=spec["dtype"],
                     vocab_pad=spec["vocab_pad"], optimizer=False)
    for r in range(cfg.world_size):
        res = tenplex.load(url, cfg, r, ptc=mine if own_ptc else None)
        tenplex.save(url, mine if own_ptc else res.ptc, cfg, r, res.shard, step=step, extra={"job": "finetune"})


@pytest.mark.parametrize("own_ptc", [False, True], ids=["loaded_ptc", "own_ptc"])
@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_export_after_a_job_resaves_keeps_the_source_config(tmp_path: Path, name: str, own_ptc: bool) -> None:
    """import -> a job loads under dp=1,tp=2,pp=2 and saves twice (what training does) -> export: the
    exported config.json is the source's, key for key, and transformers' logits equal the original's."""
    kind, kw = HF_CONFIGS[name]
    transformers = _save_pretrained(kind, kw, tmp_path / "hf")
    url = str(tmp_path / "tp")
    assert cli_main(["import", str(tmp_path / "hf"), url]) == 0  # tenplex import / export, as the finding did
    cfg = P("dp=1,tp=2,pp=2")
    _job_resaves(url, cfg, own_ptc, step=1)
    _job_resaves(url, cfg, own_ptc, step=2)
    assert read_manifest(url)["step"] == 2
    assert cli_main(["export", url, str(tmp_path / "out")]) == 0
    src_cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    changed = sorted(k for k in set(src_cfg) | set(out_cfg) if src_cfg.get(k) != out_cfg.get(k))
    assert out_cfg == src_cfg, f"keys changed by the round trip: {changed}"
    a, b = _from_pretrained(kind, tmp_path / "hf"), _from_pretrained(kind, tmp_path / "out")
    diff = (_logits(a, IDS_500) - _logits(b, IDS_500)).abs().max().item()
    assert diff <= 1e-6


def _save_pretrained(kind: str, kw: dict, out: Path) -> Path:
    transformers = pytest.importorskip("transformers", reason="transformers not installed (optional test dep)")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**kw) if kind == "llama" else transformers.GPT2Config(**kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = _hf_cls(kind)(config)
        with torch.no_grad():  # norms other than 1, so that a wrong epsilon shows
            for n, p in model.named_parameters():
                if "norm" in n or "ln_" in n:
                    p.add_(0.3 * torch.randn(p.shape))
        model.save_pretrained(str(out))
    return out


def test_a_job_stating_other_hyperparameters_is_refused_and_its_change_exported(tmp_path: Path, caplog) -> None:
    """The import's norm epsilon and RoPE are model settings: a job whose PTC states others is
    refused (unless allow_meta_change); one that goes on with another RoPE base exports the source
    config with that base, every other key kept."""
    from tenplex.errors import CheckpointMismatchError

    src = _save_pretrained("llama", HF_CONFIGS["llama3"][1], tmp_path / "hf")
    url, cfg = str(tmp_path / "tp"), P("dp=1,tp=2,pp=1")
    tenplex.import_hf(src, url)
    spec = read_manifest(url)["ptc"].meta["model"]
    assert (spec["norm_eps"], spec["rope_theta"], spec["rope_scaling"]["rope_type"]) == (1e-5, 500000.0, "llama3")
    dims = {k: spec[k] for k in ("arch", "num_layers", "hidden", "heads", "kv_heads", "ffn_hidden", "vocab",
                                 "seq_len", "tied_embeddings", "dtype", "vocab_pad")}
    other = model_ptc(**dims, rope_theta=10000.0, optimizer=False)
    with pytest.raises(CheckpointMismatchError, match="rope_theta: saved 500000.0, requested 10000.0"):
        tenplex.load(url, cfg, 0, ptc=other)
    with pytest.raises(CheckpointMismatchError, match="norm_eps: saved 1e-05, requested 1e-06"):
        tenplex.load(url, cfg, 0, ptc=model_ptc(**dims, norm_eps=1e-6, optimizer=False))
    for r in range(cfg.world_size):
        res = tenplex.load(url, cfg, r, ptc=other, allow_meta_change=True)
        tenplex.save(url, other, cfg, r, res.shard, step=1)
    with caplog.at_level("WARNING", logger="tenplex.checkpoint.hf_mapping"):
        export_hf(url, tmp_path / "out")
    assert "rope_theta: saved 500000.0, requested 10000.0" in caplog.text
    src_cfg = json.loads((src / "config.json").read_text())
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert out_cfg["rope_parameters"] == {**src_cfg["rope_parameters"], "rope_theta": 10000.0}
    changed = {k for k in set(src_cfg) | set(out_cfg) if src_cfg.get(k) != out_cfg.get(k)}
    assert changed == {"rope_parameters"}  # the new base; token ids, scaling, eps: the source's


def test_fine_tuning_into_a_new_directory_with_adam_state_keeps_the_source_config(tmp_path: Path) -> None:
    """The common fine-tuning shape: parameters from the import, Adam state added, saved into the
    run's own directory under dp=1,tp=2,pp=2 with a PTC built from the loaded model description."""
    from tenplex.layout.models import ModelSpec

    src = _save_pretrained("llama", HF_CONFIGS["llama3"][1], tmp_path / "hf")
    tenplex.import_hf(src, str(tmp_path / "imported"))
    cfg, run = P("dp=1,tp=2,pp=2"), str(tmp_path / "run")
    for r in range(cfg.world_size):
        res = tenplex.load(str(tmp_path / "imported"), cfg, r)
        ptc = model_ptc(ModelSpec.from_json(res.ptc.meta["model"]), optimizer=True)
        shard = {n: res.shard[n] if n in res.shard else torch.zeros(ptc.local_shape(n, cfg, r),
                                                                    dtype=ptc.tensors[n].dtype)
                 for n in ptc.rank_tensors(cfg, r)}
        tenplex.save(run, ptc, cfg, r, {**shard, "optimizer.step": 0}, step=10)
    export_hf(run, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    diff = (_logits(_from_pretrained("llama", src), IDS_500) - _logits(_from_pretrained("llama", tmp_path / "out"),
                                                                        IDS_500)).abs().max().item()
    assert diff <= 1e-6


def test_no_description_is_carried_into_another_model(tmp_path: Path) -> None:
    """A save of a model with other dimensions into a URL holding an import carries nothing of it."""
    src = _save_pretrained("llama", HF_CONFIGS["llama_default"][1], tmp_path / "hf")
    url = str(tmp_path / "tp")
    tenplex.import_hf(src, url)
    ptc = model_ptc("tiny", optimizer=False)
    _save_global(url, ptc, _random_state(ptc), ParallelConfig())
    assert read_manifest(url)["ptc"].meta["model"] == ptc.meta["model"]


def test_a_checkpoint_imported_before_keeps_its_config_from_extra(tmp_path: Path) -> None:
    """Imports by an older tenplex kept the config in the step's extra (not in the description)."""
    config = {**LLAMA_CFG, "rope_theta": 500000.0, "rms_norm_eps": 1e-6, "bos_token_id": 256}
    spec = hf_config_to_spec(LLAMA_CFG, torch.float32)
    ptc = model_ptc(arch="llama", num_layers=spec.num_layers, hidden=spec.hidden, heads=spec.heads,
                    kv_heads=spec.kv_heads, ffn_hidden=spec.ffn_hidden, vocab=spec.vocab, seq_len=spec.seq_len,
                    dtype=torch.float32, optimizer=False)
    shard = ptc.shard(_random_state(ptc), ParallelConfig())[0]
    tenplex.save(str(tmp_path / "t"), ptc, ParallelConfig(), 0, shard, step=0,
                 extra={"imported_from": "hf", "hf_config": config})
    export_hf(str(tmp_path / "t"), tmp_path / "out")
    out_cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: out_cfg[k] for k in config} == config


@pytest.mark.parametrize("name", ["llama_default", "llama_rope5e5"])
def test_tenplex_model_computes_with_the_imported_hyperparameters(tmp_path: Path, name: str) -> None:
    """tenplex's own Llama (the reference trainer's) on an imported model gives transformers' logits:
    it computes with the description's norm epsilon and RoPE base, not tenplex's defaults."""
    from tenplex.layout.models import ModelSpec
    from tenplex.train.model import StageModel

    kw = dict(_TINY, rope_theta=500000.0, bos_token_id=498) if name == "llama_rope5e5" else dict(_TINY)
    src = _save_pretrained("llama", kw, tmp_path / "hf")
    tenplex.import_hf(src, str(tmp_path / "tp"))
    ptc, state, _ = load_global(str(tmp_path / "tp"))
    spec = ModelSpec.from_json(ptc.meta["model"])
    assert spec.norm_eps == 1e-6 and spec.rope_theta == kw.get("rope_theta", 10000.0)
    one = ParallelConfig()
    params = ptc.shard(state, one)[0]
    with torch.no_grad():
        ref = (StageModel(spec, one, 0, params, None).forward(IDS_500) @ params["lm_head.weight"].t())[..., :spec.vocab]
    got = _logits(_from_pretrained("llama", src), IDS_500)
    assert (ref - got).abs().max().item() <= 1e-6
    scaled = dataclasses.replace(spec, rope_scaling=HF_CONFIGS["llama3"][1]["rope_scaling"])
    with pytest.raises(ConfigError, match="implements unscaled RoPE"):  # rather than computing another model
        StageModel(scaled, one, 0, params, None)


@pytest.mark.parametrize("form", ["transformers5", "transformers4"])
def test_a_changed_setting_is_written_into_the_source_config_in_its_own_form(form: str) -> None:
    """Only the keys of what changed are written, RoPE in the form the source config uses."""
    from tenplex.checkpoint.hf_mapping import spec_to_hf_config

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    rope = ({"rope_parameters": {**scaling, "rope_theta": 500000.0}} if form == "transformers5"
            else {"rope_theta": 500000.0, "rope_scaling": scaling})
    base = {**LLAMA_CFG, **rope, "rms_norm_eps": 1e-6, "bos_token_id": 256, "initializer_range": 0.02,
            "dtype": "float32"}
    spec = dataclasses.replace(hf_config_to_spec(base, torch.float32), source_config=base)
    assert spec_to_hf_config(spec) == base
    longer = dataclasses.replace(spec, seq_len=128)
    assert spec_to_hf_config(longer) == {**base, "max_position_embeddings": 128}
    other = dataclasses.replace(spec, rope_theta=1e4, norm_eps=1e-5)
    got = spec_to_hf_config(other)
    want_rope = ({"rope_parameters": {**scaling, "rope_theta": 1e4}} if form == "transformers5"
                 else {"rope_theta": 1e4, "rope_scaling": scaling})
    assert got == {**base, **want_rope, "rms_norm_eps": 1e-5}
    assert hf_config_to_spec(got, torch.float32) == dataclasses.replace(other, source_config=None)


def test_hf_head_dim_other_than_hidden_over_heads_is_refused() -> None:
    with pytest.raises(ConfigError, match="head_dim=16 times num_attention_heads=8 is not hidden_size=64"):
        hf_config_to_spec({**LLAMA_CFG, "head_dim": 16}, torch.float32)


def _save_global(url: str, ptc: tenplex.PTC, state: dict[str, torch.Tensor], cfg: ParallelConfig) -> None:
    shards = ptc.shard(state, cfg)
    for r in range(cfg.world_size):
        tenplex.save(url, ptc, cfg, r, shards[r], step=5)


def test_native_llama_export_computes_what_tenplex_computes(tmp_path: Path) -> None:
    """A checkpoint tenplex's trainer initialised (not from Hugging Face): transformers' model of
    the exported files gives the logits of tenplex's own Llama (tenplex.train.model, tp=pp=1)."""
    from tenplex.layout.models import NORM_EPS, ROPE_THETA, ModelSpec
    from tenplex.train.model import StageModel, init_global_tensor

    ptc = model_ptc("tiny", optimizer=False)
    gen = torch.Generator().manual_seed(2)
    state = {n: init_global_tensor(ptc, n, seed=1) for n in ptc.tensors}
    for n in state:  # norms other than 1, so that a wrong epsilon or a missing weight shows
        if n.endswith("norm.weight"):
            state[n] = state[n] + 0.1 * torch.randn(state[n].shape, generator=gen)
    _save_global(str(tmp_path / "ck"), ptc, state, P("dp=1,tp=2,pp=2"))
    export_hf(str(tmp_path / "ck"), tmp_path / "out")
    spec = ModelSpec.from_json(ptc.meta["model"])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf_config_to_spec(config, spec.dtype, vocab_pad=spec.vocab_pad) == spec.resolved()  # eps, RoPE stated
    assert (config["rms_norm_eps"], config["rope_theta"], config["head_dim"]) == (NORM_EPS, ROPE_THETA, spec.head_dim)
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": ROPE_THETA}
    assert config["bos_token_id"] is None and config["eos_token_id"] is None  # tenplex knows none
    assert config["vocab_size"] == 259 and config["num_key_value_heads"] == 4 and not config["tie_word_embeddings"]
    one = ParallelConfig()
    params = ptc.shard(state, one)[0]
    ids = torch.randint(0, spec.vocab, (2, spec.seq_len), generator=gen)
    with torch.no_grad():
        ref = (StageModel(spec, one, 0, params, None).forward(ids) @ params["lm_head.weight"].t())[..., :spec.vocab]
    got = _logits(_from_pretrained("llama", tmp_path / "out"), ids)
    assert (ref - got).abs().max().item() <= 1e-6


def test_native_gpt_export_config_reproduces_the_spec(tmp_path: Path) -> None:
    """No tenplex GPT forward exists to compare with: the config must describe every ModelSpec field
    and transformers must load the files with no missing or unexpected tensors."""
    from tenplex.layout.models import NORM_EPS, ModelSpec

    ptc = model_ptc(arch="gpt", num_layers=2, hidden=64, heads=8, ffn_hidden=192, vocab=259, seq_len=32,
                    dtype=torch.float32, vocab_pad=8, optimizer=False)
    _save_global(str(tmp_path / "ck"), ptc, _random_state(ptc, seed=4), P("dp=1,tp=2,pp=1"))
    export_hf(str(tmp_path / "ck"), tmp_path / "out")
    spec = ModelSpec.from_json(ptc.meta["model"])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert hf_config_to_spec(config, spec.dtype, vocab_pad=spec.vocab_pad) == spec.resolved()  # eps, RoPE stated
    assert config["layer_norm_epsilon"] == NORM_EPS and config["n_inner"] == 192 and config["vocab_size"] == 259
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["dtype"] == config["torch_dtype"] == "float32"
    model = _from_pretrained("gpt2", tmp_path / "out")
    assert model.config.n_inner == 192 and model.config.bos_token_id is None
    assert _logits(model).shape == (1, IDS.shape[1], 259)


# ---------------------------------------------------------------------------------------------
# storage options reach fsspec (a recording test filesystem, recfs://)
# ---------------------------------------------------------------------------------------------
def _calls(recfs) -> list[dict]:  # type: ignore[no-untyped-def]
    calls = list(recfs.calls)
    recfs.calls.clear()
    return calls


SRC_OPTS = {"endpoint_url": "http://127.0.0.1:5000", "anon": False}
CK_OPTS = {"key": "ck", "retries": 3}
OUT_OPTS = {"key": "out", "client_kwargs": {"region_name": "x"}}


def test_import_export_pass_storage_options(tmp_path: Path, recfs) -> None:  # type: ignore[no-untyped-def]
    """HF source, tenplex checkpoint and export destination all remote: each URL's filesystem is built
    with its own options, and the round trip is still bit for bit."""
    src = _hf_by_hand("llama", tmp_path / "hf")
    fs = recfs()
    fs.put(str(src), "recfs://hf", recursive=True)
    _calls(recfs)
    assert detect_format("recfs://hf", storage_options=SRC_OPTS) == "hf"
    res = import_hf("recfs://hf", "recfs://ck", layout=P("tp=2"), storage_options=CK_OPTS,
                    source_storage_options=SRC_OPTS)
    calls = _calls(recfs)
    assert SRC_OPTS in calls and CK_OPTS in calls and all(c in (SRC_OPTS, CK_OPTS) for c in calls), calls
    assert res.layout == P("tp=2")
    path = export_hf("recfs://ck", "recfs://out", storage_options=CK_OPTS, out_storage_options=OUT_OPTS)
    calls = _calls(recfs)
    assert CK_OPTS in calls and OUT_OPTS in calls and all(c in (CK_OPTS, OUT_OPTS) for c in calls), calls
    assert path == "recfs:///out/model.safetensors"
    from safetensors.torch import load as load_bytes

    a, b = load_file(str(src / "model.safetensors")), load_bytes(fs.cat_file("recfs://out/model.safetensors"))
    assert set(a) == set(b) and all(_bits_equal(a[k], b[k]) for k in a)
    assert json.loads(fs.cat_file("recfs://out/config.json")) == {
        **json.loads((src / "config.json").read_text()), "torch_dtype": "float32", "dtype": "float32"}
    _, glob, _ = load_global("recfs://ck", storage_options=CK_OPTS)
    assert _calls(recfs) and set(glob) == set(hf_to_tenplex(a, hf_config_to_spec(LLAMA_CFG, torch.float32)))


def test_dcp_import_from_a_url_passes_storage_options(tmp_path: Path, recfs) -> None:  # type: ignore[no-untyped-def]
    ptc = model_ptc("tiny")
    state = _random_state(ptc, seed=5)
    _dcp_save(dict(state), tmp_path / "dcp")
    recfs().put(str(tmp_path / "dcp"), "recfs://dcp", recursive=True)
    _calls(recfs)
    assert detect_format("recfs://dcp", storage_options=SRC_OPTS) == "dcp"
    import_dcp("recfs://dcp", str(tmp_path / "t"), names=DcpNames(model="tiny"), source_storage_options=SRC_OPTS)
    calls = _calls(recfs)
    assert calls and all(c == SRC_OPTS for c in calls), calls
    got = _load_all(str(tmp_path / "t"), P("dp=1,tp=2,pp=2"))
    assert all(_bits_equal(got[n], state[n]) for n in state)


def test_bad_storage_options_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="source_storage_options must map option names"):
        detect_format(tmp_path, storage_options=[("a", 1)])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="storage_options must map option names"):
        load_global(str(tmp_path), storage_options={1: 2})  # type: ignore[dict-item]


def test_cli_import_export_pass_storage_options(tmp_path: Path, recfs, capsys) -> None:  # type: ignore[no-untyped-def]
    """``--source-storage-option`` / ``--storage-option`` / ``--out-storage-option`` reach the
    constructor of each URL's filesystem (values parsed as JSON when they parse)."""
    src = _hf_by_hand("gpt2", tmp_path / "hf")
    fs = recfs()
    fs.put(str(src), "recfs://hf", recursive=True)
    _calls(recfs)
    assert cli_main(["import", "recfs://hf", "recfs://ck", "--json",
                     "--source-storage-option", "endpoint_url=http://127.0.0.1:5000",
                     "--source-storage-option", "anon=false",
                     "--storage-option", "key=ck", "--storage-option", "retries=3"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "hf"
    calls = _calls(recfs)
    assert SRC_OPTS in calls and CK_OPTS in calls and all(c in (SRC_OPTS, CK_OPTS) for c in calls), calls
    assert cli_main(["export", "recfs://ck", "recfs://out/m.safetensors", "--storage-option", "key=ck",
                     "--storage-option", "retries=3", "--out-storage-option", "key=out",
                     "--out-storage-option", 'client_kwargs={"region_name": "x"}']) == 0
    assert "recfs:///out/m.safetensors" in capsys.readouterr().out
    calls = _calls(recfs)
    assert CK_OPTS in calls and OUT_OPTS in calls and all(c in (CK_OPTS, OUT_OPTS) for c in calls), calls
    assert fs.exists("recfs://out/config.json")


def test_dcp_names_that_keep_the_chunks_take_no_model() -> None:
    """Keeping a DCP checkpoint's chunks keeps its names: a model or HF config with it is refused up front."""
    with pytest.raises(ConfigError, match="keep_partitioning keeps the DCP checkpoint's own names"):
        DcpNames(model="tiny", keep_partitioning=True)
    with pytest.raises(ConfigError, match="takes no model or hf_config"):
        DcpNames(hf_config=LLAMA_CFG, keep_partitioning=True)
    assert DcpNames(model="tiny").keep_partitioning is None
