"""Engine errors contract, publish as the line, and save()/close() races."""

from __future__ import annotations

import os
import threading

import pytest

from asyncckpt import AsyncOptions, EngineClosedError
from asyncckpt._engine.slots import StagingPool
from asyncckpt._engine.writer import AsyncEngine
from tests.jobs import DirJob


def _Job(root, name, *, fail=None, gate=None, after=None):
    """A directory checkpoint; ``fail`` raised by its write, ``after`` after its commit."""
    return DirJob(root, name, fail=fail, gate=gate, after=after)


class _Waiting(threading.Thread):
    """Runs ``fn`` on a side thread and keeps what it raised."""

    def __init__(self, fn):
        super().__init__(daemon=True)
        self._fn, self.error, self.started_wait = fn, None, threading.Event()

    def run(self):
        try:
            self._fn(self.started_wait)
        except BaseException as e:  # recorded for the test
            self.error = e


def _wait_in_sync(engine):
    def fn(started):
        started.set()
        engine.wait_until_finished(timeout=60)
    return _Waiting(fn)


def test_failure_reaches_side_waiter_and_the_owner_save(tmp_path):
    gate = threading.Event()
    engine = AsyncEngine()
    engine.save(lambda s: _Job(str(tmp_path), "a", fail=OSError(28, "disk full"), gate=gate),
                label="a")
    side = _wait_in_sync(engine)
    side.start()
    assert side.started_wait.wait(30)
    gate.set()
    side.join(60)
    assert isinstance(side.error, OSError)  # the side thread's wait saw it...
    with pytest.raises(OSError, match="disk full"):  # ...and the owner's next save too
        engine.save(lambda s: _Job(str(tmp_path), "b"), label="b")
    # Seen by the owner: cleared, the engine keeps working.
    engine.save(lambda s: _Job(str(tmp_path), "c"), label="c")
    engine.close()
    assert (tmp_path / "c").is_dir() and not (tmp_path / "b").exists()


def test_failure_reaches_side_waiter_and_the_owner_close(tmp_path):
    gate = threading.Event()
    engine = AsyncEngine()
    engine.save(lambda s: _Job(str(tmp_path), "a", fail=RuntimeError("boom"), gate=gate),
                label="a")
    side = _wait_in_sync(engine)
    side.start()
    assert side.started_wait.wait(30)
    gate.set()
    side.join(60)
    assert isinstance(side.error, RuntimeError)
    # A non-owner call does not clear it: it still reaches the owner.
    with pytest.raises(RuntimeError):
        _call_on_thread(engine.wait_until_finished)
    with pytest.raises(RuntimeError, match="boom"):
        engine.close()
    engine.close()  # seen by the owner: nothing more to report
    _call_on_thread(engine.wait_until_finished)  # nor to other threads


def _call_on_thread(fn):
    box = []
    t = threading.Thread(target=lambda: box.append(_capture(fn)))
    t.start()
    t.join(60)
    if box[0] is not None:
        raise box[0]


def _capture(fn):
    try:
        fn()
    except BaseException as e:
        return e
    return None


class _SignallingPool(StagingPool):
    """The real pool, telling the test when a save starts waiting for a slot."""

    def __init__(self, num_slots):
        super().__init__(num_slots)
        self.acquiring = threading.Semaphore(0)

    def acquire(self, timeout=None):
        self.acquiring.release()
        return super().acquire(timeout)


@pytest.mark.parametrize("num_slots", [1, 2])
def test_save_waiting_for_a_slot_raises_the_failure_that_freed_it(tmp_path, num_slots):
    gate = threading.Event()
    engine = AsyncEngine(options=AsyncOptions(num_slots=num_slots))
    engine._pool = pool = _SignallingPool(num_slots)
    failing = engine.save(
        lambda s: _Job(str(tmp_path), "bad", fail=OSError(5, "I/O error"), gate=gate), label="bad"
    )
    for i in range(num_slots - 1):  # fill the other slots with slow, good saves
        engine.save(lambda s, i=i: _Job(str(tmp_path), f"ok{i}", gate=gate), label=f"ok{i}")
    for _ in range(num_slots):
        assert pool.acquiring.acquire(timeout=30)
    # The next save finds every slot busy and waits; the failure frees a slot.
    opener = threading.Thread(target=lambda: (pool.acquiring.acquire(timeout=30), gate.set()))
    opener.start()
    with pytest.raises(OSError, match="I/O error"):
        engine.save(lambda s: _Job(str(tmp_path), "after"), label="after")
    opener.join(30)
    assert failing.committed.exception(30) is not None
    engine.close()
    assert not (tmp_path / "after").exists()


def test_save_after_a_failure_raises_it(tmp_path):
    engine = AsyncEngine()
    h = engine.save(lambda s: _Job(str(tmp_path), "a", fail=ValueError("bad")), label="a")
    assert h.committed.exception(30) is not None
    with pytest.raises(ValueError, match="bad"):
        engine.save(lambda s: _Job(str(tmp_path), "b"), label="b")
    engine.close()


def test_save_with_raise_pending_false_stages_then_leaves_the_failure_to_the_caller(tmp_path):
    # A multi-process save: every process must take part, so the save is queued
    # and the earlier failure is raised by the caller's next raise_pending_error().
    engine = AsyncEngine()
    h = engine.save(lambda s: _Job(str(tmp_path), "a", fail=ValueError("bad")), label="a")
    assert h.committed.exception(30) is not None
    b = engine.save(lambda s: _Job(str(tmp_path), "b"), label="b", raise_pending=False)
    with pytest.raises(ValueError, match="bad"):
        engine.raise_pending_error()
    assert b.result(30) is not None and (tmp_path / "b").is_dir()
    engine.close()


def test_error_after_publish_is_logged_counted_and_not_a_failure(tmp_path, caplog):
    with AsyncEngine() as engine:
        h = engine.save(
            lambda s: _Job(str(tmp_path), "a", after=OSError(16, "Device or resource busy")),
            label="a",
        )
        stats = h.result(30)
        engine.wait_until_finished()
        assert engine.post_commit_errors == 1
        assert "Device or resource busy" in stats.post_commit_error
        assert engine.history[-1].post_commit_error == stats.post_commit_error
    assert (tmp_path / "a").is_dir()
    assert "committed, but the work after the commit failed" in caplog.text


def _race_round(root):
    """Four threads save ten times each while two threads close the engine."""
    engine = AsyncEngine(options=AsyncOptions(num_slots=2))
    jobs, handles, refused = [], [], []
    lock = threading.Lock()
    start = threading.Barrier(6)

    def saver(t):
        start.wait()
        for i in range(10):
            def stage(slot, name=f"t{t}-{i}"):
                job = _Job(str(root), name)
                with lock:
                    jobs.append(job)
                return job
            try:
                h = engine.save(stage, label=f"t{t}-{i}")
            except EngineClosedError:
                with lock:
                    refused.append(t)
                return
            with lock:
                handles.append(h)

    def closer():
        start.wait()
        engine.close()

    threads = [threading.Thread(target=saver, args=(t,)) for t in range(4)]
    threads += [threading.Thread(target=closer) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return engine, jobs, handles, refused


def test_concurrent_saves_and_closes_lose_nothing(tmp_path):
    """Several threads save while others close: one writer, nothing stranded."""
    for round_ in range(15):
        root = tmp_path / str(round_)
        root.mkdir()
        engine, jobs, handles, refused = _race_round(root)
        for h in handles:  # every accepted save is written, none stranded behind the sentinel
            h.result(timeout=60)
        assert len(handles) + len(refused) >= 4
        assert len({j.writer_thread for j in jobs if j.writer_thread is not None}) <= 1
        assert sorted(os.listdir(root)) == sorted(h.label for h in handles)
        assert engine.closed and engine.pending == 0


def test_close_never_overtakes_a_save_being_staged(tmp_path):
    """close() from another thread while a save is copying: the save is written first."""
    engine = AsyncEngine()
    engine.save(lambda s: _Job(str(tmp_path), "first"), label="first").result(30)
    durable_at_close = []

    def close():
        engine.close()
        durable_at_close.append((tmp_path / "racing").is_dir())

    closer = threading.Thread(target=close)

    def stage(slot):
        closer.start()
        # A correct close() waits for this save, so this join runs out; one
        # that does not wait has returned by now.
        closer.join(1.0)
        return _Job(str(tmp_path), "racing")

    try:
        handle = engine.save(stage, label="racing")
    except EngineClosedError:
        pytest.fail("a save that had started staging was refused")
    closer.join(60)
    assert durable_at_close == [True]  # close() returned only once the racing save was durable
    assert handle.result(timeout=30).label == "racing"
    assert engine.closed
