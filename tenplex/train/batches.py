"""Where a trainer rank's batches come from: the dataset VFS mount, or the same bytes without FUSE
(``tenplex.data.batches.IndexBatches``).

Both read the corpus through a tenplex dataset index (token samples of ``seq_len + 1``
tokens), so a sample id means the same bytes everywhere. ``MountBatches`` reads the rank's
``samples.bin`` of a ``tenplex mount`` and re-shards the mount in place after a rescale;
``IndexBatches`` uses ``RankReader`` (no FUSE needed). Either checks that the ids it serves
are the ones the trainer's data state expects. A DP size that does not divide the global batch
into equal whole micro-batches reads its share of whole micro-batches (``replica_samples``).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data.batches import tokens_of, uneven_micro_batch
from ..data.corpus import TokenCorpus
from ..data.partition import DataState, rank_batch_ids, replica_samples
from ..errors import ConfigError
from ..vfs.control import mount_status, remount

__all__ = ["MountBatches"]

log = logging.getLogger(__name__)


class MountBatches:
    """Batches read from ``MOUNT/rank-<dp_rank>/samples.bin`` of a dataset mount.

    ``prepare`` (called by one process per host, before the others open files) re-shards the
    mount in place when its DP size, progress or batch differ from the job's.
    """

    kind = "mount"

    def __init__(self, mountpoint: str, corpus: TokenCorpus) -> None:
        self.mnt = Path(mountpoint)
        self.corpus = corpus
        self.sample_bytes = (corpus.seq_len + 1) * np.dtype(corpus.dtype).itemsize
        self._file: Any = None
        self._job: dict[str, Any] = {}
        self._key: tuple[int, int, int | None] | None = None

    @staticmethod
    def prepare(mountpoint: str, state: DataState, dp: int, micro_batch: int | None = None) -> dict[str, Any]:
        status = mount_status(mountpoint)
        layout = status.get("layout", status)
        if int(layout.get("num_samples", -1)) != state.num_samples:
            raise ConfigError(f"the dataset mount {mountpoint} shows an index of {layout.get('num_samples')} samples "
                              f"but the job's data has {state.num_samples}: mount the index of this corpus "
                              f"(tenplex.data.batches.corpus_index)")
        want = {"dp": dp, "progress": state.consumed, "global_batch": state.global_batch, "seed": state.seed,
                "micro_batch": uneven_micro_batch(state.global_batch, dp, micro_batch)}
        if all(layout.get(k) == v for k, v in want.items()) and layout.get("shuffle", True) == state.shuffle:
            return status
        log.info("re-sharding the dataset mount %s: %s", mountpoint, want)
        return remount(mountpoint, shuffle=state.shuffle, **want)

    def _open(self, dp: int, dp_rank: int, micro_batch: int | None) -> None:
        if self._file is not None:
            self._file.close()
        rank_dir = self.mnt / f"rank-{dp_rank:03d}"
        # resolve the generation once, so job.json and samples.bin come from the same view
        gen_dir = Path(os.path.realpath(rank_dir)).parent
        self._job = json.loads((gen_dir / "job.json").read_text())
        if self._job["dp"] != dp or self._job.get("micro_batch") != micro_batch:
            raise ConfigError(f"the dataset mount {self.mnt} shows dp={self._job['dp']} (micro_batch "
                              f"{self._job.get('micro_batch')}), the job runs dp={dp} (micro_batch {micro_batch}): "
                              "it was not re-sharded (MountBatches.prepare)")
        self._file = open(gen_dir / rank_dir.name / "samples.bin", "rb")  # noqa: SIM115 - kept across steps
        self._ids = gen_dir / rank_dir.name / "ids.txt"
        self._key = (dp, dp_rank, micro_batch)

    def batch(self, state: DataState, dp: int, dp_rank: int, micro_batch: int | None = None) -> torch.Tensor:
        mb = uneven_micro_batch(state.global_batch, dp, micro_batch)
        split = replica_samples(state.global_batch, dp, mb)
        per = split[dp_rank]
        if self._key != (dp, dp_rank, mb):
            self._open(dp, dp_rank, mb)
            first = np.loadtxt(self._ids, dtype=np.int64, max_rows=per, ndmin=1)
            expect = rank_batch_ids(state, dp, dp_rank, mb)
            if not np.array_equal(first[: len(expect)], expect):
                raise ConfigError(f"the dataset mount {self.mnt} serves other samples than the job's data state "
                                  f"(first ids {first[:4].tolist()} vs {expect[:4].tolist()})")
        done = state.consumed - int(self._job["progress"])
        if done < 0 or done % state.global_batch:
            raise ConfigError(f"data position {state.consumed} is not a batch boundary after the mount's progress "
                              f"{self._job['progress']}: {state.consumed} - {self._job['progress']} = {done}, "
                              f"not a multiple >= 0 of the global batch {state.global_batch}")
        self._file.seek(done // state.global_batch * per * self.sample_bytes)
        raw = self._file.read(per * self.sample_bytes)
        if len(raw) != per * self.sample_bytes:
            raise OSError(f"short read from {self._file.name}: {len(raw)} of {per * self.sample_bytes} bytes")
        return tokens_of(raw, per, self.corpus.dtype)
