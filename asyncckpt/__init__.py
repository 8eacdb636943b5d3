"""asyncckpt: asynchronous, durable, preemption-proof checkpoints.

Front ends, each importing its framework only when imported itself:

* ``asyncckpt.tf``: ``Checkpoint`` and ``CheckpointManager``, drop-ins for
  ``tf.train.Checkpoint`` and ``tf.train.CheckpointManager``.
* ``asyncckpt.jax``: an orbax-style ``CheckpointManager`` and orbax's
  checkpointers, for pytrees of sharded ``jax.Array``s, writing files orbax
  restores.
* ``asyncckpt.keras``: Keras 3's ``BackupAndRestore`` and ``ModelCheckpoint``
  callbacks, asynchronous, with exact mid-epoch resumes.
* ``asyncckpt.jobrunner``: a framework-neutral epoch loop (``JobRunner``).
* ``asyncckpt.preemption``: ``PreemptionCheckpointHandler``, for either
  framework's manager.
* ``asyncckpt.storage``: the options of ``s3://`` / ``gs://`` directories and
  of a remote tier.

This top-level module holds what they share: the options of every save and
restore, the save handle and its stats, and the errors (every error
asyncckpt raises is an ``AsyncCkptError``). ``docs/architecture.md`` ("Public
API") lists each namespace's names and why each is there.
"""

from asyncckpt import _deprecation
from asyncckpt._engine.metrics import SaveStats
from asyncckpt._engine.writer import SaveHandle
from asyncckpt._version import __version__
from asyncckpt.errors import (
    AsyncCkptError,
    CheckpointNotFoundError,
    CoordinationError,
    CoordinationTimeoutError,
    CorruptCheckpointError,
    DirectoryLockedError,
    EngineClosedError,
    HostMemoryError,
    PeerFailedError,
    UnsupportedObjectError,
)
from asyncckpt.options import AsyncOptions, RestoreOptions

__all__ = [
    "AsyncCkptError",
    "AsyncOptions",
    "CheckpointNotFoundError",
    "CoordinationError",
    "CoordinationTimeoutError",
    "CorruptCheckpointError",
    "DirectoryLockedError",
    "EngineClosedError",
    "HostMemoryError",
    "PeerFailedError",
    "RestoreOptions",
    "SaveHandle",
    "SaveStats",
    "UnsupportedObjectError",
    "__version__",
]

# Names that left this namespace in asyncckpt 0.2: they warn, for one release.
__getattr__ = _deprecation.moved(__name__, {
    "JobRunner": ("asyncckpt.jobrunner", "JobRunner",
                  "use asyncckpt.jobrunner.JobRunner (with JobOptions, beside it)"),
    "RetentionPolicy": ("asyncckpt._engine.retention", "RetentionPolicy",
                        "no public API takes one: give max_to_keep, keep_period, ... to the "
                        "managers"),
})
