"""rescale() from a checkpoint URL: one scan of the storage, one read of each manifest, one
model check, and the reads of ``tenplex.load`` (issue #16 item 3)."""

from __future__ import annotations

import dataclasses
import importlib
from collections import Counter
from pathlib import Path

import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

import tenplex
from tenplex import ParallelConfig, load, model_ptc, rescale, save
from tenplex.planning import choose
from tenplex.planning.planner import plan

elastic = importlib.import_module("tenplex.elastic.rescale")  # the module rescale() runs in: patched below


def _ptc() -> tenplex.PTC:
    return model_ptc(arch="llama", num_layers=4, hidden=32, heads=8, kv_heads=4, ffn_hidden=64, vocab=37,
                     vocab_pad=2, seq_len=8, dtype=torch.float32)


def _save(url: str, ptc: tenplex.PTC, cfg: ParallelConfig, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    glob: dict = {n: torch.randn(s.shape, generator=g).to(s.dtype) for n, s in ptc.tensors.items()}
    glob.update({obj: step for obj in ptc.objects})
    shards = ptc.shard(glob, cfg)
    for r in range(cfg.world_size):
        save(url, ptc, cfg, r, shards[r], step=step, extra={"at": step})


def _plain(path: str) -> str:
    return str(path).removeprefix("file://").rstrip("/")


class _Calls:
    """Counts the storage calls of a local checkpoint: listings of its root, reads of each manifest."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
        self.root = str(root).rstrip("/")
        self.listings = 0
        self.manifests: Counter[str] = Counter()
        ls, cat_file = LocalFileSystem.ls, LocalFileSystem.cat_file

        def counted_ls(fs: LocalFileSystem, path: str, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if _plain(path) == self.root:
                self.listings += 1
            return ls(fs, path, *args, **kwargs)

        def counted_cat(fs: LocalFileSystem, path: str, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if path.endswith("/manifest.json"):
                self.manifests[_plain(path)] += 1
            return cat_file(fs, path, *args, **kwargs)

        monkeypatch.setattr(LocalFileSystem, "ls", counted_ls)
        monkeypatch.setattr(LocalFileSystem, "cat_file", counted_cat)

    def reset(self) -> None:
        self.listings = 0
        self.manifests.clear()


def test_rescale_from_a_url_lists_once_and_reads_each_manifest_once(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: a rescale from a URL listed the checkpoint three times (list_steps, read_manifest,
    load) and read every manifest three times. Now: one listing, each manifest once, one model
    check, and the load reads what ``tenplex.load`` reads (the same reader)."""
    ptc, old, new = _ptc(), ParallelConfig(tp=2), ParallelConfig(dp=2, pp=2)
    root = tmp_path / "ckpt"
    url = f"file://{root}"
    for step in (3, 5):
        _save(url, ptc, old, step)
    checks = []
    check_model = elastic.check_model
    monkeypatch.setattr(elastic, "check_model", lambda *a, **k: checks.append(a[2]) or check_model(*a, **k))
    calls = _Calls(monkeypatch, root)

    res = rescale(url, ptc, rank=1, world_size=4, parallel=new)
    assert res.step == 5 and res.extra == {"at": 5} and res.previous == old and not res.skipped
    assert calls.listings == 1
    assert len(calls.manifests) == 2 and set(calls.manifests.values()) == {1}, calls.manifests
    assert checks == [f"{url} step 5"]

    calls.reset()
    plain = load(url, new, 1, ptc=ptc)
    assert calls.listings == 1 and set(calls.manifests.values()) == {1}
    assert all(torch.equal(res.shard[n], plain.shard[n]) for n in ptc.rank_tensors(new, 1))
    got, want = res.load_stats, plain.stats
    assert (got.bytes_needed, got.bytes_read, got.metadata_bytes, got.ranges) == \
        (want.bytes_needed, want.bytes_read, want.metadata_bytes, want.ranges)
    assert res.bytes_by_tier == {"storage": want.bytes_read}
    # the live-move statistics: the plan of this move, computed once
    want_plan = dataclasses.replace(plan(ptc, old, new).stats, plan_seconds=res.plan_stats.plan_seconds)
    assert res.plan_stats == want_plan


def test_rescale_plans_once_and_hands_the_plan_to_the_load(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan behind ``plan_stats`` is the one the tiered load gets (for the recovery schedule);
    a fallback to an older step saved under another layout plans that move instead."""
    ptc, new = _ptc(), ParallelConfig(tp=2)
    url = str(tmp_path / "ckpt")
    _save(url, ptc, ParallelConfig(pp=2), 3)
    _save(url, ptc, ParallelConfig(dp=2), 5)
    plans, handed = [], []
    load_tiered = elastic.load_tiered
    monkeypatch.setattr(elastic, "plan", lambda *a, **k: plans.append(plan(*a, **k)) or plans[-1])
    monkeypatch.setattr(elastic, "load_tiered", lambda *a, **k: handed.append(k["moves"]) or load_tiered(*a, **k))
    res = rescale(url, ptc, rank=0, world_size=2, parallel=new)
    assert res.step == 5 and len(plans) == 1 and handed == plans and res.plan_stats is plans[0].stats
    (sdir,) = (tmp_path / "ckpt").glob("step-000000000005-*")
    (sdir / "rank-00000.json").write_bytes(b"{}")  # damaged: the load falls back to step 3, saved under pp=2
    plans.clear()
    res = rescale(url, ptc, rank=0, world_size=2, parallel=new)
    assert res.step == 3 and res.previous == ParallelConfig(pp=2) and [s for s, _, _ in res.skipped] == [5]
    assert [(p.old, p.new) for p in plans] == [(ParallelConfig(dp=2), new), (ParallelConfig(pp=2), new)]
    assert res.plan_stats is plans[-1].stats


def test_a_url_that_cannot_be_listed_is_an_error_not_a_fresh_start(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The tier scan passes over a tier it cannot list; a checkpoint URL it cannot list raises
    (as list_steps did) instead of starting fresh over its checkpoints. Missing: fresh."""
    ptc, root = _ptc(), tmp_path / "ckpt"
    _save(str(root), ptc, ParallelConfig(), 1)
    ls = LocalFileSystem.ls

    def denied(fs: LocalFileSystem, path: str, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if _plain(path) == str(root):
            raise PermissionError(13, "Permission denied", str(root))
        return ls(fs, path, *args, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "ls", denied)
    with pytest.raises(PermissionError):
        rescale(str(root), ptc, rank=0, world_size=1, parallel=ParallelConfig())
    assert rescale(str(tmp_path / "none"), ptc, rank=0, world_size=1, parallel=ParallelConfig()).fresh


def test_fresh_start_is_a_rescale_result_without_io(tmp_path: Path) -> None:
    """No URL: the layout only (what the trainer's side benchmarks use for a fresh Trainer)."""
    ptc = _ptc()
    res = rescale(None, ptc, rank=1, world_size=2, parallel=ParallelConfig(tp=2))
    assert res.fresh and res.step == 0 and res.shard is None and res.cfg == ParallelConfig(tp=2)
    assert res.rank == 1 and res.world_size == 2
    chooser = choose.default_chooser(choose.layout_options_for(
        ptc, dict(global_batch=8, micro_batch=2, gpu_mem="16GiB")))
    assert chooser(ptc, 2, None).world_size == 2


def test_options_objects_validate_with_the_arithmetic_and_refuse_unknown_keywords() -> None:
    """``RescaleOptions``, ``MigrationInputs`` and ``TieredLoadOptions`` (#30 item 4) refuse bad values in
    ``__post_init__`` naming them; the keywords of ``rescale`` / ``migrate`` / ``load_tiered`` override
    their fields, and a keyword none of them has is a ConfigError listing the fields."""
    from tenplex.elastic import RescaleOptions
    from tenplex.errors import ConfigError
    from tenplex.elastic.migrate import MigrationInputs, migrate
    from tenplex.store.recovery import TieredLoadOptions, load_tiered

    with pytest.raises(ConfigError, match=r"rank 4 is outside the world: 0 <= rank < world_size = 4"):
        RescaleOptions(rank=4, world_size=4)
    with pytest.raises(ConfigError, match="parallel=.* pins the layout and choose= picks one"):
        RescaleOptions(parallel=ParallelConfig(), choose=lambda ptc, world, previous: ParallelConfig())
    with pytest.raises(ConfigError, match="gpus_per_host must be >= 1, got 0"):
        rescale(None, _ptc(), gpus_per_host=0)
    with pytest.raises(ConfigError, match=r"rescale\(\) got unknown keyword\(s\) \['ranks'\]; it takes rank, "):
        rescale(None, _ptc(), ranks=2)
    res = rescale(None, _ptc(), RescaleOptions(world_size=2, parallel=ParallelConfig(tp=2)), rank=1)
    assert (res.rank, res.world_size, res.cfg, res.fresh) == (1, 2, ParallelConfig(tp=2), True)
    ex = elastic.plan(_ptc(), ParallelConfig(tp=2), ParallelConfig(dp=2), alive=[0, 1])
    from tenplex.elastic.migrate import exchange_plan

    with pytest.raises(ConfigError, match="exchange= was computed with its rounds"):
        MigrationInputs(exchange=exchange_plan(ex), rounds=[])
    with pytest.raises(ConfigError, match=r"migrate\(\) got unknown keyword\(s\) \['plans'\]"):
        migrate(_ptc(), ParallelConfig(tp=2), ParallelConfig(dp=2), None, alive=[0, 1], plans=ex)
    with pytest.raises(ConfigError, match="max_workers must be >= 1, got 0"):
        TieredLoadOptions(max_workers=0)
    with pytest.raises(ConfigError, match=r"load_tiered\(\) got unknown keyword\(s\) \['step_'\]"):
        load_tiered([], ParallelConfig(), 0, step_=3)
