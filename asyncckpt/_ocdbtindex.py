"""Where each key of an OCDBT database is, every file its B-tree names kept in the checkpoint.

An OCDBT database (orbax's layout, and asyncckpt's JAX default) is a
``manifest.ocdbt`` and B-tree nodes that refer to further nodes and to
values in data files, each by a path relative to the database's directory.
Those paths are input like any name in a checkpoint: ``OcdbtIndex`` reads
the tree through TensorStore's ``ocdbt.dump`` (the manifest, then the
nodes), and hands each path to a check before the node is read or the value
is used (``contained.check_name`` by default; a restore's check also wants
the file in the checkpoint's manifest). Framework-neutral: the JAX restore
reads the values it finds here, ``asyncckpt inspect`` the arrays' metadata.

TensorStore is imported when a database is read, not at import.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from asyncckpt._engine import contained
from asyncckpt.errors import CorruptCheckpointError

MANIFEST = "manifest.ocdbt"

# ``check(name, source)``: ``name`` (relative to the database's directory) was read
# from the file ``source``; raises ``CorruptCheckpointError`` if it must not be read.
Check = Callable[[str, str], None]


def location(text: str) -> tuple[str, int, int]:
    """``(file relative to the database, offset, length)`` of a node location or an indirect value.

    TensorStore spells both ``<kind>:<base path>:<relative path>:<offset>:<length>``.

    Raises:
        ValueError: not in that form.
    """
    ref, offset, length = text.rsplit(":", 2)
    base_path, _, relative = ref.split(":", 1)[1].partition(":")
    return base_path + relative, int(offset), int(length)


class OcdbtIndex:
    """Where each key of an OCDBT database is: its value inline, or a byte range of a file.

    Args:
        item_dir: The directory of the (root) database.
        checkpoint: For error messages.
        check: Called with every file the tree names (nodes and data files,
            relative to ``item_dir``) and the file naming it, before that
            file is read; default ``contained.check_name`` (inside
            ``item_dir``'s checkpoint).

    Raises:
        CorruptCheckpointError: the database cannot be read, or names a file
            ``check`` refuses.
    """

    def __init__(self, item_dir: str, *, checkpoint: str, check: Check | None = None):
        try:
            import tensorstore as ts
        except ImportError as e:  # pragma: no cover - a dependency of orbax and asyncckpt[jax]
            raise ImportError("OCDBT checkpoints need TensorStore: pip install tensorstore") from e
        self._dir = item_dir
        self._checkpoint = checkpoint
        self._check = check or self._inside
        self._entries: dict[str, bytes | tuple[str, int, int]] = {}
        manifest_path = os.path.join(item_dir, MANIFEST)
        try:
            base = ts.KvStore.open({"driver": "file", "path": item_dir.rstrip("/") + "/"}).result()
            manifest = ts.ocdbt.dump(base).result()
            for node in manifest.get("version_tree_nodes") or []:
                self._check(location(node)[0], manifest_path)
            versions = manifest.get("versions") or []
            root = (versions[-1].get("root") or {}).get("location") if versions else None
            if root:
                self._walk(ts, base, root, b"", manifest_path)
        except CorruptCheckpointError:
            raise
        except (ValueError, RuntimeError, KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(
                f"checkpoint {checkpoint!r}: the OCDBT database {item_dir!r} is unreadable: {e}",
                checkpoint=checkpoint, file=manifest_path) from e

    def _inside(self, name: str, source: str) -> None:
        contained.check_name(name, checkpoint=self._checkpoint, source=source)

    def _walk(self, ts: Any, base: Any, where: str, prefix: bytes, source: str) -> None:
        name = location(where)[0]
        self._check(name, source)  # before TensorStore reads the node
        path = os.path.join(self._dir, *name.split("/"))
        node = ts.ocdbt.dump(base, node=where).result()
        entries = node.get("entries") or []
        if node.get("height", 0):
            for e in entries:
                if "location" in e:
                    self._walk(ts, base, e["location"],
                               prefix + (e.get("subtree_common_prefix") or b""), path)
            return
        for e in entries:
            key = (prefix + e["key"]).decode()
            if e.get("inline_value") is not None:
                self._entries[key] = bytes(e["inline_value"])
            else:
                file, offset, length = location(e["indirect_value"])
                self._check(file, path)
                self._entries[key] = (file, offset, length)

    def get(self, key: str) -> bytes | tuple[str, int, int] | None:
        """A key's value (bytes), its ``(file relative to the database, offset, length)``,
        or None when the database has no such key."""
        return self._entries.get(key)

    def __iter__(self) -> Iterator[str]:
        """Every key of the database."""
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
