"""One suite, every backend: local disk, S3 (SeaweedFS) and GCS (fake-gcs-server)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from asyncckpt.storage.base import AlreadyExistsError, ObjectInfo
from asyncckpt.storage.stores import open_store


@pytest.fixture
def store(location):
    s = open_store(location, part_size=5 << 20)
    yield s
    s.close()


def test_put_get_roundtrip_and_ranges(store):
    data = bytes(range(256)) * 40
    store.put("a/b/obj", data)
    assert store.get("a/b/obj") == data
    assert store.get_range("a/b/obj", 10, 20) == data[10:20]
    assert store.get_range("a/b/obj", 10000) == data[10000:]
    assert store.get_range("a/b/obj", 5, 5) == b""


def test_put_overwrites(store):
    store.put("k", b"one")
    store.put("k", b"two")
    assert store.get("k") == b"two"


def test_missing_key_is_file_not_found(store):
    with pytest.raises(FileNotFoundError):
        store.get("nope")
    with pytest.raises(FileNotFoundError):
        store.get_range("nope", 0, 3)


def test_create_only_put(store):
    store.put("marker", b"first", create_only=True)
    if store.create_only_enforced:
        with pytest.raises(AlreadyExistsError):
            store.put("marker", b"second", create_only=True)
        assert store.get("marker") == b"first"


def test_list_is_recursive_sorted_and_prefixed(store):
    for key in ["x/2", "x/1", "x/sub/3", "y"]:
        store.put(key, key.encode())
    assert store.list() == [ObjectInfo("x/1", 3), ObjectInfo("x/2", 3),
                            ObjectInfo("x/sub/3", 7), ObjectInfo("y", 1)]
    assert [o.key for o in store.list("x/")] == ["x/1", "x/2", "x/sub/3"]
    assert store.list("zzz") == []
    assert [o.key for o in store.list("x")] == ["x/1", "x/2", "x/sub/3"]  # not only whole segments
    assert [o.key for o in store.list("x/s")] == ["x/sub/3"]


def test_delete_ignores_missing(store):
    store.put("d/1", b"1")
    store.put("d/2", b"2")
    store.delete(["d/1", "d/missing"])
    assert [o.key for o in store.list()] == ["d/2"]
    store.delete(["d/2"])
    assert store.list() == []


def test_put_file_multipart_and_get_file(store, tmp_path):
    data = np.random.default_rng(1).integers(0, 255, (12 << 20) + 123, dtype=np.uint8)
    src = tmp_path / "src.bin"
    data.tofile(src)
    store.put_file("big/blob", str(src))  # > part size: multipart where the backend has it
    assert store.list("big/") == [ObjectInfo("big/blob", data.nbytes)]
    dst = tmp_path / "dst.bin"
    assert store.get_file("big/blob", str(dst)) == data.nbytes
    assert np.array_equal(np.fromfile(dst, dtype=np.uint8), data)
    assert store.get_range("big/blob", 7 << 20, (7 << 20) + 9) == data[7 << 20:(7 << 20) + 9
                                                                      ].tobytes()
    assert os.path.getsize(dst) == data.nbytes
