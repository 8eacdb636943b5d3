"""A save that fails: the error reaches the caller, and nothing of the save is left.

On every front end, with real files and the real writer, a save fails in
its background write (a full disk at the values' file, an I/O error making
the files durable, a failed publish). Its error is raised by the next call
(``save``, ``wait``, ``close``), once; the checkpoints saved before it are
kept, whole, and restore with asyncckpt's reader and the framework's; no
temporary, no file of the failed save and no fsync thread is left; a
manager's retention decision made for the failed save is given back; the
front end saves again afterwards.
"""

from __future__ import annotations

import errno
import functools
import os
import threading

import numpy as np
import pytest

from tests.behaviour.frontends import FailingPublish, Faults, FlushErrorWriter, Gate, on, values


def _fsync_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "asyncckpt-fsync"}


def _set(faults: Faults, fault: Faults) -> None:
    faults.writer, faults.database = fault.writer, fault.database
    faults.destination = fault.destination


def _fault(frontend, kind: str) -> Faults:
    if kind == "disk-full":
        return frontend.data_fault()
    if kind == "flush":
        return Faults(writer=FlushErrorWriter)
    return Faults(destination=FailingPublish)


@on()
@pytest.mark.parametrize("kind", ["disk-full", "flush", "publish"])
def test_a_failed_save_is_raised_by_the_next_call_and_leaves_nothing(frontend, kind):
    keep = 1 if frontend.retains else None
    faults = Faults()
    saver = frontend.open(max_to_keep=keep, faults=faults)
    saver.save(1, 1.0)
    saver.wait()
    threads = _fsync_threads()

    _set(faults, _fault(frontend, kind))
    faults.gate = gate = Gate()
    try:
        saver.save(2, 2.0)  # staging succeeds; the write is held, then fails
        assert gate.entered.acquire(timeout=30)
        if frontend.retains:
            # Retention is decided at the call: 1 is dropped from the listing. The
            # managers list 2 at once, as TensorFlow's and orbax's do; the store
            # lists only what is durable.
            assert saver.steps() == ([2] if frontend.lists_in_flight else [])
    finally:
        faults.gate = None
        gate.release()
    error = saver.last_save.committed.exception(60)  # the failure has happened
    assert isinstance(error, OSError), error
    assert error.errno == {"disk-full": errno.ENOSPC, "flush": errno.EIO,
                           "publish": errno.EIO}[kind] or (kind, error.errno) == (
        "disk-full", errno.EIO)  # TensorFlow's bundle: taking in its data file fails
    _set(faults, Faults())

    with pytest.raises(OSError) as raised:
        saver.save(3, 3.0)  # the next call reports it (and saves nothing)
    assert raised.value is error
    assert any(repr(frontend.cli_name(2)) in note for note in raised.value.__notes__)
    saver.wait()  # reported once

    # The failed save never became durable: its retention decision is given back.
    assert saver.steps() == [1]
    assert frontend.framework_steps() == [1]
    assert sorted(os.listdir(frontend.directory)) == frontend.listing([1])  # no temporary
    for t in _fsync_threads() - threads:  # the failed commit stopped its fsync thread
        t.join(30)
        assert not t.is_alive()
    np.testing.assert_array_equal(frontend.read_both(1), values(1))

    # The front end keeps working: the failed step is saved again, and retention
    # drops what the failed save would have dropped.
    saver.save(2, 2.5)
    saver.wait()
    assert saver.steps() == ([2] if frontend.retains else [1, 2])
    saver.close()
    assert frontend.framework_steps() == saver.steps()
    assert sorted(os.listdir(frontend.directory)) == frontend.listing(saver.steps(),
                                                                     closed=True)
    np.testing.assert_array_equal(frontend.read_both(2), values(2.5))


@on()
def test_a_background_error_is_raised_by_wait_and_by_close(frontend):
    saver = frontend.open(faults=frontend.data_fault())
    saver.save(1, 1.0)
    with pytest.raises(OSError):
        saver.wait()
    saver.wait()  # reported once
    saver.save(2, 2.0)
    with pytest.raises(OSError):
        saver.close()
    assert frontend.framework_steps() == []
    assert sorted(os.listdir(frontend.directory)) == frontend.listing([], closed=True)


@on(waits_for_in_flight=True)
def test_restore_of_a_step_in_flight_waits_for_its_save(frontend):
    gate = Gate()
    saver = frontend.open(faults=Faults(gate=gate))
    try:
        saver.save(1, 1.0)
        assert gate.entered.acquire(timeout=30)
        assert frontend.framework_steps() == []  # not written yet
        got, errors = [], []

        def restore():
            try:
                got.append(saver.restore(1))
            except BaseException as e:  # reported below
                errors.append(e)

        reader = threading.Thread(target=restore)
        reader.start()
        reader.join(0.2)
        # Waiting for the write, not failing (a restore that does not wait fails or
        # restores something else: both are caught below too).
        assert reader.is_alive() and not errors
    finally:
        gate.release()
    reader.join(60)
    assert not errors, errors
    (step, restored), = got
    assert step == 1
    np.testing.assert_array_equal(restored, values(1))
    saver.close()
    np.testing.assert_array_equal(frontend.read_both(1), values(1))


@on()
def test_nothing_of_a_checkpoint_is_visible_before_its_publish(frontend):
    """The files and the manifest are all written, durable, and still no reader sees them."""
    from tests.behaviour.frontends import HeldPublish

    gate = Gate()
    faults = Faults()
    saver = frontend.open(faults=faults)
    saver.save(1, 1.0)
    saver.wait()
    faults.destination = functools.partial(HeldPublish, gate=gate)
    try:
        saver.save(2, 2.0)
        assert gate.entered.acquire(timeout=30)  # about to publish
        assert frontend.framework_steps() == [1]
        # What the save wrote is under a temporary name no reader takes for a checkpoint.
        extra = set(os.listdir(frontend.directory)) - set(frontend.listing([1]))
        assert extra and all(n.startswith(".asyncckpt-tmp-") for n in extra), extra
    finally:
        gate.release()
    saver.close()
    assert frontend.framework_steps() == [1, 2]
    assert sorted(os.listdir(frontend.directory)) == frontend.listing([1, 2], closed=True)
    np.testing.assert_array_equal(frontend.read_both(2), values(2))
