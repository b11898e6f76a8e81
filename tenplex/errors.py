"""Exceptions raised by tenplex. Every message says what went wrong and how to fix it."""

from __future__ import annotations

__all__ = [
    "TenplexError",
    "ConfigError",
    "LayoutError",
    "PlanError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointValueError",
    "CheckpointWriteError",
    "NetnsUnavailableError",
]


class TenplexError(Exception):
    """Base class of every error tenplex raises on purpose."""


class ConfigError(TenplexError, ValueError):
    """A parallel configuration is malformed or does not match a world size."""


class LayoutError(TenplexError, ValueError):
    """A layout cannot exist for a model (e.g. TP does not divide the head count)."""


class PlanError(TenplexError, ValueError):
    """A repartitioning plan cannot be made (bad `alive` set, unknown tensors)."""


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
