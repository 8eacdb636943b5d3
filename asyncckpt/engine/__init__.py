"""The framework-neutral engine: snapshot, write, commit, retention.

Imports neither TensorFlow nor JAX. Framework adapters (``asyncckpt.tf``,
``asyncckpt.jax``) stage their state into ``Slot`` buffers and hand the engine
a ``SaveJob`` that writes those buffers in their framework's file format.
"""

from asyncckpt.engine._jobs import SaveJob
from asyncckpt.engine.commit import (
    cleanup_stale_temps,
    directory_guard,
    ensure_writable_dir,
    forget_temp,
    is_temp_name,
    make_temp_dir,
    publish_dir,
    publish_files,
    remove_tree,
    write_text_atomic,
)
from asyncckpt.engine.files import DurableWriter, FileRecord
from asyncckpt.engine.manifest import (
    Manifest,
    has_owner_marker,
    is_owned,
    load_manifest,
    read_manifest,
    verify_files,
)
from asyncckpt.engine.metrics import SaveStats, WriteTimeEstimator
from asyncckpt.engine.retention import Candidate, Decision, RetentionPolicy
from asyncckpt.engine.slots import Slot, StagingPool
from asyncckpt.engine.writer import AsyncEngine, SaveHandle

__all__ = [
    "AsyncEngine",
    "Candidate",
    "Decision",
    "DurableWriter",
    "FileRecord",
    "Manifest",
    "RetentionPolicy",
    "SaveHandle",
    "SaveJob",
    "SaveStats",
    "Slot",
    "StagingPool",
    "WriteTimeEstimator",
    "cleanup_stale_temps",
    "directory_guard",
    "ensure_writable_dir",
    "forget_temp",
    "has_owner_marker",
    "is_owned",
    "is_temp_name",
    "load_manifest",
    "make_temp_dir",
    "publish_dir",
    "publish_files",
    "read_manifest",
    "remove_tree",
    "verify_files",
    "write_text_atomic",
]
