"""The integrity manifest every committed checkpoint carries.

The manifest is written last, just before the commit rename: it lists every
file with its size and CRC32 (computed by the background writer), the step,
the framework, the asyncckpt version and the save's timings. It carries a CRC
of its own content, so a damaged manifest is told apart from damaged data.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncckpt._version import __version__
from asyncckpt.engine.files import FileRecord, crc32_file
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

        Raises:
            CorruptCheckpointError: The manifest is not valid JSON, lacks
                fields, or its own CRC does not match.
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
            return cls(
                framework=body["framework"],
                label=body["label"],
                step=body["step"],
                files=tuple(FileRecord.from_json(f) for f in body["files"]),
                stats=body.get("stats", {}),
                extra=body.get("extra", {}),
                created=body["created"],
                version=body["asyncckpt_version"],
            )
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(
                f"manifest {path!r} is unreadable: {e}", checkpoint=path, file=path
            ) from e


def read_manifest(path: str) -> Manifest:
    """Reads a manifest file.

    Raises:
        FileNotFoundError: There is no manifest at ``path``.
        CorruptCheckpointError: The manifest is damaged.
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    return Manifest.from_json(text, path=path)


def verify_files(
    root: str,
    files: Sequence[FileRecord],
    *,
    checksums: bool,
    checkpoint: str,
) -> None:
    """Checks that every file exists with the recorded size (and CRC32).

    Args:
        root: Directory the file names are relative to.
        files: Records from the manifest.
        checksums: Also recompute and compare CRC32s.
        checkpoint: Checkpoint path used in error messages.

    Raises:
        CorruptCheckpointError: naming the first file that does not match.
    """
    for rec in files:
        path = os.path.join(root, *rec.name.split("/"))
        try:
            size = os.path.getsize(path)
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
        if checksums and rec.crc32 is not None:
            _, crc = crc32_file(path)
            if crc != rec.crc32:
                raise CorruptCheckpointError(
                    f"checkpoint {checkpoint!r} is corrupt: file {path!r} fails its "
                    f"CRC32 check (stored {rec.crc32:#010x}, computed {crc:#010x})",
                    checkpoint=checkpoint,
                    file=path,
                )
