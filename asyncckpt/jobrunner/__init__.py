"""Framework-neutral epoch job runner and the array store under it.

* ``ArrayStore``: numbered checkpoints of named arrays plus JSON, saved
  asynchronously and committed atomically; partial restores read only the
  selected arrays' bytes.
* ``JobRunner``: runs ``init`` then epochs, checkpointing each epoch through
  an ``ArrayStore``, resuming from the newest verified (or a given) epoch,
  recording per-epoch stats and running an upload hook in the background.
"""

from asyncckpt.jobrunner.runner import EpochStats, JobOptions, JobRunner, UploadError
from asyncckpt.jobrunner.store import ArrayStore, Restored, select_names

__all__ = [
    "ArrayStore",
    "EpochStats",
    "JobOptions",
    "JobRunner",
    "Restored",
    "UploadError",
    "select_names",
]
