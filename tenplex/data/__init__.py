"""Dataset state: corpora, sample order and partitioning across data-parallel ranks."""

from .corpus import TokenCorpus, stdlib_corpus
from .index import (
    DataIndex,
    DataIndexError,
    IndexNotFoundError,
    SourceChangedError,
    SourceFile,
    SourceReader,
    SourceReadError,
    build_index,
    load_index,
)
from .loader import ElasticBatchSampler, ElasticIterable, ElasticLoader, loader_state, rank_step_ids
from .hf import HFSamples, StreamSlice, hf_dataset, hf_index
from .megatron import MegatronIndexed, megatron_gpt_dataset, megatron_index, megatron_packing, write_megatron
from .packing import DocumentSource, PackedDataset, Packing, TokenFile, pack_documents
from .partition import (
    DataState,
    DataStateError,
    global_batch_ids,
    feistel_ids,
    ids_at,
    loss_scale,
    rank_batch_ids,
    rank_positions,
    remaining_ids,
    replica_samples,
    replica_slice,
    sample_order,
    stream_end,
)
from .text import TextDocuments, encoder
from .view import LineFile, RankReader, RankView, rank_view

__all__ = [
    "TokenCorpus", "stdlib_corpus", "DataState", "DataStateError", "sample_order", "global_batch_ids", "rank_batch_ids",
    "replica_samples", "stream_end", "rank_positions", "ids_at", "remaining_ids",
    "DataIndex", "SourceFile", "SourceReader", "build_index", "load_index",
    "DataIndexError", "IndexNotFoundError", "SourceChangedError", "SourceReadError",
    "LineFile", "RankView", "RankReader", "rank_view", "feistel_ids", "replica_slice", "loss_scale",
    "ElasticBatchSampler", "ElasticIterable", "ElasticLoader", "loader_state", "rank_step_ids",
    "DocumentSource", "Packing", "PackedDataset", "TokenFile", "pack_documents", "MegatronIndexed", "write_megatron",
    "megatron_packing", "megatron_gpt_dataset", "megatron_index", "TextDocuments", "encoder", "hf_dataset",
    "HFSamples", "StreamSlice", "hf_index",
]
