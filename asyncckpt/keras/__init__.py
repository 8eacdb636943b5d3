"""Keras 3 front end: asynchronous, exact-resume training callbacks.

* ``BackupAndRestore``: Keras's callback of that name, with background saves
  of the whole training state and exact mid-epoch resumes.
* ``ModelCheckpoint``: Keras's callback of that name, writing the same
  ``.weights.h5`` / ``.keras`` files in the background; ``best`` survives
  restarts.
* ``ResumableDataset``: input whose batch order is fixed per (seed, epoch),
  so a resumed epoch can leave out the batches already applied.

Works with ``KERAS_BACKEND=tensorflow`` and ``KERAS_BACKEND=jax``. Importing
this subpackage imports Keras; ``import asyncckpt`` alone does not.
"""

try:
    import keras as _keras  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("asyncckpt.keras needs Keras 3: pip install keras") from e

from asyncckpt.keras._preemption import PreemptionOptions
from asyncckpt.keras.backup import BackupAndRestore, BackupOptions
from asyncckpt.keras.checkpoint import ModelCheckpoint
from asyncckpt.keras.data import ResumableDataset

__all__ = [
    "BackupAndRestore",
    "BackupOptions",
    "ModelCheckpoint",
    "PreemptionOptions",
    "ResumableDataset",
]
