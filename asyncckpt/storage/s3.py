"""S3 implementation of the storage interface, on ``obstore`` (Rust ``object_store``).

Endpoint and credentials come from the standard environment (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``,
``AWS_ALLOW_HTTP=true`` for a plain-HTTP server) or the usual AWS profile
chain. Create-only puts send ``If-None-Match: *``. Large files go up as
multipart uploads with parts sent in parallel; a multipart upload left by a
killed writer is found and aborted through ``botocore`` (when installed).
"""

from __future__ import annotations

import datetime
import logging
import os
import pathlib
import threading

from asyncckpt._threads import lower_thread_priority
from asyncckpt.storage.base import AlreadyExistsError, ObjectInfo, ObjectStore

logger = logging.getLogger(__name__)


_RUNTIME_STARTED = False
_RUNTIME_LOCK = threading.Lock()


def _start_runtime_niced(obs, nice: int) -> None:
    """Starts obstore's Rust runtime (its worker threads move every byte) at a lower priority.

    Linux threads inherit the niceness of the thread that creates them, so the
    runtime is created by a first, local call from a short-lived niced thread;
    uploads then yield the cores to the training thread (as gcsfs's IO thread
    does). No effect if this process has used obstore already.
    """
    global _RUNTIME_STARTED
    with _RUNTIME_LOCK:
        if _RUNTIME_STARTED:
            return
        _RUNTIME_STARTED = True

        def start() -> None:
            from obstore.store import MemoryStore

            lower_thread_priority(nice)
            obs.put(MemoryStore(), "runtime-start", b"")

        t = threading.Thread(target=start, name="asyncckpt-obstore-start")
        t.start()
        t.join()


def _import_obstore():
    try:
        import obstore
        from obstore.store import S3Store
    except ImportError as e:
        raise ImportError("s3:// checkpoints need obstore: pip install 'asyncckpt[storage]'") from e
    return obstore, S3Store


class S3ObjectStore(ObjectStore):
    """Objects under ``s3://bucket/prefix``.

    Args:
        bucket: Bucket name.
        prefix: Key prefix (no leading or trailing ``/``).
        part_size: Multipart part size in bytes.
        max_concurrency: Parts of one file in flight at once.
        nice: Niceness of obstore's runtime threads, if this starts them.
    """

    def __init__(self, bucket: str, prefix: str, *, part_size: int = 16 << 20,
                 max_concurrency: int = 8, nice: int = 10):
        obs, S3Store = _import_obstore()
        _start_runtime_niced(obs, nice)
        self._obs = obs
        self.bucket = bucket
        self.prefix = prefix
        self.url = f"s3://{bucket}/{prefix}".rstrip("/")
        self._part_size = part_size
        self._client = None
        self._client_lock = threading.Lock()
        self._concurrency = max_concurrency
        # Everything else (endpoint, keys, region, allow-http) from the environment.
        options = {}
        if os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("1", "true"):
            options["allow_http"] = True
        # A few quick client-side retries; the deadline-bound retries are ours (base.retry_call).
        retry = {"max_retries": 2, "retry_timeout": datetime.timedelta(seconds=20),
                 "backoff": {"init_backoff": datetime.timedelta(milliseconds=100),
                             "max_backoff": datetime.timedelta(seconds=1), "base": 2}}
        self._store = S3Store(bucket, prefix=prefix or None, client_options=options or None,
                              retry_config=retry)

    def _full(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def put(self, key: str, data: bytes | memoryview, *, create_only: bool = False) -> None:
        try:
            self._obs.put(self._store, key, data, mode="create" if create_only else "overwrite",
                          use_multipart=False)
        except self._obs.exceptions.AlreadyExistsError as e:
            raise AlreadyExistsError(f"{self.url}/{key} already exists") from e
        except self._obs.exceptions.PreconditionError as e:
            raise AlreadyExistsError(f"{self.url}/{key} already exists ({e})") from e

    def put_file(self, key: str, path: str) -> None:
        size = os.path.getsize(path)
        # A Path, not a file object: obstore then reads the file in Rust, without taking
        # the GIL for every chunk from the training thread.
        self._obs.put(self._store, key, pathlib.Path(path), use_multipart=size > self._part_size,
                      chunk_size=self._part_size, max_concurrency=self._concurrency)

    def get_range(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        if start == 0 and end is None:
            return bytes(self._obs.get(self._store, key).bytes())
        if end is None:
            end = self._obs.head(self._store, key)["size"]
        if end <= start:
            return b""
        return bytes(self._obs.get_range(self._store, key, start=start, end=end))

    def get_file(self, key: str, path: str) -> int:
        n = 0
        with open(path, "wb") as f:
            for chunk in self._obs.get(self._store, key).stream(min_chunk_size=8 << 20):
                f.write(chunk)
                n += len(chunk)
        return n

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        # object_store lists by path segments: list the enclosing "directory", then filter.
        directory = prefix.rpartition("/")[0]
        out = []
        for batch in self._obs.list(self._store, prefix=directory or None):
            out.extend(ObjectInfo(m["path"], int(m["size"])) for m in batch
                       if m["path"].startswith(prefix))
        return sorted(out, key=lambda o: o.key)

    def delete(self, keys: list[str]) -> None:
        if keys:
            self._obs.delete(self._store, keys)

    def _botocore_client(self, session_module):
        # Made once per store: building a botocore client is ~0.2-0.3 s of Python under the
        # GIL, which the training thread would wait through after every upload.
        with self._client_lock:
            if self._client is None:
                self._client = session_module.get_session().create_client("s3")
            return self._client

    def abort_incomplete_uploads(self, *, older_than_s: float = 0.0) -> int:
        """Aborts multipart uploads under the prefix started more than ``older_than_s`` ago."""
        try:
            import botocore.session
        except ImportError:
            logger.debug("botocore not installed: orphaned multipart uploads are not aborted")
            return 0
        client = self._botocore_client(botocore.session)
        cutoff = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=older_than_s)
        n = 0
        kwargs = {"Bucket": self.bucket, "Prefix": self.prefix}
        while True:
            page = client.list_multipart_uploads(**kwargs)
            for up in page.get("Uploads", []):
                if up["Initiated"] <= cutoff:
                    client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"],
                                                  UploadId=up["UploadId"])
                    n += 1
            if not page.get("IsTruncated"):
                break
            kwargs["KeyMarker"] = page["NextKeyMarker"]
            kwargs["UploadIdMarker"] = page["NextUploadIdMarker"]
        if n:
            logger.info("aborted %d orphaned multipart upload(s) under %s", n, self.url)
        return n
