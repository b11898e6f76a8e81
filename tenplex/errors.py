"""Exceptions raised by tenplex. Every message says what went wrong and how to fix it."""

from __future__ import annotations

import errno

__all__ = [
    "TenplexError",
    "ConfigError",
    "LayoutError",
    "PlanError",
    "SpecError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointValueError",
    "CheckpointWriteError",
    "NetnsUnavailableError",
    "DataStateError",
    "DataIndexError",
    "IndexNotFoundError",
    "SourceChangedError",
    "SourceReadError",
    "VfsError",
    "SideTaskMemoryError",
    "MigrationError",
    "PeerFailure",
    "MembershipError",
    "EtcdStoreError",
    "StoreInterrupted",
]


class TenplexError(Exception):
    """Base class of every error tenplex raises on purpose."""


class ConfigError(TenplexError, ValueError):
    """A layout is malformed or does not match what it is used with (a world size, the number of
    pipeline stages an estimate describes)."""


class LayoutError(TenplexError, ValueError):
    """A layout cannot exist for a model (e.g. TP does not divide the head count)."""


class PlanError(TenplexError, ValueError):
    """A repartitioning plan cannot be made (bad `alive` set, unknown tensors)."""


class SpecError(TenplexError, ValueError):
    """A model, tensor spec or PTC is malformed (unknown dtype or preset, a split that does not fit
    the shape, a damaged PTC description, tensors that do not match the PTC)."""


class CheckpointError(TenplexError):
    """Base class of checkpoint problems."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No (complete) checkpoint exists at the requested URL and step."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is truncated or its bytes fail their checksum."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint describes another model than the one requested."""


class CheckpointValueError(CheckpointError, ValueError):
    """``save`` was given a value it cannot store (a step out of range, an ``extra`` that
    ``torch.load(weights_only=True)`` cannot read back, a malformed save id)."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint or snapshot could not be written (on this rank or another rank of the job):
    training stops on every rank rather than continue without the saves it was asked for."""


class NetnsUnavailableError(TenplexError, OSError):
    """Simulated hosts cannot get network namespaces here (not root, no `ip`, creation refused)."""


class DataStateError(TenplexError, ValueError):
    """A data state or partitioning argument has the wrong type or is out of range."""


class DataIndexError(TenplexError, ValueError):
    """A dataset index or token corpus cannot be built or opened (bad arguments, malformed file)."""


class IndexNotFoundError(DataIndexError, FileNotFoundError):
    """The index file does not exist."""


class SourceChangedError(DataIndexError):
    """A source file's size differs from the one recorded in the index."""


class SourceReadError(TenplexError, OSError):
    """A sample's bytes could not be read (missing or shrunk source); errno is EIO."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)


class VfsError(TenplexError, ValueError):
    """A mount or re-shard request is invalid (bad DP size, progress, mountpoint ...)."""


class SideTaskMemoryError(TenplexError, ValueError):
    """A side task needs more memory than the stage's side-task budget has left."""


class MigrationError(TenplexError, RuntimeError):
    """A live state migration failed while moving bytes (a peer died or a transfer broke); the
    survivors' state is unchanged and the caller falls back to loading from stores or storage."""


class PeerFailure(TenplexError, RuntimeError):
    """A peer of this process's group died or its connection broke (a collective failed, or the
    heartbeats stopped); call ``Membership.recover()`` to form the survivors' group."""


class MembershipError(TenplexError, RuntimeError):
    """The survivors could not form a new group: this member was left out of the decision, a round
    did not decide within its timeout, or the rounds allowed ran out. The caller falls back to a
    restart (torchrun's, or its own)."""


class EtcdStoreError(TenplexError, RuntimeError):
    """The etcd membership store failed an operation: no endpoint of the cluster answered within
    the store's timeout (a majority of its members is down), a key did not appear in time
    (``get`` / ``wait``), or etcd refused the request. A ``RuntimeError`` as c10d's store errors
    are, so :class:`~tenplex.elastic.membership_runtime.Membership` treats it as theirs."""


class StoreInterrupted(EtcdStoreError):
    """A store call was given up because its caller no longer needs the answer (the store's
    ``interrupt`` said so between two tries): a member that learned of a failure leaves a write
    that an election of the store holds up and recovers (``Membership.join_due``)."""
