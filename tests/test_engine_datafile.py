"""The engine's data-file writer: one file from many buffers, checksummed as written."""

from __future__ import annotations

import os

import numpy as np
import pytest

from asyncckpt._engine import datafile, fastcrc
from asyncckpt._engine._pages import aligned_empty

pytestmark = pytest.mark.skipif(not datafile.available(), reason="no native CRC32C")


def _direct_ok(directory) -> bool:
    probe = directory / "probe"
    probe.write_bytes(b"")
    fd = datafile._open_direct_for_write(str(probe))
    if fd >= 0:
        os.close(fd)
    return fd >= 0


@pytest.mark.parametrize("range_bytes", [16 << 20, 4096, 1000])
def test_the_file_is_the_parts_in_order_with_its_crc_and_each_owners(tmp_path, monkeypatch,
                                                                      range_bytes):
    """Owners in several parts, parts cut over ranges, ranges written by two threads."""
    monkeypatch.setattr(datafile, "_RANGE", range_bytes)
    monkeypatch.setattr(datafile, "_MIN_RANGE", min(range_bytes, 1 << 20))
    rng = np.random.default_rng(0)
    blobs = [rng.integers(0, 255, n, dtype=np.uint8) for n in (5000, 1, 70_000, 0, 3 << 20)]
    parts = [(0, blobs[0]), (1, blobs[1]), (0, blobs[2]), (2, blobs[3]), (3, blobs[4])]
    path = tmp_path / "data"
    written = datafile.write(str(path), parts, [True, False, True, True], mode=0o640)
    content = path.read_bytes()
    assert content == b"".join(b.tobytes() for _, b in parts)
    assert written.sums == (len(content), fastcrc.crc32c_extend(0, content), fastcrc.CRC32C)
    assert written.owner_crcs == [
        fastcrc.crc32c_extend(0, blobs[0].tobytes() + blobs[2].tobytes()), None, None,
        fastcrc.crc32c_extend(0, blobs[4])]
    assert (path.stat().st_mode & 0o777) == 0o640


def test_a_small_file_is_cut_in_eight_ranges_for_its_two_threads():
    mib = 1 << 20
    assert [r.nbytes for r in datafile._ranges([(0, bytes(16 * mib))], [False])] == [2 * mib] * 8
    assert len(datafile._ranges([(0, bytes(3 * mib))], [False])) == 3  # 1 MiB at least
    assert [r.nbytes for r in datafile._ranges([(0, bytes(2 * mib))], [False])] == [mib, mib]
    big = datafile._ranges([(0, memoryview(bytes(256 * mib)))], [False])
    assert {r.nbytes for r in big} == {16 * mib}  # 16 MiB at most


def test_page_aligned_buffers_are_written_o_direct_as_they_are(tmp_path, monkeypatch):
    """A JAX slot's large buffers (page-aligned, whole pages): no gathering copy; any other
    range is gathered first. The bytes and CRC are the same either way."""
    if not _direct_ok(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    gathered = []
    real_take = datafile._take_bounce

    def take(nbytes):
        gathered.append(nbytes)
        return real_take(nbytes)

    monkeypatch.setattr(datafile, "_take_bounce", take)
    mib = 1 << 20
    aligned = [aligned_empty(2 * mib), aligned_empty(64 << 10)]
    for i, buf in enumerate(aligned):
        buf[:] = i + 1
    parts = [(0, aligned[0]), (0, aligned[1])] * 3  # 6.4 MiB: over datafile.DIRECT_MIN
    written = datafile.write(str(tmp_path / "aligned"), parts, [False])
    assert gathered == []
    content = (tmp_path / "aligned").read_bytes()
    assert content == b"".join(b.tobytes() for _, b in parts)
    assert written.crc == fastcrc.crc32c_extend(0, content)
    # An odd-sized buffer first: no range starts aligned in memory; all are gathered.
    odd = [(0, np.full(100, 9, np.uint8)), *parts]
    written = datafile.write(str(tmp_path / "odd"), odd, [False])
    assert gathered
    content = (tmp_path / "odd").read_bytes()
    assert content == b"".join(b.tobytes() for _, b in odd)
    assert written.crc == fastcrc.crc32c_extend(0, content)


def test_small_staging_buffers_are_packed_back_to_back_in_order():
    from asyncckpt._engine._pages import packed_empty

    sizes = [8192, 8192, 100, 4096, 4 << 20, 65_600, 8192]
    bufs = packed_empty(sizes)
    assert [b.nbytes for b in bufs] == sizes
    address = [b.ctypes.data for b in bufs]
    assert address[1] == address[0] + 8192  # whole pages: side by side, on pages
    assert all(a % 4096 == 0 for a, n in zip(address, sizes, strict=True)
               if n % 4096 == 0 or n >= 64 << 10)
    assert address[2] % 64 == 0 and address[3] == -(-(address[2] + 100) // 4096) * 4096
    assert address[4] % (2 << 20) == 0  # a large buffer: its own huge-page mapping
    for i, b in enumerate(bufs):  # each is its own memory
        b[:] = i
    assert [int(b.min()) for b in bufs] == [int(b.max()) for b in bufs] == list(range(len(bufs)))


def test_parts_back_to_back_in_memory_are_written_as_one(tmp_path):
    from asyncckpt._engine._pages import packed_empty

    rng = np.random.default_rng(1)
    bufs = packed_empty([8192] * 600)  # 4.7 MiB: written O_DIRECT where the disk takes it
    for b in bufs:
        b[:] = rng.integers(0, 255, b.nbytes, dtype=np.uint8)
    # Owner 0's CRC is not wanted: its parts join; owner 1's and 2's are, so they stay apart.
    owners = [0] * 500 + [1] * 50 + [2] * 50
    parts = list(zip(owners, bufs, strict=True))
    views = datafile._coalesced(parts, [False, True, True])
    assert [(o, len(v)) for o, v in views] == [(0, 500 * 8192), (1, 50 * 8192), (2, 50 * 8192)]
    assert len(datafile._coalesced(parts, [True, True, True])) == 3
    assert len(datafile._coalesced(parts[::-1], [False, False, False])) == 600  # not in order
    # A read-only part (bytes) between staged ones: its own view, the others still joined.
    mixed = [*parts[:3], (0, bytes(range(256)) * 32), *parts[3:6]]
    views = datafile._coalesced(mixed, [False, True, True])
    assert [len(v) for _, v in views] == [3 * 8192, 8192, 3 * 8192]
    assert b"".join(bytes(v) for _, v in views) == b"".join(bytes(p) for _, p in mixed)
    path = tmp_path / "data"
    written = datafile.write(str(path), parts, [False, True, True])
    content = path.read_bytes()
    assert content == b"".join(b.tobytes() for b in bufs)
    assert written.crc == fastcrc.crc32c_extend(0, content)
    assert written.owner_crcs == [
        None, fastcrc.crc32c_extend(0, b"".join(b.tobytes() for b in bufs[500:550])),
        fastcrc.crc32c_extend(0, b"".join(b.tobytes() for b in bufs[550:]))]
