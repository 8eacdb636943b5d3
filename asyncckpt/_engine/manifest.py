"""The integrity manifest every committed checkpoint carries.

The manifest is written last, just before the commit rename: it lists every
file with its size and checksum (CRC32C or zlib's CRC32, named per file;
computed by the background writer), the step,
the framework, the asyncckpt version and the save's timings. It carries a CRC
of its own content, so a damaged manifest is told apart from damaged data.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncckpt._engine import contained
from asyncckpt._engine.files import FileRecord
from asyncckpt._version import __version__
from asyncckpt.errors import CorruptCheckpointError

logger = logging.getLogger(__name__)

MANIFEST_FORMAT = 1


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """Contents of a checkpoint's manifest.

    Attributes:
        framework: ``"tensorflow"`` or ``"jax"``.
        label: Checkpoint name (TensorFlow prefix basename, or the step).
        step: Training step, when known.
        files: Every data file of the checkpoint, relative to its root.
        stats: The save's timings (see ``SaveStats.to_dict``).
        extra: Front-end specific data (e.g. preemption timing estimates).
        created: Wall-clock time the manifest was written.
        version: asyncckpt version that wrote it.
    """

    framework: str
    label: str
    step: int | None
    files: tuple[FileRecord, ...]
    stats: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    version: str = __version__

    @property
    def nbytes(self) -> int:
        return sum(f.size for f in self.files)

    def to_json(self) -> str:
        body = {
            "format": MANIFEST_FORMAT,
            "framework": self.framework,
            "label": self.label,
            "step": self.step,
            "created": self.created,
            "asyncckpt_version": self.version,
            "stats": self.stats,
            "extra": self.extra,
            "files": [f.to_json() for f in self.files],
        }
        canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
        body["manifest_crc32"] = zlib.crc32(canonical.encode())
        return json.dumps(body, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str, *, path: str) -> Manifest:
        """Parses and self-checks a manifest.

        Every file name must stay inside the checkpoint's directory
        (``contained.name_problem``), with a size of 0 or more: whoever
        wrote the manifest chose them, and its own CRC can be recomputed
        after any edit.

        Raises:
            CorruptCheckpointError: The manifest is not valid JSON, lacks
                fields, its own CRC does not match, or it names a file
                outside its checkpoint.
        """
        try:
            body = json.loads(text)
            stored = body.pop("manifest_crc32")
            canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
            if zlib.crc32(canonical.encode()) != stored:
                raise ValueError("manifest checksum mismatch")
            if body["format"] > MANIFEST_FORMAT:
                raise ValueError(
                    f"manifest format {body['format']} is newer than this asyncckpt "
                    f"understands ({MANIFEST_FORMAT}); upgrade asyncckpt"
                )
            files = tuple(FileRecord.from_json(f) for f in body["files"])
            _check_records(files)
            return cls(
                framework=body["framework"],
                label=body["label"],
                step=body["step"],
                files=files,
                stats=body.get("stats", {}),
                extra=body.get("extra", {}),
                created=body["created"],
                version=body["asyncckpt_version"],
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(
                f"manifest {path!r} is unreadable: {e}", checkpoint=path, file=path
            ) from e


def _check_records(files: Sequence[FileRecord]) -> None:
    for rec in files:
        problem = contained.name_problem(rec.name)
        if problem is not None:
            raise ValueError(f"it names the file {rec.name!r}, which {problem}")
        if rec.size < 0:
            raise ValueError(f"it records {rec.size} bytes for {rec.name!r}")


def read_manifest(path: str, *, checkpoint: str | None = None) -> Manifest:
    """Reads a manifest file.

    Args:
        path: The manifest.
        checkpoint: Its checkpoint, for errors (default: ``path``).

    Raises:
        FileNotFoundError: There is no manifest at ``path``.
        CorruptCheckpointError: The manifest is damaged, or a directory,
            FIFO or device is where it should be.
    """
    data = contained.read_file(path, checkpoint=checkpoint or path)
    return Manifest.from_json(data.decode("utf-8", errors="replace"), path=path)


def verify_files(
    root: str,
    files: Sequence[FileRecord],
    *,
    checksums: bool,
    checkpoint: str,
) -> None:
    """Checks that every file exists with the recorded size (and checksum).

    Args:
        root: Directory the file names are relative to.
        files: Records from the manifest.
        checksums: Also recompute and compare checksums (each record's algorithm).
        checkpoint: Checkpoint path used in error messages.

    Raises:
        CorruptCheckpointError: naming the first file that does not match (or
            that is a directory, a FIFO... where a file should be), or a
            name that leads outside ``root``.
    """
    for rec in files:
        path = contained.member(root, rec.name, checkpoint=checkpoint, source=checkpoint)
        try:
            size = contained.regular_size(path, checkpoint=checkpoint)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"checkpoint {checkpoint!r} is incomplete: file {path!r} is missing",
                checkpoint=checkpoint,
                file=path,
            ) from None
        if size != rec.size:
            raise CorruptCheckpointError(
                f"checkpoint {checkpoint!r} is corrupt: file {path!r} has {size} bytes, "
                f"the manifest records {rec.size} (truncated or overwritten)",
                checkpoint=checkpoint,
                file=path,
            )
        if checksums and (bad := rec.check(path)) is not None:
            raise CorruptCheckpointError(
                f"checkpoint {checkpoint!r} is corrupt: file {path!r} fails its "
                f"{rec.mismatch(bad)}",
                checkpoint=checkpoint,
                file=path,
            )


# -- Whose checkpoint is it? ------------------------------------------------------
#
# A checkpoint asyncckpt wrote always has a manifest; one without a manifest is
# either another library's (restored unverified, as before) or one of ours that
# lost it, which is corruption. Two records, kept apart from the manifest, tell
# them apart:
#
# * a directory checkpoint (JAX/orbax layout) carries ``OWNER_MARKER`` inside
#   itself, published by the same rename as the rest (and listed in the
#   manifest, so losing the marker alone is caught by the manifest);
# * a TensorFlow checkpoint is a set of files named by a prefix, in a directory
#   other tools write into too; ``OWNED_RECORD`` in that directory lists the
#   prefixes asyncckpt published there with the size of their commit marker
#   (the index), so a checkpoint written over by another tool is not claimed.

OWNER_MARKER = "asyncckpt.owner.json"
OWNED_RECORD = ".asyncckpt-owned.json"
_owned_lock = threading.Lock()


def owner_marker_bytes() -> bytes:
    """Contents of the ``OWNER_MARKER`` file a directory checkpoint carries."""
    return json.dumps({"writer": "asyncckpt", "version": __version__}).encode()


def has_owner_marker(root: str) -> bool:
    """Whether the directory checkpoint at ``root`` was written by asyncckpt."""
    return os.path.exists(os.path.join(root, OWNER_MARKER))


def _read_owned(directory: str) -> dict[str, int]:
    try:
        path = os.path.join(directory, OWNED_RECORD)
        body = json.loads(contained.read_file(path, checkpoint=directory))
        owned = body.get("checkpoints", {})
        return {str(k): int(v) for k, v in owned.items()} if isinstance(owned, dict) else {}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}


def record_owned(directory: str, name: str, *, marker_suffix: str, fsync: bool) -> None:
    """Records that asyncckpt published the checkpoint ``name`` in ``directory``.

    Call after the publish (a checkpoint committed but not yet recorded still
    has its manifest). Entries whose marker file is gone are dropped, so the
    record stays as small as the directory. Updates are serialized within
    the process; two processes updating one directory at once (which the
    directory lock prevents for managers) may drop each other's entry, which
    only makes that checkpoint look foreign if it also loses its manifest.

    Args:
        directory: Directory holding the checkpoint's files.
        name: The checkpoint's name (TensorFlow prefix basename).
        marker_suffix: Suffix of the commit marker (``.index``), whose size
            is recorded.
        fsync: Whether to make the record durable.
    """
    from asyncckpt._engine.commit import write_text_atomic

    with _owned_lock:
        owned = _read_owned(directory)
        owned[name] = os.path.getsize(os.path.join(directory, name + marker_suffix))
        owned = {
            n: size for n, size in owned.items()
            if os.path.exists(os.path.join(directory, n + marker_suffix))
        }
        text = json.dumps({"format": 1, "checkpoints": owned}, sort_keys=True)
        write_text_atomic(os.path.join(directory, OWNED_RECORD), text, fsync=fsync)


def is_owned(prefix: str, *, marker_suffix: str) -> bool:
    """Whether asyncckpt published the prefix-named checkpoint at ``prefix``.

    True only while the commit marker still has the size recorded at the
    publish: a checkpoint another tool wrote over under the same name is not
    claimed.
    """
    directory, name = os.path.split(os.path.abspath(prefix))
    size = _read_owned(directory).get(name)
    try:
        return size is not None and os.path.getsize(prefix + marker_suffix) == size
    except OSError:
        return False


def load_manifest(path: str, *, checkpoint: str, owned: bool) -> Manifest | None:
    """Reads a checkpoint's manifest; a missing one is corruption if asyncckpt wrote it.

    Args:
        path: Where the manifest should be.
        checkpoint: The checkpoint, for error messages.
        owned: Whether asyncckpt wrote the checkpoint (``has_owner_marker`` /
            ``is_owned``).

    Returns:
        The manifest, or None for a checkpoint another library wrote (which
        has none and is restored unverified).

    Raises:
        CorruptCheckpointError: The manifest is damaged, or missing from a
            checkpoint asyncckpt wrote.
    """
    try:
        return read_manifest(path, checkpoint=checkpoint)
    except FileNotFoundError:
        if owned:
            raise CorruptCheckpointError(
                f"checkpoint {checkpoint!r} was written by asyncckpt but its manifest "
                f"{path!r} is missing: its files cannot be verified",
                checkpoint=checkpoint,
                file=path,
            ) from None
        return None
