"""Committing a checkpoint to an object store without rename, and reading it back.

Object stores have no atomic directory rename, so a checkpoint is published
by the last object written. Upload order:

1. every data file of the locally committed checkpoint (in parallel; large
   files as multipart uploads), each retried with backoff within a deadline;
2. the asyncckpt manifest (names, sizes, CRC32s), unchanged;
3. verification: one listing must show every file with its recorded size and
   the manifest object must read back byte for byte;
4. the commit marker, written create-only (S3 ``If-None-Match: *``, GCS
   ``ifGenerationMatch=0``); it names the manifest and carries its CRC32;
5. JAX only: orbax's own marker, ``commit_success.txt``.

A checkpoint without a valid marker (one whose manifest is present with the
recorded size) is invisible to ``list_committed`` and so to restore; its
objects are removed by ``delete_uncommitted``. The protocol never relies on
the create-only condition for safety: the marker goes up only after step 3,
so even where a server ignores the condition (fake-gcs-server) no partial
checkpoint is published, and a racing duplicate marker has the same content
(it is derived from the manifest), so overwriting it changes nothing.

Remote layout mirrors the local one: TensorFlow ``ckpt-10.index``,
``ckpt-10.data-*``, ``ckpt-10.asyncckpt-manifest.json`` and the marker
``ckpt-10.asyncckpt-commit.json``; JAX ``10/...`` with
``10/asyncckpt.commit.json`` and ``10/commit_success.txt``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from asyncckpt import layout
from asyncckpt._engine import commit as commit_lib
from asyncckpt._engine.files import FileRecord
from asyncckpt._engine.manifest import Manifest, verify_files
from asyncckpt._threads import run_in_threads
from asyncckpt.catalog import CheckpointInfo
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.storage.base import (
    AlreadyExistsError,
    ObjectInfo,
    ObjectStore,
    RetryPolicy,
    StorageError,
    retry_call,
)

logger = logging.getLogger(__name__)

#: Name of the threads that move a checkpoint's files.
THREADS = "asyncckpt-storage"

TF_MARKER_SUFFIX = ".asyncckpt-commit.json"
JAX_MARKER_NAME = "asyncckpt.commit.json"
ORBAX_COMMIT_NAME = "commit_success.txt"
MARKER_FORMAT = 1

# JAX step directories: the plain step, or orbax's prefixed / fixed-length names
# (``ckpt_000012``); the step is the trailing number.
_JAX_NAME = re.compile(r"^(?:[^/]*_)?(\d+)$")
_TF_NAME = re.compile(r"^([^/]+?)\.(index|data-\d+-of-\d+|asyncckpt-manifest\.json|"
                      r"asyncckpt-commit\.json)$")


@dataclass(frozen=True, kw_only=True)
class RemoteCheckpoint:
    """A committed checkpoint in an object store.

    Attributes:
        name: ``ckpt-10`` (TensorFlow prefix basename) or ``10`` (JAX step).
        framework: ``"tensorflow"``, ``"jax"`` or ``"arrays"`` (a directory
            checkpoint of ``asyncckpt.jobrunner.store.ArrayStore``).
        step: The step, when the name carries one.
        manifest_crc32: CRC32 of the manifest object, from the marker.
        nbytes: Bytes of data the manifest lists.
        committed: When the marker was written (``time.time()``).
    """

    name: str
    framework: str
    step: int | None
    manifest_crc32: int
    nbytes: int
    committed: float

    @property
    def root_key(self) -> str:
        """Key prefix the manifest's file names are relative to."""
        return _root_key(self.framework, self.name)

    @property
    def manifest_key(self) -> str:
        return _manifest_key(self.framework, self.name)

    @property
    def marker_key(self) -> str:
        return _marker_key(self.framework, self.name)


def _is_dir(framework: str) -> bool:
    """Directory checkpoints (``jax``, ``arrays``) share one remote layout: ``<step>/...``."""
    return framework != "tensorflow"


def _manifest_key(framework: str, name: str) -> str:
    if _is_dir(framework):
        return f"{name}/{layout.JAX_MANIFEST_NAME}"
    return name + layout.TF_MANIFEST_SUFFIX


def _marker_key(framework: str, name: str) -> str:
    return f"{name}/{JAX_MARKER_NAME}" if _is_dir(framework) else name + TF_MARKER_SUFFIX


def _root_key(framework: str, name: str) -> str:
    return f"{name}/" if _is_dir(framework) else ""


def _read_marker(store: ObjectStore, key: str) -> dict:
    body = json.loads(store.get(key))
    if body.get("format", 0) > MARKER_FORMAT:
        raise ValueError(f"commit marker format {body['format']} is newer than this asyncckpt")
    return body


def upload_files(
    store: ObjectStore,
    root_key: str,
    directory: str,
    records: Sequence[FileRecord],
    *,
    retry: RetryPolicy,
    concurrency: int = 4,
) -> None:
    """Uploads files of a checkpoint staged in ``directory`` under ``root_key``.

    One process's share of a multi-process save: its own files, named as in
    the manifest (``records``), largest first. Publishes nothing; the commit
    is ``upload_checkpoint``'s, once every process's files are checked.

    Raises:
        StorageError: an upload failed past its deadline.
        OSError: a permanent error (a missing local file, access denied).
    """

    def put_one(rec: FileRecord) -> None:
        key = root_key + rec.name
        path = os.path.join(directory, *rec.name.split("/"))
        retry_call(lambda: store.put_file(key, path), what=f"upload {key} ({store.url})",
                   policy=retry)

    run_in_threads(put_one, sorted(records, key=lambda r: -r.size), concurrency, name=THREADS)


def download_files(
    store: ObjectStore,
    root_key: str,
    directory: str,
    records: Sequence[FileRecord],
    *,
    retry: RetryPolicy,
    concurrency: int = 4,
) -> None:
    """Downloads these files of a checkpoint (under ``root_key``) into ``directory``.

    Each file's size is checked against its record (a short object raises).

    Raises:
        StorageError: a download failed past its deadline, or a size differs.
        FileNotFoundError: an object is missing.
    """

    def get_one(rec: FileRecord) -> None:
        key = root_key + rec.name
        path = os.path.join(directory, *rec.name.split("/"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        retry_call(lambda: store.get_file(key, path), what=f"download {key} ({store.url})",
                   policy=retry)
        if (size := os.path.getsize(path)) != rec.size:
            raise StorageError(f"{store.url}: {key} has {size} bytes, {rec.size} were uploaded")

    run_in_threads(get_one, list(records), concurrency, name=THREADS)


def check_objects(
    store: ObjectStore,
    root_key: str,
    records: Sequence[FileRecord],
    *,
    retry: RetryPolicy,
) -> None:
    """Checks with one listing that every record's object exists with its size.

    Raises:
        StorageError: naming every missing or wrong-size object.
    """
    listed = {o.key: o.size for o in retry_call(
        lambda: store.list(root_key), what=f"list {root_key} ({store.url})", policy=retry)}
    bad = []
    for rec in sorted(records, key=lambda r: r.name):
        size = listed.get(root_key + rec.name)
        if size != rec.size:
            bad.append(f"{root_key}{rec.name} ("
                       + ("missing" if size is None else f"{size} bytes") + f", expected "
                       f"{rec.size})")
    if bad:
        shown = ", ".join(bad[:20]) + (f" and {len(bad) - 20} more" if len(bad) > 20 else "")
        raise StorageError(f"{store.url}: {len(bad)} object(s) of the checkpoint are missing or "
                           f"have the wrong size: {shown}; it is not committed")


def upload_checkpoint(
    store: ObjectStore,
    info: CheckpointInfo,
    *,
    retry: RetryPolicy,
    concurrency: int = 4,
    should_stop: Callable[[], bool] | None = None,
    data_uploaded: bool = False,
) -> RemoteCheckpoint:
    """Commits a locally committed checkpoint to ``store`` (see the module docstring).

    Idempotent: a checkpoint already committed there with the same manifest
    is left as it is.

    Args:
        store: Destination.
        info: The local checkpoint (its files must not change during the upload).
        retry: Backoff and deadline for each object.
        concurrency: Files uploaded at once.
        should_stop: Checked between retries; True gives up early.
        data_uploaded: The data files are in the store already (a multi-process
            save: each process uploaded its own, and the local checkpoint holds
            only this process's); only the manifest goes up, after the same
            verification of every file's size, then the markers.

    Raises:
        StorageError: an upload failed past its deadline, or the verification
            found a missing or short object (then no marker is written).
        CorruptCheckpointError: the local checkpoint has no readable manifest.
    """
    fw, name = info.framework, info.name
    manifest_bytes = open(info.manifest_path, "rb").read()  # noqa: SIM115 (read at once)
    manifest = Manifest.from_json(manifest_bytes.decode("utf-8", "replace"),
                                  path=info.manifest_path)
    crc = zlib.crc32(manifest_bytes)
    root = _root_key(fw, name)
    marker_key = _marker_key(fw, name)

    def call(fn, what):
        return retry_call(fn, what=f"{what} ({store.url})", policy=retry, should_stop=should_stop)

    try:
        existing = call(lambda: _read_marker(store, marker_key), f"read {marker_key}")
        if existing.get("manifest_crc32") == crc:
            logger.info("%s is already committed in %s", name, store.url)
            return _remote_from_marker(fw, name, existing)
        raise StorageError(
            f"{store.url}: checkpoint {name} is already committed with a different manifest; "
            f"refusing to overwrite it"
        )
    except FileNotFoundError:
        pass
    except (ValueError, KeyError) as e:
        raise StorageError(f"{store.url}: the commit marker of {name} is unreadable: {e}") from e

    start = time.monotonic()

    def put_one(rec) -> None:
        path = os.path.join(info.root, *rec.name.split("/"))
        call(lambda: store.put_file(root + rec.name, path), f"upload {root + rec.name}")

    if not data_uploaded:
        # Largest first, so the long multipart uploads overlap the small files.
        run_in_threads(put_one, sorted(manifest.files, key=lambda r: -r.size), concurrency,
                       name=THREADS)
    manifest_key = _manifest_key(fw, name)
    call(lambda: store.put(manifest_key, manifest_bytes), f"upload {manifest_key}")

    # Verify before publishing: never rely on the server's create-only condition.
    listed = {o.key: o.size for o in call(lambda: store.list(root or name), f"list {name}")}
    expected = {root + r.name: r.size for r in manifest.files}
    expected[manifest_key] = len(manifest_bytes)
    for key, size in expected.items():
        if listed.get(key) != size:
            raise StorageError(
                f"{store.url}: after upload, {key} has {listed.get(key)} bytes, expected {size}; "
                f"checkpoint {name} is not committed"
            )
    if call(lambda: store.get(manifest_key), f"read back {manifest_key}") != manifest_bytes:
        raise StorageError(f"{store.url}: manifest of {name} reads back different; not committed")

    marker = {
        "format": MARKER_FORMAT,
        "name": name,
        "framework": fw,
        "step": info.step,
        "manifest_crc32": crc,
        "manifest_size": len(manifest_bytes),
        "nbytes": manifest.nbytes,
        "files": len(manifest.files),
        "committed": time.time(),
    }
    data = json.dumps(marker, sort_keys=True).encode()
    try:
        call(lambda: store.put(marker_key, data, create_only=True), f"commit {marker_key}")
    except AlreadyExistsError:
        # A racing writer (or our own retry whose first try did land) committed it.
        other = _read_marker(store, marker_key)
        if other.get("manifest_crc32") != crc:
            raise StorageError(
                f"{store.url}: checkpoint {name} was committed concurrently with a different "
                f"manifest") from None
        marker = other
    if fw == "jax":
        text = f"Checkpoint commit was successful to {store.url}/{name}".encode()
        call(lambda: store.put(root + ORBAX_COMMIT_NAME, text), f"upload orbax marker of {name}")
    logger.info("committed %s to %s: %d files, %.1f MiB in %.2f s", name, store.url,
                len(manifest.files), manifest.nbytes / 2**20, time.monotonic() - start)
    return _remote_from_marker(fw, name, marker)


def _remote_from_marker(framework: str, name: str, marker: dict) -> RemoteCheckpoint:
    if _is_dir(framework) and _is_dir(marker.get("framework", framework)):
        framework = marker.get("framework", framework)  # "arrays", or "jax" (also older uploads)
    return RemoteCheckpoint(
        name=name,
        framework=framework,
        step=marker.get("step"),
        manifest_crc32=int(marker["manifest_crc32"]),
        nbytes=int(marker.get("nbytes", 0)),
        committed=float(marker.get("committed", 0.0)),
    )


def _jax_step_of(name: str) -> int | None:
    m = _JAX_NAME.match(name)
    return int(m.group(1)) if m else None


def _group_of(key: str) -> tuple[str, str] | None:
    """``(framework, name)`` of the checkpoint an object belongs to, if any."""
    head, sep, _rest = key.partition("/")
    if sep:
        return ("jax", head) if _JAX_NAME.match(head) else None
    m = _TF_NAME.match(key)
    return ("tensorflow", m.group(1)) if m else None


def list_committed(store: ObjectStore, *, objects: list[ObjectInfo] | None = None
                   ) -> list[RemoteCheckpoint]:
    """Committed checkpoints in ``store``, ordered by step then name.

    A checkpoint is listed only if its marker parses and its manifest object
    is present with the size the marker records.
    """
    objects = store.list() if objects is None else objects
    sizes = {o.key: o.size for o in objects}
    found = []
    for key in sizes:
        group = _group_of(key)
        if group is None or key != _marker_key(*group):
            continue
        fw, name = group
        try:
            marker = _read_marker(store, key)
            if sizes.get(_manifest_key(fw, name)) != marker["manifest_size"]:
                raise ValueError("its manifest is missing or has another size")
            found.append(_remote_from_marker(fw, name, marker))
        except FileNotFoundError:
            continue  # deleted while listing
        except (ValueError, KeyError, TypeError) as e:
            logger.warning("%s: ignoring checkpoint %s: invalid commit marker (%s)",
                           store.url, name, e)
    found.sort(key=lambda c: (c.step if c.step is not None else -1, c.name))
    return found


def download_checkpoint(
    store: ObjectStore,
    remote: RemoteCheckpoint,
    directory: str,
    *,
    retry: RetryPolicy,
    concurrency: int = 4,
    checksums: bool = True,
) -> None:
    """Downloads one committed checkpoint into a local manager directory.

    Only that checkpoint's objects are read. Files land in a temporary
    directory, are checked against the manifest (sizes, and CRC32s unless
    ``checksums`` is false), and are published like a local save: a JAX step
    directory by one rename, TensorFlow files with the ``.index`` last.

    Raises:
        CorruptCheckpointError: the manifest does not match the marker, or a
            downloaded file does not match the manifest.
        StorageError: a download failed past its deadline.
    """

    def call(fn, what):
        return retry_call(fn, what=f"{what} ({store.url})", policy=retry)

    manifest_bytes = call(lambda: store.get(remote.manifest_key), f"read {remote.manifest_key}")
    where = f"{store.url}/{remote.manifest_key}"
    if zlib.crc32(manifest_bytes) != remote.manifest_crc32:
        raise CorruptCheckpointError(
            f"{where} does not match its commit marker (CRC32)", checkpoint=where, file=where)
    manifest = Manifest.from_json(manifest_bytes.decode("utf-8", "replace"), path=where)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f"{commit_lib.TEMP_PREFIX}download-{remote.name}-"
                                  f"{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        def get_one(rec) -> None:
            dest = os.path.join(tmp, *rec.name.split("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            call(lambda: store.get_file(remote.root_key + rec.name, dest),
                 f"download {remote.root_key + rec.name}")

        run_in_threads(get_one, sorted(manifest.files, key=lambda r: -r.size), concurrency,
                       name=THREADS)
        verify_files(tmp, manifest.files, checksums=checksums, checkpoint=where)
        manifest_name = os.path.basename(remote.manifest_key)
        with open(os.path.join(tmp, manifest_name), "wb") as f:
            f.write(manifest_bytes)
        if _is_dir(remote.framework):
            final = os.path.join(directory, remote.name)
            try:
                if os.path.lexists(final):
                    raise FileExistsError(f"{final} exists already")
                os.rename(tmp, final)
            except OSError:
                # Processes sharing a directory may all fetch a step: one
                # publishes it, the others find the same manifest there.
                if not _same_bytes(os.path.join(final, manifest_name), manifest_bytes):
                    raise
                logger.info("%s was downloaded by another process meanwhile", final)
                return
            tmp = None
            return
        index = remote.name + layout.TF_INDEX_SUFFIX
        for entry in sorted(os.listdir(tmp), key=lambda n: n == index):  # .index last
            os.replace(os.path.join(tmp, entry), os.path.join(directory, entry))
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _same_bytes(path: str, data: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read() == data
    except OSError:
        return False


def delete_checkpoint(store: ObjectStore, remote: RemoteCheckpoint, *,
                      objects: list[ObjectInfo] | None = None) -> None:
    """Deletes a remote checkpoint: its markers first, so it is never listed half-deleted."""
    store.delete([remote.marker_key] + (
        [remote.root_key + ORBAX_COMMIT_NAME] if remote.framework == "jax" else []))
    objects = store.list(remote.root_key or remote.name) if objects is None else objects
    group = ("jax" if _is_dir(remote.framework) else "tensorflow", remote.name)
    store.delete([o.key for o in objects if _group_of(o.key) == group])


def delete_uncommitted(store: ObjectStore, *, older_than_step: int,
                       objects: list[ObjectInfo] | None = None) -> list[str]:
    """Removes objects of checkpoints that have no commit marker (interrupted uploads).

    Only checkpoints with a step below ``older_than_step`` are touched, so an
    upload of a newer step in progress elsewhere is left alone. Returns the
    names of the checkpoints removed.
    """
    objects = store.list() if objects is None else objects
    groups: dict[tuple[str, str], list[str]] = {}
    for o in objects:
        g = _group_of(o.key)
        if g is not None:
            groups.setdefault(g, []).append(o.key)
    removed = []
    for (fw, name), keys in groups.items():
        step = _jax_step_of(name) if fw == "jax" else layout.tf_step_of(name)
        if step is None or step >= older_than_step or _marker_key(fw, name) in keys:
            continue
        store.delete(keys)
        removed.append(name)
    if removed:
        logger.info("%s: removed uncommitted checkpoint(s) %s", store.url, ", ".join(removed))
    return removed


def local_info(directory: str, name: str) -> CheckpointInfo:
    """The catalog entry of a locally committed checkpoint, by name."""
    from asyncckpt import catalog

    for c in catalog.list_checkpoints(directory):
        if c.name == name:
            if not os.path.isfile(c.manifest_path):
                raise CorruptCheckpointError(
                    f"{c.path} has no asyncckpt manifest; it cannot be uploaded",
                    checkpoint=c.path, file=c.manifest_path)
            return c
    raise FileNotFoundError(f"no committed checkpoint {name!r} in {directory!r}")


__all__ = [
    "RemoteCheckpoint",
    "check_objects",
    "delete_checkpoint",
    "delete_uncommitted",
    "download_checkpoint",
    "list_committed",
    "local_info",
    "upload_checkpoint",
    "upload_files",
]
