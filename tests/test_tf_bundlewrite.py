"""asyncckpt's own writer of TensorFlow's bundle format, checked against TensorFlow."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
ml_dtypes = pytest.importorskip("ml_dtypes")

from tensorflow.python.distribute.sharded_variable import ShardedVariable  # noqa: E402

import asyncckpt.tf as at  # noqa: E402
from asyncckpt._engine import datafile, fastcrc  # noqa: E402
from asyncckpt.tf import _bundlewrite, _job, _slices  # noqa: E402
from asyncckpt.tf._snapshot import StagedState, StagedTensor  # noqa: E402
from tests.tfrestore import restore_both  # noqa: E402

pytestmark = pytest.mark.skipif(not fastcrc.available(), reason="no native CRC32C")


def _state(many_keys: int = 0) -> StagedState:
    rng = np.random.default_rng(0)
    v = "/.ATTRIBUTES/VARIABLE_VALUE"
    tensors = [
        StagedTensor("a" + v, "", tf.float32, rng.random((30, 7), dtype=np.float32)),
        StagedTensor("scalar" + v, "", tf.int64, np.array(-3, np.int64)),
        StagedTensor("empty" + v, "", tf.float16, np.zeros((0, 4), np.float16)),
        StagedTensor("bool" + v, "", tf.bool, rng.random(5) > 0.5),
        StagedTensor("bf16" + v, "", tf.bfloat16, rng.random(6).astype(ml_dtypes.bfloat16)),
        StagedTensor("half" + v, "", tf.float16, rng.random(9).astype(np.float16)),
        StagedTensor("c64" + v, "", tf.complex64, (rng.random(4) + 1j).astype(np.complex64)),
        StagedTensor("c128" + v, "", tf.complex128, (rng.random(3) - 2j).astype(np.complex128)),
        StagedTensor("i8" + v, "", tf.int8, rng.integers(-128, 127, 1000, dtype=np.int8)),
        StagedTensor("u16" + v, "", tf.uint16, rng.integers(0, 9, (3, 3), dtype=np.uint16)),
        # Python state and string variables: bytes that OrderedCode and the
        # string encoding must escape or count correctly.
        StagedTensor("py/.ATTRIBUTES/PY_STATE", "", tf.string,
                     np.array(b"a\x00b\xffc" * 40, dtype=object)),
        StagedTensor("strs" + v, "", tf.string,
                     np.array([[b"x", b""], [b"abc" * 100, b"\xff\x00"]], dtype=object)),
        StagedTensor("nostr" + v, "", tf.string, np.zeros((0,), dtype=object)),
        # A partitioned variable: two slices, one with a whole-dimension extent.
        StagedTensor("part" + v, "300 2 0,200:-", tf.float64, rng.random((200, 2))),
        StagedTensor("part" + v, "300 2 200,100:0,2", tf.float64, rng.random((100, 2))),
        # A slice spec that covers the whole tensor: saved as a plain entry.
        StagedTensor("whole" + v, "3 4 0,3:0,4", tf.float32, rng.random((3, 4), np.float32)),
    ]
    for i in range(many_keys):  # long keys over several 256 KiB index blocks
        tensors.append(StagedTensor(f"many/{i:05d}/" + "k" * 300 + v, "", tf.int32,
                                    np.array([i, -i], np.int32)))
    return StagedState(tuple(tensors), b"object\x00graph\xff" * 100)


@pytest.mark.parametrize(("chunk", "max_iov", "many", "combine_min"), [
    (16 << 20, 512, 0, 1 << 20),
    (100, 3, 900, 1 << 20),  # tensors cut over ranges, several views per range, big index
    (100, 3, 0, 5),  # the file's CRC32C by combining the views' CRCs
    (7, 1, 0, 1),
])
def test_files_are_byte_identical_to_savev2(tmp_path, monkeypatch, chunk, max_iov, many,
                                            combine_min):
    monkeypatch.setattr(datafile, "_RANGE", chunk)
    monkeypatch.setattr(datafile, "_MAX_IOV", max_iov)
    monkeypatch.setattr(datafile, "_COMBINE_MIN", combine_min)
    state = _state(many)
    _job.save_v2_bundle(str(tmp_path / "ref"), state)
    sums = _bundlewrite.write_bundle(str(tmp_path / "ours"), state)
    assert sums is not None
    for suffix in (".index", ".data-00000-of-00001"):
        ours = (tmp_path / ("ours" + suffix)).read_bytes()
        assert ours == (tmp_path / ("ref" + suffix)).read_bytes(), suffix
        assert sums["ours" + suffix] == (len(ours), fastcrc.crc32c_extend(0, ours),
                                         fastcrc.CRC32C)
    reader = tf.train.load_checkpoint(str(tmp_path / "ours"))
    np.testing.assert_array_equal(reader.get_tensor("part/.ATTRIBUTES/VARIABLE_VALUE")[:200],
                                  state.tensors[13].host)
    assert reader.get_tensor("py/.ATTRIBUTES/PY_STATE") == b"a\x00b\xffc" * 40


def test_ordered_code_numbers_match_tensorflows_examples():
    # The examples of tensorflow/core/lib/strings/ordered_code.cc.
    assert _slices.encode_signed(0x424242) == bytes.fromhex("f0424242")
    assert _slices.encode_signed(-0x800) == bytes.fromhex("3800")
    assert _slices.encode_signed(-1) == b"\x7f"
    assert _slices.encode_unsigned(0) == b"\x00"
    assert _slices.encode_unsigned(0x1234) == b"\x02\x12\x34"


def _spy(monkeypatch) -> list:
    """Records what the own writer returned for every save (None: SaveV2 wrote it)."""
    calls = []
    real = _bundlewrite.write_bundle

    def spy(prefix, state, **kw):
        calls.append(real(prefix, state, **kw))
        return calls[-1]

    monkeypatch.setattr(_bundlewrite, "write_bundle", spy)
    return calls


def test_checkpoint_written_by_asyncckpt_restores_with_plain_tensorflow(ckpt_dir, monkeypatch):
    calls = _spy(monkeypatch)
    rng = np.random.default_rng(1)
    full = rng.random((24, 3), dtype=np.float32)
    shards = []
    for i, part in enumerate(np.split(full, 3)):
        with tf.device(f"/cpu:{i}"):
            shards.append(tf.Variable(part))
    objects = dict(
        w=tf.Variable(rng.random((64, 32), dtype=np.float32)),
        h=tf.Variable(rng.random(7).astype(np.float16)),
        b=tf.Variable(tf.cast(rng.random(5), tf.bfloat16)),
        n=tf.Variable(np.int64(7)),
        flag=tf.Variable([True, False]),
        c=tf.Variable(np.array([1 + 2j], np.complex128)),
        e=tf.Variable(tf.zeros((0, 3))),
        s=tf.Variable(b"some \x00 bytes"),
        emb=ShardedVariable(shards),
    )
    with at.Checkpoint(**objects) as ckpt:
        path = ckpt.save(str(ckpt_dir / "ckpt"))
        ckpt.sync()
    assert calls and calls[-1] is not None  # the own writer wrote it
    at.verify_checkpoint(path)  # the manifest's CRC32s match the files

    names = dict(tf.train.list_variables(path))
    assert names["w/.ATTRIBUTES/VARIABLE_VALUE"] == [64, 32]
    assert names["emb/.ATTRIBUTES/VARIABLE_VALUE"] == [24, 3]

    def make():
        fresh = {k: tf.Variable(tf.zeros_like(v)) for k, v in objects.items() if k != "emb"}
        return {**fresh, "emb": ShardedVariable([tf.Variable(tf.zeros((12, 3)))
                                                 for _ in range(2)])}

    def check(o):
        for k, v in o.items():
            if k != "emb":
                np.testing.assert_array_equal(v.numpy(), objects[k].numpy())
        np.testing.assert_array_equal(np.concatenate([v.numpy() for v in o["emb"].variables]),
                                      full)

    restore_both(path, make, check)


def test_tensorflow_checks_the_written_crc32c(ckpt_dir):
    w = tf.Variable(np.arange(4096, dtype=np.float32))
    with at.Checkpoint(w=w) as ckpt:
        path = ckpt.save(str(ckpt_dir / "ckpt"))
        ckpt.sync()
    restore_both(path, lambda: {"w": tf.Variable(tf.zeros(4096))},
                 lambda o: np.testing.assert_array_equal(o["w"].numpy(), w.numpy()))
    entry = _bundle_entry(path, "w/.ATTRIBUTES/VARIABLE_VALUE")
    data = path + ".data-00000-of-00001"
    with open(data, "r+b") as f:
        f.seek(entry.offset + entry.size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(tf.errors.DataLossError, match=r"(?i)checksum|crc"):
        tf.train.Checkpoint(w=tf.Variable(tf.zeros(4096))).restore(path)


def _bundle_entry(prefix: str, key: str):
    from asyncckpt.tf import _bundle

    with open(prefix + ".index", "rb") as f:
        return _bundle.parse_index(f.read()).entries[key]


def test_what_the_own_writer_cannot_write_goes_to_savev2(tmp_path):
    plain = StagedTensor("x", "", tf.float32, np.ones(3, np.float32))
    remote = StagedState((plain,), b"g", io_device="/job:worker/replica:0/task:1/device:CPU:0")
    assert "not the local CPU" in _bundlewrite._plan(remote)
    assert _bundlewrite.write_bundle(str(tmp_path / "r"), remote) is None
    assert not os.listdir(tmp_path)  # nothing written: SaveV2 writes it all
    local = StagedState((plain,), b"g", io_device="/job:localhost/replica:0/task:0/device:CPU:0")
    assert not isinstance(_bundlewrite._plan(local), str)
    bad_slice = StagedState((StagedTensor("x", "3 0,9", tf.float32, np.ones(3, np.float32)),), b"")
    assert "does not fit" in _bundlewrite._plan(bad_slice)
    twice = StagedState((plain, plain), b"")
    assert "saved twice" in _bundlewrite._plan(twice)


def test_a_write_error_on_a_helper_thread_is_raised_by_the_writer(tmp_path, monkeypatch):
    monkeypatch.setattr(datafile, "_RANGE", 1000)
    real = os.pwritev
    calls = []

    def full_disk(fd, views, offset):  # the real call, until the disk is "full"
        calls.append(offset)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        return real(fd, views, offset)

    monkeypatch.setattr(datafile.os, "pwritev", full_disk)
    state = StagedState((StagedTensor("x", "", tf.float32, np.ones(10000, np.float32)),), b"g")
    with pytest.raises(OSError, match="No space left"):
        _bundlewrite.write_bundle(str(tmp_path / "ckpt"), state)
    assert not (tmp_path / "ckpt.index").exists()  # no index: the bundle is not complete


def _big_state() -> StagedState:
    rng = np.random.default_rng(7)
    return StagedState((
        StagedTensor("odd", "", tf.int8, rng.integers(-9, 9, 4097, np.int8)),
        StagedTensor("big", "", tf.float32, rng.random(300_000, np.float32)),
        StagedTensor("tail", "", tf.float64, rng.random(1001)),
    ), b"object graph")


def _direct_ok(directory) -> bool:
    probe = directory / "probe"
    probe.write_bytes(b"")
    fd = datafile._open_direct_for_write(str(probe))
    if fd >= 0:
        os.close(fd)
    return fd >= 0


def _direct_jobs(monkeypatch) -> list:
    """Records the offsets of the ranges written with O_DIRECT (the real function runs)."""
    offsets = []
    real = datafile._run_range_direct

    def spy(fd, job, needs_crc):
        out = real(fd, job, needs_crc)
        offsets.append(job.offset)
        return out

    monkeypatch.setattr(datafile, "_run_range_direct", spy)
    return offsets


def _assert_same_as_savev2(tmp_path, state, sums) -> None:
    _job.save_v2_bundle(str(tmp_path / "ref"), state)
    for suffix in (".index", ".data-00000-of-00001"):
        ours = (tmp_path / ("ours" + suffix)).read_bytes()
        assert ours == (tmp_path / ("ref" + suffix)).read_bytes(), suffix
        assert sums["ours" + suffix] == (len(ours), fastcrc.crc32c_extend(0, ours),
                                         fastcrc.CRC32C)


def test_aligned_ranges_are_written_with_o_direct_and_the_files_stay_identical(
        tmp_path, monkeypatch):
    if not _direct_ok(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    monkeypatch.setattr(datafile, "_RANGE", 64 << 10)
    monkeypatch.setattr(datafile, "DIRECT_MIN", 0)  # a big file's way, on a small one
    direct = _direct_jobs(monkeypatch)
    state = _big_state()
    sums = _bundlewrite.write_bundle(str(tmp_path / "ours"), state)
    size = sums["ours.data-00000-of-00001"][0]
    # Every whole 64 KiB range went around the page cache; the unaligned tail did not.
    assert sorted(direct) == list(range(0, size - size % (64 << 10), 64 << 10))
    _assert_same_as_savev2(tmp_path, state, sums)
    reader = tf.train.load_checkpoint(str(tmp_path / "ours"))
    np.testing.assert_array_equal(reader.get_tensor("big"), state.tensors[1].host)


def test_a_refused_direct_write_goes_through_the_page_cache_and_a_full_disk_fails(
        tmp_path, monkeypatch):
    monkeypatch.setattr(datafile, "_RANGE", 64 << 10)
    monkeypatch.setattr(datafile, "DIRECT_MIN", 0)
    real = os.pwrite
    refusal = [errno.EINVAL]

    def pwrite(fd, data, offset):  # only the direct writes go through os.pwrite
        raise OSError(refusal[0], os.strerror(refusal[0]))

    monkeypatch.setattr(datafile.os, "pwrite", pwrite)
    state = _big_state()
    sums = _bundlewrite.write_bundle(str(tmp_path / "ours"), state)
    monkeypatch.setattr(datafile.os, "pwrite", real)
    _assert_same_as_savev2(tmp_path, state, sums)
    if not _direct_ok(tmp_path):
        return  # no direct writes on this file system: nothing more to refuse
    refusal[0] = errno.ENOSPC
    monkeypatch.setattr(datafile.os, "pwrite", pwrite)
    with pytest.raises(OSError, match="No space left"):
        _bundlewrite.write_bundle(str(tmp_path / "full"), state)
    assert not (tmp_path / "full.index").exists()


def test_direct_write_buffers_fit_the_ranges_and_are_reused_from_save_to_save(
        tmp_path, monkeypatch):
    if not _direct_ok(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    chunk = 2 << 20
    monkeypatch.setattr(datafile, "_RANGE", chunk)
    monkeypatch.setattr(datafile, "_MIN_RANGE", chunk)  # not an eighth of this small file
    monkeypatch.setattr(datafile, "_BOUNCE", [])
    monkeypatch.setattr(datafile, "_BOUNCE_SIZE", [0])
    allocated = []
    real_mmap = datafile.mmap.mmap

    def counting_mmap(fileno, length, *args, **kwargs):
        allocated.append(length)
        return real_mmap(fileno, length, *args, **kwargs)

    monkeypatch.setattr(datafile.mmap, "mmap", counting_mmap)
    rng = np.random.default_rng(3)
    # 5.5 MiB of data: two whole 2 MiB ranges and a shorter tail range.
    state = StagedState((
        StagedTensor("a", "", tf.float32, rng.random(3 << 18, np.float32)),
        StagedTensor("b", "", tf.float32, rng.random(5 << 17, np.float32)),
    ), b"object graph")
    direct = _direct_jobs(monkeypatch)
    sums = _bundlewrite.write_bundle(str(tmp_path / "ours"), state)
    assert direct, "no range was written O_DIRECT"
    # Buffers the size of a range, not of the default 16 MiB range.
    assert allocated and set(allocated) == {chunk}
    kept = list(datafile._BOUNCE)
    assert kept and all(len(b) == chunk for b in kept)
    _assert_same_as_savev2(tmp_path, state, sums)
    # The next save of the same state allocates nothing.
    allocated.clear()
    _bundlewrite.write_bundle(str(tmp_path / "again"), state)
    assert allocated == []


def test_direct_write_buffers_are_sized_in_whole_mib_by_the_largest_range(monkeypatch):
    monkeypatch.setattr(datafile, "_BOUNCE", [])
    monkeypatch.setattr(datafile, "_BOUNCE_SIZE", [0])
    mib = 1 << 20
    small = datafile._take_bounce(3 * mib + 1)
    assert len(small) == 4 * mib  # a 3 MiB state does not get a 16 MiB buffer
    datafile._give_bounce(small)
    assert datafile._take_bounce(mib) is small  # a shorter range reuses it
    larger = datafile._take_bounce(5 * mib)
    assert len(larger) == 5 * mib
    datafile._give_bounce(small)  # now too small for the ranges seen: dropped
    datafile._give_bounce(larger)
    assert len(datafile._BOUNCE) == 1 and datafile._BOUNCE[0] is larger
    assert datafile._take_bounce(2 * mib) is larger
