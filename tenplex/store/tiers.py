"""Recovery tiers: the places state can come from, and the save attempts usable across them.

Tiers, cheapest first: this host's store, peer hosts' stores (their own ranks' snapshots or
replicas of others'), then persistent storage. A save attempt is usable when every rank part
of it exists in some tier and a copy of its manifest verifies. ``scan_tiers`` lists every
tier once; ``tenplex.store.recovery`` loads from what it finds.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import fsspec

from ..checkpoint.catalog import read_manifest_at
from ..checkpoint.format import (
    MANIFEST_NAME,
    OBJECTS_NAME,
    RANK_INDEX_RE,
    REUSED_PREFIX,
    Manifest,
    data_name,
    parse_step_dir,
)
from ..errors import CheckpointError
from ..layout.config import ParallelConfig
from ..layout.ptc import Layout
from ..layout.state_layout import StateLayout
from ..urls import url_fs

__all__ = ["Tier", "Attempt", "UsableStep", "TierScan", "scan_tiers", "find_usable", "usable_steps"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tier:
    """One place state can come from. ``kind``: "local" (this host's store), "peer" (another
    host's store) or "storage" (persistent checkpoints)."""

    name: str
    url: str
    kind: str = "storage"
    storage_options: Mapping[str, Any] | None = None

    def fs(self) -> tuple[fsspec.AbstractFileSystem, str]:
        return url_fs(self.url, self.storage_options)


@dataclass(frozen=True)
class Attempt:
    """One save attempt across the tiers: its directory and complete rank parts in each tier."""

    step: int
    save_id: str
    dirs: dict[str, str]  # tier name -> step dir
    ranks: dict[str, set[int]]  # tier name -> complete rank parts
    meta_tiers: list[str]  # tiers holding manifest.json and objects.pt
    reused: list[str] = field(default_factory=list)  # tiers where a save marked the save id as used twice


def _scan_tier(tier: Tier) -> tuple[dict[tuple[int, str], tuple[str, set[int], bool, bool]], OSError | None]:
    """The tier's save attempts, and the error listing its root raised (None when it was listed
    or does not exist: a missing root holds no checkpoints)."""
    try:
        fs, root = tier.fs()
        entries = fs.ls(root, detail=False)
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        log.info("tier %s (%s) unavailable: %s", tier.name, tier.url, e)
        return {}, e
    out = {}
    for entry in entries:
        parsed = parse_step_dir(entry)
        if not parsed:
            continue
        try:
            files = {f.rstrip("/").rsplit("/", 1)[-1] for f in fs.ls(entry.rstrip("/"), detail=False)}
        except (FileNotFoundError, OSError):
            continue
        ranks = {int(mm.group(1)) for f in files if (mm := RANK_INDEX_RE.fullmatch(f))
                 and data_name(int(mm.group(1))) in files}
        out[parsed] = (entry.rstrip("/"), ranks, {MANIFEST_NAME, OBJECTS_NAME} <= files,
                       any(f.startswith(REUSED_PREFIX) for f in files))
    return out, None


def _attempts(tiers: Sequence[Tier]) -> tuple[list[Attempt], dict[str, OSError]]:
    merged: dict[tuple[int, str], Attempt] = {}
    unavailable: dict[str, OSError] = {}
    for tier in tiers:
        found, error = _scan_tier(tier)
        if error is not None:
            unavailable[tier.name] = error
        for key, (path, ranks, meta, reused) in found.items():
            a = merged.setdefault(key, Attempt(key[0], key[1], {}, {}, []))
            a.dirs[tier.name] = path
            a.ranks[tier.name] = ranks
            if meta:
                a.meta_tiers.append(tier.name)
            if reused:
                a.reused.append(tier.name)
    return sorted(merged.values(), key=lambda a: a.step), unavailable


@dataclass(frozen=True)
class UsableStep:
    """A save attempt whose parts all exist in some tier, with its manifest (read once and
    verified: ``verified``; ``manifest`` is its JSON object) and the tier it came from."""

    step: int
    save_id: str
    world_size: int
    attempt: Attempt
    manifest: dict[str, Any]
    manifest_bytes: int
    meta_tier: Tier
    verified: Manifest | None = None

    @property
    def layout(self) -> Layout:
        """The layout the attempt was saved under: a ``ParallelConfig``, or a torch-native state
        dict's ``StateLayout``."""
        if self.verified is not None:
            return self.verified.layout
        if "state_layout" in self.manifest:
            return StateLayout.from_json(self.manifest["state_layout"])
        return ParallelConfig.parse(self.manifest["layout"])


@dataclass(frozen=True)
class TierScan:
    """One scan of the tiers: the usable attempts (oldest first) and, for reports, the attempts
    whose parts all exist but that cannot be used: ``(step, save_id, reason)``; ``unavailable``:
    the tiers whose root could not be listed, with the error (a missing root is not one)."""

    usable: list[UsableStep]
    unusable: list[tuple[int, str, str]] = field(default_factory=list)
    unavailable: dict[str, OSError] = field(default_factory=dict)


def scan_tiers(tiers: Sequence[Tier]) -> TierScan:
    """Every save attempt across ``tiers`` (one listing of every tier): usable when every rank
    part exists in some tier and a copy of its manifest verifies (tiers tried in order)."""
    by_name = {t.name: t for t in tiers}
    usable, unusable = [], []
    attempts, unavailable = _attempts(tiers)
    for a in attempts:
        if not a.meta_tiers:
            continue
        if a.reused:
            unusable.append((a.step, a.save_id, f"save id reused (marker in {', '.join(a.reused)})"))
            continue
        verified, errors = None, []
        for name in a.meta_tiers:
            fs, _ = by_name[name].fs()
            try:
                verified = read_manifest_at(fs, a.dirs[name], step=a.step, save_id=a.save_id)
            except (CheckpointError, OSError) as e:
                log.warning("tier %s: the manifest of step %d (save %s) is unusable: %s", name, a.step, a.save_id, e)
                errors.append(f"{name}: {e}")
                continue
            tier = by_name[name]
            break
        if verified is None:
            unusable.append((a.step, a.save_id, "no tier holds a valid manifest: " + "; ".join(errors)))
            continue
        have = set().union(*a.ranks.values()) if a.ranks else set()
        if set(range(verified.world_size)) <= have:
            usable.append(UsableStep(a.step, a.save_id, verified.world_size, a, verified.raw, verified.nbytes, tier,
                                     verified))
    usable.sort(key=lambda u: (u.step, u.verified.created if u.verified else 0.0))
    return TierScan(usable, unusable, unavailable)


def find_usable(tiers: Sequence[Tier]) -> list[UsableStep]:
    """Every usable save attempt across ``tiers``, oldest first (one scan of every tier)."""
    return scan_tiers(tiers).usable


def usable_steps(tiers: Sequence[Tier]) -> list[tuple[int, str, int]]:
    """``(step, save_id, world_size)`` of every save attempt whose parts all exist somewhere, oldest first."""
    return [(u.step, u.save_id, u.world_size) for u in find_usable(tiers)]

