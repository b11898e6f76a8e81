"""Resharding checkpoints on any fsspec URL: safetensors data, JSON manifests, partial reads.

The package's modules: ``format`` (names, data layout, checksums, metadata schemas; no I/O),
``writer`` (a rank's part of a save attempt, ``save``) and ``reader`` (listing, read plans and
the readers that execute them, ``load``). See docs/format.md for the layout on disk.

Every chunk is one interval of a tensor's canonical flat order (see ``tenplex.layout.ptc``), stored
as a 1-D safetensors tensor, so any piece a future layout needs is one contiguous byte
range. Replicated intervals are written once, by the least-loaded of their holders. CRC32s
cover fixed blocks of each chunk, so a load verifies exactly the blocks it reads. The
manifest and every rank index end in a SHA-256 digest of their own bytes; the manifest holds
the SHA-256 of ``objects.pt``; every index names its step, save id, rank, layout and model
fingerprint. A load checks all of that before it uses a byte, and falls back to the newest
older step that verifies when a step is damaged.
"""

from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointValueError,
)
from .format import (
    FORMAT,
    MAX_STEP,
    VERSION,
    Binding,
    Manifest,
    check_step,
    open_sealed_json,
    safetensors_header,
    seal_json,
    verify_index,
    verify_manifest,
    writer_assignment,
)
from .catalog import StepInfo, list_steps, read_manifest, read_part_chunks
from .load import (
    LoadResult,
    LoadStats,
    ReadOptions,
    ShardSink,
    check_model,
    load,
    load_with_reader,
    read_objects,
    read_shard,
)
from .part_reader import PartReader, ShardReader
from .read_plan import ReadItem, plan_reads
from .writer import PartWriter, SaveOptions, SaveResult, carry_model, default_save_id, save

__all__ = ["SaveResult", "SaveOptions", "LoadStats", "LoadResult", "StepInfo", "save", "load", "list_steps", "read_manifest",
           "writer_assignment", "default_save_id", "seal_json", "open_sealed_json", "MAX_STEP", "FORMAT", "VERSION",
           "check_step", "check_model", "safetensors_header", "Manifest", "Binding", "verify_manifest",
           "verify_index", "load_with_reader", "read_objects",
           "read_part_chunks", "read_shard",
           "ReadItem", "ReadOptions", "plan_reads", "ShardReader", "ShardSink", "PartReader", "PartWriter",
           "carry_model",
           "CheckpointError",
           "CheckpointCorruptError", "CheckpointMismatchError", "CheckpointNotFoundError", "CheckpointValueError"]
