"""Checkpoints of ``ArrayStore`` (Keras callbacks, JobRunner) are their own kind: ``arrays``.

``asyncckpt list/inspect/verify`` show them as ``arrays`` with their arrays;
orbax/JAX step directories stay ``jax``; the object-store protocol uploads,
lists, downloads and deletes them, and still lists those uploaded before the
kind existed (their marker says ``jax``).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from asyncckpt import catalog, cli
from asyncckpt._engine.files import DurableWriter
from asyncckpt._engine.manifest import Manifest
from asyncckpt.jobrunner.store import ArrayStore
from asyncckpt.storage import RetryPolicy
from asyncckpt.storage import protocol as proto
from asyncckpt.storage.stores import open_store

FAST = RetryPolicy(deadline_s=1.0, initial_backoff_s=0.05)


def _array_store(directory, steps=(3, 7)) -> dict[str, np.ndarray]:
    arrays = {"trainable/0000": np.arange(12, dtype=np.float32).reshape(3, 4),
              "optimizer/0000": np.array(5, dtype=np.int64)}
    with ArrayStore(directory, max_to_keep=None) as store:
        for step in steps:
            store.save(step, arrays, {"epoch": step})
        store.wait_until_finished()
    return arrays


def _jax_layout_step(directory, step: int) -> None:
    root = directory / str(step)
    writer = DurableWriter(str(root), fsync=False, checksums=True)
    writer.write("default/w/0", (np.zeros(100, np.uint8),))
    manifest = Manifest(framework="jax", label=str(step), step=step,
                        files=tuple(writer.finish()))
    (root / "asyncckpt.manifest.json").write_text(manifest.to_json())


def test_array_store_checkpoints_are_listed_described_and_verified_as_arrays(tmp_path, capsys):
    arrays = _array_store(tmp_path / "keras")
    found = catalog.list_checkpoints(str(tmp_path / "keras"))
    assert [(c.step, c.framework, c.is_directory) for c in found] == [
        (3, "arrays", True), (7, "arrays", True)]
    described = catalog.describe_arrays(found[-1])
    assert [(a.name, a.shape, a.dtype, a.nbytes) for a in described] == [
        (name, a.shape, a.dtype.name, a.nbytes) for name, a in sorted(arrays.items())]
    assert catalog.verify(found[-1]).framework == "arrays"

    _jax_layout_step(tmp_path / "jax", 4)  # a JAX step directory is still "jax"
    assert [c.framework for c in catalog.list_checkpoints(str(tmp_path / "jax"))] == ["jax"]

    assert cli.main(["list", str(tmp_path / "keras")]) == 0
    listing = capsys.readouterr().out
    assert listing.count(" arrays ") == 2 and " jax " not in listing
    assert cli.main(["inspect", str(tmp_path / "keras")]) == 0
    inspected = capsys.readouterr().out
    assert "(arrays, step 7)" in inspected and "2 arrays" in inspected
    assert "trainable/0000" in inspected and "[3, 4]" in inspected
    assert cli.main(["verify", str(tmp_path / "keras")]) == 0
    # A corrupt byte is found by verify.
    data = tmp_path / "keras" / "7" / "arrays.bin"
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))
    capsys.readouterr()
    assert cli.main(["verify", str(tmp_path / "keras")]) != 0


def test_arrays_kind_through_the_object_store_protocol(tmp_path):
    arrays = _array_store(tmp_path / "src")
    store = open_store(str(tmp_path / "remote"))
    local = catalog.list_checkpoints(str(tmp_path / "src"))
    proto.upload_checkpoint(store, local[0], retry=FAST)
    # An upload made before the "arrays" kind existed: its marker says "jax".
    proto.upload_checkpoint(store, dataclasses.replace(local[1], framework="jax"), retry=FAST)
    remote = proto.list_committed(store)
    assert [(r.step, r.framework) for r in remote] == [(3, "arrays"), (7, "jax")]
    for r in remote:
        dest = tmp_path / f"dest-{r.step}"
        proto.download_checkpoint(store, r, str(dest), retry=FAST)
        [info] = catalog.list_checkpoints(str(dest))
        assert (info.step, info.framework) == (r.step, "arrays")
        got = ArrayStore(dest).restore(r.step)
        assert got.metadata == {"epoch": r.step}
        for name, a in arrays.items():
            np.testing.assert_array_equal(got.arrays[name], a)
    proto.delete_checkpoint(store, remote[0])
    assert [r.step for r in proto.list_committed(store)] == [7]
    assert not [o.key for o in store.list() if o.key.startswith("3/")]
