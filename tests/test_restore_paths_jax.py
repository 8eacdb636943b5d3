"""The JAX restore pipeline: chunks read in pieces, checked as they arrive, exact.

These checkpoints are saved in the zarr-file layout (``use_ocdbt=False``), whose chunk
files the restore reads itself.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from asyncckpt._engine import reads
from tests.helpers import evict, flip_byte, test_seed

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import asyncckpt.jax as aj  # noqa: E402
from asyncckpt import CorruptCheckpointError  # noqa: E402

# These tests read the chunk files of the zarr-file layout (OCDBT: tests/test_jax_ocdbt.py).
PLAIN = aj.FormatOptions(use_ocdbt=False)


def _mesh(shape, names):
    return Mesh(np.array(jax.devices()[: int(np.prod(shape))]).reshape(shape), names)


def test_chunks_read_in_many_pieces_restore_exactly_onto_another_sharding(
        ckpt_dir, monkeypatch):
    monkeypatch.setattr(reads, "PIECE", 1000)  # every chunk spans many pieces
    rng = np.random.default_rng(test_seed("jax pieces"))
    mesh8 = _mesh((8,), ("d",))
    state = {
        "w": jax.device_put(jnp.asarray(rng.standard_normal((64, 40)), jnp.bfloat16),
                            NamedSharding(mesh8, P("d"))),
        "b": jax.device_put(rng.integers(-9, 9, 24).astype(np.int64),
                            NamedSharding(mesh8, P())),
        "scale": jnp.float32(0.25),
        "step": 7,
    }
    with aj.CheckpointManager(ckpt_dir, format_options=PLAIN) as mgr:
        mgr.save(1, state)
    mesh2 = _mesh((2, 2), ("x", "y"))
    target = {
        "w": jax.ShapeDtypeStruct((64, 40), jnp.bfloat16,
                                  sharding=NamedSharding(mesh2, P("y", "x"))),
        "b": jax.ShapeDtypeStruct((24,), jnp.int64, sharding=NamedSharding(mesh2, P("x"))),
        "scale": jax.ShapeDtypeStruct((), jnp.float32,
                                      sharding=NamedSharding(mesh2, P())),
        "step": 0,
    }
    with aj.CheckpointManager(ckpt_dir, format_options=PLAIN) as mgr:
        got = mgr.restore(1, target=target)
    assert got["w"].sharding == target["w"].sharding and got["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got["w"]).view(np.uint16),
                                  np.asarray(state["w"]).view(np.uint16))
    np.testing.assert_array_equal(np.asarray(got["b"]), np.asarray(state["b"]))
    assert float(got["scale"]) == 0.25 and got["step"] == 7

    # A flipped byte deep inside a chunk (not in its first piece) is caught.
    chunk = ckpt_dir / "1" / "default" / "w" / "0.0"
    flip_byte(chunk, chunk.stat().st_size - 3, mask=0x01)
    with aj.CheckpointManager(ckpt_dir) as mgr, pytest.raises(CorruptCheckpointError) as err:
        mgr.restore(1, target=target)
    assert err.value.file == str(chunk)


def test_cold_chunks_read_directly_into_huge_pages_are_checked_and_restored_exactly(
        ckpt_dir, monkeypatch):
    """A chunk past the huge-page size goes by O_DIRECT: a flipped byte is still caught."""
    rng = np.random.default_rng(test_seed("jax direct"))
    mesh = _mesh((2,), ("d",))
    rows = 2 * (reads.HUGE // 4 // 64) + 2  # two chunks just over the huge-page size
    state = {"w": jax.device_put(rng.standard_normal((rows, 64)).astype(np.float32),
                                 NamedSharding(mesh, P("d")))}
    with aj.CheckpointManager(ckpt_dir, format_options=PLAIN) as mgr:
        mgr.save(1, state)
    chunk = ckpt_dir / "1" / "default" / "w" / "1.0"
    assert chunk.stat().st_size > reads.HUGE
    probe = reads._open_direct(str(chunk))
    if probe < 0:
        pytest.skip("this file system refuses O_DIRECT")
    os.close(probe)
    opened = []
    real = reads._open_direct
    monkeypatch.setattr(reads, "_open_direct", lambda path: opened.append(path) or real(path))
    target = {"w": jax.ShapeDtypeStruct((rows, 64), jnp.float32,
                                        sharding=NamedSharding(mesh, P("d")))}
    flip_byte(chunk, chunk.stat().st_size // 2 + 1, mask=0x01)
    for path in chunk.parent.iterdir():
        evict(path)
    with aj.CheckpointManager(ckpt_dir) as mgr, pytest.raises(CorruptCheckpointError) as err:
        mgr.restore(1, target=target)
    assert err.value.file == str(chunk)
    assert str(chunk) in opened
    flip_byte(chunk, chunk.stat().st_size // 2 + 1, mask=0x01)
    evict(chunk)
    with aj.CheckpointManager(ckpt_dir, format_options=PLAIN) as mgr:
        got = mgr.restore(1, target=target)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(state["w"]))
    assert opened.count(str(chunk)) == 2


def test_the_restored_arrays_other_files_are_checked_in_the_same_reads(ckpt_dir, monkeypatch):
    """Metadata files are checksummed alongside the chunks (one ``read_all``), still caught."""
    state = {"w": jnp.arange(4096, dtype=jnp.float32), "b": jnp.ones(8)}
    with aj.CheckpointManager(ckpt_dir, format_options=PLAIN) as mgr:
        mgr.save(1, state)
    calls: list[list[str]] = []
    real = reads.read_all

    def counted(file_reads, **kw):
        calls.append([os.path.relpath(r.path, ckpt_dir / "1") for r in file_reads])
        return real(file_reads, **kw)

    monkeypatch.setattr(reads, "read_all", counted)
    with aj.CheckpointManager(ckpt_dir, format_options=PLAIN) as mgr:
        got = mgr.restore(1, target=jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state))
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(state["w"]))
    assert len(calls) == 1  # chunks and the other files in one batch of reads
    assert {"default/w/0", "default/w/.zarray", "default/_METADATA",
            "_CHECKPOINT_METADATA"} <= set(calls[0])
    # A changed digit keeps the JSON valid: only the checksum can tell.
    meta = ckpt_dir / "1" / "_CHECKPOINT_METADATA"
    text = meta.read_text()
    at = text.index("commit_timestamp_nsecs") + len('commit_timestamp_nsecs": ') + 5
    meta.write_text(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1:])
    evict(meta)
    with aj.CheckpointManager(ckpt_dir) as mgr, pytest.raises(CorruptCheckpointError) as err:
        mgr.restore(1, target=state)
    assert os.path.basename(err.value.file) == "_CHECKPOINT_METADATA"
