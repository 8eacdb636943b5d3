"""The framework-neutral engine: slots, writer, commit, manifest, retention."""

from __future__ import annotations

import json
import mmap
import os
import subprocess
import sys
import threading
import zlib

import numpy as np
import pytest

from asyncckpt import AsyncOptions, CorruptCheckpointError, EngineClosedError
from asyncckpt._engine import commit, fastcrc, retention
from asyncckpt._engine._copy import copy_arrays
from asyncckpt._engine.commit import cleanup_stale_temps, make_temp_dir, publish_dir, publish_files
from asyncckpt._engine.files import Checksummed, DurableWriter
from asyncckpt._engine.manifest import Manifest, read_manifest, verify_files
from asyncckpt._engine.retention import Candidate, RetentionPolicy
from asyncckpt._engine.slots import StagingPool
from asyncckpt._engine.writer import AsyncEngine
from tests.jobs import DirJob


def test_engine_package_imports_no_framework():
    code = (
        "import sys, asyncckpt, asyncckpt._engine;"
        "bad = [m for m in ('tensorflow', 'jax') if m in sys.modules];"
        "sys.exit(1 if bad else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_slot_buffers_are_reused_and_trimmed():
    pool = StagingPool(1)
    slot, _ = pool.acquire()
    a = slot.buffer("a", (4, 4), np.float32)
    b = slot.buffer("b", (8,), np.int64)
    assert a.ctypes.data % 64 == 0 and b.ctypes.data % 64 == 0
    slot.trim()
    pool.release(slot)
    slot, _ = pool.acquire()
    assert slot.buffer("a", (4, 4), np.float32).ctypes.data == a.ctypes.data
    # Same bytes, other shape/dtype: still the same memory.
    assert slot.buffer("b", (16,), np.int32).ctypes.data == b.ctypes.data
    slot.trim()
    pool.release(slot)
    slot, _ = pool.acquire()
    slot.buffer("a", (4, 4), np.float32)
    slot.trim()  # "b" was not used by this save: freed
    assert slot.nbytes == 64


def test_pool_blocks_until_a_slot_is_released():
    pool = StagingPool(1)
    slot, _ = pool.acquire()
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.05)
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire(timeout=30)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and not got  # blocked while the only slot is out
    pool.release(slot)
    waiter.join(30)
    ((again, waited),) = got
    assert again is slot and waited > 0
    with pytest.raises(RuntimeError, match="twice"):
        pool.release(again)
        pool.release(again)


def test_copy_arrays_copies_large_and_small_arrays():
    rng = np.random.default_rng(0)
    srcs = [rng.random(n).astype(np.float32) for n in (3, 1 << 20, 5 << 20)]
    dsts = [np.zeros_like(s) for s in srcs]
    copy_arrays(list(zip(dsts, srcs, strict=True)))
    for d, s in zip(dsts, srcs, strict=True):
        np.testing.assert_array_equal(d, s)
    with pytest.raises(ValueError, match="mismatch"):
        copy_arrays([(np.zeros(3, np.float32), np.zeros(3, np.float64))])
    # The last of many pairs has another shape: named, and nothing is copied.
    many = [(np.zeros(1 << 16, np.float32), np.ones(1 << 16, np.float32)) for _ in range(63)]
    many.append((np.zeros((4, 4), np.float32), np.ones((2, 8), np.float32)))
    with pytest.raises(ValueError, match=r"\(2, 8\)/float32 into \(4, 4\)/float32"):
        copy_arrays(many)
    assert not any(d.any() for d, _ in many)
    # Same shapes, another byte order: a dtype mismatch too.
    with pytest.raises(ValueError, match="mismatch"):
        copy_arrays([(np.zeros(8, "<f4"), np.zeros(8, ">f4"))])


def test_copy_columns_views_cpu_jax_arrays_as_it_copies_them():
    """Sources may be CPU ``jax.Array``s, small, shared out and cut in pieces alike."""
    import jax.numpy as jnp
    import ml_dtypes

    from asyncckpt._engine._copy import copy_columns

    rng = np.random.default_rng(3)
    host = [rng.random(n).astype(np.float32) for n in (3, 2 << 10, 1 << 16, 3 << 20)]
    host += [rng.random(1 << 15).astype(ml_dtypes.bfloat16) for _ in range(40)]
    srcs = [jnp.asarray(h) for h in host]
    dsts = [np.zeros_like(h) for h in host]
    copy_columns(dsts, srcs)
    for d, h in zip(dsts, host, strict=True):
        np.testing.assert_array_equal(d, h)
    with pytest.raises(ValueError, match="2 sources for 1 destinations"):
        copy_columns([np.zeros(3, np.float32)], srcs[:2])
    with pytest.raises(ValueError, match="mismatch"):
        copy_columns([np.zeros(3, np.float64)], srcs[:1])


def _tapped_copy(monkeypatch, before=None, after=None, each=None) -> dict[str, int]:
    """Counts the pieces each thread copies.

    ``before``/``after`` run once per thread around its copying, ``each`` on
    every piece a thread has taken, before it is copied.
    """
    import threading

    from asyncckpt._engine import _copy

    copied: dict[str, int] = {}
    real = _copy._copy_all

    def tapped(pairs):
        name = threading.current_thread().name
        if before is not None:
            before(name)

        def tap():
            for pair in pairs:
                copied[name] = copied.get(name, 0) + 1
                if each is not None:
                    each(name)
                yield pair

        real(tap())
        if after is not None:
            after(name)

    monkeypatch.setattr(_copy, "_copy_all", tapped)
    return copied


def _pairs(srcs):
    return [(np.zeros_like(s), s) for s in srcs]


def _assert_copied(pairs):
    for d, s in pairs:
        np.testing.assert_array_equal(d, s)


def test_copy_arrays_shares_a_state_of_many_small_arrays_with_the_copy_threads(monkeypatch):
    import threading

    from asyncckpt._engine import _copy

    if _copy._copy_threads() < 2:
        pytest.skip("one copy thread on this machine")
    # The calling thread holds its first piece until a copy thread has taken
    # one, so the test does not depend on how fast the pool's thread wakes up.
    caller = threading.current_thread().name
    helped = threading.Event()

    def each(name):
        if name != caller:
            helped.set()
        elif copied[name] == 1:
            helped.wait(10)

    copied = _tapped_copy(monkeypatch, each=each)
    rng = np.random.default_rng(1)
    # 64 arrays of 64 KiB, each far under a piece, and one non-contiguous view.
    srcs = [rng.random(16 << 10).astype(np.float32) for _ in range(64)]
    srcs.append(rng.random((64, 64)).astype(np.float32)[:, ::2])
    pairs = _pairs(srcs)
    copy_arrays(pairs)
    _assert_copied(pairs)
    assert sum(copied.values()) == len(srcs)
    assert any(t.startswith("asyncckpt-copy") and n > 0 for t, n in copied.items()), copied


def test_copy_arrays_copies_arrays_under_64_kib_on_the_calling_thread(monkeypatch):
    # Small copies shared out mostly hand the GIL back and forth (4,000 of 8 KiB: 2.3x
    # the time of the calling thread alone): they stay on the calling thread, while the
    # copy threads take the large pieces.
    import threading

    from asyncckpt._engine import _copy

    if _copy._copy_threads() < 2:
        pytest.skip("one copy thread on this machine")
    caller = threading.current_thread().name
    rng = np.random.default_rng(2)
    small = _pairs([rng.random(2 << 10).astype(np.float32) for _ in range(400)])  # 8 KiB
    copied = _tapped_copy(monkeypatch)
    copy_arrays(small)  # 3.1 MiB in all: over the inline limit, every array small
    _assert_copied(small)
    assert copied == {caller: len(small)}
    large = _pairs([rng.random(1 << 20).astype(np.float32) for _ in range(4)])  # 4 MiB
    copied.clear()
    mixed = small[:50] + large + small[50:100]
    for d, _ in mixed:
        d[...] = 0
    copy_arrays(mixed)
    _assert_copied(mixed)
    assert sum(copied.values()) == 100 + sum(-(-d.nbytes // _copy._piece_bytes(
        sum(p[0].nbytes for p in mixed), _copy._copy_threads())) for d, _ in large)
    assert copied[caller] >= 100  # every small one, and what it took of the large pieces


def test_copy_arrays_does_not_wait_for_a_copy_thread_that_starts_late(monkeypatch):
    """Pieces are taken from one queue: a late copy thread finds none left."""
    import threading

    from asyncckpt._engine import _copy

    if _copy._copy_threads() < 2:
        pytest.skip("one copy thread on this machine")
    caller = threading.current_thread().name
    caller_done = threading.Event()

    def before(name):
        if name != caller:
            caller_done.wait(10)  # a copy thread held back until the caller is done

    def after(name):
        if name == caller:
            caller_done.set()

    copied = _tapped_copy(monkeypatch, before=before, after=after)
    rng = np.random.default_rng(2)
    srcs = [rng.random(3 << 20).astype(np.float32) for _ in range(3)]  # 36 MiB, cut in pieces
    pairs = _pairs(srcs)
    copy_arrays(pairs)
    _assert_copied(pairs)
    assert copied.get(caller, 0) > len(srcs), copied  # the caller took every piece
    assert sum(copied.values()) == copied[caller], copied


def test_staging_buffers_are_aligned_writable_and_on_huge_pages_where_little_is_wasted():
    from asyncckpt._engine._pages import aligned_empty

    for nbytes in (100, 64 << 10, (2 << 20) + 64, 4 << 20, (32 << 20) + 4096):
        buf = aligned_empty(nbytes)
        assert buf.nbytes == nbytes and buf.dtype == np.uint8 and buf.flags.writeable
        assert buf.ctypes.data % 64 == 0
        if nbytes >= 64 << 10:  # on a page: written O_DIRECT from where it is (datafile)
            assert buf.ctypes.data % 4096 == 0
        buf[-1] = 7  # pre-faulted and writable to its last byte
        # 2 MiB-aligned mappings exactly where huge pages waste <= 1/16 (platform allowing).
        wants_huge = nbytes >= (2 << 20) and (-nbytes % (2 << 20)) * 16 <= nbytes
        if wants_huge and hasattr(mmap, "MADV_HUGEPAGE"):
            assert buf.ctypes.data % (2 << 20) == 0
            view = buf.view(np.float32)
            del buf
            view[:] = 1.0  # the mapping lives as long as any view of it
            assert float(view.sum()) == nbytes / 4


def _Job(root, name, data, *, fail_in=None, gate=None):
    """One file as a directory checkpoint; ``fail_in`` "write" or "commit" injects a failure."""
    return DirJob(root, name, [data], gate=gate, fsync=True,
                  fail_after_write=OSError(28, "No space left on device")
                  if fail_in == "write" else None,
                  fail_in_commit=RuntimeError("commit failed") if fail_in == "commit" else None)


def test_engine_saves_commits_and_reports_stats(tmp_path):
    with AsyncEngine(options=AsyncOptions(num_slots=2)) as engine:
        handles = [
            engine.save(lambda slot, i=i: _Job(str(tmp_path), f"c{i}", bytes([i]) * 1000),
                        label=f"c{i}")
            for i in range(3)
        ]
        engine.wait_until_finished()
        assert all(h.done() for h in handles)
        assert [s.label for s in engine.history] == ["c0", "c1", "c2"]
        assert engine.estimated_write_s is not None
    for i in range(3):
        m = read_manifest(str(tmp_path / f"c{i}" / "manifest.json"))
        verify_files(str(tmp_path / f"c{i}"), m.files, checksums=True, checkpoint=f"c{i}")
        assert m.stats["nbytes"] == 1000
    with pytest.raises(EngineClosedError):
        engine.save(lambda slot: _Job(str(tmp_path), "late", b"x"), label="late")


def test_each_save_records_where_its_time_went(tmp_path):
    """SaveStats.phases: the engine's phases, the file writes by kind, the checksum, the
    fsyncs (files and directories, counted), the manifest and the publish; not in the
    manifest, whose stats are the save's until its commit."""
    data = np.ones(3 << 20, np.uint8)
    with AsyncEngine(options=AsyncOptions(fsync=True)) as engine:
        handle = engine.save(lambda slot: DirJob(str(tmp_path), "c", (data,), fsync=True),
                             label="c")
        stats = handle.result()
    phases = stats.phases
    assert phases is not None
    seconds, counts, nbytes = phases["seconds"], phases["counts"], phases["bytes"]
    for phase in ("copy to host", "queue", "write:files", "checksum", "fsync", "fsync wait",
                  "manifest", "publish", "after commit"):
        assert seconds[phase] >= 0, phase
    assert nbytes["write:files"] == nbytes["checksum"] == data.nbytes
    assert counts["write:files"] == 1
    assert counts["fsync"] == 3  # data.bin, the manifest (in the same batch), their directory
    assert seconds["fsync wait"] <= stats.durable_s
    assert "phases" not in read_manifest(str(tmp_path / "c" / "manifest.json")).stats


@pytest.mark.parametrize("stage", ["write", "commit"])
def test_background_error_is_reraised_once_and_cleaned_up(tmp_path, stage):
    engine = AsyncEngine()
    jobs = []

    def failing(slot):
        jobs.append(_Job(str(tmp_path), "bad", b"x" * 10, fail_in=stage))
        return jobs[-1]

    handle = engine.save(failing, label="bad")
    assert handle.committed.exception(30) is not None
    with pytest.raises((OSError, RuntimeError)) as err:
        engine.wait_until_finished()
    assert "bad" in "".join(getattr(err.value, "__notes__", []))
    assert not os.path.exists(jobs[0].tmp)
    assert not (tmp_path / "bad").exists()
    engine.wait_until_finished()  # reported once, then cleared
    engine.save(lambda slot: _Job(str(tmp_path), "good", b"y"), label="good")
    engine.close()
    assert (tmp_path / "good").is_dir()


def test_stage_failure_releases_the_slot(tmp_path):
    engine = AsyncEngine(options=AsyncOptions(num_slots=1))

    def broken(slot):
        raise ValueError("cannot stage")

    with pytest.raises(ValueError):
        engine.save(broken, label="x")
    engine.save(lambda slot: _Job(str(tmp_path), "ok", b"1"), label="ok", slot_timeout=5)
    engine.close()


def test_publish_files_commits_marker_last_and_replaces_old(tmp_path):
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "ck.index").write_text("old index")
    (dest / "ck.data").write_text("old data")
    tmp = make_temp_dir(str(dest), "ck")
    for name, text in (("ck.data", "new data"), ("ck.index", "new index")):
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    publish_files(tmp, str(dest), ["ck.data", "ck.index"], fsync=True)
    assert (dest / "ck.index").read_text() == "new index"
    assert (dest / "ck.data").read_text() == "new data"
    assert not os.path.exists(tmp)


def test_publish_dir_refuses_to_overwrite(tmp_path):
    (tmp_path / "5").mkdir()
    tmp = make_temp_dir(str(tmp_path), "5")
    with pytest.raises(FileExistsError):
        publish_dir(tmp, str(tmp_path / "5"), fsync=False)


def test_cleanup_removes_only_temporaries(tmp_path):
    # As a killed run leaves it: a temporary no one in this process is using.
    commit.forget_temp(make_temp_dir(str(tmp_path), "3"))
    (tmp_path / "3").mkdir()
    (tmp_path / "ckpt-1.index").write_text("x")
    removed = cleanup_stale_temps(str(tmp_path))
    assert len(removed) == 1
    assert sorted(os.listdir(tmp_path)) == ["3", "ckpt-1.index"]


@pytest.mark.parametrize("algorithm", [fastcrc.CRC32C, fastcrc.CRC32])
def test_manifest_detects_flipped_byte_truncation_and_damage(tmp_path, algorithm):
    root = tmp_path / "ck"
    root.mkdir()
    writer = DurableWriter(str(root), fsync=False, checksums=True, algorithm=algorithm)
    writer.write("a/b.bin", [np.arange(1000, dtype=np.int32)])
    with open(root / "c.bin", "wb") as f:  # a file something else wrote
        f.write(b"xyz" * 1000)
    writer.add_existing("c.bin")
    records = writer.finish()
    m = Manifest(framework="test", label="ck", step=3, files=tuple(records))
    (root / "manifest.json").write_text(m.to_json())
    loaded = read_manifest(str(root / "manifest.json"))
    assert loaded.files == m.files and loaded.step == 3
    raw_files = json.loads((root / "manifest.json").read_text())["files"]
    assert [sorted(f) for f in raw_files] == [sorted(["name", "size", algorithm])] * 2
    expected = {fastcrc.CRC32: zlib.crc32, fastcrc.CRC32C: _crc32c}[algorithm]
    assert [r.crc for r in loaded.files] == [
        expected(np.arange(1000, dtype=np.int32).tobytes()), expected(b"xyz" * 1000)]
    verify_files(str(root), loaded.files, checksums=True, checkpoint="ck")

    data = root / "a" / "b.bin"
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0x01
    data.write_bytes(bytes(raw))
    verify_files(str(root), loaded.files, checksums=False, checkpoint="ck")  # sizes only
    with pytest.raises(CorruptCheckpointError, match=algorithm.upper() + " check") as err:
        verify_files(str(root), loaded.files, checksums=True, checkpoint="ck")
    assert err.value.file == str(data)
    data.write_bytes(bytes(raw[:-10]))
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        verify_files(str(root), loaded.files, checksums=False, checkpoint="ck")
    data.unlink()
    with pytest.raises(CorruptCheckpointError, match="missing"):
        verify_files(str(root), loaded.files, checksums=False, checkpoint="ck")

    text = (root / "manifest.json").read_text().replace('"step": 3', '"step": 4')
    (root / "manifest.json").write_text(text)
    with pytest.raises(CorruptCheckpointError, match="manifest"):
        read_manifest(str(root / "manifest.json"))


def _crc32c(data: bytes) -> int:
    return fastcrc.crc32c_extend(0, data)


def test_new_checkpoints_record_crc32c_where_the_hardware_one_runs(tmp_path):
    if not fastcrc.available():
        pytest.skip("no native CRC32C (google_crc32c's libcrc32c) installed")
    writer = DurableWriter(str(tmp_path), fsync=False, checksums=True)
    record = writer.write("x", [b"123456789"])
    writer.finish()
    assert record.algorithm == fastcrc.CRC32C and record.crc == 0xE3069283


@pytest.mark.parametrize("algorithm", [fastcrc.CRC32, fastcrc.CRC32C])
def test_chunks_with_known_checksums_give_the_files_checksum(tmp_path, algorithm):
    if algorithm == fastcrc.CRC32C and not fastcrc.available():
        pytest.skip("no native CRC32C (google_crc32c's libcrc32c) installed")
    update = fastcrc.updater(algorithm)
    rng = np.random.default_rng(5)
    parts = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 7, 70_001, 3)]
    chunks = [Checksummed(p, update(p, 0)) if i % 2 else p for i, p in enumerate(parts)]
    writer = DurableWriter(str(tmp_path), fsync=False, checksums=True, algorithm=algorithm)
    record = writer.write("f", chunks)
    writer.finish()
    whole = (tmp_path / "f").read_bytes()
    assert whole == b"".join(p.tobytes() for p in parts)
    assert record.size == len(whole) and record.crc == update(whole, 0)
    # A wrong checksum handed in is what the record says; the read-back check catches it.
    (tmp_path / "bad").mkdir()
    bad = DurableWriter(str(tmp_path / "bad"), fsync=False, checksums=True, algorithm=algorithm)
    record = bad.write("f", [Checksummed(parts[3], update(parts[3], 0) ^ 1)])
    bad.finish()
    assert record.check(str(tmp_path / "bad" / "f")) == update(parts[3], 0)


def test_old_manifests_of_zlib_crc32s_still_verify_and_catch_a_flipped_byte(tmp_path):
    """A manifest written before CRC32C (records hold ``"crc32"``, no algorithm field)."""
    data = np.arange(5000, dtype=np.int64).tobytes()
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.bin").write_bytes(data)
    body = {"format": 1, "framework": "jax", "label": "7", "step": 7, "created": 1.0,
            "asyncckpt_version": "0.1.0", "stats": {}, "extra": {},
            "files": [{"name": "d/x.bin", "size": len(data), "crc32": zlib.crc32(data)}]}
    canonical = json.dumps(body, sort_keys=True, separators=(",", ":"))
    body["manifest_crc32"] = zlib.crc32(canonical.encode())
    (tmp_path / "manifest.json").write_text(json.dumps(body, sort_keys=True, indent=1))
    loaded = read_manifest(str(tmp_path / "manifest.json"))
    assert loaded.files[0].algorithm == fastcrc.CRC32
    verify_files(str(tmp_path), loaded.files, checksums=True, checkpoint="old")
    raw = bytearray(data)
    raw[4321] ^= 0x10
    (tmp_path / "d" / "x.bin").write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="CRC32 check"):
        verify_files(str(tmp_path), loaded.files, checksums=True, checkpoint="old")


def _cands(*steps, metrics=None):
    return [
        Candidate(str(s), s, float(s), None if metrics is None else metrics[i])
        for i, s in enumerate(steps)
    ]


def test_retention_keeps_newest_n():
    d = retention.apply(_cands(1, 2, 3, 4), RetentionPolicy(max_to_keep=2))
    assert [c.step for c in d.keep] == [3, 4]
    assert [c.step for c in d.delete] == [1, 2]
    d = retention.apply(_cands(1, 2), RetentionPolicy())
    assert not d.delete


def test_retention_keep_period_preserves():
    d = retention.apply(_cands(5, 10, 15, 20, 25), RetentionPolicy(max_to_keep=1, keep_period=10))
    assert [c.step for c in d.keep] == [25]
    assert [c.step for c in d.preserve] == [10, 20]
    assert [c.step for c in d.delete] == [5, 15]


def test_retention_best_n_never_deletes_newest():
    metrics = [0.9, 0.1, 0.8, 0.2, 0.05]
    d = retention.apply(
        _cands(1, 2, 3, 4, 5, metrics=metrics), RetentionPolicy(max_to_keep=2, best_mode="max")
    )
    assert [c.step for c in d.keep] == [1, 3, 5]  # best two, plus the newest
    d = retention.apply(
        _cands(1, 2, 3, 4, 5, metrics=metrics), RetentionPolicy(max_to_keep=2, best_mode="min")
    )
    assert [c.step for c in d.keep] == [2, 5]  # 0.05 (newest) and 0.1 are the best two


def test_retention_checkpoints_without_metrics():
    cands = _cands(1, 2, 3, metrics=[None, 0.5, 0.7])
    keep_them = RetentionPolicy(max_to_keep=1, best_mode="max")
    assert [c.step for c in retention.apply(cands, keep_them).keep] == [1, 3]
    drop_them = RetentionPolicy(max_to_keep=1, best_mode="max",
                                keep_checkpoints_without_metrics=False)
    assert [c.step for c in retention.apply(cands, drop_them).delete] == [1, 2]


def test_retention_every_n_hours_matches_tensorflow_rule():
    hour = 3600.0
    times = [0, 0.5 * hour, 2 * hour, 2.1 * hour]
    cands = [Candidate(f"c{i}", None, t) for i, t in enumerate(times)]
    d = retention.apply(cands, RetentionPolicy(max_to_keep=1, keep_every_n_hours=1.0),
                        last_preserved_timestamp=-1.0)
    # As in TensorFlow: a checkpoint is preserved once it is at least N hours
    # newer than the last preserved one (the manager's start, here -1 s).
    assert [c.key for c in d.preserve] == ["c2"]
    assert [c.key for c in d.delete] == ["c0", "c1"]
    assert [c.key for c in d.keep] == ["c3"]
    assert d.last_preserved_timestamp == 2 * hour


def test_retention_keep_none_keeps_only_what_a_preserving_rule_keeps():
    """``max_to_keep=0`` (orbax's "keep none"): the newest goes too, unless preserved."""
    d = retention.apply(_cands(5, 10, 15), RetentionPolicy(max_to_keep=0, keep_period=10))
    assert [c.step for c in d.keep] == []
    assert [c.step for c in d.preserve] == [10]
    assert [c.step for c in d.delete] == [5, 15]
    d = retention.apply(_cands(5, 10, 20), RetentionPolicy(max_to_keep=0, keep_period=10))
    assert [c.step for c in d.preserve] == [10, 20] and [c.step for c in d.delete] == [5]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_max_to_keep_has_one_rule(bad):
    """None or an int >= 1; 0 only where the framework keeps none (orbax)."""
    for allow_zero in (False, True):
        with pytest.raises(ValueError, match="max_to_keep must be None or an int >= "):
            retention.check_max_to_keep(bad, allow_zero=allow_zero)
    with pytest.raises(ValueError, match=">= 1"):
        retention.check_max_to_keep(0, allow_zero=False)
    assert retention.check_max_to_keep(0, allow_zero=True) == 0
    assert retention.check_max_to_keep(np.int64(3), allow_zero=False) == 3
    assert retention.check_max_to_keep(None, allow_zero=False) is None


def test_bad_policy_and_options_are_refused():
    with pytest.raises(ValueError):
        RetentionPolicy(max_to_keep=-1)
    with pytest.raises(ValueError):
        RetentionPolicy(best_mode="median")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        AsyncOptions(num_slots=0)
    with pytest.raises(TypeError):
        AsyncOptions(2)  # type: ignore[misc]  # keyword-only


def _niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


class _PriorityProbe(DirJob):
    """Records the niceness of the writer thread and of a thread it starts (as the fsync one is)."""

    def write(self):
        self.writer_nice = _niceness()
        super().write()
        seen = []
        probe = threading.Thread(target=lambda: seen.append(_niceness()))
        probe.start()
        probe.join()
        self.child_nice = seen[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
@pytest.mark.parametrize("nice", [0, 7])
def test_writer_runs_below_the_training_threads_priority(tmp_path, nice):
    before = _niceness()
    jobs = []

    def stage(slot):
        jobs.append(_PriorityProbe(str(tmp_path), f"n{nice}", [b"x" * 100]))
        return jobs[-1]

    with AsyncEngine(options=AsyncOptions(writer_nice=nice)) as engine:
        engine.save(stage, label=f"n{nice}").committed.result(30)
    assert _niceness() == before  # the caller's thread keeps its priority
    assert jobs[0].writer_nice == min(19, before + nice)
    assert jobs[0].child_nice == jobs[0].writer_nice  # threads the writer starts inherit it


@pytest.mark.parametrize("bad", [-1, 20, 2.5, True])
def test_writer_nice_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="writer_nice"):
        AsyncOptions(writer_nice=bad)
