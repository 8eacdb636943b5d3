"""A JAX restore from the remote tier fetches only the files it reads.

Saved in the zarr-file layout (one file per chunk); in the OCDBT layout the
files are the item's databases (tests/storage/test_jax_remote_ocdbt.py).

The store the tier uses is the real one (SeaweedFS / fake-gcs-server),
given a counting subclass so the test sees every object it fetches.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

jax = pytest.importorskip("jax")
ocp = pytest.importorskip("orbax.checkpoint")

import jax.numpy as jnp  # noqa: E402

import asyncckpt.jax as aj  # noqa: E402
from asyncckpt._engine import reads  # noqa: E402
from asyncckpt.errors import CorruptCheckpointError  # noqa: E402
from asyncckpt.storage.lazy import is_chunk  # noqa: E402
from asyncckpt.storage.protocol import list_committed  # noqa: E402
from asyncckpt.storage.stores import open_store  # noqa: E402

PLAIN = aj.FormatOptions(use_ocdbt=False)


def _items(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "params": {"w": jnp.asarray(rng.standard_normal((256, 128), dtype=np.float32)),
                   "b": jnp.asarray(rng.standard_normal(128, dtype=np.float32))},
        "opt": {"m": jnp.asarray(rng.standard_normal((256, 128), dtype=np.float32)),
                "v": jnp.asarray(rng.standard_normal((256, 128), dtype=np.float32))},
    }


def _save_args(items: dict):
    return ocp.args.Composite(**{k: ocp.args.StandardSave(v) for k, v in items.items()})


def _count_fetches(mgr) -> dict[str, int]:
    """Makes the manager's remote store count what it fetches; returns {key: bytes}."""
    store = mgr._tiers._dir.remote.store
    fetched: dict[str, int] = {}
    lock = threading.Lock()

    class Counting(type(store)):
        def get_file(self, key, path):
            n = super().get_file(key, path)
            with lock:
                fetched[key] = fetched.get(key, 0) + n
            return n

        def get_range(self, key, start=0, end=None):
            data = super().get_range(key, start, end)
            with lock:
                fetched[key] = fetched.get(key, 0) + len(data)
            return data

    store.__class__ = Counting
    return fetched


def _chunk_keys(url: str, step: str) -> dict[str, int]:
    return {o.key: o.size for o in open_store(url).list(f"{step}/")
            if is_chunk(o.key[len(step) + 1:])}


def _equal(a: dict, b: dict) -> bool:
    return all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in b)


def test_partial_restore_of_one_item_fetches_only_its_chunks(remote_url):
    with aj.CheckpointManager(remote_url, format_options=PLAIN) as mgr:
        assert mgr.save(1, args=_save_args(_items(1)))
        mgr.wait_until_finished()
    chunks = _chunk_keys(remote_url, "1")
    params = {k: n for k, n in chunks.items() if k.startswith("1/params/")}
    total = sum(o.size for o in open_store(remote_url).list("1/"))
    with aj.CheckpointManager(remote_url) as mgr:  # fresh scratch: only the remote has it
        fetched = _count_fetches(mgr)
        out = mgr.restore(1, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_items(0)["params"])))
        assert list(out.keys()) == ["params"]
        assert _equal(out["params"], _items(1)["params"])
        fetched_chunks = {k: n for k, n in fetched.items() if k in chunks}
        print(f"item restore: {len(fetched)} objects, {sum(fetched.values())} bytes fetched "
              f"of {total} in the step; chunks {sum(fetched_chunks.values())} of "
              f"{sum(chunks.values())}")
        assert fetched_chunks == params  # its chunks, each once, and no other item's
        assert "1" not in os.listdir(mgr._tiers.local_dir)  # not published as a local step
        assert mgr.all_steps() == [1]
        # A partial restore of some arrays fetches nothing more than it reads...
        fetched.clear()
        out = mgr.restore(1, args=ocp.args.Composite(opt=ocp.args.PyTreeRestore(
            {"m": _items(0)["opt"]["m"]}, partial_restore=True)))
        assert np.array_equal(np.asarray(out["opt"]["m"]), np.asarray(_items(1)["opt"]["m"]))
        assert set(fetched) & set(chunks) == {k for k in chunks if k.startswith("1/opt/m/")}
        # ...and a full restore reuses what is fetched: only the rest comes over.
        fetched.clear()
        out = mgr.restore(1)
        assert _equal(out["params"], _items(1)["params"]) and _equal(out["opt"], _items(1)["opt"])
        assert set(fetched) & set(chunks) == {k for k in chunks if k.startswith("1/opt/v/")}
        cache = mgr._tiers._dir._fetch_dir
        assert cache is not None and os.path.isdir(cache)
    assert not os.path.exists(cache)  # removed on close


class _RecordedReads(reads.FileRead):
    """The real ``FileRead``, noting which files the restore checksums as it reads them."""

    checked: dict[str, bool] = {}

    def __init__(self, path, size, dests, **kwargs):
        super().__init__(path, size, dests, **kwargs)
        _RecordedReads.checked[path] = self.checksum


def test_a_corrupt_needed_remote_chunk_fails_and_restore_falls_back(remote_url, monkeypatch):
    with aj.CheckpointManager(remote_url, format_options=PLAIN) as mgr:
        for step in (1, 2):
            assert mgr.save(step, args=_save_args(_items(step)))
        mgr.wait_until_finished()
    store = open_store(remote_url)
    assert [c.name for c in list_committed(store)] == ["1", "2"]
    victim = sorted(k for k in _chunk_keys(remote_url, "2") if k.startswith("2/params/w/"))[0]
    data = bytearray(store.get(victim))
    data[len(data) // 2] ^= 0xFF  # same size: only the CRC32 can tell
    store.put(victim, bytes(data))
    with aj.CheckpointManager(remote_url) as mgr:
        with pytest.raises(CorruptCheckpointError, match="CRC32"):
            mgr.restore(2, args=ocp.args.Composite(
                params=ocp.args.StandardRestore(_items(0)["params"])))
        # The newest step fails, the one before restores.
        monkeypatch.setattr(reads, "FileRead", _RecordedReads)
        out = mgr.restore(args=ocp.args.Composite(
            params=ocp.args.StandardRestore(_items(0)["params"])))
        assert _equal(out["params"], _items(1)["params"])
        # Its chunks were checksummed as they were fetched, not a second time when read.
        chunk_reads = {p: c for p, c in _RecordedReads.checked.items()
                       if "params" in p.replace(os.sep, "/").split("/")}
        assert chunk_reads and not any(chunk_reads.values()), chunk_reads
        monkeypatch.undo()
        # Restoring only the other item does not read the damaged chunk.
        out = mgr.restore(2, args=ocp.args.Composite(
            opt=ocp.args.StandardRestore(_items(0)["opt"])))
        assert _equal(out["opt"], _items(2)["opt"])


def test_a_typed_prng_key_restores_from_the_bucket_alone(remote_url):
    """Its impl is in ``array_metadatas``, a metadata file fetched with the others."""
    assert not is_chunk("default/array_metadatas/process_0")
    state = {"rng": jax.random.key(3), "w": jnp.arange(4.0)}
    with aj.CheckpointManager(remote_url, format_options=PLAIN) as mgr:
        assert mgr.save(1, state)
    with aj.CheckpointManager(remote_url) as mgr:  # fresh scratch: only the remote has it
        got = mgr.restore(1)
    assert jax.dtypes.issubdtype(got["rng"].dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(got["rng"]),
                                  jax.random.key_data(state["rng"]))
