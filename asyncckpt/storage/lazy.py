"""A committed remote directory checkpoint, fetched file by file as a restore reads it.

A JAX restore of a step only the remote tier holds needs the manifest, the
small metadata files and the chunk files of the arrays it restores (in a
multi-process run, plus its share of the other files it checks), not the
whole step. ``LazyStep`` opens such a step in a private cache directory:

* the manifest is read and checked against the commit marker's CRC32
  (zlib's, of the manifest object);
* one listing of the step's prefix checks that every file of the manifest is
  there with its recorded size (what a local restore checks on disk first);
* the metadata files (every file that is not an array chunk) are fetched;
* ``fetch(paths)`` then brings in the chunk files asked for, in parallel,
  each checked against the manifest (size, checksum in the record's
  algorithm) before it is renamed into place. Files already fetched are not
  fetched again; ``checked`` names those whose checksum was verified here,
  which a reader need not checksum a second time.

The cache directory is private to its owner (``TieredDirectory``), never a
manager's step directory: a partly fetched step is never listed or published
as a local checkpoint. The owner removes it on close.
"""

from __future__ import annotations

import os
import threading
import uuid
import zlib
from collections.abc import Iterable

from asyncckpt import layout
from asyncckpt._engine.files import FileRecord
from asyncckpt._engine.manifest import Manifest
from asyncckpt._threads import run_in_threads
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.storage.base import ObjectStore, RetryPolicy, retry_call
from asyncckpt.storage.protocol import THREADS, RemoteCheckpoint


def is_chunk(name: str) -> bool:
    """Whether a file of a step is array data (``item/param/0.0``), not metadata.

    In the OCDBT layout the data files are ``item/ocdbt.process_<i>/ocdbt_data/*``;
    the databases' manifests and B-tree nodes (``manifest.ocdbt``,
    ``ocdbt_meta/*``: small, and needed to list an item's arrays) are metadata,
    as is orbax's ``item/array_metadatas/process_<i>`` (a PRNG key's impl).
    """
    parts = name.split("/")
    if len(parts) < 3 or parts[-1].startswith(".") or parts[-1] == "manifest.ocdbt":
        return False
    return "ocdbt_meta" not in parts[1:-1] and parts[1] != "array_metadatas"


class LazyStep:
    """A remote directory checkpoint whose files are fetched when asked for.

    Args:
        store: The store holding it.
        remote: The committed checkpoint (its marker read by ``list_committed``).
        directory: Where to put it: a new directory, private to the caller.
        retry: Backoff and deadline per object.
        concurrency: Files fetched at once.
        checksums: Check each fetched file's checksum (sizes are checked always).

    Raises:
        CorruptCheckpointError: the manifest does not match the marker, a
            file is missing or has another size than recorded, or a metadata
            file fails its check.
    """

    def __init__(self, store: ObjectStore, remote: RemoteCheckpoint, directory: str, *,
                 retry: RetryPolicy, concurrency: int = 4, checksums: bool = True):
        self.store = store
        self.remote = remote
        self.path = directory
        self._retry = retry
        self._concurrency = concurrency
        self._checksums = checksums
        self._where = f"{store.url}/{remote.root_key}"
        self._lock = threading.Lock()
        self._fetched: set[str] = set()
        self.checked: set[str] = set()  # fetched files whose checksum matched
        self.fetched_bytes = 0
        manifest_bytes = self._call(lambda: store.get(remote.manifest_key),
                                    f"read {remote.manifest_key}")
        if zlib.crc32(manifest_bytes) != remote.manifest_crc32:
            where = f"{store.url}/{remote.manifest_key}"
            raise CorruptCheckpointError(f"{where} does not match its commit marker (CRC32)",
                                         checkpoint=where, file=where)
        manifest = Manifest.from_json(manifest_bytes.decode("utf-8", "replace"),
                                      path=f"{store.url}/{remote.manifest_key}")
        self.records = {r.name: r for r in manifest.files}
        listed = {o.key[len(remote.root_key):]: o.size
                  for o in self._call(lambda: store.list(remote.root_key),
                                      f"list {remote.root_key}")}
        for rec in manifest.files:
            size = listed.get(rec.name)
            if size != rec.size:
                what = "is missing" if size is None else (
                    f"has {size} bytes, the manifest records {rec.size}")
                raise CorruptCheckpointError(
                    f"checkpoint {self._where!r} is {'incomplete' if size is None else 'corrupt'}"
                    f": file {rec.name!r} {what}", checkpoint=self._where, file=rec.name)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, layout.JAX_MANIFEST_NAME), "wb") as f:
            f.write(manifest_bytes)
        self.fetch_names([n for n in self.records if not is_chunk(n)])

    def _call(self, fn, what: str):
        return retry_call(fn, what=f"{what} ({self.store.url})", policy=self._retry)

    def fetch(self, paths: Iterable[str]) -> None:
        """Fetches these files of the step (paths under ``self.path``) unless here already.

        Paths the manifest does not list are left alone (a reader then finds
        them missing, as it would locally).
        """
        names = []
        for p in paths:
            rel = os.path.relpath(p, self.path)
            if not rel.startswith(".."):
                names.append(rel.replace(os.sep, "/"))
        self.fetch_names(names)

    def fetch_all(self) -> None:
        """Fetches every file (a restore handed to orbax reads them all)."""
        self.fetch_names(list(self.records))

    def fetch_names(self, names: Iterable[str]) -> None:
        """``fetch`` by names relative to the step."""
        with self._lock:
            todo = sorted({n for n in names if n in self.records} - self._fetched,
                          key=lambda n: -self.records[n].size)
        run_in_threads(self._fetch_one, todo, self._concurrency, name=THREADS)

    def _fetch_one(self, name: str) -> None:
        rec: FileRecord = self.records[name]
        dest = os.path.join(self.path, *name.split("/"))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        tmp = f"{dest}.fetch-{uuid.uuid4().hex[:8]}"
        key = self.remote.root_key + name
        try:
            self._call(lambda: self.store.get_file(key, tmp), f"download {key}")
            size = os.path.getsize(tmp)
            if size != rec.size:
                raise CorruptCheckpointError(
                    f"checkpoint {self._where!r} is corrupt: file {name!r} has {size} bytes, "
                    f"the manifest records {rec.size}", checkpoint=self._where, file=name)
            checked = self._checksums and rec.crc is not None
            if checked and (bad := rec.check(tmp)) is not None:
                raise CorruptCheckpointError(
                    f"checkpoint {self._where!r} is corrupt: file {name!r} fails its "
                    f"{rec.mismatch(bad)}", checkpoint=self._where, file=name)
            os.replace(tmp, dest)
        finally:
            if os.path.lexists(tmp):
                os.unlink(tmp)
        with self._lock:
            self._fetched.add(name)
            if checked:
                self.checked.add(name)
            self.fetched_bytes += rec.size


__all__ = ["LazyStep", "is_chunk"]
