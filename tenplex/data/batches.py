"""A data-parallel rank's batches of a token corpus through its dataset index (no FUSE needed).

The corpus's index (token samples of ``seq_len + 1`` tokens, built once next to the token file:
:func:`corpus_index`) makes a sample id mean the same bytes everywhere; :class:`IndexBatches`
serves rank ``i`` of ``dp`` its slice of every global batch of a :class:`~tenplex.data.partition.DataState`
(``RankReader``), exactly the bytes a dataset VFS mount would show. A DP size that does not divide
the global batch into equal whole micro-batches reads its share of whole micro-batches
(``replica_samples``, :func:`uneven_micro_batch`).
"""

from __future__ import annotations

import logging
import os

import numpy as np
import torch

from ..errors import ConfigError
from .corpus import TokenCorpus
from .index import DataIndex, build_index, load_index
from .partition import DataState
from .view import RankReader

__all__ = ["corpus_index", "uneven_micro_batch", "tokens_of", "IndexBatches"]

log = logging.getLogger(__name__)


def corpus_index(corpus: TokenCorpus) -> tuple[str, DataIndex]:
    """The dataset index of a token corpus (built once, next to the token file)."""
    path = f"{corpus.path}.s{corpus.seq_len + 1}.idx.npz"
    if os.path.exists(path):
        try:
            return path, load_index(path)
        except Exception as e:  # noqa: BLE001 - a stale or damaged index is rebuilt
            log.info("rebuilding %s: %s", path, e)
    index = build_index([corpus.path], kind="tokens", seq_len=corpus.seq_len + 1, dtype=corpus.dtype)
    tmp = f"{path}.tmp{os.getpid()}"
    index.save(tmp)
    os.replace(tmp, path)
    return path, index


def uneven_micro_batch(global_batch: int, dp: int, micro_batch: int | None) -> int | None:
    """``micro_batch`` when it makes the DP split uneven, else None (equal slices: what a view
    without a micro-batch size shows, so an even job's mount is never re-sharded for it)."""
    if micro_batch is None or global_batch % (dp * micro_batch) == 0:
        return None
    return micro_batch


def tokens_of(raw: bytes, n: int, dtype: str) -> torch.Tensor:
    """``n`` samples of ``raw`` token bytes (``dtype``) as an int64 tensor, one row each."""
    arr = np.frombuffer(raw, dtype=dtype).astype(np.int64)
    return torch.from_numpy(arr.reshape(n, -1))


class IndexBatches:
    """Batches through the index reader (no FUSE): exactly the bytes a mount would show."""

    kind = "reader"

    def __init__(self, corpus: TokenCorpus) -> None:
        self.corpus = corpus
        self.path, self.index = corpus_index(corpus)
        if self.index.num_samples != corpus.num_samples:
            raise ConfigError(f"index {self.path} has {self.index.num_samples} samples, corpus {corpus.num_samples}: "
                              "rebuild the index of this corpus (corpus_index)")

    def batch(self, state: DataState, dp: int, dp_rank: int, micro_batch: int | None = None) -> torch.Tensor:
        samples = RankReader(self.index, state, dp, dp_rank, micro_batch=micro_batch).next_batch()
        return tokens_of(b"".join(samples), len(samples), self.corpus.dtype)
