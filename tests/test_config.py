"""ParallelConfig: validation, Megatron rank order, text form, pipeline stages."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tenplex import ConfigError, ParallelConfig, TenplexError
from tenplex.layout.config import Coords


# -- validation ---------------------------------------------------------------------------
def test_defaults_are_one_rank():
    cfg = ParallelConfig()
    assert (cfg.dp, cfg.tp, cfg.pp, cfg.stages) == (1, 1, 1, None)
    assert cfg.world_size == 1
    assert cfg.coords(0) == Coords(pp=0, dp=0, tp=0)


@pytest.mark.parametrize("field", ["dp", "tp", "pp"])
@pytest.mark.parametrize("bad", [0, -1, -8, True, False, 2.0, "2", None])
def test_rejects_non_positive_ints(field, bad):
    with pytest.raises(ConfigError, match=rf"{field} must be a positive integer, got {bad!r}"):
        ParallelConfig(**{field: bad})


def test_config_error_is_a_value_error_and_tenplex_error():
    with pytest.raises(ValueError):
        ParallelConfig(dp=0)
    with pytest.raises(TenplexError):
        ParallelConfig(tp=-2)


@pytest.mark.parametrize(
    "stages, pp, msg",
    [
        ((1, 2), 3, "stages lists 2 layer counts but pp=3"),
        ((1, 2, 3, 4), 2, "stages lists 4 layer counts but pp=2"),
        ((1, -1), 2, "stages must be non-negative integers"),
        ((1, True), 2, "stages must be non-negative integers"),
        ((1, 2.0), 2, "stages must be non-negative integers"),
    ],
)
def test_stages_validation(stages, pp, msg):
    with pytest.raises(ConfigError, match=msg):
        ParallelConfig(pp=pp, stages=stages)


def test_stages_list_is_normalised_to_tuple_and_hashable():
    cfg = ParallelConfig(pp=3, stages=[2, 0, 3])
    assert cfg.stages == (2, 0, 3)
    assert isinstance(cfg.stages, tuple)
    assert cfg == ParallelConfig(pp=3, stages=(2, 0, 3))
    assert hash(cfg) == hash(ParallelConfig(pp=3, stages=(2, 0, 3)))
    assert cfg != ParallelConfig(pp=3)


def test_frozen():
    cfg = ParallelConfig(dp=2)
    with pytest.raises(AttributeError):
        cfg.dp = 3  # type: ignore[misc]


# -- world size and rank arithmetic ------------------------------------------------------
@pytest.mark.parametrize("dp,tp,pp", [(1, 1, 1), (2, 4, 2), (3, 1, 5), (8, 8, 16), (6, 8, 16)])
def test_world_size(dp, tp, pp):
    cfg = ParallelConfig(dp=dp, tp=tp, pp=pp)
    assert cfg.world_size == dp * tp * pp
    cfg.check_world_size(dp * tp * pp)  # no error


def test_check_world_size_message_shows_arithmetic():
    cfg = ParallelConfig(dp=2, tp=4, pp=2)
    with pytest.raises(ConfigError) as info:
        cfg.check_world_size(12)
    msg = str(info.value)
    assert "dp*tp*pp = 2*4*2 = 16" in msg
    assert "world size is 12" in msg
    assert "dp=2,tp=4,pp=2" in msg


def test_megatron_order_example():
    cfg = ParallelConfig(dp=2, tp=4, pp=2)
    assert cfg.coords(13) == Coords(pp=1, dp=1, tp=1)
    assert cfg.rank(pp=1, dp=1, tp=1) == 13
    # TP varies fastest, then DP, then PP.
    assert [cfg.coords(r).tp for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [cfg.coords(r).dp for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [cfg.coords(r).pp for r in range(0, 16, 4)] == [0, 0, 1, 1]
    assert cfg.coords(0) == (0, 0, 0)
    assert cfg.coords(15) == Coords(pp=1, dp=1, tp=3)


def test_megatron_order_all_ranks_explicit():
    cfg = ParallelConfig(dp=3, tp=2, pp=2)
    expected = [Coords(pp, dp, tp) for pp in range(2) for dp in range(3) for tp in range(2)]
    assert [cfg.coords(r) for r in range(cfg.world_size)] == expected


@given(dp=st.integers(1, 6), tp=st.integers(1, 8), pp=st.integers(1, 6))
def test_coords_rank_inverse(dp, tp, pp):
    cfg = ParallelConfig(dp=dp, tp=tp, pp=pp)
    seen = set()
    for r in range(cfg.world_size):
        c = cfg.coords(r)
        assert 0 <= c.pp < pp and 0 <= c.dp < dp and 0 <= c.tp < tp
        assert r == c.tp + tp * (c.dp + dp * c.pp)
        assert cfg.rank(**c._asdict()) == r
        seen.add(c)
    assert len(seen) == cfg.world_size
    for p, d, t in itertools.product(range(pp), range(dp), range(tp)):
        assert cfg.coords(cfg.rank(pp=p, dp=d, tp=t)) == (p, d, t)


@pytest.mark.parametrize("rank", [-1, 16, 100])
def test_coords_out_of_range(rank):
    cfg = ParallelConfig(dp=2, tp=4, pp=2)
    with pytest.raises(ConfigError, match=rf"rank {rank} is outside \[0, 16\)"):
        cfg.coords(rank)


@pytest.mark.parametrize("kw, msg", [({"pp": 2}, r"pp=2 is outside \[0, 2\)"),
                                     ({"dp": -1}, r"dp=-1 is outside \[0, 2\)"),
                                     ({"tp": 4}, r"tp=4 is outside \[0, 4\)")])
def test_rank_out_of_range(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        ParallelConfig(dp=2, tp=4, pp=2).rank(**kw)


# -- text form ------------------------------------------------------------------------------
def test_str():
    assert str(ParallelConfig(dp=2, tp=4, pp=2)) == "dp=2,tp=4,pp=2"
    assert str(ParallelConfig(pp=3, stages=(3, 0, 5))) == "dp=1,tp=1,pp=3,stages=3+0+5"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("dp=2,tp=4,pp=2", ParallelConfig(dp=2, tp=4, pp=2)),
        ("pp=2,dp=2,tp=4", ParallelConfig(dp=2, tp=4, pp=2)),
        ("tp=8", ParallelConfig(tp=8)),
        (" dp = 3 , pp=2 ", ParallelConfig(dp=3, pp=2)),
        ("dp=2,,tp=2,", ParallelConfig(dp=2, tp=2)),
        ("pp=2,stages=3+5", ParallelConfig(pp=2, stages=(3, 5))),
        ("stages=4", ParallelConfig(stages=(4,))),
        ("dp=1,tp=1,pp=3,stages=0+7+1", ParallelConfig(pp=3, stages=(0, 7, 1))),
    ],
)
def test_parse(text, expected):
    assert ParallelConfig.parse(text) == expected


@pytest.mark.parametrize(
    "text, msg",
    [
        ("", "expected dp=N,tp=N,pp=N"),
        (",", "expected dp=N,tp=N,pp=N"),
        ("dp2", "expected comma-separated"),
        ("xp=2", "expected comma-separated"),
        ("dp=2,dp=3", "dp given twice"),
        ("dp=two", r"dp='two' is not an integer"),
        ("pp=2,stages=3+x", r"stages='3\+x' is not an integer"),
        ("dp=0", "dp must be a positive integer"),
        ("pp=3,stages=1+2", "stages lists 2 layer counts but pp=3"),
        ("stages=1+2", "stages lists 2 layer counts but pp=1"),
    ],
)
def test_parse_errors(text, msg):
    with pytest.raises(ConfigError, match=msg):
        ParallelConfig.parse(text)


@st.composite
def configs(draw):
    dp, tp, pp = draw(st.integers(1, 64)), draw(st.integers(1, 64)), draw(st.integers(1, 8))
    stages = draw(st.none() | st.lists(st.integers(0, 20), min_size=pp, max_size=pp).map(tuple))
    return ParallelConfig(dp=dp, tp=tp, pp=pp, stages=stages)


@given(configs())
def test_parse_str_round_trip(cfg):
    text = str(cfg)
    back = ParallelConfig.parse(text)
    assert back == cfg
    assert str(back) == text
    assert ("stages=" in text) == (cfg.stages is not None)


# -- pipeline stages ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "pp, layers, expected",
    [
        (1, 5, (5,)),
        (2, 8, (4, 4)),
        (4, 10, (3, 3, 2, 2)),
        (3, 7, (3, 2, 2)),
        (5, 5, (1, 1, 1, 1, 1)),
        (16, 96, (6,) * 16),
    ],
)
def test_layers_per_stage_even(pp, layers, expected):
    cfg = ParallelConfig(pp=pp)
    assert cfg.layers_per_stage(layers) == expected
    stage_of = cfg.stage_of_layers(layers)
    assert len(stage_of) == layers
    assert list(stage_of) == sorted(stage_of)
    assert tuple(stage_of.count(s) for s in range(pp)) == expected


@given(pp=st.integers(1, 12), layers=st.integers(1, 40))
def test_layers_per_stage_even_property(pp, layers):
    cfg = ParallelConfig(pp=pp)
    if pp > layers:
        with pytest.raises(ConfigError, match=f"pp={pp} is larger than the model's {layers} layers"):
            cfg.layers_per_stage(layers)
        return
    counts = cfg.layers_per_stage(layers)
    assert sum(counts) == layers
    assert max(counts) - min(counts) <= 1
    assert list(counts) == sorted(counts, reverse=True)  # earlier stages take the extra layers


def test_layers_per_stage_uneven():
    cfg = ParallelConfig(pp=4, stages=(3, 0, 4, 1))
    assert cfg.layers_per_stage(8) == (3, 0, 4, 1)
    assert cfg.stage_of_layers(8) == (0, 0, 0, 2, 2, 2, 2, 3)


def test_layers_per_stage_uneven_sum_mismatch():
    cfg = ParallelConfig(pp=2, stages=(3, 5))
    with pytest.raises(ConfigError, match=r"stages 3\+5 = 8 layers but the model has 9"):
        cfg.layers_per_stage(9)
    with pytest.raises(ConfigError, match="but the model has 7"):
        cfg.stage_of_layers(7)


def test_uneven_stages_may_exceed_layers_with_empty_stages():
    # More stages than layers is fine when the stages are given explicitly.
    cfg = ParallelConfig(pp=4, stages=(0, 1, 0, 1))
    assert cfg.stage_of_layers(2) == (1, 3)


def test_pp_larger_than_layers():
    with pytest.raises(ConfigError, match="pp=4 is larger than the model's 3 layers"):
        ParallelConfig(pp=4).layers_per_stage(3)


def test_absurd_sizes_are_refused_with_the_arithmetic():
    from tenplex.layout.config import MAX_WORLD_SIZE

    with pytest.raises(ConfigError, match=r"dp\*tp\*pp = 999999999999\*1\*1 = 999999999999 ranks, more than"):
        ParallelConfig.parse("dp=999999999999")
    with pytest.raises(ConfigError, match=r"= 524288 ranks"):
        ParallelConfig(dp=1024, tp=8, pp=64)
    assert ParallelConfig(dp=MAX_WORLD_SIZE).world_size == MAX_WORLD_SIZE
