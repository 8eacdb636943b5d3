"""Restores a TensorFlow checkpoint with both readers: TensorFlow's and asyncckpt's own.

Wherever a test checks a TensorFlow restore it restores with both (issue 24):
a bug in asyncckpt's reader (``asyncckpt/tf/_restore.py``) must not hide
behind TensorFlow's. A checkpoint asyncckpt wrote (it has a manifest) must
also really be read by asyncckpt: its fast path takes it, and TensorFlow's
own ``RestoreV2`` is asked for none of its tensors of a dtype asyncckpt
reads itself (only the object graph, strings and dtypes such as float8).

Import after ``pytest.importorskip("tensorflow")``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import tensorflow as tf

import asyncckpt.tf as at
from asyncckpt._engine import reads
from asyncckpt._engine.manifest import read_manifest
from asyncckpt.tf import _bundle, _bundleread, _restore
from asyncckpt.tf._job import manifest_path

READERS = ("tensorflow", "asyncckpt")


def checkpoint_class(reader: str):
    """The ``Checkpoint`` class of a reader: TensorFlow's or asyncckpt's."""
    return {"tensorflow": tf.train.Checkpoint, "asyncckpt": at.Checkpoint}[reader]


def _as_str(x) -> str:
    if isinstance(x, bytes):
        return x.decode()
    if tf.is_tensor(x):
        return x.numpy().decode()
    return str(x)


class OwnReader:
    """While entered, records what asyncckpt's reader took and what TensorFlow read itself.

    Wraps the real ``_restore.prefetch`` (``took``: whether the fast path
    took each checkpoint) and the real ``RestoreV2`` asyncckpt's hook falls
    back to (``tf_reads``: ``(prefix, key)`` of every tensor TensorFlow read
    itself while entered). The hook stays installed while entered, so the
    wrapped ``RestoreV2`` is the one it calls.
    """

    def __enter__(self) -> OwnReader:
        self.took: list[bool] = []
        self.tf_reads: list[tuple[str, str]] = []
        self._prefetch = _restore.prefetch
        real_prefetch = self._prefetch

        def prefetch(*args, **kwargs):
            out = real_prefetch(*args, **kwargs)
            self.took.append(out is not None)
            return out

        _restore.prefetch = prefetch
        _restore._hook(+1)
        self._restore_v2 = real_restore = _restore._original_restore_v2

        def restore_v2(prefix, names, slices, dtypes, name=None):
            path = os.path.abspath(_as_str(prefix))
            self.tf_reads += [(path, _as_str(n)) for n in names]
            return real_restore(prefix, names, slices, dtypes, name=name)

        _restore._original_restore_v2 = restore_v2
        return self

    def __exit__(self, *exc) -> None:
        _restore._original_restore_v2 = self._restore_v2
        _restore._hook(-1)
        _restore.prefetch = self._prefetch

    def assert_read_by_asyncckpt(self, path: str) -> None:
        """asyncckpt's reader read ``path``; TensorFlow read none of its plain tensors."""
        assert self.took and all(self.took), (
            f"asyncckpt's reader did not take {path} (took={self.took})")
        if not reads.has_fast_crc32c():
            return  # tensors not prefetched are then TensorFlow's to read
        with open(path + ".index", "rb") as f:
            index = _bundle.parse_index(f.read())
        plain = {k for k, e in index.entries.items() if e.dtype in _bundleread.PLAIN}
        here = os.path.abspath(path)
        by_tf = sorted({k for p, k in self.tf_reads if p == here} & plain)
        assert not by_tf, f"TensorFlow's RestoreV2 read these tensors itself: {by_tf}"


def written_by_asyncckpt(path: str) -> bool:
    """Whether the checkpoint at ``path`` carries an asyncckpt manifest."""
    return os.path.exists(manifest_path(path))


def restore_both(
    path: str,
    make: Callable[[], dict],
    check: Callable[[dict], None],
    *,
    verdict: str | None = "assert_consumed",
    method: str = "restore",
    settle: Callable[[dict], None] | None = None,
) -> dict:
    """Restores ``path`` with TensorFlow's reader and with asyncckpt's; checks each.

    Args:
        path: The checkpoint prefix.
        make: Fresh objects to restore into, as ``Checkpoint`` keyword
            arguments (called once per reader).
        check: Asserts the restored values of ``make()``'s objects.
        verdict: The status method called after the restore (and ``settle``),
            e.g. ``"assert_consumed"``, ``"expect_partial"``; None: none.
        method: ``"restore"`` or ``"read"``.
        settle: Called with the objects after the restore, before the
            verdict and ``check`` (creates objects a deferred restore fills).

    Returns:
        Reader name -> the restored objects.

    With asyncckpt's reader, a checkpoint asyncckpt wrote must be read by
    asyncckpt itself (``OwnReader.assert_read_by_asyncckpt``).
    """
    out = {}
    for reader in READERS:
        objects = make()
        with OwnReader() as spy:
            status = getattr(checkpoint_class(reader)(**objects), method)(path)
            if settle is not None:
                settle(objects)
            if verdict is not None:
                getattr(status, verdict)()
        check(objects)
        if reader == "asyncckpt" and written_by_asyncckpt(path):
            spy.assert_read_by_asyncckpt(path)
        out[reader] = objects
    return out


def contents(path: str) -> dict:
    """Every tensor at ``path`` by checkpoint key (the object graph left out), read by both.

    TensorFlow's ``CheckpointReader`` reads every tensor; for a checkpoint
    asyncckpt wrote, asyncckpt's own reader reads every tensor of a dtype it
    reads (partitioned ones assembled from their slices), and the two must
    agree byte for byte.
    """
    reader = tf.train.load_checkpoint(path)
    theirs = {key: reader.get_tensor(key) for key in reader.get_variable_to_shape_map()
              if key != "_CHECKPOINTABLE_OBJECT_GRAPH"}
    if written_by_asyncckpt(path):
        bundle = _bundleread.open_bundle(path, read_manifest(manifest_path(path)),
                                         checksums=True)
        assert bundle is not None, f"asyncckpt's reader does not read {path}"
        for key in bundle.plain_keys():
            dtype = tf.as_dtype(bundle.index.entries[key].dtype)
            arrays = _bundleread.read_tensors(bundle, [key])
            ours = _bundleread.assemble(_bundleread.plan(bundle, key, "", dtype),
                                        lambda piece, arrays=arrays: arrays[piece][1])
            want = np.asarray(theirs[key])
            assert ours.shape == want.shape and ours.tobytes() == want.tobytes(), key
    return theirs
