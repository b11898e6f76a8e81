"""Hostile checkpoints: every byte flipped, metadata rewritten with valid digests, parts swapped
between steps and attempts, save ids reused.

Every attempt ends in one outcome of the shared tally (``tests/hostile.py``, area
"checkpoint"): ``refused`` (a clear ``CheckpointError``), ``detected`` (``CheckpointCorruptError``,
or a fall back to the intact older step that ``LoadResult.skipped`` reports), ``identical``
(the same shard bit for bit, step and extra as the untampered load) or ``silent`` (anything
else: a failure). An exception outside ``CheckpointError`` fails the test on the spot.

The checkpoint is tiny (four tensors: vocabulary padding, fused blocks, a split on dim 1, a
replicated one; one object; ``extra``) so that every byte of it can be flipped in seconds;
it is saved under tp=2 and loaded under tp=1, so one load reads every file.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hostile import Tally

from tenplex import PTC, CheckpointCorruptError, CheckpointError, ParallelConfig, Split, TensorSpec
from tenplex.checkpoint import LoadResult, load, open_sealed_json, save, seal_json

PTC_ = PTC(
    [
        TensorSpec("emb", (11, 4), tp=Split(0, pad_multiple=2), placement="first"),
        TensorSpec("qkv", (12, 4), tp=Split(0, blocks=(4, 4, 4)), placement=0),
        TensorSpec("proj", (4, 6), tp=Split(1), placement=0),
        TensorSpec("norm", (4,), placement="all"),
    ],
    num_layers=1,
    objects=("optimizer.step",),
    meta={"model": {"arch": "toy", "heads": 2, "norm_eps": 1e-5}},
)
SAVED, NEW = ParallelConfig(tp=2), ParallelConfig()
FILES = ("manifest.json", "objects.pt", "rank-00000.json", "rank-00001.json", "rank-00000.safetensors",
         "rank-00001.safetensors")


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    out: dict = {n: torch.randn(s.shape, generator=g) for n, s in PTC_.tensors.items()}
    out["optimizer.step"] = seed
    return out


def _save(root: Path, step: int, seed: int, *, save_id: str | None = None, ranks=(0, 1)) -> Path:
    shards = PTC_.shard(_state(seed), SAVED)
    path = None
    for r in ranks:
        path = save(str(root), PTC_, SAVED, r, shards[r], step=step, extra={"seed": seed, "loss": 1.5 * seed},
                    save_id=save_id).path
    return Path(path)


def _same(a: LoadResult, b: LoadResult) -> bool:
    if a.step != b.step or a.extra != b.extra or set(a.shard) != set(b.shard):
        return False
    for k, v in b.shard.items():
        w = a.shard[k]
        if isinstance(v, torch.Tensor):
            if not (isinstance(w, torch.Tensor) and w.dtype == v.dtype and w.shape == v.shape
                    and torch.equal(w.view(torch.uint8), v.view(torch.uint8))):
                return False
        elif w != v:
            return False
    return True


def _outcome(call: Callable[[], LoadResult], ref: LoadResult | None, fallback: LoadResult | None = None,
             newer: int = 20) -> str:
    """Classify one load of a tampered step ``newer`` (see the module docstring): ``ref`` is the
    untampered result (None: there is none), ``fallback`` the intact older step's."""
    try:
        res = call()
    except CheckpointCorruptError:
        return "detected"
    except CheckpointError:
        return "refused"
    if ref is not None and _same(res, ref):
        return "identical"
    if fallback is not None and _same(res, fallback) and any(s == newer for s, _, _ in res.skipped):
        return "detected"
    return "silent"


def _flip(path: Path, i: int) -> bytes:
    raw = path.read_bytes()
    bad = bytearray(raw)
    bad[i] ^= 1 << (i % 8)
    path.write_bytes(bytes(bad))
    return raw


@pytest.mark.timeout(120)
def test_every_byte_flipped_once(tmp_path: Path) -> None:
    """One bit of every byte of the manifest, the objects and every rank index of the only step
    (and of every third byte of the data files, whose blocks CRC32 covers): the load detects the
    damage, or gives the same result where the byte is never read (safetensors headers)."""
    t = Tally.of("checkpoint")
    sdir = _save(tmp_path, 20, 20)
    ref = load(str(tmp_path), NEW, 0, ptc=PTC_)
    per_file: dict[str, dict[str, int]] = {}
    for name in FILES:
        path = sdir / name
        counts = per_file.setdefault(name, {})
        for i in range(0, path.stat().st_size, 3 if name.endswith(".safetensors") else 1):
            raw = _flip(path, i)
            o = _outcome(lambda: load(str(tmp_path), NEW, 0, ptc=PTC_), ref)
            path.write_bytes(raw)
            counts[o] = counts.get(o, 0) + 1
            t.record(o, f"{name} byte {i}")
    # metadata is covered byte for byte; data files only outside their (unread) safetensors header
    for name in FILES[:4]:
        assert set(per_file[name]) == {"detected"}, (name, per_file[name])
    assert _same(load(str(tmp_path), NEW, 0, ptc=PTC_), ref)
    t.assert_none_silent()


@pytest.mark.timeout(120)
def test_flips_in_the_newest_step_fall_back_to_the_intact_one(tmp_path: Path) -> None:
    t = Tally.of("checkpoint")
    _save(tmp_path, 10, 10)
    sdir = _save(tmp_path, 20, 20)
    older = load(str(tmp_path), NEW, 0, step=10)
    ref = load(str(tmp_path), NEW, 0)
    assert ref.step == 20 and ref.skipped == ()
    for name in FILES:
        path = sdir / name
        for i in range(0, path.stat().st_size, 19):
            raw = _flip(path, i)
            o = _outcome(lambda: load(str(tmp_path), NEW, 0), ref, older)
            path.write_bytes(raw)
            assert o in ("detected", "identical"), (name, i, o)
            t.record(o, f"fallback: {name} byte {i}")
    t.assert_none_silent()


_HOSTILE_VALUES = (None, True, -1, 0, 7, 2**70, 1.5, "", "x", [], {}, [1], {"a": 1})


def _leaves(obj, path=()):  # noqa: ANN001, ANN202
    if isinstance(obj, dict):
        yield path, obj
        for k, v in obj.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(obj, list):
        yield path, obj
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))
    else:
        yield path, obj


def _replaced(obj, path, value):  # noqa: ANN001, ANN202
    if not path:
        return value
    out = dict(obj) if isinstance(obj, dict) else list(obj)
    out[path[0]] = _replaced(obj[path[0]], path[1:], value)
    return out


@pytest.mark.timeout(120)
def test_metadata_rewritten_with_valid_digests(tmp_path: Path) -> None:
    """A writer that seals what it likes (not a bit flip): every field of the manifest and the
    indexes replaced by hostile values of other types and ranges, sealed again. Schema checks
    turn each into a clear error (or an equivalent checkpoint), never a raw exception."""
    t = Tally.of("checkpoint")
    sdir = _save(tmp_path, 20, 20)
    ref = load(str(tmp_path), NEW, 0, ptc=PTC_)
    for name in ("manifest.json", "rank-00000.json", "rank-00001.json"):
        path = sdir / name
        raw = path.read_bytes()
        obj = open_sealed_json(raw, name)
        for where, old in list(_leaves(obj)):
            if not where or (where[0] == "chunks" and len(where) > 2 and where[1] > 0):
                continue  # the first chunk stands for the others
            for value in _HOSTILE_VALUES:
                if value == old and type(value) is type(old):
                    continue
                try:
                    path.write_bytes(seal_json(_replaced(obj, where, value)))
                except ValueError:  # e.g. the digest's own key
                    continue
                o = _outcome(lambda: load(str(tmp_path), NEW, 0, ptc=PTC_), ref)
                t.record(o, f"{name} {'.'.join(map(str, where))} = {value!r}")
                assert o != "silent", (name, where, value)
        path.write_bytes(raw)
    # removed and added keys
    for name in ("manifest.json", "rank-00001.json"):
        path = sdir / name
        raw = path.read_bytes()
        obj = open_sealed_json(raw, name)
        for key in obj:
            path.write_bytes(seal_json({k: v for k, v in obj.items() if k != key}))
            o = _outcome(lambda: load(str(tmp_path), NEW, 0, ptc=PTC_), ref)
            t.record(o, f"{name} without {key}")
        path.write_bytes(raw)
    t.assert_none_silent()


@pytest.mark.timeout(120)
def test_parts_swapped_between_steps_and_attempts(tmp_path: Path) -> None:
    """Files of step 10 (or of another attempt of step 20) copied over step 20's: never loaded
    as step 20; the load falls back to step 10 and says why, or refuses without it."""
    t = Tally.of("checkpoint")
    ten = _save(tmp_path, 10, 10)
    twenty = _save(tmp_path, 20, 20)
    other = _save(tmp_path / "other", 20, 21, save_id="0badcafe")
    older = load(str(tmp_path), NEW, 0, step=10)
    ref = load(str(tmp_path), NEW, 0)
    groups = [[f] for f in FILES] + [["rank-00001.json", "rank-00001.safetensors"],
                                     ["rank-00000.json", "rank-00000.safetensors"],
                                     ["manifest.json", "objects.pt"]]
    for src_dir, label in ((ten, "step 10"), (other, "attempt 0badcafe of step 20")):
        for group in groups:
            saved = {f: (twenty / f).read_bytes() for f in group}
            for f in group:
                shutil.copyfile(src_dir / f, twenty / f)
            o = _outcome(lambda: load(str(tmp_path), NEW, 0), ref, older)
            assert o == "detected", (label, group, o)
            t.record(o, f"{'+'.join(group)} from {label}")
            o = _outcome(lambda: load(str(tmp_path), NEW, 0, step=20), ref)
            assert o == "detected", (label, group, o)
            t.record(o, f"{'+'.join(group)} from {label}, step=20")
            for f, data in saved.items():
                (twenty / f).write_bytes(data)
    assert _same(load(str(tmp_path), NEW, 0), ref)
    t.assert_none_silent()


@pytest.mark.timeout(120)
def test_resaves_with_a_reused_save_id(tmp_path: Path) -> None:
    """Step 20 saved again under the save id of an earlier attempt, with other data, interrupted
    after some ranks (in either order). The earlier attempt's files are never changed, the
    attempt is marked unusable, and a load falls back to step 10 and says why: never a mix.

    Not covered here: a re-save none of whose ranks overlaps the earlier attempt's (the earlier
    attempt has rank 0's part, the re-save is killed before rank 0 saves and after rank 1 did).
    Nothing on disk tells the two saves apart then; launches under a process group never share
    a save id (``default_save_id``'s launch nonce, tested with gloo in test_checkpoint.py)."""
    t = Tally.of("checkpoint")
    sid = "5a7e1d00"
    for earlier in ((0,), (1,), (0, 1)):
        for again in ((0,), (1,), (0, 1), (1, 0)):
            if not set(again) & set(earlier):
                continue
            root = tmp_path / f"e{''.join(map(str, earlier))}-a{''.join(map(str, again))}"
            _save(root, 10, 10)
            sdir = _save(root, 20, 20, save_id=sid, ranks=earlier)
            before = {p.name: p.read_bytes() for p in sdir.iterdir()}
            older = load(str(root), NEW, 0, step=10)
            shards = PTC_.shard(_state(99), SAVED)
            refused = 0
            for r in again:
                try:
                    save(str(root), PTC_, SAVED, r, shards[r], step=20, extra={"seed": 99}, save_id=sid)
                except CheckpointError as e:
                    assert "was used by an earlier save" in str(e)
                    refused += 1
            assert refused == len(set(again) & set(earlier))
            assert all((sdir / n).read_bytes() == data for n, data in before.items()), "a re-save changed a file"
            o = _outcome(lambda: load(str(root), NEW, 0), None, older)
            assert o == "detected", (earlier, again, o)
            t.record(o, f"earlier ranks {earlier}, again {again}")
            o = _outcome(lambda: load(str(root), NEW, 0, step=20), None)
            assert o == "detected", (earlier, again, o)
            t.record(o, f"step=20: {earlier}, {again}")
    t.assert_none_silent()
