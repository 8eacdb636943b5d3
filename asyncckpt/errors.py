"""Exceptions raised by asyncckpt, every front end's.

Every error asyncckpt raises on its own account is an ``AsyncCkptError``,
and each also subclasses the built-in exception a caller would already catch
for the same situation (a missing file, a bad value), so code written against
the framework's own checkpoint API keeps working. A front end's own errors
live in its namespace and join the family the same way
(``asyncckpt.jax.StepAlreadyExistsError`` is also orbax's
``StepAlreadyExistsError``; the TensorFlow front end's missing checkpoint is
also a ``tf.errors.NotFoundError``; ``asyncckpt.storage.StorageError`` an
``OSError``).
"""

from __future__ import annotations


class AsyncCkptError(Exception):
    """Base class of every error asyncckpt raises on its own account."""


class CheckpointNotFoundError(AsyncCkptError, FileNotFoundError):
    """The checkpoint (or step) asked for does not exist."""


class CorruptCheckpointError(AsyncCkptError, ValueError):
    """A checkpoint's files do not match its manifest.

    Attributes:
        checkpoint: Path of the checkpoint that failed verification.
        file: The file that is missing, truncated or corrupt, when known.
    """

    def __init__(self, message: str, *, checkpoint: str, file: str | None = None):
        super().__init__(message)
        self.checkpoint = checkpoint
        self.file = file


class UnsupportedObjectError(AsyncCkptError, TypeError):
    """The state holds an object asyncckpt cannot stage to host memory."""


class UnsupportedLeafError(UnsupportedObjectError, ValueError):
    """A pytree (or one of its leaves) that orbax's handlers refuse too.

    The JAX front end's ``UnsupportedObjectError``: also a ``ValueError``,
    which orbax raises for the same trees (a ``str`` leaf in a standard
    pytree, an empty tree, a bare array, a target leaf of another type), so
    code written against orbax catches it as it did.
    """


class TopologyMismatchError(AsyncCkptError, ValueError):
    """A checkpoint's saved sharding cannot be rebuilt on this run's devices.

    Raised by a restore that keeps the saved sharding (no target, or a
    ``jax.ShapeDtypeStruct`` without one), as orbax raises a ``ValueError``
    there: give a target with the shardings to restore onto.
    """


class DirectoryLockedError(AsyncCkptError, RuntimeError):
    """Another live process already writes checkpoints into this directory."""


class EngineClosedError(AsyncCkptError, RuntimeError):
    """A save was requested after the engine was closed."""


class HostMemoryError(AsyncCkptError, MemoryError):
    """Not even one staging copy of the state fits the host memory budget.

    Raised by ``save()`` (or ``prepare()``) before anything is allocated; see
    ``AsyncOptions.host_memory_limit``.

    Attributes:
        state_nbytes: Bytes one staging copy of the state needs.
        budget_nbytes: Bytes staging may hold.
    """

    def __init__(self, message: str, *, state_nbytes: int, budget_nbytes: int):
        super().__init__(message)
        self.state_nbytes = state_nbytes
        self.budget_nbytes = budget_nbytes


class CoordinationError(AsyncCkptError, RuntimeError):
    """A coordination service failed, or another worker failed its part."""


class CoordinationTimeoutError(CoordinationError, TimeoutError):
    """A worker did not take its part in the protocol in time."""


class PeerFailedError(CoordinationError):
    """Another worker's training function raised; this worker stops too.

    Attributes:
        worker: Index of the worker that failed first.
        error: That worker's exception, as text.
    """

    def __init__(self, worker: int, error: str):
        super().__init__(f"worker {worker} failed: {error}")
        self.worker = worker
        self.error = error
