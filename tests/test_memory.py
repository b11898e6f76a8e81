"""The memory estimator: the reference's worked example, hand-computed terms, and a cross-check
of the parameter counts against the PTC's real shard shapes."""

from __future__ import annotations

import math
from typing import Any

import pytest
from conftest import layouts, model_kwargs
from hypothesis import given
from hypothesis import strategies as st

from tenplex import ConfigError, LayoutError, ParallelConfig, estimate_memory, model_ptc
from tenplex.layout.models import ModelSpec, model_spec
from tenplex.planning.memory import GiB, MemoryEstimate, MemoryOptions, StageMemory, layer_params, parse_size, recompute_flops

P = ParallelConfig


def stage_params_from_ptc(ptc: Any, cfg: ParallelConfig, stage: int, tp_index: int = 0) -> int:
    """Elements one GPU of ``stage`` holds: the product of the local shapes of its tensors."""
    rank = cfg.rank(pp=stage, dp=0, tp=tp_index)
    return sum(math.prod(ptc.local_shape(n, cfg)) for n in ptc.rank_tensors(cfg, rank))


# -- the worked example of Fujii et al. ----------------------------------------------------------
def test_worked_example_llama3_8b() -> None:
    est = estimate_memory("llama3-8b", P(dp=8, tp=2, pp=2), seq_len=8192, micro_batch=1)
    first = est.stages[0]
    assert first.layers == 16
    assert abs(first.params - 2.008e9) / 2.008e9 < 1e-3
    # h V / t + (L/p) 2h^2 [(1 + k/a + 1.5 f/h)/t + 1/h], exactly
    h, f, a, k, v, t = 4096, 14336, 32, 8, 128256, 2
    assert first.params == h * v // t + 16 * (2 * h * h * (1 + k / a + 1.5 * f / h) / t + 2 * h) == 2_007_629_824
    assert f"{first.model_state_bytes / GiB:.2f}" == "14.02"  # (6 + 12/8) bytes per parameter
    assert first.model_state_bytes == 2_007_629_824 * 6 + 2_007_629_824 * 12 // 8
    assert f"{first.activation_bytes_per_layer / GiB:.3f}" == "0.641"
    assert first.activation_bytes_per_layer == 8192 * 1 * 4096 * (12 + 4 * 8 // 32 + 8 * 14336 // 4096) // 2
    assert first.in_flight == 2 and first.activation_bytes / GiB == 20.5
    assert f"{first.total_bytes / GiB:.1f}" == "34.5"
    assert est.peak_bytes == first.total_bytes and est.peak_stage == 0
    last = est.stages[1]  # LM head h V / t and the final norm h instead of the embedding
    assert last.params == first.params + h and last.in_flight == 1
    assert est.fits(80 * GiB) and not est.fits(40 * GiB)
    assert est.fits("80GiB") and est.fits(80 * GiB, fraction=0.44) and not est.fits(80 * GiB, fraction=0.43)


def test_worked_example_without_distributed_optimizer_is_18_bytes_per_param() -> None:
    est = estimate_memory("llama3-8b", P(dp=8, tp=2, pp=2), seq_len=8192, micro_batch=1, distributed_optimizer=False)
    s = est.stages[0]
    assert (s.param_bytes, s.grad_bytes, s.optimizer_bytes) == (2 * s.params, 4 * s.params, 12 * s.params)
    assert s.model_state_bytes == 18 * 2_007_629_824


# -- hand-computed tiny models -------------------------------------------------------------------
TINY_LLAMA = ModelSpec(arch="llama", num_layers=4, hidden=8, heads=4, kv_heads=2, ffn_hidden=12, vocab=50,
                       seq_len=16, vocab_pad=4)


def test_tiny_llama_every_term_by_hand() -> None:
    est = estimate_memory(TINY_LLAMA, P(dp=2, tp=2, pp=2), seq_len=16, micro_batch=2)
    # One layer: q 8*8 + k,v 2*8*4 (kv dim = 2 heads * 2) + o 8*8 + gate/up 2*12*8 + down 12*8 = 480, /tp=2 -> 240;
    # two RMSNorms 2*8 = 16, not split.
    layer = (8 * 8 + 2 * 8 * 4 + 8 * 8 + 2 * 12 * 8 + 12 * 8) // 2 + 2 * 8
    assert layer == 256
    padded = 56  # 50 rounded up to a multiple of vocab_pad*tp = 8
    assert TINY_LLAMA.padded_vocab(2) == padded
    s0, s1 = est.stages
    assert s0.params == 2 * layer + padded * 8 // 2 == 736  # embedding on the first stage
    assert s1.params == 2 * layer + padded * 8 // 2 + 8 == 744  # LM head + final norm on the last
    assert (s0.param_bytes, s0.grad_bytes, s0.optimizer_bytes) == (2 * 736, 4 * 736, 12 * 736 // 2)
    # s b h (12 + 4k/a + 8f/h) / (t c) = 16*2*8*(12 + 2 + 12)/2
    assert s0.activation_bytes_per_layer == 16 * 2 * 8 * (12 + 4 * 2 // 4 + 8 * 12 // 8) // 2 == 3328
    assert (s0.in_flight, s0.activation_bytes) == (2, 2 * 2 * 3328)
    assert (s1.in_flight, s1.activation_bytes) == (1, 1 * 2 * 3328)
    assert s0.total_bytes == 18 * 736 - 6 * 736 + 13312
    assert est.peak_bytes == max(s0.total_bytes, s1.total_bytes)


def test_recompute_terms_by_hand() -> None:
    """selective drops SiLU(gate) (recomputed from gate and up); full keeps each layer's input and
    adds one layer's full activations (the layer being recomputed)."""
    kw: dict = dict(seq_len=16, micro_batch=2)
    none = estimate_memory(TINY_LLAMA, P(dp=2, tp=2, pp=2), **kw)
    sel = estimate_memory(TINY_LLAMA, P(dp=2, tp=2, pp=2), recompute="selective", **kw)
    full = estimate_memory(TINY_LLAMA, P(dp=2, tp=2, pp=2), recompute="full", **kw)
    sbh = 16 * 2 * 8
    assert none.stages[0].activation_bytes_per_layer == sbh * (12 + 2 + 12) // 2
    assert sel.stages[0].activation_bytes_per_layer == sbh * (12 + 2 + 6 * 12 // 8) // 2 == 2944
    assert full.stages[0].activation_bytes_per_layer == sbh * 2 // 2 == 256
    for est in (none, sel):
        assert all(st.recompute_bytes == 0 for st in est.stages)
    assert all(st.recompute_bytes == 3328 for st in full.stages)
    for a, b in zip(none.stages, full.stages):
        assert a.model_state_bytes == b.model_state_bytes
        assert b.total_bytes == b.model_state_bytes + b.in_flight * b.layers * 256 + 3328
    assert none.peak_bytes > sel.peak_bytes > full.peak_bytes
    assert full.to_json()["recompute"] == "full" and full.to_json()["stages"][0]["recompute_bytes"] == 3328
    with pytest.raises(ConfigError, match="recompute must be one of none, selective, full, got 'some'"):
        estimate_memory(TINY_LLAMA, P(), recompute="some", **kw)


def test_llama3_405b_published_layout_needs_recompute() -> None:
    """The Llama 3 report's 405B run: TP8 x PP16 x DP128 on 16,384 80 GiB GPUs, 2,048 x 8,192 tokens."""
    cfg = P(dp=128, tp=8, pp=16)
    kw: dict = dict(seq_len=8192, micro_batch=1, num_microbatches=16)
    none = estimate_memory("llama3-405b", cfg, **kw)
    assert f"{none.peak_bytes / GiB:.1f}" == "96.1" and not none.fits("80GiB")  # the figure
    assert f"{estimate_memory('llama3-405b', cfg, recompute='selective', **kw).peak_bytes / GiB:.1f}" == "83.1"
    assert estimate_memory("llama3-405b", cfg, recompute="full", **kw).fits("80GiB")


def test_recompute_flops() -> None:
    spec = model_spec("llama-100m")
    split, replicated = layer_params(spec, 1)
    assert recompute_flops(spec, 1000, "none") == 0
    assert recompute_flops(spec, 1000, "full") == 2 * (split + replicated) * 12 * 1000
    assert 0 < recompute_flops(spec, 1000, "selective") < recompute_flops(spec, 1000, "full") / 20


def test_single_stage_holds_embedding_and_head() -> None:
    est = estimate_memory(TINY_LLAMA, P(dp=1, tp=1, pp=1), seq_len=16, micro_batch=1, distributed_optimizer=False)
    (s,) = est.stages
    layer = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 2 * 12 * 8 + 12 * 8 + 2 * 8
    padded = 52  # multiple of 4
    assert s.params == 4 * layer + padded * 8 + padded * 8 + 8
    assert s.params == TINY_LLAMA.num_params() + 2 * 2 * 8  # the PTC counts the unpadded vocabulary
    assert s.in_flight == 1 and s.activation_bytes == 4 * s.activation_bytes_per_layer


TINY_GPT = ModelSpec(arch="gpt", num_layers=2, hidden=8, heads=2, vocab=30, seq_len=10, vocab_pad=8)


def test_gpt_tied_embedding_sits_on_first_and_last_stage() -> None:
    est = estimate_memory(TINY_GPT, P(dp=1, tp=1, pp=2), seq_len=10, micro_batch=1)
    h, f = 8, 32
    # qkv 3h^2 + 3h, proj h^2 + h, fc1 hf + f, fc2 fh + h, two LayerNorms 4h
    layer = 3 * h * h + 3 * h + h * h + h + h * f + f + f * h + h + 4 * h
    assert layer == 872
    word = 32 * h  # vocabulary 30 padded to 32
    s0, s1 = est.stages
    assert s0.params == layer + word + 10 * h  # word + position embeddings (model's 10 positions)
    assert s1.params == layer + word + 2 * h  # tied copy of the word embedding + final LayerNorm
    # GELU MLP: s b h (12 + 4k/a + 4f/h) = 32 s b h with f = 4h, k = a
    assert s0.activation_bytes_per_layer == 10 * 1 * h * 32 // 1
    one = estimate_memory(TINY_GPT, P(), seq_len=10, micro_batch=1).stages[0]
    assert one.params == 2 * layer + word + 10 * h + 2 * h  # one copy when pp == 1


def test_gpt_tensor_parallel_split_and_replicated_parts() -> None:
    est = estimate_memory(TINY_GPT, P(dp=1, tp=2, pp=2), seq_len=10, micro_batch=1)
    h, f = 8, 32
    split = (3 * h * h + 3 * h + h * h + h * f + f + f * h) // 2
    replicated = h + h + 4 * h
    assert est.stages[0].params == 2 // 2 * (split + replicated) + 32 * h // 2 + 10 * h
    assert est.stages[0].activation_bytes_per_layer == 10 * h * 32 // 2


def test_uneven_stages_and_in_flight_rule() -> None:
    cfg = P(dp=1, tp=1, pp=3, stages=(3, 1, 0))
    est = estimate_memory(TINY_LLAMA, cfg, seq_len=16, micro_batch=1)
    per = est.stages[0].activation_bytes_per_layer
    assert [s.layers for s in est.stages] == [3, 1, 0]
    assert [s.in_flight for s in est.stages] == [3, 2, 1]
    assert [s.activation_bytes for s in est.stages] == [9 * per, 2 * per, 0]
    layer = 8 * 8 + 2 * 8 * 4 + 8 * 8 + 2 * 12 * 8 + 12 * 8 + 2 * 8
    assert est.stages[2].params == 52 * 8 + 8  # no layers: LM head and final norm only
    assert est.stages[1].params == layer
    fewer = estimate_memory(TINY_LLAMA, cfg, seq_len=16, micro_batch=1, num_microbatches=2)
    assert [s.in_flight for s in fewer.stages] == [2, 2, 1]  # min(p - i, m)


def test_context_parallel_divides_activations_and_optimizer_state() -> None:
    base = estimate_memory(TINY_LLAMA, P(dp=2, tp=1, pp=1), seq_len=16, micro_batch=1)
    cp4 = estimate_memory(TINY_LLAMA, P(dp=2, tp=1, pp=1), seq_len=16, micro_batch=1, cp=4)
    b, c = base.stages[0], cp4.stages[0]
    assert c.params == b.params and c.param_bytes == b.param_bytes and c.grad_bytes == b.grad_bytes
    assert c.activation_bytes_per_layer * 4 == b.activation_bytes_per_layer
    assert b.optimizer_bytes == math.ceil(12 * b.params / 2) and c.optimizer_bytes == math.ceil(12 * c.params / 8)


def test_fp32_precision() -> None:
    est = estimate_memory(TINY_LLAMA, P(dp=4, tp=1, pp=1), seq_len=16, micro_batch=1, precision="fp32")
    bf = estimate_memory(TINY_LLAMA, P(dp=4, tp=1, pp=1), seq_len=16, micro_batch=1)
    s, n = est.stages[0], est.stages[0].params
    assert (s.param_bytes, s.grad_bytes, s.optimizer_bytes) == (4 * n, 4 * n, 8 * n // 4)  # 8 + 8/(d c)
    assert s.activation_bytes_per_layer == 2 * bf.stages[0].activation_bytes_per_layer
    rep = estimate_memory(TINY_LLAMA, P(dp=4), seq_len=16, micro_batch=1, precision="fp32",
                          distributed_optimizer=False).stages[0]
    assert rep.model_state_bytes == 16 * n  # weight 4 + grad 4 + m, v 8, no master copy


def test_model_given_as_preset_spec_or_ptc() -> None:
    kw: dict[str, Any] = dict(seq_len=64, micro_batch=2)
    a = estimate_memory("tiny", P(dp=2, tp=2, pp=2), **kw)
    b = estimate_memory(model_spec("tiny"), P(dp=2, tp=2, pp=2), **kw)
    c = estimate_memory(model_ptc("tiny"), P(dp=2, tp=2, pp=2), **kw)
    assert a.stages == b.stages == c.stages
    assert isinstance(a, MemoryEstimate) and all(isinstance(s, StageMemory) for s in a.stages)
    j = a.to_json()
    assert j["layout"] == "dp=2,tp=2,pp=2" and j["peak_bytes"] == a.peak_bytes
    assert j["stages"][1]["total_bytes"] == a.stages[1].total_bytes and j["stages"][0]["layers"] == 2


def test_errors() -> None:
    with pytest.raises(LayoutError, match=r"tp=3 does not divide heads=8"):
        estimate_memory("tiny", P(tp=3), seq_len=64, micro_batch=1)
    with pytest.raises(LayoutError, match="larger than a host"):
        estimate_memory("tiny", P(tp=8), seq_len=64, micro_batch=1, gpus_per_host=4)
    with pytest.raises(ConfigError, match="pp=5 is larger than the model's 4 layers"):
        estimate_memory("tiny", P(pp=5), seq_len=64, micro_batch=1)
    with pytest.raises(ConfigError, match="precision"):
        estimate_memory("tiny", P(), seq_len=64, micro_batch=1, precision="int8")
    with pytest.raises(ConfigError, match="seq_len"):
        estimate_memory("tiny", P(), seq_len=0, micro_batch=1)
    with pytest.raises(ConfigError, match="unknown model preset"):
        estimate_memory("nope", P(), seq_len=8, micro_batch=1)
    with pytest.raises(ConfigError, match="meta"):
        from tenplex import PTC
        estimate_memory(PTC([]), P(), seq_len=8, micro_batch=1)


def test_parse_size() -> None:
    assert parse_size("80GiB") == 80 * 2**30
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("40G") == parse_size("40g") == 40 * 2**30
    assert parse_size("1.5TiB") == 3 * 2**39
    assert parse_size("512") == parse_size("512B") == parse_size(512) == 512
    for bad in ("", "GiB", "80 XB", "-1GiB", "0"):
        with pytest.raises(ConfigError):
            parse_size(bad)


# -- cross-check against the PTC's shard shapes ---------------------------------------------------
@pytest.mark.parametrize(("preset", "cfg"), [
    ("llama3-8b", P(dp=8, tp=2, pp=2)),
    ("llama3-8b", P(dp=1, tp=8, pp=4)),
    ("llama3-8b", P(dp=1, tp=4, pp=3, stages=(10, 12, 10))),
    ("llama3-70b", P(dp=1, tp=8, pp=1)),
    ("gpt3-1.3b", P(dp=2, tp=4, pp=2)),
    ("gpt3-2.7b", P(dp=1, tp=8, pp=8)),
    ("gpt-100m", P(dp=1, tp=1, pp=1)),
    ("gpt-100m", P(dp=1, tp=4, pp=5)),
    ("tiny", P(dp=1, tp=2, pp=4)),
])
def test_stage_params_match_ptc_shards(preset: str, cfg: ParallelConfig) -> None:
    ptc = model_ptc(preset, optimizer=False)
    est = estimate_memory(ptc, cfg, seq_len=128, micro_batch=1)
    for stage in est.stages:
        for t in {0, cfg.tp - 1}:
            assert stage_params_from_ptc(ptc, cfg, stage.stage, t) == stage.params, (preset, cfg, stage.stage, t)


@given(st.data())
def test_stage_params_match_ptc_shards_random_models(data: st.DataObject) -> None:
    kw = data.draw(model_kwargs(max_layers=5))
    kw.update(optimizer=False, distributed_optimizer=False)
    cfg = data.draw(layouts(kw))
    ptc = model_ptc(**kw)
    est = estimate_memory(ptc, cfg, seq_len=4, micro_batch=1)
    for stage in est.stages:
        assert stage_params_from_ptc(ptc, cfg, stage.stage, cfg.tp - 1) == stage.params, (kw, cfg, stage.stage)


def test_memory_options_object_and_keywords_agree() -> None:
    opts = MemoryOptions(seq_len=16, micro_batch=2, num_microbatches=4, recompute="selective")
    a = estimate_memory(TINY_LLAMA, P(dp=2, tp=2, pp=2), opts)
    b = estimate_memory(TINY_LLAMA, P(dp=2, tp=2, pp=2), seq_len=16, micro_batch=2, num_microbatches=4,
                        recompute="selective")
    assert a == b and a.recompute == "selective" and a.num_microbatches == 4
    c = estimate_memory(TINY_LLAMA, P(dp=2, tp=2, pp=2), opts, recompute="none")  # a keyword overrides one field
    assert c.recompute == "none" and c.peak_bytes > a.peak_bytes
    with pytest.raises(ConfigError, match="num_microbatches must be a positive integer, got 0"):
        MemoryOptions(seq_len=16, micro_batch=1, num_microbatches=0)
    with pytest.raises(ConfigError, match="gpus_per_host must be a positive integer, got -8"):
        MemoryOptions(seq_len=16, micro_batch=1, gpus_per_host=-8)
