"""Tiered recovery: read each needed piece from the cheapest place that holds it.

Tiers, cheapest first: this host's store, peer hosts' stores (their own ranks' snapshots or
replicas of others'), then persistent storage. A step is usable when every rank part of one
save attempt exists in some tier; the newest usable step is chosen, and steps are never
mixed. A part that fails its size or checksum test in one tier is read from the next tier
that has it.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import fsspec
import torch

from ..checkpoint import LoadResult, _read_json, _Reader, load_with_reader
from ..config import ParallelConfig
from ..errors import CheckpointCorruptError, CheckpointNotFoundError
from ..ptc import PTC

__all__ = ["Tier", "TieredLoad", "UsableStep", "find_usable", "usable_steps", "load_tiered"]

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step-(\d{12})-([0-9a-f]{8})$")
_RANK_JSON = re.compile(r"^rank-(\d{5})\.json$")


@dataclass(frozen=True)
class Tier:
    """One place state can come from. ``kind``: "local" (this host's store), "peer" (another
    host's store) or "storage" (persistent checkpoints)."""

    name: str
    url: str
    kind: str = "storage"
    storage_options: Mapping[str, Any] | None = None

    def fs(self) -> tuple[fsspec.AbstractFileSystem, str]:
        fs, root = fsspec.core.url_to_fs(self.url, **dict(self.storage_options or {}))
        return fs, root.rstrip("/")


@dataclass(frozen=True)
class _Attempt:
    step: int
    save_id: str
    dirs: dict[str, str]  # tier name -> step dir
    ranks: dict[str, set[int]]  # tier name -> complete rank parts
    meta_tiers: list[str]  # tiers holding manifest.json and objects.pt


@dataclass(frozen=True)
class TieredLoad:
    """A tiered load's result plus where the bytes came from."""

    result: LoadResult
    bytes_by_tier: dict[str, int]
    bytes_by_kind: dict[str, int]
    fallbacks: int
    tiers_used: dict[int, str] = field(default_factory=dict)  # writer rank -> tier read from


def _scan_tier(tier: Tier) -> dict[tuple[int, str], tuple[str, set[int], bool]]:
    try:
        fs, root = tier.fs()
        entries = fs.ls(root, detail=False)
    except (FileNotFoundError, OSError) as e:
        log.info("tier %s (%s) unavailable: %s", tier.name, tier.url, e)
        return {}
    out = {}
    for entry in entries:
        name = entry.rstrip("/").rsplit("/", 1)[-1]
        m = _STEP_DIR.match(name)
        if not m:
            continue
        try:
            files = {f.rstrip("/").rsplit("/", 1)[-1] for f in fs.ls(entry.rstrip("/"), detail=False)}
        except (FileNotFoundError, OSError):
            continue
        ranks = {int(mm.group(1)) for f in files if (mm := _RANK_JSON.match(f))
                 and f"rank-{mm.group(1)}.safetensors" in files}
        out[(int(m.group(1)), m.group(2))] = (entry.rstrip("/"), ranks, {"manifest.json", "objects.pt"} <= files)
    return out


def _attempts(tiers: Sequence[Tier]) -> list[_Attempt]:
    merged: dict[tuple[int, str], _Attempt] = {}
    for tier in tiers:
        for key, (path, ranks, meta) in _scan_tier(tier).items():
            a = merged.setdefault(key, _Attempt(key[0], key[1], {}, {}, []))
            a.dirs[tier.name] = path
            a.ranks[tier.name] = ranks
            if meta:
                a.meta_tiers.append(tier.name)
    return sorted(merged.values(), key=lambda a: a.step)


@dataclass(frozen=True)
class UsableStep:
    """A save attempt whose parts all exist in some tier, with its manifest (read once)."""

    step: int
    save_id: str
    world_size: int
    attempt: _Attempt
    manifest: dict[str, Any]
    manifest_bytes: int
    meta_tier: Tier


def find_usable(tiers: Sequence[Tier]) -> list[UsableStep]:
    """Every usable save attempt across ``tiers``, oldest first (one scan of every tier)."""
    by_name = {t.name: t for t in tiers}
    out = []
    for a in _attempts(tiers):
        if not a.meta_tiers:
            continue
        tier = by_name[a.meta_tiers[0]]
        fs, _ = tier.fs()
        try:
            manifest, nbytes = _read_json(fs, f"{a.dirs[tier.name]}/manifest.json")
        except Exception:  # noqa: BLE001 - a damaged manifest makes the attempt unusable
            continue
        world = int(manifest.get("world_size", 0))
        have = set().union(*a.ranks.values()) if a.ranks else set()
        if world and set(range(world)) <= have:
            out.append(UsableStep(a.step, a.save_id, world, a, manifest, nbytes, tier))
    return out


def usable_steps(tiers: Sequence[Tier]) -> list[tuple[int, str, int]]:
    """``(step, save_id, world_size)`` of every save attempt whose parts all exist somewhere, oldest first."""
    return [(u.step, u.save_id, u.world_size) for u in find_usable(tiers)]


class _TieredReader:
    """Reads a writer rank's chunks from the first tier that has its part; falls back on corruption."""

    def __init__(self, tiers: Sequence[Tier], attempt: _Attempt) -> None:
        self.tiers = [t for t in tiers if t.name in attempt.dirs]
        self.attempt = attempt
        self.readers: dict[str, _Reader] = {}
        self.choice: dict[int, list[str]] = {}
        self.bytes_by_tier: dict[str, int] = {}
        self.fallbacks = 0
        self.metadata_bytes = 0

    def _reader(self, tier: Tier) -> _Reader:
        if tier.name not in self.readers:
            fs, _ = tier.fs()
            self.readers[tier.name] = _Reader(fs, self.attempt.dirs[tier.name])
        return self.readers[tier.name]

    def read(self, rank: int, name: str, chunk_start: int, a: int, b: int, dtype: torch.dtype,
             itemsize: int, out: torch.Tensor | None = None) -> torch.Tensor:
        if rank not in self.choice:
            self.choice[rank] = [t.name for t in self.tiers if rank in self.attempt.ranks.get(t.name, set())]
        errors = []
        while self.choice[rank]:
            tier = next(t for t in self.tiers if t.name == self.choice[rank][0])
            reader = self._reader(tier)
            before = reader.bytes_read
            try:
                got = reader.read(rank, name, chunk_start, a, b, dtype, itemsize, out=out)
                self.bytes_by_tier[tier.name] = self.bytes_by_tier.get(tier.name, 0) + reader.bytes_read - before
                return got
            except (CheckpointCorruptError, CheckpointNotFoundError, OSError) as e:
                log.warning("rank part %d in tier %s is unusable (%s); trying the next copy", rank, tier.name, e)
                errors.append(f"{tier.name}: {e}")
                self.choice[rank].pop(0)
                self.fallbacks += 1
        raise CheckpointCorruptError(f"no usable copy of rank {rank}'s part of step {self.attempt.step}: "
                                     + "; ".join(errors or ["no tier holds it"]))

    @property
    def bytes_read(self) -> int:
        return sum(self.bytes_by_tier.values())

    @property
    def ranges(self) -> int:
        return sum(r.ranges for r in self.readers.values())

    def close(self) -> None:
        for r in self.readers.values():
            r.close()
        self.metadata_bytes += sum(r.metadata_bytes for r in self.readers.values())


def load_tiered(tiers: Sequence[Tier], cfg: ParallelConfig, rank: int, *, ptc: PTC | None = None,
                step: int | None = None, found: UsableStep | None = None) -> TieredLoad:
    """Load ``rank``'s shard under ``cfg`` from the newest step usable across ``tiers``.

    Tiers are tried in the given order for every writer rank's part (put the cheapest first).
    ``found``: the attempt to load, when the caller has already scanned the tiers.
    """
    t0 = time.perf_counter()
    usable = [found] if found is not None else find_usable(tiers)
    if step is not None:
        usable = [u for u in usable if u.step == step]
    if not usable:
        names = ", ".join(f"{t.name}={t.url}" for t in tiers)
        raise CheckpointNotFoundError(f"no step{'' if step is None else f' {step}'} is complete across the tiers "
                                      f"{names}")
    chosen = usable[-1]
    step_, attempt, meta_tier = chosen.step, chosen.attempt, chosen.meta_tier
    reader = _TieredReader(tiers, attempt)
    fs, _ = meta_tier.fs()
    sdir = attempt.dirs[meta_tier.name]
    manifest = chosen.manifest
    reader.metadata_bytes += chosen.manifest_bytes
    result = load_with_reader(manifest, f"{meta_tier.url} step {step_}", cfg, rank, reader, fs, sdir, ptc=ptc, t0=t0)
    by_kind: dict[str, int] = {}
    for t in tiers:
        by_kind[t.kind] = by_kind.get(t.kind, 0) + reader.bytes_by_tier.get(t.name, 0)
    used = {r: names[0] for r, names in reader.choice.items() if names}
    return TieredLoad(result, dict(reader.bytes_by_tier), by_kind, reader.fallbacks, used)
