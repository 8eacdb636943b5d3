"""asyncckpt: asynchronous, durable, preemption-proof checkpoints.

Front ends, each importing its framework only when imported itself:

* ``asyncckpt.tf``: ``Checkpoint`` and ``CheckpointManager``, drop-ins for
  ``tf.train.Checkpoint`` and ``tf.train.CheckpointManager``.
* ``asyncckpt.jax``: an orbax-style ``CheckpointManager`` for pytrees of
  sharded ``jax.Array``s, writing files orbax restores.

This top-level module holds what both share: options, save handles and stats,
retention rules and errors.
"""

from asyncckpt._engine.metrics import SaveStats
from asyncckpt._engine.retention import RetentionPolicy
from asyncckpt._engine.writer import SaveHandle
from asyncckpt._version import __version__
from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DirectoryLockedError,
    EngineClosedError,
    HostMemoryError,
    UnsupportedObjectError,
)
from asyncckpt.jobrunner import JobRunner as JobRunner
from asyncckpt.options import AsyncOptions, RestoreOptions

__all__ = [
    "AsyncCkptError",
    "AsyncOptions",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DirectoryLockedError",
    "EngineClosedError",
    "HostMemoryError",
    "RestoreOptions",
    "RetentionPolicy",
    "SaveHandle",
    "SaveStats",
    "UnsupportedObjectError",
    "__version__",
]
