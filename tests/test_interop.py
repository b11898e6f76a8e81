"""Import from DCP and Hugging Face checkpoints written by the real libraries; export back.

Every comparison is bit for bit: import -> load under another layout -> unshard must give
the source tensors, and export must give back the Hugging Face file's tensors.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import tenplex
from tenplex import ParallelConfig, model_ptc
from tenplex.cli import main as cli_main
from tenplex.errors import CheckpointError, CheckpointNotFoundError, ConfigError
from tenplex.interop import (
    detect_format,
    export_hf,
    hf_config_to_spec,
    hf_to_tenplex,
    import_dcp,
    import_hf,
    load_global,
    tenplex_to_hf,
)

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
    ptc = tenplex.read_manifest(url)["ptc"]
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
    res = import_dcp(tmp_path / "dcp", url, model="tiny", layout=P("dp=2,tp=1,pp=1"))
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
    import_dcp(tmp_path / "h", str(tmp_path / "th"), hf_config=LLAMA_CFG, layout=P("tp=2"))
    _, glob, _ = load_global(str(tmp_path / "th"))
    want = hf_to_tenplex(hf, hf_config_to_spec(LLAMA_CFG, torch.float32))
    assert all(_bits_equal(glob[n], want[n]) for n in want)


def test_dcp_import_partial_optimizer_is_an_error(tmp_path: Path) -> None:
    ptc = model_ptc("tiny")
    state = {n: t for n, t in _random_state(ptc).items() if not n.startswith("optimizer.exp_avg_sq.layers.3")}
    _dcp_save(state, tmp_path / "d")
    with pytest.raises(CheckpointError, match="optimizer state for some parameters"):
        import_dcp(tmp_path / "d", str(tmp_path / "t"), model="tiny")


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
