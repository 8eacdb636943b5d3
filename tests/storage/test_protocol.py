"""The commit protocol against real servers: partial uploads are never listed.

Faults are injected by subclassing the real store of each kind.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from asyncckpt import catalog
from asyncckpt._engine.files import DurableWriter
from asyncckpt._engine.manifest import Manifest
from asyncckpt.storage import RetryPolicy, StorageError
from asyncckpt.storage import protocol as proto
from asyncckpt.storage.stores import open_store

FAST = RetryPolicy(deadline_s=1.0, initial_backoff_s=0.05)


def _local_jax_checkpoint(directory, step: int, nfiles: int = 4) -> catalog.CheckpointInfo:
    """A committed JAX-layout step directory with a real manifest (no JAX needed)."""
    root = directory / str(step)
    writer = DurableWriter(str(root), fsync=False, checksums=True)
    rng = np.random.default_rng(step)
    for i in range(nfiles):
        writer.write(f"default/a{i}/0", (rng.integers(0, 255, 50_000 + i, dtype=np.uint8),))
    records = writer.finish()
    manifest = Manifest(framework="jax", label=str(step), step=step, files=tuple(records))
    (root / "asyncckpt.manifest.json").write_text(manifest.to_json())
    return next(c for c in catalog.list_checkpoints(str(directory)) if c.step == step)


def _faulty(store, *, fail_key=None, drop_key=None):
    """Wraps the real store's class: put_file of ``fail_key`` raises, of ``drop_key`` is lost."""

    class Faulty(type(store)):
        def put_file(self, key, path):
            if fail_key and key.endswith(fail_key):
                raise ConnectionError("injected: connection reset")
            if drop_key and key.endswith(drop_key):
                return  # acknowledged, never stored (what a lying server would do)
            return super().put_file(key, path)

    store.__class__ = Faulty
    return store


@pytest.mark.parametrize("fault", ["fail", "drop"])
def test_failed_or_lost_object_publishes_nothing(location, tmp_path, fault):
    info = _local_jax_checkpoint(tmp_path / "src", 5)
    store = open_store(location)
    kwargs = {"fail_key": "a2/0"} if fault == "fail" else {"drop_key": "a2/0"}
    _faulty(store, **kwargs)
    with pytest.raises(StorageError):
        proto.upload_checkpoint(store, info, retry=FAST)
    assert proto.list_committed(store) == []
    assert not any(o.key.endswith(proto.JAX_MARKER_NAME) for o in store.list())
    # A clean retry commits; older uncommitted leftovers are cleaned up afterwards.
    clean = open_store(location)
    proto.upload_checkpoint(clean, info, retry=FAST)
    assert [c.name for c in proto.list_committed(clean)] == ["5"]


def test_uncommitted_leftovers_are_removed_below_the_newest_step(location, tmp_path):
    store = open_store(location)
    old = _local_jax_checkpoint(tmp_path / "src", 3)
    with pytest.raises(StorageError):
        proto.upload_checkpoint(_faulty(open_store(location), fail_key="a3/0"), old, retry=FAST)
    assert any(o.key.startswith("3/") for o in store.list())
    proto.upload_checkpoint(store, _local_jax_checkpoint(tmp_path / "src", 4), retry=FAST)
    assert proto.delete_uncommitted(store, older_than_step=4) == ["3"]
    assert {o.key.split("/")[0] for o in store.list()} == {"4"}


def test_racing_duplicate_commits_are_harmless(location, tmp_path):
    info = _local_jax_checkpoint(tmp_path / "src", 7)
    errors = []
    barrier = threading.Barrier(3)

    def upload():
        barrier.wait()
        try:
            proto.upload_checkpoint(open_store(location), info, retry=FAST)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=upload) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    store = open_store(location)
    [remote] = proto.list_committed(store)
    dest = tmp_path / "dest"
    proto.download_checkpoint(store, remote, str(dest), retry=FAST)
    catalog.verify(catalog.list_checkpoints(str(dest))[0])


def test_invalid_marker_or_manifest_hides_the_checkpoint(location, tmp_path):
    store = open_store(location)
    for step in (1, 2):
        proto.upload_checkpoint(store, _local_jax_checkpoint(tmp_path / "src", step), retry=FAST)
    store.put("2/asyncckpt.manifest.json", b"{}")  # manifest replaced: size no longer matches
    store.put("1/asyncckpt.commit.json", b"not json")
    assert proto.list_committed(store) == []


def test_download_verifies_against_the_manifest(location, tmp_path):
    store = open_store(location)
    info = _local_jax_checkpoint(tmp_path / "src", 9)
    proto.upload_checkpoint(store, info, retry=FAST)
    [remote] = proto.list_committed(store)
    key = "9/default/a1/0"
    data = bytearray(store.get(key))
    data[100] ^= 0xFF
    store.put(key, bytes(data))  # same size, different bytes
    with pytest.raises(Exception, match="CRC32"):
        proto.download_checkpoint(store, remote, str(tmp_path / "dest"), retry=FAST)
    assert catalog.list_checkpoints(str(tmp_path / "dest")) == []  # nothing published


def _stage(directory, names, seed):
    """One process's staged files of a step (a temporary directory of its own)."""
    writer = DurableWriter(str(directory), fsync=False, checksums=True)
    rng = np.random.default_rng(seed)
    for i, name in enumerate(names):
        writer.write(name, (rng.integers(0, 255, 30_000 + i, dtype=np.uint8),))
    return writer.finish()


def test_a_step_uploaded_by_two_processes_commits_only_once_every_object_is_there(
        location, tmp_path):
    store = open_store(location)
    own = ["default/a/0", "default/a/1"]
    other = ["default/b/0", "default/b/1"]
    # Step 9: each "process" uploads its own files from its own directory.
    recs0 = _stage(tmp_path / "p0" / "9", own, 1)
    recs1 = _stage(tmp_path / "p1" / "9", other, 2)
    proto.upload_files(store, "9/", str(tmp_path / "p1" / "9"), recs1, retry=FAST)
    proto.upload_files(store, "9/", str(tmp_path / "p0" / "9"), recs0, retry=FAST)
    proto.check_objects(store, "9/", recs0 + recs1, retry=FAST)
    manifest = Manifest(framework="jax", label="9", step=9, files=tuple(recs0 + recs1))
    (tmp_path / "p0" / "9" / "asyncckpt.manifest.json").write_text(manifest.to_json())
    info = next(c for c in catalog.list_checkpoints(str(tmp_path / "p0")) if c.step == 9)
    proto.upload_checkpoint(store, info, retry=FAST, data_uploaded=True)  # p0 lacks b/*
    (remote,) = proto.list_committed(store)
    proto.download_checkpoint(store, remote, str(tmp_path / "restore"), retry=FAST)
    for rec in recs0 + recs1:  # the whole step, verified against the manifest
        assert (tmp_path / "restore" / "9" / rec.name).stat().st_size == rec.size

    # Step 10: one object lost by the other process, one with another size: both named.
    recs0 = _stage(tmp_path / "p0" / "10", own, 3)
    recs1 = _stage(tmp_path / "p1" / "10", other, 4)
    proto.upload_files(_faulty(open_store(location), drop_key="10/default/b/1"), "10/",
                       str(tmp_path / "p1" / "10"), recs1, retry=FAST)
    proto.upload_files(store, "10/", str(tmp_path / "p0" / "10"), recs0, retry=FAST)
    store.put("10/default/a/0", b"short")
    with pytest.raises(StorageError) as e:
        proto.check_objects(store, "10/", recs0 + recs1, retry=FAST)
    assert "10/default/b/1 (missing" in str(e.value)
    assert "10/default/a/0 (5 bytes, expected 30000)" in str(e.value)
    assert [c.name for c in proto.list_committed(store)] == ["9"]
