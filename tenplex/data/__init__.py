"""Dataset state: corpora, sample order and partitioning across data-parallel ranks."""

from .corpus import TokenCorpus, stdlib_corpus
from .partition import DataState, global_batch_ids, rank_batch_ids, sample_order

__all__ = ["TokenCorpus", "stdlib_corpus", "DataState", "sample_order", "global_batch_ids", "rank_batch_ids"]
