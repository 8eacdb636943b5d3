"""Local-disk implementation of the storage interface (a directory as a bucket)."""

from __future__ import annotations

import os
import shutil
import uuid

from asyncckpt._engine.files import fsync_path
from asyncckpt.storage.base import AlreadyExistsError, ObjectInfo, ObjectStore

_TMP = ".asyncckpt-obj-tmp-"


class LocalObjectStore(ObjectStore):
    """Objects as files under ``root``; puts are atomic (temporary file, fsync, rename).

    Args:
        root: The directory (created on the first put).
        fsync: Whether puts are flushed to stable storage.
    """

    def __init__(self, root: str, *, fsync: bool = True):
        self.root = os.path.abspath(root)
        self.url = self.root
        self._fsync = fsync

    def _path(self, key: str) -> str:
        parts = [p for p in key.split("/") if p]
        if not parts or any(p in (".", "..") for p in parts):
            raise ValueError(f"invalid object key {key!r}")
        return os.path.join(self.root, *parts)

    def _publish(self, tmp: str, final: str, *, create_only: bool) -> None:
        try:
            if create_only:
                try:
                    os.link(tmp, final)  # fails if final exists: a create-only publish
                except FileExistsError:
                    raise AlreadyExistsError(f"{final} already exists") from None
                os.unlink(tmp)
            else:
                os.replace(tmp, final)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        if self._fsync:
            fsync_path(os.path.dirname(final))

    def _tmp_for(self, final: str) -> str:
        parent = os.path.dirname(final)
        os.makedirs(parent, exist_ok=True)
        return os.path.join(parent, f"{_TMP}{uuid.uuid4().hex[:12]}")

    def put(self, key: str, data: bytes | memoryview, *, create_only: bool = False) -> None:
        final = self._path(key)
        if create_only and os.path.lexists(final):
            raise AlreadyExistsError(f"{final} already exists")
        tmp = self._tmp_for(final)
        with open(tmp, "wb") as f:
            f.write(data)
            if self._fsync:
                f.flush()
                os.fsync(f.fileno())
        self._publish(tmp, final, create_only=create_only)

    def put_file(self, key: str, path: str) -> None:
        final = self._path(key)
        tmp = self._tmp_for(final)
        shutil.copyfile(path, tmp)
        if self._fsync:
            fsync_path(tmp)
        self._publish(tmp, final, create_only=False)

    def get_range(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        with open(self._path(key), "rb") as f:
            f.seek(start)
            return f.read() if end is None else f.read(max(0, end - start))

    def get_file(self, key: str, path: str) -> int:
        shutil.copyfile(self._path(key), path)
        return os.path.getsize(path)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        out = []
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith(_TMP):
                    continue
                full = os.path.join(dirpath, name)
                key = os.path.relpath(full, self.root).replace(os.sep, "/")
                if key.startswith(prefix):
                    try:
                        out.append(ObjectInfo(key, os.path.getsize(full)))
                    except FileNotFoundError:
                        continue  # deleted while listing
        return sorted(out, key=lambda o: o.key)

    def delete(self, keys: list[str]) -> None:
        parents = set()
        for key in keys:
            path = self._path(key)
            try:
                os.unlink(path)
                parents.add(os.path.dirname(path))
            except FileNotFoundError:
                pass
        for parent in sorted(parents, key=len, reverse=True):
            while parent != self.root and parent.startswith(self.root):
                try:
                    os.rmdir(parent)  # only empty directories go
                except OSError:
                    break
                parent = os.path.dirname(parent)
