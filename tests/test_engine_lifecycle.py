"""Lifecycle: dropped engines, the shared directory lock, fork() and the exit flush."""

from __future__ import annotations

import gc
import tracemalloc
import weakref

import numpy as np
import pytest

from asyncckpt import AsyncOptions, DirectoryLockedError
from asyncckpt._engine.lock import DirectoryLock
from asyncckpt._engine.writer import AsyncEngine
from tests.helpers import run_python, start_python, write_script
from tests.jobs import DirJob

_MB = 1 << 20


def _SlotJob(root, name, buf):
    """Writes the slot's staged buffer as a directory checkpoint."""
    return DirJob(root, name, [buf])


def _stage(root, name, state):
    def stage(slot):
        buf = slot.buffer("x", state.shape, state.dtype)
        np.copyto(buf, state)
        return _SlotJob(root, name, buf)
    return stage


def test_dropped_engines_finish_their_saves_then_free_thread_and_memory(tmp_path):
    state = np.random.default_rng(0).random(64 * _MB // 8)  # 64 MiB
    tracemalloc.start()
    try:
        gc.collect()
        baseline = tracemalloc.get_traced_memory()[0]
        threads, engines = [], []
        for i in range(3):
            engine = AsyncEngine(options=AsyncOptions(num_slots=1), name=f"dropped{i}")
            engine.save(_stage(str(tmp_path), f"c{i}", state), label=f"c{i}")
            threads.append(engine._thread)
            engines.append(weakref.ref(engine))
            del engine  # dropped with its save in flight, never closed
        for t in threads:
            t.join(60)
        gc.collect()
        leaked = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    assert not any(t.is_alive() for t in threads)  # every writer thread exited
    assert all(ref() is None for ref in engines)  # engines (and their pools) freed
    assert leaked < 16 * _MB, f"{leaked / _MB:.0f} MiB of staging memory still held"
    for i in range(3):  # the saves in flight when they were dropped were completed
        data = (tmp_path / f"c{i}" / "data.bin").read_bytes()
        assert data == state.tobytes()


def test_dropped_tf_checkpoints_are_freed(tmp_path):
    tf = pytest.importorskip("tensorflow")
    import asyncckpt.tf as atf

    threads, refs = [], []
    for i in range(3):
        ckpt = atf.Checkpoint(v=tf.Variable(tf.fill([16 * _MB // 4], float(i))))
        path = ckpt.save(str(tmp_path / f"run{i}" / "ckpt"))
        threads.append(ckpt.engine._thread)
        refs.append(weakref.ref(ckpt.engine))
        del ckpt
    for ref, thread in zip(refs, threads, strict=True):
        assert _collected(ref, thread)
    from tests.tfrestore import restore_both

    restore_both(path, lambda: {"v": tf.Variable(tf.zeros([16 * _MB // 4]))},
                 lambda o: np.testing.assert_array_equal(o["v"][:2].numpy(), [2.0, 2.0]))


_TRY_LOCK = """
import sys
from asyncckpt import DirectoryLockedError
from asyncckpt._engine.lock import DirectoryLock
try:
    DirectoryLock(sys.argv[1]).acquire()
except DirectoryLockedError as e:
    print("refused:", e)
    sys.exit(3)
print("acquired")
"""


def _other_process_can_lock(tmp_path, directory) -> bool:
    script = write_script(tmp_path, "try_lock.py", _TRY_LOCK)
    proc = run_python(script, str(directory), timeout=120)
    assert proc.returncode in (0, 3), proc.stderr
    return proc.returncode == 0


def test_directory_lock_is_shared_in_process_and_exclusive_between_processes(tmp_path):
    d = tmp_path / "ckpts"
    first, second = DirectoryLock(str(d)), DirectoryLock(str(d / ".." / "ckpts"))
    first.acquire()
    second.acquire()  # same real path, same process: shared
    assert first.held and second.held
    assert not _other_process_can_lock(tmp_path, d)
    first.release()
    assert second.held
    assert not _other_process_can_lock(tmp_path, d)  # still held by the other holder
    second.release()
    assert _other_process_can_lock(tmp_path, d)


def test_a_dropped_holder_gives_its_share_back(tmp_path):
    d = tmp_path / "ckpts"
    lock = DirectoryLock(str(d))
    lock.acquire()
    assert not _other_process_can_lock(tmp_path, d)
    del lock
    gc.collect()
    assert _other_process_can_lock(tmp_path, d)


def test_another_process_is_refused_with_the_holder_named(tmp_path):
    d = tmp_path / "ckpts"
    script = write_script(tmp_path, "hold.py", """
        import sys, threading
        from asyncckpt._engine.lock import DirectoryLock
        lock = DirectoryLock(sys.argv[1])
        lock.acquire()
        print("held", flush=True)
        threading.Event().wait()  # until killed
    """)
    holder = start_python(script, str(d))
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DirectoryLockedError, match=f"pid {holder.pid}"):
            DirectoryLock(str(d)).acquire()
    finally:
        holder.kill()
        holder.wait(60)
    with DirectoryLock(str(d)) as lock:  # the kernel dropped the dead holder's lock
        assert lock.held


_FORK = """
import os, sys, threading
from asyncckpt import AsyncOptions, EngineClosedError
from asyncckpt._engine.writer import AsyncEngine
from tests.jobs import DirJob

root = sys.argv[1]
gate = threading.Event()

def GatedJob(name):
    return DirJob(root, name, [b"x"], gate=gate, fsync=True)

engine = AsyncEngine(options=AsyncOptions(exit_timeout_s=600))
engine.save(lambda slot: GatedJob("parent"), label="parent")
pid = os.fork()
if pid == 0:
    try:
        engine.save(lambda slot: GatedJob("child"), label="child")
    except EngineClosedError:
        print("child: inherited engine refused", flush=True)
    sys.exit(0)  # a normal interpreter exit: exit hooks run
waiter = threading.Thread(target=os.waitpid, args=(pid, 0), daemon=True)
waiter.start()
waiter.join(120)  # the child must not wait for the parent's save (600 s)
print("child exited:", not waiter.is_alive(), flush=True)
print("files while gated:", sorted(os.listdir(root)), flush=True)
gate.set()
engine.close()
print("files:", sorted(os.listdir(root)), flush=True)
"""


def test_fork_child_exits_at_once_and_never_writes_the_parents_saves(tmp_path):
    root = tmp_path / "ckpts"
    root.mkdir()
    script = write_script(tmp_path, "fork.py", _FORK)
    proc = run_python(script, str(root), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "child: inherited engine refused" in proc.stdout
    assert "child exited: True" in proc.stdout
    assert "files while gated: []" in proc.stdout
    assert "files: ['parent']" in proc.stdout


_EXIT_TF = """
import sys, threading
import tensorflow as tf
import asyncckpt.tf as atf
from asyncckpt.tf._job import TFSaveJob

class AfterMainJob(TFSaveJob):
    # Writes only once the main thread has finished: the exit flush does it.
    def write(self):
        threading.main_thread().join()
        print("writing after the main thread finished", flush=True)
        super().write()

class Ckpt(atf.Checkpoint):
    _job_class = AfterMainJob

ckpt = Ckpt(v=tf.Variable(tf.range(1000, dtype=tf.float32)))
print("saved", ckpt.save(sys.argv[1]), flush=True)
# No sync(), no close(): the main thread ends here.
"""


def test_exit_flush_writes_with_tensorflow_after_the_main_thread_ends(tmp_path):
    tf = pytest.importorskip("tensorflow")
    script = write_script(tmp_path, "exit_tf.py", _EXIT_TF)
    proc = run_python(script, str(tmp_path / "run" / "ckpt"), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "writing after the main thread finished" in proc.stdout
    assert "interpreter exiting: waiting" in proc.stderr
    path = str(tmp_path / "run" / "ckpt-1")
    from tests.tfrestore import restore_both

    restore_both(path, lambda: {"v": tf.Variable(tf.zeros(1000))},
                 lambda o: np.testing.assert_array_equal(o["v"].numpy(), np.arange(1000.0)))
    assert tf.train.latest_checkpoint(str(tmp_path / "run")) == path


def _collected(ref, thread) -> bool:
    """Collects garbage until ``ref`` is dead and ``thread`` has exited (bounded).

    Objects in reference cycles (a manager and its callbacks) go only when
    the collector runs, which the test cannot otherwise wait for.
    """
    for _ in range(100):
        gc.collect()
        thread.join(0.1)
        if ref() is None and not thread.is_alive():
            return True
    return False


def test_dropped_jax_manager_completes_its_save_and_lets_go(tmp_path):
    pytest.importorskip("jax")
    import jax.numpy as jnp

    import asyncckpt.jax as aj

    mgr = aj.CheckpointManager(tmp_path / "run")
    mgr.save(1, {"w": jnp.arange(1 << 20, dtype=jnp.float32)})
    thread, ref = mgr.engine._thread, weakref.ref(mgr.engine)
    del mgr  # never closed, save in flight
    assert _collected(ref, thread)
    assert _other_process_can_lock(tmp_path, tmp_path / "run")
    with aj.CheckpointManager(tmp_path / "run") as again:  # a restart in the same process
        assert again.all_steps() == [1]
        assert float(again.restore(1)["w"][-1]) == (1 << 20) - 1


def test_a_finished_save_holds_no_reference_to_its_job(tmp_path):
    state = np.arange(1000.0)
    jobs = []

    def stage(slot):
        job = _stage(str(tmp_path), "c", state)(slot)
        jobs.append(weakref.ref(job))
        return job

    bad_jobs = []

    def failing(slot):
        job = DirJob(str(tmp_path), "bad", [state], fail=OSError(5, "Input/output error"))
        bad_jobs.append(weakref.ref(job))
        return job

    with AsyncEngine() as engine:
        handle = engine.save(stage, label="c")
        handle.result(30)
        engine.wait_until_finished()
        failed = engine.save(failing, label="bad")
        assert failed.committed.exception(30) is not None
        with pytest.raises(OSError):
            engine.wait_until_finished()
        engine.save(lambda slot: _SlotJob(str(tmp_path), "d", state), label="d").result(30)
        engine.wait_until_finished()  # the writer is idle now, its last save done
        # Alive engine, handles kept, error delivered: the jobs are gone.
        assert jobs[0]() is None and bad_jobs[0]() is None


_EXIT_BEFORE_ATEXIT = """
import atexit, os, sys, threading
from asyncckpt._engine.writer import AsyncEngine
from tests.jobs import DirJob

def refuse(*args):
    raise RuntimeError("threading._register_atexit is private CPython API")

threading._register_atexit = refuse  # the exit flush must not need it

root = sys.argv[1]
torn_down = []

class AfterMainJob(DirJob):
    def __init__(self):
        super().__init__(root, "late", [b"x"], fsync=True)
    def write(self):
        threading.main_thread().join()
        # Like a framework's own exit hook (jax.distributed.shutdown), registered
        # after the engine was made: it must not have run yet.
        assert not torn_down, "atexit hooks ran before the exit flush"
        super().write()

engine = AsyncEngine()
engine.save(lambda slot: AfterMainJob(), label="late")
atexit.register(torn_down.append, True)
"""


def test_exit_flush_runs_before_atexit_hooks_without_private_api(tmp_path):
    root = tmp_path / "ckpts"
    root.mkdir()
    script = write_script(tmp_path, "exit_order.py", _EXIT_BEFORE_ATEXIT)
    proc = run_python(script, str(root), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "background save of 'late' failed" not in proc.stderr, proc.stderr
    assert (root / "late").is_dir()
