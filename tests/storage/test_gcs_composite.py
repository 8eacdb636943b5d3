"""GCS parallel composite uploads against fake-gcs-server: exact bytes, parts cleaned up."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from asyncckpt.storage.gcs import PARTS_PREFIX, GCSObjectStore
from tests.storage.conftest import BUCKET

PART = 256 << 10


@pytest.fixture
def gcs(gcs_server):
    store = GCSObjectStore(BUCKET, f"comp-{uuid.uuid4().hex[:10]}", part_size=PART, parallel=4,
                           composite_min_size=0)
    yield store
    store.close()


def _file(tmp_path, nbytes: int, seed: int = 0) -> tuple[str, bytes]:
    data = np.random.default_rng(seed).integers(0, 255, nbytes, dtype=np.uint8).tobytes()
    path = tmp_path / f"f{nbytes}"
    path.write_bytes(data)
    return str(path), data


@pytest.mark.parametrize("parts", [1, 3, 70])  # one upload; one compose; rounds of 32
def test_composite_upload_is_exact_and_leaves_no_parts(gcs, tmp_path, parts):
    path, data = _file(tmp_path, PART * parts - 1234 if parts > 1 else PART - 5, seed=parts)
    gcs.put_file("dir/obj", path)
    assert gcs.get("dir/obj") == data
    assert [o.key for o in gcs.list()] == ["dir/obj"]  # parts and intermediates deleted


class _FailingPart:
    """Wraps the real gcsfs client: the third part upload fails."""

    def __init__(self, fs):
        self._fs = fs
        self._calls = 0

    def pipe_file(self, path, data, **kwargs):
        self._calls += 1
        if self._calls == 3:
            raise ConnectionError("injected: part upload failed")
        return self._fs.pipe_file(path, data, **kwargs)

    def __getattr__(self, name):
        return getattr(self._fs, name)


def test_failed_part_publishes_nothing(gcs, tmp_path):
    path, _ = _file(tmp_path, PART * 6)
    gcs._fs = _FailingPart(gcs._fs)
    with pytest.raises(ConnectionError, match="injected"):
        gcs.put_file("obj", path)
    assert gcs.list() == []  # no destination object, no part left


def test_abort_incomplete_uploads_deletes_orphaned_parts(gcs):
    gcs.put(f"{PARTS_PREFIX}deadbeef/000000", b"x" * 10)  # what a killed writer leaves
    gcs.put(f"{PARTS_PREFIX}deadbeef/000001", b"y" * 10)
    gcs.put("keep", b"k")
    assert gcs.abort_incomplete_uploads(older_than_s=3600.0) == 0  # too recent: left alone
    assert gcs.abort_incomplete_uploads(older_than_s=0.0) == 1
    assert [o.key for o in gcs.list()] == ["keep"]
