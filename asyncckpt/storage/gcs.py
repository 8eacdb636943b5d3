"""GCS implementation of the storage interface, on ``gcsfs`` (the JSON API).

An emulator is reached through ``STORAGE_EMULATOR_HOST`` (then no credentials
are used); otherwise the usual Google credentials (application default
credentials, ``GOOGLE_APPLICATION_CREDENTIALS``, the metadata server).
Create-only puts send ``ifGenerationMatch=0``. Large files go up as resumable
uploads in parts; GCS discards an unfinished resumable upload by itself after
a week, so there is nothing to abort.
"""

from __future__ import annotations

import contextlib
import os
import threading

from asyncckpt.engine.writer import lower_thread_priority
from asyncckpt.storage.base import AlreadyExistsError, ObjectInfo, ObjectStore


def _start_io_thread_niced(nice: int) -> None:
    """Starts fsspec's IO thread (gcsfs runs every request on it) at a lower priority.

    Linux threads inherit the niceness of the thread that creates them, so the
    loop is created from a short-lived niced thread; the uploads' Python work
    then yields the cores to training. No effect if the loop already runs.
    """
    import fsspec.asyn

    if fsspec.asyn.loop[0] is not None:
        return

    def start() -> None:
        lower_thread_priority(nice)
        fsspec.asyn.get_loop()

    t = threading.Thread(target=start, name="asyncckpt-fsspec-start")
    t.start()
    t.join()


def _gcsfs_class():
    try:
        # The plain file system: the "extended" default probes a gRPC endpoint for a minute
        # before it falls back to the JSON API on anything but real GCS.
        from gcsfs.core import GCSFileSystem
    except ImportError as e:
        raise ImportError("gs:// checkpoints need gcsfs: pip install 'asyncckpt[storage]'") from e
    return GCSFileSystem


class GCSObjectStore(ObjectStore):
    """Objects under ``gs://bucket/prefix``.

    Args:
        bucket: Bucket name.
        prefix: Key prefix (no leading or trailing ``/``).
        part_size: Resumable-upload chunk size in bytes.
        nice: Niceness of fsspec's IO thread, if this starts it.
    """

    def __init__(self, bucket: str, prefix: str, *, part_size: int = 16 << 20, nice: int = 10):
        cls = _gcsfs_class()
        _start_io_thread_niced(nice)
        self.bucket = bucket
        self.prefix = prefix
        self.url = f"gs://{bucket}/{prefix}".rstrip("/")
        self._part_size = part_size
        emulator = os.environ.get("STORAGE_EMULATOR_HOST")
        # fake-gcs-server does not honour ifGenerationMatch on every upload path.
        self.create_only_enforced = not emulator
        self._fs = cls(token="anon" if emulator else None, skip_instance_cache=True,
                       use_listings_cache=False)
        self._base = f"{bucket}/{prefix}".rstrip("/")

    def _path(self, key: str) -> str:
        return f"{self._base}/{key}"

    def put(self, key: str, data: bytes | memoryview, *, create_only: bool = False) -> None:
        try:
            self._fs.pipe_file(self._path(key), bytes(data),
                               mode="create" if create_only else "overwrite")
        except FileExistsError as e:
            raise AlreadyExistsError(f"{self.url}/{key} already exists") from e

    def put_file(self, key: str, path: str) -> None:
        self._fs.put_file(path, self._path(key), chunksize=self._part_size)

    def get_range(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        if end is not None and end <= start:
            return b""
        return self._fs.cat_file(self._path(key), start=start or None, end=end)

    def get_file(self, key: str, path: str) -> int:
        self._fs.get_file(self._path(key), path)
        return os.path.getsize(path)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        self._fs.invalidate_cache()
        try:
            found = self._fs.find(self._base, detail=True)
        except FileNotFoundError:
            return []
        out = []
        cut = len(self._base) + 1
        for path, info in found.items():
            if info.get("type") == "directory":
                continue
            key = path[cut:]
            if key.startswith(prefix):
                out.append(ObjectInfo(key, int(info["size"])))
        return sorted(out, key=lambda o: o.key)

    def delete(self, keys: list[str]) -> None:
        if not keys:
            return
        try:
            self._fs.rm([self._path(k) for k in keys])
        except FileNotFoundError:
            for k in keys:  # some were gone already: delete the rest one by one
                with contextlib.suppress(FileNotFoundError):
                    self._fs.rm_file(self._path(k))
