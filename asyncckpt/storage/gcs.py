"""GCS implementation of the storage interface, on ``gcsfs`` (the JSON API).

An emulator is reached through ``STORAGE_EMULATOR_HOST`` (then no credentials
are used); otherwise the usual Google credentials (application default
credentials, ``GOOGLE_APPLICATION_CREDENTIALS``, the metadata server).
Create-only puts send ``ifGenerationMatch=0``.

Large files (over ``composite_min_size``, 64 MiB by default: smaller ones fit
in one or two of gcsfs's 50 MiB chunks and gain nothing from parts, which
cost a compose and deletes) go up as parallel composite uploads: the file is cut into parts
of ``part_size`` bytes, the parts are uploaded at once as temporary objects
under ``_asyncckpt-parts/`` (at most ``parallel`` of them in flight per store,
so memory stays bounded), composed into the destination object (in rounds of
32, GCS's limit per compose), and deleted. gcsfs alone sends one file as one
resumable upload, its chunks one after the other. Parts left by a killed
writer are deleted by ``abort_incomplete_uploads``. Each gcsfs request is
tried once: the retries, their backoff and their deadline are the caller's
``RetryPolicy`` (gcsfs would otherwise retry a refused connection for half a
minute, whatever the deadline).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from asyncckpt._threads import lower_thread_priority
from asyncckpt.storage.base import AlreadyExistsError, ObjectInfo, ObjectStore

logger = logging.getLogger(__name__)

#: Key prefix (under the store's root) of the temporary parts of composite uploads.
PARTS_PREFIX = "_asyncckpt-parts/"
#: Most source objects one GCS compose request takes.
COMPOSE_LIMIT = 32


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
        from gcsfs.retry import retry_request
    except ImportError as e:
        raise ImportError("gs:// checkpoints need gcsfs: pip install 'asyncckpt[storage]'") from e

    class OneTryGCSFileSystem(GCSFileSystem):
        """gcsfs with one try per request: ``retry_call`` owns retries and deadlines."""

        _request = retry_request(retries=1)(GCSFileSystem._request.__wrapped__)
        _get_file_request = retry_request(retries=1)(
            GCSFileSystem._get_file_request.__wrapped__)

    return OneTryGCSFileSystem


class GCSObjectStore(ObjectStore):
    """Objects under ``gs://bucket/prefix``.

    Args:
        bucket: Bucket name.
        prefix: Key prefix (no leading or trailing ``/``).
        part_size: Part size of composite uploads (and chunk size of resumable ones).
        nice: Niceness of fsspec's IO thread, if this starts it.
        parallel: Parts in flight at once, over all files of this store; files
            of up to ``composite_min_size``, and every file when this is 0 or
            1, go up as one resumable upload each.
        composite_min_size: Smallest file sent as a composite upload.
    """

    def __init__(self, bucket: str, prefix: str, *, part_size: int = 16 << 20, nice: int = 10,
                 parallel: int = 8, composite_min_size: int = 64 << 20):
        cls = _gcsfs_class()
        _start_io_thread_niced(nice)
        self.bucket = bucket
        self.prefix = prefix
        self.url = f"gs://{bucket}/{prefix}".rstrip("/")
        self._part_size = part_size
        self._parallel = parallel
        self._composite_min = max(composite_min_size, part_size + 1)
        self._parts_pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
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
        size = os.path.getsize(path)
        if self._parallel <= 1 or size < self._composite_min:
            self._fs.put_file(path, self._path(key), chunksize=max(self._part_size, 50 << 20))
            return
        self._put_composite(key, path, size)

    def _pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._parts_pool is None:
                self._parts_pool = ThreadPoolExecutor(
                    self._parallel, thread_name_prefix="asyncckpt-gcs-part")
            return self._parts_pool

    def _put_composite(self, key: str, path: str, size: int) -> None:
        """Parallel composite upload: parts at once, then compose, then delete the parts."""
        tmp = f"{self._base}/{PARTS_PREFIX}{uuid.uuid4().hex}"
        part = self._part_size
        n = -(-size // part)

        def upload_part(i: int) -> str:
            dest = f"{tmp}/{i:06d}"
            with open(path, "rb") as f:
                data = os.pread(f.fileno(), part, i * part)
            # One request per part (a chunk size above the part size: a simple upload).
            self._fs.pipe_file(dest, data, chunksize=part + 1)
            return dest

        made: list[str] = []
        try:
            futures = [self._pool().submit(upload_part, i) for i in range(n)]
            try:
                sources = [f.result() for f in futures]
            finally:
                made += [f.result() for f in futures if not f.cancel() and f.exception() is None]
            level = 0
            while len(sources) > COMPOSE_LIMIT:  # compose in rounds of 32 (parts stay small)
                level += 1
                groups = [sources[j:j + COMPOSE_LIMIT]
                          for j in range(0, len(sources), COMPOSE_LIMIT)]
                sources = [f"{tmp}/c{level}-{j:06d}" for j in range(len(groups))]
                for dest, group in zip(sources, groups, strict=True):
                    self._fs.merge(dest, group)
                    made.append(dest)
            self._fs.merge(self._path(key), sources)
        finally:
            try:
                self._fs.rm(made)
            except Exception as e:  # abort_incomplete_uploads removes them later
                logger.warning("%s: could not delete the parts of %s: %s", self.url, key, e)

    def abort_incomplete_uploads(self, *, older_than_s: float = 0.0) -> int:
        """Deletes composite-upload parts older than ``older_than_s`` (left by killed writers)."""
        self._fs.invalidate_cache()
        try:
            found = self._fs.find(f"{self._base}/{PARTS_PREFIX}".rstrip("/"), detail=True)
        except FileNotFoundError:
            return 0
        now = time.time()
        old = []
        for p, info in found.items():
            stamp = info.get("updated") or info.get("timeCreated")
            if not stamp or info.get("type") == "directory":
                continue
            t = datetime.datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp()
            if now - t >= older_than_s:
                old.append(p)
        if old:
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm(old)
            logger.info("%s: deleted %d part(s) of interrupted uploads", self.url, len(old))
        return len({p.rsplit("/", 2)[-2] for p in old})

    def close(self) -> None:
        with self._pool_lock:
            pool, self._parts_pool = self._parts_pool, None
        if pool is not None:
            pool.shutdown(wait=True)

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
