"""Chunk files of a JAX checkpoint read once, in parallel, each checked against the manifest.

Split from ``_restore`` (which places the arrays): ``ChunkReader`` plans
and runs the reads (``engine.reads``) of the chunk files a restore needs,
and checks the other files of the restored arrays in the same batch. In an
OCDBT item (``use_values``) the chunks are byte ranges of the databases'
data files: each data file is read once, the ranges straight into their
buffers, and checked whole in the same pass.

In a checkpoint with a manifest, every file read is one the manifest lists
(a chunk file, an OCDBT data file): any other is an integrity error naming
it, never an unchecked read, and ``check_layout`` holds each array's
metadata to the files before anything is sized from it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from asyncckpt._engine import contained, fastcrc, reads
from asyncckpt._engine.files import FileRecord
from asyncckpt._engine.manifest import Manifest
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.jax._format import ARRAY_METADATAS, in_item

_READERS = 8  # parallel file reads: enough to keep a disk's queue full


@dataclasses.dataclass(frozen=True)
class Listing:
    """Which files of a step may be read: inside it and, with a manifest, listed there.

    Apart from ``ChunkReader`` so that an OCDBT index can check the files its
    B-tree names through it: a check holding the reader, which holds the
    index, would be a reference cycle keeping every buffer the restore read
    alive until the garbage collector next runs (64 MiB more resident per
    restore of a 64 MiB checkpoint, and slower restores, until it did).
    """

    checkpoint: str
    records: Mapping[str, FileRecord]
    has_manifest: bool

    def corrupt(self, path: str, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"checkpoint {self.checkpoint!r} is corrupt: file {path!r} {what}",
            checkpoint=self.checkpoint, file=path)

    def listed(self, name: str, *, source: str) -> FileRecord | None:
        """The record of ``name`` (relative to the step), a file about to be read.

        ``source``: the file that named it. The name must stay inside the
        step (``contained.check_name``); in a checkpoint with a manifest it
        must be listed there. None: no manifest (another library's
        checkpoint, read unverified).

        Raises:
            CorruptCheckpointError: it leads outside, or is not listed.
        """
        contained.check_name(name, checkpoint=self.checkpoint, source=source)
        rec = self.records.get(name)
        if rec is None and self.has_manifest:
            raise self.corrupt(os.path.join(self.checkpoint, *name.split("/")),
                               "is not listed in the manifest: it is not read")
        return rec


class ChunkReader:
    """Reads chunk files once, in parallel, checking each against the manifest.

    Args:
        step_dir: The checkpoint.
        manifest: Its manifest, or None for a checkpoint written by orbax.
        checksums: Check checksums (sizes are checked in any case).
        remote: The step is a remote one opened file by file
            (``asyncckpt.storage.lazy.LazyStep``): each file is fetched into
            ``step_dir`` just before it is read, and only then.
    """

    def __init__(self, step_dir: str, manifest: Manifest | None, *, checksums: bool,
                 remote: Any = None):
        self._dir = step_dir
        self._remote = remote
        self.listing = Listing(step_dir, {r.name: r for r in manifest.files} if manifest else {},
                               manifest is not None)
        self.has_manifest = self.listing.has_manifest
        self._records = self.listing.records
        self._checksums = checksums
        self._data: dict[str, np.ndarray | None] = {}
        self._checked: set[str] = set()  # names of files checked without keeping their bytes
        self._values: tuple[str, Any] | None = None  # OCDBT: (item, its ``OcdbtIndex``)

    def use_values(self, item: str, index: Any) -> None:
        """Chunks of ``item`` are values of its OCDBT database (``_ocdbtindex.OcdbtIndex``)."""
        self._values = (item, index)

    @property
    def reads_values(self) -> bool:
        return self._values is not None

    def _name(self, path: str) -> str:
        """``path``'s name relative to the step, as the manifest spells it."""
        prefix = self._dir.rstrip(os.sep) + os.sep
        rel = path[len(prefix):] if path.startswith(prefix) else os.path.relpath(path, self._dir)
        return rel.replace(os.sep, "/")

    def _record(self, path: str) -> FileRecord | None:
        return self._records.get(self._name(path))

    def _corrupt(self, path: str, what: str) -> CorruptCheckpointError:
        return self.listing.corrupt(path, what)

    def check_layout(self, array: Any) -> None:
        """Holds a ``ZarrArray``'s metadata to the checkpoint's files before anything is sized.

        With a manifest, every chunk of the array's grid must be a listed
        file (or, in OCDBT, a value of the database) of exactly one
        chunk's bytes: then no buffer sized from the metadata is larger
        than the files it is read from. Without a manifest nothing is
        checked here (each chunk is still checked as it is read).

        Raises:
            CorruptCheckpointError: naming the array's metadata, or the chunk.
        """
        if not self.has_manifest:
            return
        meta = os.path.join(array.dir, ".zarray")
        index = self._values[1] if self._values is not None else None
        room = len(index) if index is not None else len(self._records)
        if array.chunk_count > room:
            raise self._corrupt(meta, f"describes {array.chunk_count} chunks of shape "
                                f"{array.chunks} for shape {array.shape}; the checkpoint "
                                f"holds {room} files")
        need = array.chunk_nbytes
        skip = 0 if index is None else len(in_item(self._values[0], ""))  # key = name[skip:]
        for path in array.chunk_paths(None):
            name = self._name(path)  # (the parameter's name was checked with its metadata)
            if index is None:
                rec = self._records.get(name)
                if rec is None:
                    raise self._corrupt(path, "is not listed in the manifest: it is not read")
                have = rec.size
            else:
                where = index.get(name[skip:])
                if where is None:
                    raise self._corrupt(path, "is a chunk the OCDBT database does not hold")
                have = len(where) if isinstance(where, bytes) else where[2]
            if have != need:
                raise self._corrupt(path, f"holds {have} bytes, a chunk of {meta!r} "
                                    f"needs {need}")

    def check_tree(self, directory: str) -> None:
        """With a manifest: every file under ``directory`` (read by TensorStore) is listed.

        Raises:
            CorruptCheckpointError: naming a file the manifest does not list.
        """
        if not self.has_manifest:
            return
        for dirpath, _, names in os.walk(directory):
            for name in names:
                path = os.path.join(dirpath, name)
                self.listing.listed(self._name(path), source=path)

    def _plan(self, path: str) -> tuple[reads.FileRead, np.ndarray] | None:
        """The read of one chunk file into an aligned buffer of its size (None: no file)."""
        rec = self.listing.listed(self._name(path), source=path)
        try:
            size = contained.regular_size(path, checkpoint=self._dir)
        except FileNotFoundError:
            if rec is not None:
                raise CorruptCheckpointError(
                    f"checkpoint {self._dir!r} is incomplete: file {path!r} is missing",
                    checkpoint=self._dir, file=path,
                ) from None
            return None
        if rec is not None and size != rec.size:
            raise self._corrupt(path, f"has {size} bytes, the manifest records {rec.size} "
                                "(truncated or overwritten)")
        checksum = (self._checksums and rec is not None and rec.crc is not None
                    and not self._checked_on_fetch(rec.name))
        buf = reads.aligned_empty(size)
        return reads.FileRead(path, size, [(0, buf)], checksum=checksum,
                              algorithm=rec.algorithm if checksum else fastcrc.CRC32), buf

    def _checked_on_fetch(self, name: str) -> bool:
        """Whether the remote tier checked this file's checksum as it fetched it.

        Such a file was checksummed from the downloaded copy just before it
        was renamed into the private fetch directory; checking it again as
        it is read would only repeat that (a second full pass over its bytes).
        """
        return self._remote is not None and name in getattr(self._remote, "checked", ())

    def _plan_check(self, rec: FileRecord) -> reads.FileRead:
        """The read of a file only checked (its bytes are not kept)."""
        path = os.path.join(self._dir, *rec.name.split("/"))
        try:
            size = contained.regular_size(path, checkpoint=self._dir)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"checkpoint {self._dir!r} is incomplete: file {path!r} is missing",
                checkpoint=self._dir, file=path) from None
        if size != rec.size:
            raise self._corrupt(path, f"has {size} bytes, the manifest records {rec.size}")
        return reads.FileRead(path, size, [], checksum=True, algorithm=rec.algorithm)

    def prefetch_values(self, paths: Iterable[str], *, mine: set[str] | None = None) -> None:
        """OCDBT: reads these chunks (values) and keeps their bytes; checks data files whole.

        Every data file holding one of the chunks is read once: the chunks'
        byte ranges straight into aligned buffers, the rest (when the file's
        checksum is this process's to check: ``mine``, by name; None: all)
        into scratch memory, so its checksum is computed in the same pass.
        Inline values (small) come with the B-tree, checked with its files.
        """
        assert self._values is not None
        item, index = self._values
        top = os.path.join(self._dir, item)
        source = os.path.join(top, "manifest.ocdbt")
        todo = sorted(set(paths) - set(self._data))
        ranges: dict[str, list[tuple[int, int, str]]] = {}
        for path in todo:
            where = index.get(os.path.relpath(path, top).replace(os.sep, "/"))
            if where is None and self.has_manifest:
                raise self._corrupt(path, "is a chunk the OCDBT database does not hold")
            if where is None or isinstance(where, bytes):
                self._data[path] = None if where is None else np.frombuffer(where, np.uint8).copy()
                continue
            file, offset, length = where
            ranges.setdefault(in_item(item, file), []).append((offset, length, path))
        for name in ranges:
            self.listing.listed(name, source=source)  # inside the step, and in the manifest
        if self._remote is not None:
            self._remote.fetch_names(list(ranges))
        plans = []
        for name, spans in sorted(ranges.items()):
            rec = self._records.get(name)
            path = os.path.join(self._dir, *name.split("/"))
            try:
                size = contained.regular_size(path, checkpoint=self._dir)
            except FileNotFoundError:
                raise CorruptCheckpointError(
                    f"checkpoint {self._dir!r} is incomplete: file {path!r} is missing",
                    checkpoint=self._dir, file=path) from None
            if any(o < 0 or n < 0 or o + n > size for o, n, _ in spans):
                raise self._corrupt(path, f"has {size} bytes, shorter than its values in the "
                                    "database's B-tree (truncated)")
            # Sized only now: every range lies in the file.
            dests = [(o, reads.aligned_empty(n, file_offset=o), p) for o, n, p in spans]
            checksum = (self._checksums and rec is not None and rec.crc is not None
                        and (mine is None or name in mine) and name not in self._checked
                        and not self._checked_on_fetch(name))
            fr = reads.FileRead(path, size, [(o, b) for o, b, _ in dests], checksum=checksum,
                                algorithm=rec.algorithm if checksum else fastcrc.CRC32)
            plans.append((name, rec, fr, dests))
        try:
            reads.read_all([fr for _, _, fr, _ in plans])
        except reads.ShortReadError as e:
            raise self._corrupt(e.path, "is shorter than its manifest records "
                                "(truncated while being read)") from e
        for name, rec, fr, dests in plans:
            if fr.crc is not None:
                if fr.crc != rec.crc:
                    raise self._corrupt(fr.path, f"fails its {rec.mismatch(fr.crc)}")
                self._checked.add(name)
            for _, buf, path in dests:
                self._data[path] = buf

    def prefetch(self, paths: Iterable[str], *,
                 rest_of: tuple[str, set[str] | None] | None = None) -> None:
        """Reads (and checks) these files in parallel and keeps their bytes.

        Each file is read straight into the aligned buffer its arrays are
        made from (on CPU, XLA takes it over without a copy), its checksum
        (the record's algorithm) computed piece by piece as the bytes arrive
        (``engine.reads``).

        Args:
            paths: The chunk files to read.
            rest_of: ``(item, params)``: also check, in the same reads, the
                other files of these arrays (``check_the_rest`` without a
                share), so their small reads overlap the chunks' instead of
                following them (5-10 ms of a 256 MiB-1 GiB restore here).
        """
        todo = sorted(set(paths) - set(self._data))
        if not todo and rest_of is None:
            return
        if self._remote is not None:
            self._remote.fetch(todo)
        plans = {path: self._plan(path) for path in todo}
        planned = [p[0] for p in plans.values() if p is not None]
        checks: list[tuple[FileRecord, reads.FileRead]] = []
        if rest_of is not None and self._checksums and self._remote is None:
            read = self.read_names() | {self._name(p) for p in todo}
            checks = [(rec, self._plan_check(rec)) for rec in self._unchecked(*rest_of, read)]
        try:
            reads.read_all(planned + [fr for _, fr in checks])
        except reads.ShortReadError as e:
            raise self._corrupt(e.path, "is shorter than its manifest records "
                                "(truncated while being read)") from e
        except FileNotFoundError as e:
            raise CorruptCheckpointError(
                f"checkpoint {self._dir!r} is incomplete: file {e.filename!r} is missing",
                checkpoint=self._dir, file=e.filename,
            ) from e
        for path, plan in plans.items():
            if plan is not None and plan[0].crc is not None:
                rec = self._record(path)
                if plan[0].crc != rec.crc:
                    raise self._corrupt(path, f"fails its {rec.mismatch(plan[0].crc)}")
        for rec, fr in checks:
            if fr.crc != rec.crc:
                raise self._corrupt(fr.path, f"fails its {rec.mismatch(fr.crc)}")
        self._checked.update(rec.name for rec, _ in checks)
        for path, plan in plans.items():
            self._data[path] = None if plan is None else plan[1]

    def wanted(self, item: str, params: set[str] | None) -> list[str]:
        """Names of the manifest's files a restore of these arrays of ``item`` relies on.

        ``item`` ``""``: the pytree is the checkpoint's root (a checkpointer's
        path), its arrays' directories are top-level. ``params`` None: every
        file of the item (its arrays share data files: OCDBT).
        """

        def wanted(name: str) -> bool:
            parts = name.split("/")
            if not item:
                return (len(parts) == 1 or params is None or parts[0] in params
                        or parts[0] == ARRAY_METADATAS)
            if len(parts) <= 2:  # step-level files and the item's own metadata files
                return len(parts) == 1 or parts[0] == item
            return parts[0] == item and (params is None or parts[1] in params
                                         or parts[1] == ARRAY_METADATAS)

        return [name for name in sorted(self._records) if wanted(name)]

    def names(self, paths: Iterable[str]) -> set[str]:
        """These files' names relative to the step, as the manifest spells them."""
        return {self._name(p) for p in paths}

    def read_names(self) -> set[str]:
        """Names (relative to the step) of the files read here so far."""
        return {self._name(p) for p in self._data}

    def check_the_rest(self, item: str, params: set[str] | None,
                       share: tuple[int, int] | None = None,
                       read_elsewhere: set[str] | frozenset[str] = frozenset()) -> None:
        """Checksums the files of the restored arrays not read here (other processes' chunks).

        Files of arrays not restored (and of other items) are not read: a
        partial restore reads only what it restores. With ``share``
        ``(index, count)``, of the files no process read (``read_elsewhere``:
        those other processes read and checked), only this process's share is
        checked: every ``count``-th in name order (the verdicts are then
        shared, see ``verified``). Without it every process checks them all.
        """
        if not self._checksums or not self._records:
            return
        rest = self._unchecked(item, params, self.read_names() | set(read_elsewhere))
        if share is not None:
            rest = rest[share[0]::share[1]]
        self._check_records(rest)

    def check_names(self, names: Iterable[str]) -> None:
        """Checksums these files (names relative to the step) unless checked already."""
        if not self._checksums:
            return
        self._check_records([self._records[n] for n in sorted(set(names))
                             if n in self._records and n not in self._checked
                             and self._records[n].crc is not None])

    def _check_records(self, rest: list[FileRecord]) -> None:
        if not rest:
            return
        if self._remote is not None:
            self._remote.fetch_names([rec.name for rec in rest])

        def check(rec: FileRecord) -> None:
            path = os.path.join(self._dir, *rec.name.split("/"))
            if self._checked_on_fetch(rec.name):
                return
            if (bad := rec.check(path)) is not None:
                raise CorruptCheckpointError(
                    f"checkpoint {self._dir!r} is corrupt: file {path!r} fails its "
                    f"{rec.mismatch(bad)}",
                    checkpoint=self._dir, file=path,
                )

        with ThreadPoolExecutor(min(_READERS, len(rest)),
                                thread_name_prefix="asyncckpt-verify") as pool:
            list(pool.map(check, rest))
        self._checked.update(rec.name for rec in rest)

    def _unchecked(self, item: str, params: set[str] | None, read: set[str]
                   ) -> list[FileRecord]:
        """Records of the files of these arrays not in ``read`` nor checked yet, with a CRC."""
        return [self._records[n] for n in self.wanted(item, params)
                if n not in read and n not in self._checked
                and self._records[n].crc is not None]

    def __call__(self, path: str) -> np.ndarray | None:
        """A chunk's bytes: prefetched, or read (and checked) now."""
        if path not in self._data:
            if self._values is not None:
                self.prefetch_values([path])
            else:
                self.prefetch([path])
        return self._data[path]
