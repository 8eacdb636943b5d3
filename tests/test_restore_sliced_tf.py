"""Partitioned tensors (ShardedVariable) read by asyncckpt's own TensorFlow reader.

TensorFlow stores a partitioned tensor as a full-tensor entry listing its
slices plus one entry per slice under a binary OrderedCode key. asyncckpt's
reader parses those keys, reads the slices and builds whatever slice a
``RestoreV2`` asks for, so a ShardedVariable saved with some number of
shards restores into any other number, or into one variable, and back,
without TensorFlow reading the tensors again. Anything in an index it does
not vouch for hands the whole restore to TensorFlow before anything is read.
"""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from asyncckpt._engine import fastcrc
from asyncckpt._engine.files import FileRecord
from asyncckpt._engine.manifest import Manifest, read_manifest, record_owned
from tests.helpers import flip_byte, test_seed

tf = pytest.importorskip("tensorflow")

# Internal, but the only way to build a ShardedVariable without a parameter-server cluster.
from tensorflow.python.distribute.sharded_variable import ShardedVariable  # noqa: E402
from tensorflow.python.ops import gen_io_ops, io_ops  # noqa: E402

import asyncckpt.tf as at  # noqa: E402
from asyncckpt import CorruptCheckpointError  # noqa: E402
from asyncckpt._engine.varint import varint  # noqa: E402
from asyncckpt.tf import _bundle, _bundleread, _restore, _slices, _sstable  # noqa: E402
from asyncckpt.tf._job import manifest_path, save_v2_bundle  # noqa: E402
from asyncckpt.tf._snapshot import StagedState, StagedTensor  # noqa: E402
from tests.tfrestore import OwnReader, restore_both  # noqa: E402

KEY = "emb/.ATTRIBUTES/VARIABLE_VALUE"


def _sharded(value: np.ndarray, shards: int) -> ShardedVariable:
    return ShardedVariable([tf.Variable(p) for p in np.array_split(value, shards)])


def _whole(sharded: ShardedVariable) -> np.ndarray:
    return np.concatenate([v.numpy() for v in sharded.variables])


# -- OrderedCode slice keys ------------------------------------------------------------


def test_slice_keys_decode_to_what_was_encoded():
    rng = random.Random(test_seed("ordered code"))
    numbers = [0, 1, 63, 64, 8191, 8192, 2**31, 2**62, 2**63 - 1]
    numbers += [rng.randrange(1, 2**rng.randrange(1, 63)) for _ in range(200)]
    for n in numbers:  # as starts and lengths, beside the whole-dimension -1
        key = _slices.slice_key("x", [n, 0, 5], [max(n, 1), -1, n + 1])
        assert _slices.parse_slice_key(key) == ("x", (n, 0, 5), (max(n, 1), -1, n + 1))
    # Names with the bytes OrderedCode escapes, and a rank-0 slice.
    for name in ("a\x00b", "\xff\x00\x00", "", "v/.ATTRIBUTES/VARIABLE_VALUE"):
        key = _slices.slice_key(name, [3], [4])
        assert _slices.is_slice_key(key)
        assert _slices.parse_slice_key(key) == (name, (3,), (4,))
    assert _slices.parse_slice_key(_slices.slice_key("s", [], [])) == ("s", (), ())
    for bad in (b"\x01", b"\x00abc", b"\x00ab\x00\x01\x01\x01\x80", b"\x00a\x00\x01\x00" + b"x"):
        with pytest.raises(ValueError):
            _slices.parse_slice_key(bad)


def _tf_partitioned_bundle(prefix: str) -> StagedState:
    """A bundle written by TensorFlow's own SaveV2, with slices of every form it writes."""
    rng = np.random.default_rng(test_seed("tf partitioned bundle"))
    full = rng.standard_normal((10, 6))
    cube = rng.integers(0, 1000, (3, 9, 2)).astype(np.int32)
    v = "/.ATTRIBUTES/VARIABLE_VALUE"
    tensors = (
        # Rows 0-3 whole ('-' extent), rows 4-9 in two column blocks.
        StagedTensor("part" + v, "10 6 0,4:-", tf.float64, full[:4]),
        StagedTensor("part" + v, "10 6 4,6:0,3", tf.float64, full[4:, :3]),
        StagedTensor("part" + v, "10 6 4,6:3,3", tf.float64, full[4:, 3:]),
        # Partitioned along the middle dimension, unevenly.
        StagedTensor("cube" + v, "3 9 2 -:0,2:-", tf.int32, cube[:, :2]),
        StagedTensor("cube" + v, "3 9 2 -:2,7:-", tf.int32, cube[:, 2:]),
        # Only some slices saved: the rest of the tensor is not in the checkpoint.
        StagedTensor("holey" + v, "8 2 0,3:-", tf.float32, full[:3, :2].astype(np.float32)),
        StagedTensor("plain" + v, "", tf.bfloat16,
                     rng.standard_normal((5, 3)).astype(tf.bfloat16.as_numpy_dtype)),
        StagedTensor("name \x00\xff" + v, "4 1 0,2:-", tf.uint8, np.array([[1], [3]], np.uint8)),
        StagedTensor("name \x00\xff" + v, "4 1 2,2:-", tf.uint8, np.array([[7], [9]], np.uint8)),
    )
    state = StagedState(tensors, b"not a real object graph")
    save_v2_bundle(prefix, state)
    return state


def _manifest_for(prefix: str) -> Manifest:
    directory, base = os.path.split(prefix)
    files = []
    for name in sorted(os.listdir(directory)):
        if name.startswith(base + "."):
            with open(os.path.join(directory, name), "rb") as f:
                data = f.read()
            files.append(FileRecord(name, len(data), fastcrc.crc32c_extend(0, data),
                                    fastcrc.CRC32C))
    return Manifest(framework="tensorflow", label=base, step=None, files=tuple(files))


def test_tensorflows_slice_entries_are_parsed_as_its_reader_reads_them(tmp_path):
    prefix = str(tmp_path / "tf")
    _tf_partitioned_bundle(prefix)
    with open(prefix + ".index", "rb") as f:
        index = _bundle.parse_index(f.read())
    v = "/.ATTRIBUTES/VARIABLE_VALUE"
    assert set(index.slices) == {"part" + v, "cube" + v, "holey" + v, "name \x00\xff" + v}
    assert [s.slice.bounds for s in index.slices["part" + v]] == [
        ((0, 4), (0, 6)), ((4, 10), (0, 3)), ((4, 10), (3, 6))]
    assert index.slices["part" + v][0].slice.lengths == (4, -1)  # the '-' extent
    reader = tf.train.load_checkpoint(prefix)
    bundle = _bundleread.open_bundle(prefix, _manifest_for(prefix), checksums=True)
    assert bundle is not None
    for key in ("part" + v, "cube" + v, "name \x00\xff" + v, "plain" + v):
        request = _bundleread.plan(bundle, key, "", tf.as_dtype(index.entries[key].dtype))
        arrays = _bundleread.read_tensors(bundle, [key])
        got = _bundleread.assemble(request, lambda piece, arrays=arrays: arrays[piece][1])
        np.testing.assert_array_equal(got, reader.get_tensor(key), key)
    # Not every element of "holey" is stored: the whole of it is TensorFlow's to refuse.
    assert _bundleread.plan(bundle, "holey" + v, "", tf.float32) is None
    assert _bundleread.plan(bundle, "holey" + v, "8 2 1,2:-", tf.float32) is not None


def test_any_slice_restorev2_asks_for_is_what_tensorflows_reader_returns(tmp_path):
    """Random requests against TensorFlow's own RestoreV2 on the same files."""
    prefix = str(tmp_path / "tf")
    _tf_partitioned_bundle(prefix)
    v = "/.ATTRIBUTES/VARIABLE_VALUE"
    shapes = {"part" + v: (10, 6), "cube" + v: (3, 9, 2), "plain" + v: (5, 3),
              "name \x00\xff" + v: (4, 1), "holey" + v: (8, 2)}
    dtypes = {"part" + v: tf.float64, "cube" + v: tf.int32, "plain" + v: tf.bfloat16,
              "name \x00\xff" + v: tf.uint8, "holey" + v: tf.float32}
    rng = random.Random(test_seed("restore slices"))

    def spec(shape):
        if rng.random() < 0.1:
            return ""
        extents = []
        for d in shape:
            if rng.random() < 0.2:
                extents.append("-")
            else:
                start = rng.randrange(d)
                extents.append(f"{start},{rng.randrange(1, d - start + 1)}")
        return " ".join(map(str, shape)) + " " + ":".join(extents)

    source = _restore.prefetch(prefix, _manifest_for(prefix), checksums=True)
    assert source is not None  # read by us: TensorFlow's own slices parsed
    tried = 0
    with OwnReader() as spy, _restore.serving(source):
        for _ in range(60):
            keys = rng.sample([k for k in shapes if k != "holey" + v], 3)
            specs = [spec(shapes[k]) for k in keys]
            got = io_ops.restore_v2(prefix, keys, specs, [dtypes[k] for k in keys])
            want = gen_io_ops.restore_v2(prefix, keys, specs, [dtypes[k] for k in keys])
            for key, s, g, w in zip(keys, specs, got, want, strict=True):
                assert g.dtype == w.dtype and g.shape == w.shape, (key, s)
                np.testing.assert_array_equal(tf.bitcast(g, tf.uint8) if g.dtype.size == 2
                                              else g, tf.bitcast(w, tf.uint8)
                                              if w.dtype.size == 2 else w, (key, s))
                tried += 1
        assert spy.tf_reads == []  # every one of them built by asyncckpt
        # What TensorFlow refuses, it refuses here too: uncovered slices, another dtype.
        for keys, specs, types in ((["holey" + v], [""], [tf.float32]),
                                   (["part" + v], [""], [tf.float32])):
            with pytest.raises(tf.errors.OpError) as ours:
                io_ops.restore_v2(prefix, keys, specs, types)
            with pytest.raises(tf.errors.OpError) as theirs:
                gen_io_ops.restore_v2(prefix, keys, specs, types)
            assert type(ours.value) is type(theirs.value)
    assert tried == 180


def test_unexpected_index_entries_are_refused_before_any_read():
    """An index this reader does not vouch for raises BundleFormatError (then TF reads)."""
    from tensorflow.core.protobuf import tensor_bundle_pb2

    def entry(shape, *, size=0, offset=0, slices=()):
        e = tensor_bundle_pb2.BundleEntryProto(dtype=tf.float32.as_datatype_enum,
                                               size=size, offset=offset)
        e.shape.SetInParent()
        for d in shape:
            e.shape.dim.add(size=d)
        for starts, lengths in slices:
            extent = e.slices.add().extent
            for s, n in zip(starts, lengths, strict=True):
                x = extent.add()
                if n != -1:
                    x.start, x.length = s, n
        return e

    header = tensor_bundle_pb2.BundleHeaderProto(num_shards=1).SerializeToString()

    def index(items):
        items = sorted([(b"", header), *((k, e.SerializeToString()) for k, e in items)])
        return _bundle.parse_index(_sstable.build_table(items))

    full = entry((4, 2), slices=[((0, 0), (2, -1)), ((2, 0), (2, -1))])
    first = (_slices.slice_key("t", [0, 0], [2, -1]), entry((2, 2), size=16))
    second = (_slices.slice_key("t", [2, 0], [2, -1]), entry((2, 2), size=16, offset=16))
    good = index([(b"t", full), first, second])
    assert [s.slice.bounds for s in good.slices["t"]] == [((0, 2), (0, 2)), ((2, 4), (0, 2))]
    overlapping = entry((4, 2), slices=[((0, 0), (3, -1)), ((2, 0), (2, -1))])
    cases = {
        "a listed slice is missing": [(b"t", full), first],
        "a slice is not listed": [(b"t", entry((4, 2), slices=[((0, 0), (2, -1))])),
                                  first, second],
        "a slice of no tensor": [first],
        "overlapping slices": [(b"t", overlapping), second,
                               (_slices.slice_key("t", [0, 0], [3, -1]), entry((3, 2)))],
        "a slice of the wrong shape": [(b"t", full), first,
                                       (second[0], entry((1, 2), size=8, offset=16))],
        "a key that is neither": [(b"\xff\xfe", entry((1,)))],
        "a slice key that does not decode": [(b"\x00t\x00", entry((1,)))],
    }
    for what, items in cases.items():
        with pytest.raises(_bundle.BundleFormatError):
            index(items)
            pytest.fail(what)


# -- restores through asyncckpt, end to end ---------------------------------------------


def _save(ckpt_dir, **objects) -> str:
    with at.Checkpoint(**objects) as ckpt:
        return ckpt.save(str(ckpt_dir / "ckpt"))


@pytest.mark.parametrize("saved_shards", [2, 3, 4])
def test_sharded_variable_restores_into_any_shard_count_read_by_asyncckpt(
        ckpt_dir, saved_shards):
    """The restores of issue 24 (3 to 2, 2 to 5, 4 to 1, ...), restore() and read()."""
    rng = np.random.default_rng(test_seed("sharded restore"))
    full = rng.standard_normal((23, 3)).astype(np.float32)  # uneven shards
    path = _save(ckpt_dir, emb=_sharded(full, saved_shards))
    for shards in (1, 2, 3, 5, 23):
        def check(objects, shards=shards):
            assert len(objects["emb"].variables) == shards
            np.testing.assert_array_equal(_whole(objects["emb"]), full)

        restore_both(path, lambda shards=shards: {"emb": _sharded(np.zeros_like(full), shards)},
                     check)
        restore_both(path, lambda shards=shards: {"emb": _sharded(np.zeros_like(full), shards)},
                     check, method="read", verdict="assert_existing_objects_matched")
    # Into one plain variable, and from one plain variable into shards.
    restore_both(path, lambda: {"emb": tf.Variable(tf.zeros_like(full))},
                 lambda o: np.testing.assert_array_equal(o["emb"].numpy(), full))
    (ckpt_dir / "plain").mkdir()
    plain = _save(ckpt_dir / "plain", emb=tf.Variable(full))
    restore_both(plain, lambda: {"emb": _sharded(np.zeros_like(full), saved_shards)},
                 lambda o: np.testing.assert_array_equal(_whole(o["emb"]), full))


def test_sharded_variable_created_after_the_restore_is_read_by_asyncckpt(ckpt_dir):
    """A deferred restoration: the ShardedVariable is attached after restore() returned."""
    full = np.arange(30, dtype=np.float64).reshape(10, 3)
    path = _save(ckpt_dir, emb=_sharded(full, 3), step=tf.Variable(7))
    with OwnReader() as spy:
        ckpt = at.Checkpoint(step=tf.Variable(0))
        status = ckpt.restore(path)
        ckpt.emb = _sharded(np.zeros_like(full), 4)  # restored as it is tracked
        status.assert_consumed()
    np.testing.assert_array_equal(_whole(ckpt.emb), full)
    spy.assert_read_by_asyncckpt(path)


def test_a_damaged_slice_fails_the_restore_before_anything_is_assigned(ckpt_dir):
    full = np.arange(40, dtype=np.float32).reshape(10, 4)
    path = _save(ckpt_dir, emb=_sharded(full, 3), other=tf.Variable(np.ones(5, np.float32)))
    with open(path + ".index", "rb") as f:
        index = _bundle.parse_index(f.read())
    middle = index.slices[KEY][1].entry
    data = _bundle.data_file(path, 0, index.num_shards)
    flip_byte(data, middle.offset + 5, mask=0x01)
    for shards in (3, 2):  # the damaged slice handed over whole, or copied from
        target = _sharded(np.zeros_like(full), shards)
        other = tf.Variable(np.zeros(5, np.float32))
        with pytest.raises(CorruptCheckpointError) as err:
            at.Checkpoint(emb=target, other=other).restore(path)
        assert os.path.basename(err.value.file) == os.path.basename(data)
        assert not _whole(target).any() and not other.numpy().any()
    # Read later, for a deferred restoration: checked before its RestoreV2 returns.
    ckpt = at.Checkpoint(other=tf.Variable(np.zeros(5, np.float32)))
    ckpt.restore(path)
    target = _sharded(np.zeros_like(full), 2)
    with pytest.raises(CorruptCheckpointError):
        ckpt.emb = target
    assert not _whole(target).any()
    flip_byte(data, middle.offset + 5, mask=0x01)
    target = _sharded(np.zeros_like(full), 2)
    at.Checkpoint(emb=target, other=tf.Variable(np.zeros(5, np.float32))).restore(
        path).assert_consumed()
    np.testing.assert_array_equal(_whole(target), full)


def _snappy_literals(data: bytes) -> bytes:
    """``data`` in Snappy's format, as literals only (valid Snappy, no compression)."""
    out = bytearray(varint(len(data)))
    for i in range(0, len(data), 60):
        chunk = data[i:i + 60]
        out.append((len(chunk) - 1) << 2)  # a literal tag of up to 60 bytes
        out += chunk
    return bytes(out)


def _compress_index_block(raw: bytes) -> bytes:
    """The same table with its index block Snappy-compressed (TensorFlow's tables allow it)."""
    footer = raw[-48:]
    meta_offset, pos = _bundle.read_varint(footer, 0)
    meta_size, pos = _bundle.read_varint(footer, pos)
    offset, pos = _bundle.read_varint(footer, pos)
    size, _ = _bundle.read_varint(footer, pos)
    packed = _snappy_literals(raw[offset:offset + size])
    crc = fastcrc.crc32c_extend(fastcrc.crc32c_extend(0, packed), b"\x01")
    block = packed + b"\x01" + fastcrc.mask(crc).to_bytes(4, "little")
    handles = (varint(meta_offset) + varint(meta_size)
               + varint(offset) + varint(len(packed)))
    return raw[:offset] + block + handles.ljust(40, b"\x00") + footer[-8:]


def test_an_index_asyncckpt_does_not_read_is_restored_by_tensorflow_whole(ckpt_dir):
    """A table block type asyncckpt's reader does not read (Snappy): TensorFlow restores.

    The reader refuses the index before reading or assigning anything, and
    the restore is TensorFlow's (after the manifest's whole-file check).
    """
    full = np.arange(24, dtype=np.float32).reshape(8, 3)
    path = _save(ckpt_dir, emb=_sharded(full, 2), step=tf.Variable(3))
    with open(path + ".index", "rb") as f:
        new_index = _compress_index_block(f.read())
    with open(path + ".index", "wb") as f:
        f.write(new_index)
    manifest = read_manifest(manifest_path(path))
    files = tuple(FileRecord(r.name, len(new_index), fastcrc.crc32c_extend(0, new_index),
                             fastcrc.CRC32C) if r.name.endswith(".index") else r
                  for r in manifest.files)
    with open(manifest_path(path), "w") as f:
        f.write(Manifest(framework=manifest.framework, label=manifest.label,
                         step=manifest.step, files=files).to_json())
    record_owned(str(ckpt_dir), os.path.basename(path), marker_suffix=".index", fsync=False)
    with pytest.raises(_bundle.BundleFormatError, match="compressed"):
        _bundle.parse_index(new_index)
    for shards in (2, 3):
        for cls in (at.Checkpoint, tf.train.Checkpoint):
            target, step = _sharded(np.zeros_like(full), shards), tf.Variable(0)
            with OwnReader() as spy:
                cls(emb=target, step=step).restore(path).assert_consumed()
            np.testing.assert_array_equal(_whole(target), full)
            assert int(step.numpy()) == 3
            assert spy.took == ([False] if cls is at.Checkpoint else [])  # TensorFlow's
