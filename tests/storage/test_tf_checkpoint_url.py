"""``asyncckpt.tf.Checkpoint.save/write/restore/read`` with s3:// and gs:// prefixes."""

from __future__ import annotations

import os
from concurrent import futures

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import asyncckpt.tf as at  # noqa: E402
from asyncckpt.errors import CorruptCheckpointError  # noqa: E402
from asyncckpt.storage import RetryPolicy, StorageError, UnsupportedURLError  # noqa: E402
from asyncckpt.storage.protocol import list_committed  # noqa: E402
from asyncckpt.storage.stores import open_store  # noqa: E402
from asyncckpt.storage.tier import RemoteOptions  # noqa: E402
from tests.storage import conftest as storage_conftest  # noqa: E402


def _ckpt(seed: int, **kwargs):
    rng = np.random.default_rng(seed)
    v = tf.Variable(rng.standard_normal((96, 64)).astype(np.float32))
    n = tf.Variable(seed, dtype=tf.int64)
    return at.Checkpoint(v=v, n=n, **kwargs)


def _names(url: str) -> list[str]:
    return [c.name for c in list_committed(open_store(url))]


def test_save_write_restore_read_round_trip(remote_url):
    ckpt = _ckpt(0)
    seen = []
    opts = tf.train.CheckpointOptions(experimental_write_callbacks=[seen.append])
    saved = {}
    for i in (1, 2):
        ckpt.v.assign_add(tf.ones_like(ckpt.v))
        ckpt.n.assign(i)
        path = ckpt.save(f"{remote_url}/ckpt", options=opts)
        assert path == f"{remote_url}/ckpt-{i}"  # numbered by save_counter, as locally
        saved[path] = ckpt.v.numpy().copy()
    ckpt.n.assign(7)
    assert ckpt.write(f"{remote_url}/named") == f"{remote_url}/named"
    named = ckpt.v.numpy().copy()
    # Restoring a path just returned waits for its upload (same process).
    ckpt.v.assign(tf.zeros_like(ckpt.v))
    ckpt.restore(f"{remote_url}/ckpt-2")
    assert np.array_equal(ckpt.v.numpy(), saved[f"{remote_url}/ckpt-2"])
    ckpt.close()
    assert seen == [f"{remote_url}/ckpt-1", f"{remote_url}/ckpt-2"]  # the URL, not scratch
    assert _names(remote_url) == ["named", "ckpt-1", "ckpt-2"]
    assert at.latest_checkpoint(remote_url) == f"{remote_url}/ckpt-2"

    fresh = _ckpt(5)  # another Checkpoint: everything comes from the bucket
    fresh.restore(f"{remote_url}/ckpt-1").assert_consumed()
    assert np.array_equal(fresh.v.numpy(), saved[f"{remote_url}/ckpt-1"])
    assert int(fresh.n.numpy()) == 1 and int(fresh.save_counter.numpy()) == 1
    fresh.read(f"{remote_url}/named").assert_consumed()
    assert np.array_equal(fresh.v.numpy(), named) and int(fresh.n.numpy()) == 7
    fresh.restore(at.latest_checkpoint(remote_url))
    assert int(fresh.save_counter.numpy()) == 2
    # Numbering continues from the restored counter, as for local paths.
    assert fresh.save(f"{remote_url}/ckpt") == f"{remote_url}/ckpt-3"
    fresh.close()
    assert at.latest_checkpoint(remote_url) == f"{remote_url}/ckpt-3"


def test_write_again_replaces(remote_url):
    ckpt = _ckpt(0)
    ckpt.write(f"{remote_url}/w")
    ckpt.v.assign(ckpt.v * 2.0)
    ckpt.write(f"{remote_url}/w")
    expected = ckpt.v.numpy().copy()
    ckpt.close()
    fresh = _ckpt(1)
    fresh.read(f"{remote_url}/w")
    assert np.array_equal(fresh.v.numpy(), expected)
    fresh.close()


def test_corrupt_object_is_refused(remote_url):
    ckpt = _ckpt(0)
    ckpt.write(f"{remote_url}/c")
    ckpt.close()
    store = open_store(remote_url)
    key = next(o.key for o in store.list("c.data-"))
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    store.put(key, bytes(data))
    fresh = _ckpt(1)
    with pytest.raises(CorruptCheckpointError):
        fresh.read(f"{remote_url}/c")
    fresh.close()


def test_missing_and_unsupported(remote_url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = _ckpt(0)
    with pytest.raises(tf.errors.NotFoundError):
        ckpt.restore(f"{remote_url}/nothing-1")
    assert at.latest_checkpoint(remote_url) is None
    for bad in ("hdfs://nn/run/ckpt", "foo://x/ckpt", "gs:/bucket/ckpt"):
        with pytest.raises(UnsupportedURLError, match="s3://"):
            ckpt.save(bad)
        with pytest.raises(UnsupportedURLError, match="gs://"):
            ckpt.write(bad)
        with pytest.raises(UnsupportedURLError):
            ckpt.restore(bad + "-1")
    assert int(ckpt.save_counter.numpy()) == 0  # nothing counted
    assert os.listdir(tmp_path) == []  # no folder named after a URL
    ckpt.close()


@pytest.fixture(params=["s3", "gcs"])
def own_server(request, tmp_path, monkeypatch):
    """A server of this test alone (it gets stopped and restarted), and its bucket URL."""
    server = storage_conftest.own_server(request.param, str(tmp_path / "srv"), monkeypatch)
    yield server, ("s3" if request.param == "s3" else "gs") + "://outage/run"
    server.kill()


@pytest.mark.slow
def test_server_stopped_fails_that_save(own_server, tmp_path):
    server, url = own_server
    opts = RemoteOptions(retry=RetryPolicy(deadline_s=2.0, initial_backoff_s=0.1))
    ckpt = _ckpt(0, remote_options=opts)
    other = _ckpt(1, remote_options=opts)
    ckpt.save(f"{url}/ckpt")
    ckpt.sync()
    server.kill()  # the server goes away
    assert ckpt.save(f"{url}/ckpt") == f"{url}/ckpt-2"  # returns; the upload fails behind
    futures.wait([ckpt.last_save.committed])  # the real event: that save has ended
    assert isinstance(ckpt.last_save.committed.exception(), StorageError)
    with pytest.raises(StorageError, match="failed after"):
        ckpt.save(f"{url}/ckpt")  # the next call raises it
    other.write(f"{url}/last")
    with pytest.raises(StorageError, match="failed after"):
        other.close()  # close raises it too
    server.start()  # same port, same data
    assert ckpt.save(f"{url}/ckpt") == f"{url}/ckpt-3"
    ckpt.sync()
    assert _names(url) == ["ckpt-1", "ckpt-3"]  # the failed ones were never committed
    with pytest.raises(tf.errors.NotFoundError):
        ckpt.restore(f"{url}/ckpt-2")  # nor kept in the scratch directory
    assert at.latest_checkpoint(url) == f"{url}/ckpt-3"
    ckpt.close()
