"""Background work yields to a save's copy (issue 13, item 3): ``engine._gate.SaveGate``."""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest

from asyncckpt import AsyncOptions
from asyncckpt._engine import _spares
from asyncckpt._engine import writer as writer_mod
from asyncckpt._engine._gate import SaveGate
from asyncckpt._engine.files import _PAUSE_CHUNK, DurableWriter
from asyncckpt._engine.writer import AsyncEngine
from tests.jobs import DirJob

_MB = 1 << 20


def _until(predicate, what: str, limit: float = 60.0) -> None:
    """Polls ``predicate`` (a state the test waits for, not a timing)."""
    end = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < end, f"never saw: {what}"
        time.sleep(0.005)


# -- the gate itself ------------------------------------------------------------------


def _wait_in_thread(gate: SaveGate) -> threading.Thread:
    t = threading.Thread(target=gate.wait, daemon=True)
    t.start()
    return t


def test_gate_is_counted_and_releases_its_waiters_when_the_last_save_is_done():
    gate = SaveGate(max_wait_s=60)
    gate.wait()  # open: returns at once
    with gate:
        gate.close()  # a second saving thread
        t = _wait_in_thread(gate)
        _until(lambda: gate.waiting == 1, "a paused waiter")
        gate.open()  # one of the two saves is done: still closed
        assert gate.is_closed
        t.join(0.1)
        assert t.is_alive() and gate.waiting == 1
    t.join(30)
    assert not t.is_alive() and not gate.is_closed
    assert gate.pauses == 1
    with pytest.raises(RuntimeError, match="more often"):
        gate.open()


def test_gate_wait_is_bounded_per_closing():
    # The bound runs from the closing, not from the wait: 1 s leaves a loaded
    # machine time to start the waiting thread inside it.
    gate = SaveGate(max_wait_s=1.0)
    gate.close()  # a staging that never ends
    t = _wait_in_thread(gate)
    _until(lambda: gate.waiting == 1, "the first wait")
    t.join(30)
    assert not t.is_alive() and gate.is_closed  # the bound let it go
    gate.wait()  # past the bound: no more pauses for this closing
    assert gate.pauses == 1
    gate.open()
    gate.close()  # a new closing holds waiters again
    t = _wait_in_thread(gate)
    _until(lambda: gate.waiting == 1, "the second wait")
    gate.open()
    t.join(30)
    assert not t.is_alive() and gate.pauses == 2


def test_disabled_gate_never_pauses():
    gate = SaveGate(enabled=False)
    gate.close()
    assert not gate.is_closed
    gate.wait()
    gate.open()
    assert gate.pauses == 0


def test_options_refuse_a_negative_bound():
    with pytest.raises(ValueError, match="yield_max_wait_s"):
        AsyncOptions(yield_max_wait_s=-1)
    with pytest.raises(ValueError, match="max_wait_s"):
        SaveGate(max_wait_s=-1)


def test_durable_writer_pauses_before_each_piece_and_fsync(tmp_path):
    calls: list[str] = []
    writer = DurableWriter(str(tmp_path), fsync=True, checksums=True,
                           pause=lambda: calls.append(threading.current_thread().name))
    data = np.arange(3 * _PAUSE_CHUNK // 8 + 5, dtype=np.int64)
    writer.write("a.bin", [data])
    writer.write("b.bin", [b"small"])
    writer.finish()
    writes = [c for c in calls if c != "asyncckpt-fsync"]
    assert len(writes) == 4 + 1  # four pieces of a.bin, one of b.bin
    assert calls.count("asyncckpt-fsync") == 3  # one per file, one for their directory
    assert (tmp_path / "a.bin").read_bytes() == data.tobytes()


def test_spare_build_pauses_between_pieces():
    gate = SaveGate(max_wait_s=60)
    faulted: list[int] = []
    gate.close()
    out: list = []
    t = threading.Thread(target=lambda: out.append(_spares.build_buffers(
        {"a": 20 * _MB}, lambda: False, lambda p: faulted.append(p.nbytes), pause=gate.wait)))
    t.start()
    _until(lambda: gate.waiting == 1, "the build paused")
    assert faulted == []  # not one page touched while the save copies
    gate.open()
    t.join(30)
    assert sum(faulted) == 20 * _MB and out[0]["a"].nbytes == 20 * _MB


# -- the engine: the writer pauses while a save stages ---------------------------------


class _StreamJob(DirJob):
    """A SaveJob writing ``pieces`` MiB through ``DurableWriter``, one MiB at a time.

    After ``hold_after`` pieces it waits for ``go``, so a test can start
    another save while this write is in flight. ``written`` counts the
    pieces handed to the writer.
    """

    def __init__(self, root: str, label: str, pieces: int, hold_after: int | None = None):
        super().__init__(root, label, self._pieces, nbytes=pieces * _MB)
        self._count, self._hold_after = pieces, hold_after
        self.go, self.holding = threading.Event(), threading.Event()
        self.written = 0

    def _pieces(self):
        for i in range(self._count):
            if i == self._hold_after:
                self.holding.set()
                assert self.go.wait(60), "the test never let the write go on"
            self.written += 1
            yield np.full(_MB, i % 251, np.uint8)


def _stage_in_thread(engine: AsyncEngine, job, release: threading.Event,
                     staging: threading.Event, label: str, **kw):
    """Runs ``engine.save`` on a thread whose stage waits for ``release``."""
    result: dict = {}

    def stage(slot):
        staging.set()
        assert release.wait(60), "the test never released the stage"
        return job

    def run():
        try:
            result["handle"] = engine.save(stage, label=label, **kw)
        except BaseException as e:
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


def _check_file(root, label: str, pieces: int) -> None:
    got = np.fromfile(os.path.join(root, label, "data.bin"), np.uint8).reshape(pieces, _MB)
    assert (got[:, 0] == np.arange(pieces) % 251).all() and (got == got[:, :1]).all()


def test_writer_pauses_while_a_save_stages_and_close_waits_for_both(tmp_path):
    engine = AsyncEngine(options=AsyncOptions(yield_max_wait_s=60))
    first = _StreamJob(str(tmp_path), "first", 24, hold_after=3)
    h1 = engine.save(lambda slot: first, label="first")
    assert first.holding.wait(60)
    second = _StreamJob(str(tmp_path), "second", 2)
    release, staging = threading.Event(), threading.Event()
    t, result = _stage_in_thread(engine, second, release, staging, "second")
    assert staging.wait(60)
    first.go.set()  # the write goes on, into a closed gate
    gate = engine._gate
    _until(lambda: gate.waiting == 1, "the writer paused")
    written, size = first.written, os.path.getsize(os.path.join(first.tmp, "data.bin"))
    closer = threading.Thread(target=engine.close, daemon=True)
    closer.start()  # close() while the write is paused: it waits, it does not hang
    time.sleep(0.2)
    assert gate.waiting == 1 and first.written == written
    assert os.path.getsize(os.path.join(first.tmp, "data.bin")) == size < 24 * _MB
    assert closer.is_alive() and not h1.done()
    release.set()  # the copy is done: the writer resumes
    t.join(60)
    closer.join(60)
    assert not closer.is_alive() and "error" not in result
    assert h1.result(0).nbytes == 24 * _MB and result["handle"].result(0).nbytes == 2 * _MB
    assert gate.pauses >= 1 and not gate.is_closed
    _check_file(tmp_path, "first", 24)
    _check_file(tmp_path, "second", 2)


def test_two_threads_staging_keep_the_writer_paused_until_both_are_done(tmp_path):
    options = AsyncOptions(num_slots=3, max_slots=3, yield_max_wait_s=60)
    with AsyncEngine(options=options) as engine:
        first = _StreamJob(str(tmp_path), "first", 12, hold_after=2)
        h1 = engine.save(lambda slot: first, label="first")
        assert first.holding.wait(60)
        stagers = []
        for name in ("a", "b"):
            release, staging = threading.Event(), threading.Event()
            t, result = _stage_in_thread(engine, _StreamJob(str(tmp_path), name, 1),
                                         release, staging, name)
            assert staging.wait(60)
            stagers.append((release, t, result))
        first.go.set()
        gate = engine._gate
        _until(lambda: gate.waiting == 1, "the writer paused")
        written = first.written
        stagers[0][0].set()  # one save staged, the other still copying
        stagers[0][1].join(60)
        assert "handle" in stagers[0][2] and gate.is_closed
        time.sleep(0.1)
        assert gate.waiting == 1 and first.written == written and not h1.done()
        stagers[1][0].set()
        stagers[1][1].join(60)
        h1.result(60)
        for _, _, result in stagers:
            result["handle"].result(60)
    _check_file(tmp_path, "first", 12)


def test_a_stage_longer_than_the_bound_does_not_stop_the_writer(tmp_path):
    with AsyncEngine(options=AsyncOptions(yield_max_wait_s=0.1)) as engine:
        first = _StreamJob(str(tmp_path), "first", 8, hold_after=2)
        h1 = engine.save(lambda slot: first, label="first")
        assert first.holding.wait(60)
        second = _StreamJob(str(tmp_path), "second", 1)

        def stage(slot):  # holds the gate until the first save is durable
            first.go.set()
            h1.result(60)
            return second

        h2 = engine.save(stage, label="second")  # returns: the writer went on
        assert h1.done()
        h2.result(60)
    _check_file(tmp_path, "first", 8)


def test_a_save_waiting_for_a_slot_does_not_pause_the_writer(tmp_path):
    # One slot: the second save waits for the writer to release it. The gate
    # bound is far longer than the slot timeout, so a gate closed during that
    # wait would make the second save time out.
    options = AsyncOptions(num_slots=1, max_slots=1, yield_max_wait_s=120)
    with AsyncEngine(options=options) as engine:
        first = _StreamJob(str(tmp_path), "first", 6, hold_after=1)
        engine.save(lambda slot: first, label="first")
        assert first.holding.wait(60)
        # The first save holds the only slot until 0.2 s after the second asks
        # for it, so the second waits at least that long, however the machine
        # paces the threads.
        pool, acquire = engine._pool, engine._pool.acquire

        def acquire_then_free_the_first(*args, **kwargs):
            threading.Timer(0.2, first.go.set).start()
            return acquire(*args, **kwargs)

        pool.acquire = acquire_then_free_the_first
        assert not engine._gate.is_closed
        h2 = engine.save(lambda slot: _StreamJob(str(tmp_path), "second", 1), label="second",
                         slot_timeout=60)
        assert h2.result(60).slot_wait_s >= 0.1


class _Interrupt(BaseException):
    """Not an Exception (as KeyboardInterrupt): the gate must reopen for it too."""


@pytest.mark.parametrize("error", [ValueError, _Interrupt])
def test_a_failed_staging_reopens_the_gate(tmp_path, error):
    with AsyncEngine(options=AsyncOptions(yield_max_wait_s=60)) as engine:
        def stage(slot):
            assert engine._gate.is_closed
            raise error("cannot stage")

        with pytest.raises(error):
            engine.save(stage, label="x")
        assert not engine._gate.is_closed
        job = _StreamJob(str(tmp_path), "after", 3)
        engine.save(lambda slot: job, label="after").result(60)
        assert engine._gate.pauses == 0
    _check_file(tmp_path, "after", 3)


# -- the frameworks' writers take the gate -----------------------------------------------


class _RecordingGate(SaveGate):
    """A real gate that records who asks it to wait (function names)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.callers: set[str] = set()

    def wait(self) -> None:
        self.callers.add(sys._getframe(1).f_code.co_qualname)
        super().wait()


def test_jax_save_pauses_between_write_pieces_and_fsyncs(tmp_path, monkeypatch):
    pytest.importorskip("jax")
    import jax.numpy as jnp

    import asyncckpt.jax as aj

    monkeypatch.setattr(writer_mod, "SaveGate", _RecordingGate)
    tree = {"w": jnp.arange(3 * _MB // 4, dtype=jnp.float32), "b": jnp.ones(3)}
    with aj.CheckpointManager(str(tmp_path)) as mgr:
        mgr.save(1, tree)
        mgr.wait_until_finished()
        callers = mgr.engine._gate.callers
        restored = mgr.restore(1, target=tree)
    assert {"AsyncEngine._process", "DurableWriter._write", "_Flusher.run"} <= callers
    assert np.array_equal(np.asarray(restored["w"]), np.asarray(tree["w"]))


def test_tf_save_pauses_between_bundle_ranges(tmp_path, monkeypatch):
    tf = pytest.importorskip("tensorflow")
    import asyncckpt.tf as at
    from asyncckpt._engine import fastcrc

    if not fastcrc.available():
        pytest.skip("no native CRC32C: TensorFlow's SaveV2 writes the bundle")
    monkeypatch.setattr(writer_mod, "SaveGate", _RecordingGate)
    v = tf.Variable(tf.range(3 * _MB // 4, dtype=tf.float32))
    ckpt = at.Checkpoint(v=v)
    path = ckpt.write(str(tmp_path / "ckpt"))
    ckpt.sync()
    assert "_run_ranges.<locals>.work" in ckpt.engine._gate.callers
    ckpt.close()
    from tests.tfrestore import restore_both

    restore_both(path, lambda: {"v": tf.Variable(tf.zeros_like(v))},
                 lambda o: np.testing.assert_array_equal(o["v"].numpy(), v.numpy()),
                 method="read", verdict="assert_consumed")
