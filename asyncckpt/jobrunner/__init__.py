"""Framework-neutral front end: the epoch job runner.

``JobRunner`` runs ``init`` then epochs, checkpointing each epoch (named
arrays plus JSON, saved asynchronously and committed atomically), resuming
from the newest verified (or a given) epoch, recording per-epoch stats
(``EpochStats``) and running an upload hook in the background (its final
failure: ``UploadError``); ``JobOptions`` says how. ``load_parts`` reads
selected arrays back (``Restored``), reading only their bytes. The store
under it (``store.ArrayStore``, also under ``asyncckpt.keras``'s backups)
is internal.
"""

from asyncckpt import _deprecation
from asyncckpt.jobrunner.runner import EpochStats, JobOptions, JobRunner, UploadError
from asyncckpt.jobrunner.store import Restored

__all__ = [
    "EpochStats",
    "JobOptions",
    "JobRunner",
    "Restored",
    "UploadError",
]

# Names that left this namespace in asyncckpt 0.2: they warn, for one release.
__getattr__ = _deprecation.moved(__name__, {
    "ArrayStore": ("asyncckpt.jobrunner.store", "ArrayStore",
                   "internal since asyncckpt 0.2: use JobRunner (or asyncckpt.keras's "
                   "callbacks); import it from asyncckpt.jobrunner.store if you must"),
    "select_names": ("asyncckpt.jobrunner.store", "select_names",
                     "internal since asyncckpt 0.2: JobOptions(load_include=..., "
                     "load_exclude=...) and JobRunner.load_parts select by glob"),
})
