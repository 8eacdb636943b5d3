"""The restore pipeline: parallel checksummed reads, TF's bundle read by us, exactness."""

from __future__ import annotations

import os
import random
import zlib

import numpy as np
import pytest

from asyncckpt._engine import fastcrc, reads
from asyncckpt._engine.manifest import read_manifest
from tests.helpers import evict, flip_byte, test_seed

tf = pytest.importorskip("tensorflow")

import asyncckpt.tf as at  # noqa: E402
from asyncckpt import CorruptCheckpointError  # noqa: E402
from asyncckpt.tf import _bundle, _restore  # noqa: E402
from asyncckpt.tf._job import manifest_path  # noqa: E402

# -- _engine.reads ------------------------------------------------------------------


def test_crc_combine_matches_zlib_and_crc32c_for_random_splits():
    google_crc32c = pytest.importorskip("google_crc32c")
    rng = random.Random(test_seed("crc combine"))
    for _ in range(100):
        a, b = rng.randbytes(rng.randrange(0, 2000)), rng.randbytes(rng.randrange(0, 2000))
        assert fastcrc.crc_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
        assert fastcrc.crc_combine(google_crc32c.value(a), google_crc32c.value(b), len(b),
                                 fastcrc.CRC32C) == google_crc32c.value(a + b)


@pytest.mark.parametrize("streams", [1, 4])
def test_file_read_fills_the_buffers_and_checksums_gaps_too(tmp_path, monkeypatch, streams):
    monkeypatch.setattr(reads, "PIECE", 4096)  # many pieces per buffer
    rng = np.random.default_rng(test_seed("file read"))
    data = rng.integers(0, 256, 50_000, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    a, b = np.empty(9_000, np.uint8), reads.aligned_empty(20_001)
    assert b.ctypes.data % reads.ALIGN == 0
    whole = reads.FileRead(str(path), data.size, [(25_000, b), (1_000, a)], checksum=True)
    per = reads.FileRead(str(path), data.size, [(1_000, a.copy()), (25_000, b.copy())],
                         checksum=True, whole_file=False)
    reads.read_all([whole, per], streams=streams)
    np.testing.assert_array_equal(a, data[1_000:10_000])
    np.testing.assert_array_equal(b, data[25_000:45_001])
    assert whole.crc == zlib.crc32(data.tobytes())
    assert whole.dest_crcs == [zlib.crc32(data[25_000:45_001]), zlib.crc32(data[1_000:10_000])]
    assert per.crc is None and per.dest_crcs == whole.dest_crcs[::-1]

    os.truncate(path, 30_000)  # shorter than the planned read
    short = reads.FileRead(str(path), data.size, [(25_000, b)], checksum=True)
    with pytest.raises(reads.ShortReadError) as err:
        reads.read_all([short], streams=streams)
    assert err.value.path == str(path)


def test_huge_buffers_take_the_file_offsets_alignment_for_direct_reads():
    for offset in (0, 64, 4096 + 640, 3 * 4096):
        buf = reads.aligned_empty(reads.HUGE + 5, file_offset=offset)
        assert buf.nbytes == reads.HUGE + 5 and buf.flags.writeable
        assert buf.ctypes.data % reads.DIRECT_ALIGN == offset % reads.DIRECT_ALIGN
    # An offset that is not ALIGN-aligned cannot be matched without losing ALIGN.
    assert reads.aligned_empty(reads.HUGE, file_offset=13).ctypes.data % reads.ALIGN == 0


@pytest.mark.parametrize("probe", ["cachestat", "mincore"])
def test_page_cache_residency_decides_direct_or_buffered_reads(tmp_path, monkeypatch, probe):
    """Both probes see the same residency; cold files go by O_DIRECT, cached ones buffered."""
    if probe == "mincore":
        monkeypatch.setattr(reads, "_syscall", False)  # as on a kernel without cachestat
    path = tmp_path / "data.bin"
    payload = os.urandom(4 * reads.HUGE)
    path.write_bytes(payload)
    fd = os.open(path, os.O_RDONLY)
    try:
        pages = len(payload) // 4096
        assert reads.resident_pages(fd, len(payload)) == (pages, pages)
        assert reads.resident_fraction(fd, len(payload)) == 1.0
        evict(path)
        assert reads.resident_fraction(fd, len(payload)) == 0.0
        # A quarter cached again, without readahead: pages of an asynchronous
        # readahead still arriving would change the count between two probes.
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        os.pread(fd, reads.HUGE, 0)
        stat = reads.cached_pages(fd, len(payload))
        if probe == "cachestat" and stat is not None:  # None: this kernel lacks cachestat
            assert stat == reads.resident_pages(fd, len(payload))
        assert 0.25 <= reads.resident_fraction(fd, len(payload)) < 1.0
    finally:
        os.close(fd)
    probe_fd = reads._open_direct(str(path))
    if probe_fd < 0:
        pytest.skip("this file system refuses O_DIRECT")
    os.close(probe_fd)
    opens = _DirectOpens(monkeypatch)
    for cold in (True, False):
        if cold:
            evict(path)
        else:
            path.read_bytes()  # all of it in the page cache
        buf = reads.aligned_empty(len(payload))
        read = reads.FileRead(str(path), len(payload), [(0, buf)], checksum=True,
                              algorithm=fastcrc.CRC32C)
        reads.read_all([read])
        assert buf.tobytes() == payload and read.crc == fastcrc.crc32c_extend(0, payload)
        assert opens.count == 1  # the cold read went by O_DIRECT, the cached one not


@pytest.mark.parametrize("direct", [True, False], ids=["o-direct", "buffered"])
def test_direct_and_buffered_reads_fill_the_same_bytes_and_crcs(tmp_path, monkeypatch, direct):
    """Aligned middles by O_DIRECT, unaligned heads and tails buffered: same bytes, same CRCs."""
    monkeypatch.setattr(reads, "PIECE", 64 << 10)  # several direct pieces per buffer
    rng = np.random.default_rng(test_seed("direct reads"))
    size = reads.HUGE * 2 + 12_345
    data = rng.integers(0, 256, size, dtype=np.uint8)
    path = tmp_path / "f.bin"
    path.write_bytes(data.tobytes())
    evict(path)
    spans = [(0, reads.HUGE + 100), (reads.HUGE + 100 + 4000, reads.HUGE - 7000),
             (2 * reads.HUGE + 64, size - 2 * reads.HUGE - 64)]
    bufs = [reads.aligned_empty(n, file_offset=off) for off, n in spans]
    dests = [(off, b) for (off, _), b in zip(spans, bufs, strict=True)]
    algorithm = fastcrc.CRC32C if reads.has_fast_crc32c() else fastcrc.CRC32
    read = reads.FileRead(str(path), size, dests, checksum=True, algorithm=algorithm)
    assert any(p.direct for p in read.pieces) and not all(p.direct for p in read.pieces)
    opened = read.open(direct=direct)
    if direct and not opened:
        read.close()
        pytest.skip("this file system refuses O_DIRECT")
    assert opened == direct
    reads.read_all([read])
    crc = reads._checksum(read.algorithm)
    for (off, n), b in zip(spans, bufs, strict=True):
        np.testing.assert_array_equal(b, data[off:off + n])
    assert read.dest_crcs == [crc(memoryview(data[off:off + n])) for off, n in spans]
    assert read.crc == crc(memoryview(data))

    os.truncate(path, reads.HUGE + 5000)  # shorter than the planned read, mid direct piece
    evict(path)
    short = reads.FileRead(str(path), size, [(0, reads.aligned_empty(size))], checksum=True)
    short.open(direct=direct)
    with pytest.raises(reads.ShortReadError) as err:
        reads.read_all([short])
    assert err.value.path == str(path)


# -- TensorFlow: the bundle read by us ------------------------------------------------


def _variables() -> dict:
    rng = np.random.default_rng(test_seed("tf restore dtypes"))
    return {
        "f32": tf.Variable(rng.standard_normal((37, 5)).astype(np.float32)),
        "f64": tf.Variable(rng.standard_normal(11)),
        "f16": tf.Variable(rng.standard_normal(7).astype(np.float16)),
        "bf16": tf.Variable(tf.constant(rng.standard_normal(13), tf.bfloat16)),
        "i64_scalar": tf.Variable(np.int64(-(2**40) - 3)),
        "i8": tf.Variable(np.array([-128, 0, 127], np.int8)),
        "u16": tf.Variable(np.array([0, 65535], np.uint16)),
        "flags": tf.Variable(np.array([True, False, True])),
        "c64": tf.Variable(np.array([1 + 2j, -3j], np.complex64)),
        "empty": tf.Variable(np.zeros((0, 4), np.float32)),
    }


class _Recorder:
    """Wraps the real ``_restore.prefetch`` and records whether it took the checkpoint."""

    def __init__(self, monkeypatch):
        self.took: list[bool] = []
        real = _restore.prefetch

        def wrapped(*args, **kwargs):
            out = real(*args, **kwargs)
            self.took.append(out is not None)
            return out

        monkeypatch.setattr(_restore, "prefetch", wrapped)


def _values(variables: dict) -> dict:
    return {k: v.numpy() for k, v in variables.items()}


def _assert_same(got: dict, want: dict) -> None:
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        np.testing.assert_array_equal(g.view(np.uint8) if g.dtype.itemsize == 2 else g,
                                      w.view(np.uint8) if w.dtype.itemsize == 2 else w, k)


def test_tf_restore_reads_every_dtype_exactly_and_stays_tensorflow_readable(
        ckpt_dir, monkeypatch):
    variables = _variables()
    want = _values(variables)
    with at.Checkpoint(**variables) as ckpt:
        path = ckpt.save(str(ckpt_dir / "ckpt"))
        ckpt.sync()
    recorder = _Recorder(monkeypatch)
    fresh = {k: tf.Variable(tf.zeros_like(v)) for k, v in variables.items()}
    at.Checkpoint(**fresh).restore(path).assert_consumed()
    assert recorder.took == [True]  # the fast path read it
    _assert_same(_values(fresh), want)
    # The bytes now belong to the variables: updating one changes nothing else.
    fresh["f32"].assign_add(tf.ones_like(fresh["f32"]))
    np.testing.assert_array_equal(fresh["f32"].numpy(), want["f32"] + 1)
    # Plain TensorFlow still reads the files.
    plain = {k: tf.Variable(tf.zeros_like(v)) for k, v in variables.items()}
    tf.train.Checkpoint(**plain).restore(path).assert_consumed()
    _assert_same(_values(plain), want)


def _optimizer_state():
    v = tf.Variable(np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6))
    opt = tf.compat.v1.train.AdamOptimizer(0.1)
    for _ in range(3):
        opt.minimize(lambda: tf.reduce_sum(v * v), var_list=[v])
    return v, opt


def test_tf_restore_fills_slot_variables_and_deferred_ones(ckpt_dir, monkeypatch):
    v, opt = _optimizer_state()
    slots = {n: opt.get_slot(v, n).numpy() for n in opt.get_slot_names()}
    assert set(slots) == {"m", "v"}
    with at.Checkpoint(v=v, opt=opt) as ckpt:
        path = ckpt.save(str(ckpt_dir / "ckpt"))
        ckpt.sync()
    recorder = _Recorder(monkeypatch)
    # An optimizer whose slots exist already: restored by the fast path.
    v2, opt2 = _optimizer_state()
    v2.assign(tf.zeros_like(v2))
    at.Checkpoint(v=v2, opt=opt2).restore(path).assert_consumed()
    np.testing.assert_array_equal(v2.numpy(), v.numpy())
    for name, value in slots.items():
        np.testing.assert_array_equal(opt2.get_slot(v2, name).numpy(), value)
    # One whose slots are created after the restore (TensorFlow's deferred restore).
    v3 = tf.Variable(tf.zeros_like(v))
    opt3 = tf.compat.v1.train.AdamOptimizer(0.1)
    status = at.Checkpoint(v=v3, opt=opt3).restore(path)
    opt3._create_slots([v3])  # what the first minimize() does
    status.assert_consumed()
    for name, value in slots.items():
        np.testing.assert_array_equal(opt3.get_slot(v3, name).numpy(), value)
    assert recorder.took == [True, True]


@pytest.mark.parametrize("check", ["bundle", "manifest-crc32c", "manifest-crc32"])
def test_tf_restore_detects_a_flipped_byte_anywhere_before_assigning(
        ckpt_dir, monkeypatch, check):
    """Every tensor's first and last byte, the object graph, the index: all caught.

    With a hardware CRC32C, data files are checked against TensorFlow's own
    per-tensor CRC32C and the manifest's whole-file CRC32C (both from one
    pass); with the restore told there is none ("manifest-crc32c"), against
    the manifest's CRC32C alone; with no native CRC32C at save time either
    ("manifest-crc32"), the manifest records zlib's CRC32 and the restore
    checks that.
    """
    if not fastcrc.available():
        pytest.skip("no hardware CRC32C (google_crc32c) installed")
    if check == "manifest-crc32c":
        monkeypatch.setattr(reads, "has_fast_crc32c", lambda: False)
    elif check == "manifest-crc32":
        monkeypatch.setattr(fastcrc, "available", lambda: False)
    variables = {k: v for k, v in _variables().items() if k in ("f32", "bf16", "i64_scalar")}
    want = _values(variables)
    with at.Checkpoint(**variables) as ckpt:
        path = ckpt.write(str(ckpt_dir / "ckpt"))
        ckpt.sync()
    algorithms = {f.algorithm for f in read_manifest(manifest_path(path)).files}
    assert algorithms == {fastcrc.CRC32 if check == "manifest-crc32" else fastcrc.CRC32C}
    with open(path + ".index", "rb") as f:
        index = _bundle.parse_index(f.read())
    data = _bundle.data_file(path, 0, index.num_shards)
    spots = [(data, e.offset + d) for e in index.entries.values() for d in (0, e.size - 1)]
    spots.append((path + ".index", 10))
    target = {k: tf.Variable(tf.zeros_like(v)) for k, v in variables.items()}
    reader = at.Checkpoint(**target)
    for file, offset in spots:
        flip_byte(file, offset, mask=0x01)
        with pytest.raises(CorruptCheckpointError) as err:
            reader.read(path)
        assert os.path.basename(err.value.file) == os.path.basename(file)
        flip_byte(file, offset, mask=0x01)  # back as it was
        for v in target.values():  # nothing was assigned
            assert not np.any(v.numpy().astype(np.float64))
    reader.read(path).assert_consumed()
    _assert_same(_values(target), want)


class _DirectOpens:
    """Wraps the real ``reads._open_direct``; counts the descriptors it gave."""

    def __init__(self, monkeypatch):
        self.count = 0
        real = reads._open_direct

        def wrapped(path):
            fd = real(path)
            self.count += fd >= 0
            return fd

        monkeypatch.setattr(reads, "_open_direct", wrapped)


def test_tf_restore_of_cold_files_reads_directly_and_still_catches_a_flipped_byte(
        ckpt_dir, monkeypatch):
    """Large tensors of evicted files go by O_DIRECT into huge pages, checked all the same."""
    rng = np.random.default_rng(test_seed("tf direct"))
    variables = {"big": tf.Variable(rng.standard_normal((3, 1 << 18)).astype(np.float32)),
                 "odd": tf.Variable(rng.standard_normal(reads.HUGE // 8 + 3))}
    want = _values(variables)
    with at.Checkpoint(**variables) as ckpt:
        path = ckpt.write(str(ckpt_dir / "ckpt"))
        ckpt.sync()
    with open(path + ".index", "rb") as f:
        index = _bundle.parse_index(f.read())
    data = _bundle.data_file(path, 0, index.num_shards)
    big = index.entries["big/.ATTRIBUTES/VARIABLE_VALUE"]
    probe = reads._open_direct(data)
    supported = probe >= 0
    if supported:
        os.close(probe)
    opens = _DirectOpens(monkeypatch)
    target = {k: tf.Variable(tf.zeros_like(v)) for k, v in variables.items()}
    reader = at.Checkpoint(**target)
    flip_byte(data, big.offset + big.size // 2, mask=0x01)
    evict(data)
    with pytest.raises(CorruptCheckpointError) as err:
        reader.read(path)
    assert os.path.basename(err.value.file) == os.path.basename(data)
    for v in target.values():  # nothing was assigned
        assert not np.any(v.numpy())
    flip_byte(data, big.offset + big.size // 2, mask=0x01)
    evict(data)
    reader.read(path).assert_consumed()
    _assert_same(_values(target), want)
    if supported:
        assert opens.count == 2  # both reads went by O_DIRECT


def test_tf_restore_falls_back_to_tensorflow_for_foreign_files_and_io_device(
        ckpt_dir, monkeypatch):
    variables = _variables()
    want = _values(variables)
    foreign = tf.train.Checkpoint(**variables).write(str(ckpt_dir / "plain"))
    with at.Checkpoint(**variables) as ckpt:
        ours = ckpt.write(str(ckpt_dir / "ours"))
        ckpt.sync()
    recorder = _Recorder(monkeypatch)
    target = {k: tf.Variable(tf.zeros_like(v)) for k, v in variables.items()}
    at.Checkpoint(**target).read(foreign).assert_consumed()  # no manifest: TF reads
    _assert_same(_values(target), want)
    for v in target.values():
        v.assign(tf.zeros_like(v))
    options = tf.train.CheckpointOptions(experimental_io_device="/job:localhost/device:CPU:0")
    at.Checkpoint(**target).read(ours, options=options).assert_consumed()
    _assert_same(_values(target), want)
    assert recorder.took == []  # neither went through the fast path


def test_bundle_index_matches_tensorflow_across_many_blocks(tmp_path):
    # Enough keys for several 4 KiB index blocks.
    variables = {f"v{i:03d}": tf.Variable(np.full(i + 1, i, np.int32)) for i in range(120)}
    variables["s"] = tf.Variable(tf.constant(3.0, tf.bfloat16))
    path = tf.train.Checkpoint(**variables).write(str(tmp_path / "ckpt"))
    with open(path + ".index", "rb") as f:
        index = _bundle.parse_index(f.read())
    reader = tf.train.load_checkpoint(path)
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    assert set(index.entries) == set(shapes)
    with open(_bundle.data_file(path, 0, index.num_shards), "rb") as f:
        data = f.read()
    for key, entry in index.entries.items():
        assert [d.size for d in entry.shape.dim] == list(shapes[key])
        assert entry.dtype == dtypes[key].as_datatype_enum
        raw = data[entry.offset:entry.offset + entry.size]
        if entry.dtype == tf.string.as_datatype_enum:
            if not reads.has_fast_crc32c():
                continue  # the CRC32C of string tensors is only checked with google_crc32c
            crc = _bundle.string_tensor_crc32c(raw, 1)
            assert _restore._masked(crc) == entry.crc32c
        elif key.startswith("v"):
            i = int(key[1:4])
            np.testing.assert_array_equal(np.frombuffer(raw, np.int32), np.full(i + 1, i))
    with pytest.raises(_bundle.BundleFormatError):
        _bundle.parse_index(b"\0" * 100)


# -- the benchmark's cold-cache check and recovery child ------------------------------


def test_bench_eviction_is_verified_by_mincore_and_the_raw_recovery_child_runs(tmp_path):
    from benchmarks.suite import restore as bench_restore

    path = tmp_path / "raw.bin"
    path.write_bytes(os.urandom(1 << 20))
    seen: list[float] = []
    bench_restore.evict([str(path)], seen)
    assert seen == [0.0]  # nothing of it left in the page cache
    path.read_bytes()
    assert bench_restore.resident_fraction([str(path)]) == 1.0
    marks = bench_restore.run_child("raw", str(path), {"rows": 0, "tensors": 1})
    assert 0 < marks["imports"] <= marks["listed"] <= marks["restored"] <= marks["step"]
