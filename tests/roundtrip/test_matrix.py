"""Every kind of TensorFlow state through every trip: one test id per (kind, trip).

Kinds: ``tests/roundtrip/kinds.py``. Trips:

* ``asyncckpt_to_asyncckpt``: saved by ``asyncckpt.tf.Checkpoint.save``,
  restored by ``asyncckpt.tf.Checkpoint.restore``, read by asyncckpt's own
  reader (TensorFlow's ``RestoreV2`` reads none of the tensors asyncckpt
  reads itself);
* ``asyncckpt_to_tensorflow``: restored by ``tf.train.Checkpoint.restore``;
* ``tensorflow_to_asyncckpt``: saved by ``tf.train.Checkpoint.save``,
  restored by asyncckpt (no manifest: verified, then TensorFlow reads it);
* ``manager``: two saves through ``asyncckpt.tf.CheckpointManager`` (the
  second after a change), the latest restored by both readers and by a new
  manager's ``restore_or_initialize`` (that one wrapping a
  ``tf.train.Checkpoint``, as the README does);
* ``write_read``: ``write`` then ``read`` (no save counter), both readers;
* ``mutated_after_save``: every value changed as soon as ``save()``
  returns, before the background copy runs (held until then); both readers
  restore the values of the call;
* ``verdicts``: ``assert_consumed``, ``assert_existing_objects_matched``,
  ``assert_nontrivial_match`` and ``expect_partial`` give TensorFlow's
  verdicts for an exact match, a checkpoint with more than the objects, and
  objects with more than the checkpoint.

The asyncckpt saves of a kind go through one ``asyncckpt.tf.Checkpoint``
kept across its trips (``Live``), as a training loop's saves do.
"""

from __future__ import annotations

import contextlib
import threading

import pytest

tf = pytest.importorskip("tensorflow")
pytest.importorskip("keras")

import asyncckpt.tf as at  # noqa: E402
from asyncckpt.tf import _copy  # noqa: E402
from tests.roundtrip.kinds import KINDS, Kind, assert_same, unchanged_labels  # noqa: E402
from tests.tfrestore import READERS, OwnReader, checkpoint_class  # noqa: E402

SAVED, TARGET = 1, 2  # seeds: the values saved, and the other values restored over


def _verdict(kind: Kind, status, method: str) -> None:
    if kind.consumed and method == "restore":
        status.assert_consumed()
    else:  # read() leaves a saved save counter unrestored, also in TensorFlow
        status.assert_existing_objects_matched()


def _restore(kind: Kind, path: str, reader: str, *, method: str = "restore",
             extra: dict | None = None) -> tuple[dict, object, OwnReader]:
    """Restores ``path`` into ``kind``'s target objects with ``reader``; settles them."""
    objects = kind.make_target(TARGET)
    with OwnReader() as spy:
        status = getattr(checkpoint_class(reader)(**objects, **(extra or {})), method)(path)
        if kind.settle is not None:
            kind.settle(objects)
    return objects, status, spy


def _restore_and_check(kind: Kind, path: str, want: dict, reader: str, *,
                       method: str = "restore", own: bool = True) -> None:
    objects, status, spy = _restore(kind, path, reader, method=method)
    _verdict(kind, status, method)
    assert_same(kind.values(objects), want)
    if reader == "asyncckpt":
        if own:
            spy.assert_read_by_asyncckpt(path)
        else:
            assert not any(spy.took), "asyncckpt's reader took a checkpoint without a manifest"


class Live:
    """One kind's objects and the ``asyncckpt.tf.Checkpoint`` that saves them, kept across trips.

    As in training, one Checkpoint saves the same objects again and again
    (its staging plan is built once: with many variables, building it is
    most of a first save's cost). ``first`` is its first save and the
    values it holds. Each trip takes the values right before its own save.
    """

    def __init__(self, kind: Kind, directory):
        self.directory = directory
        self.objects = kind.build(SAVED)
        self.ckpt = at.Checkpoint(**self.objects)
        want = kind.values(self.objects)
        self.first = (self.ckpt.save(str(directory / "first")), want)


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """kind -> its ``Live`` checkpoint (made at its first use; closed after the module)."""
    cache: dict[str, Live] = {}

    def get(kind: Kind) -> Live:
        if kind.name not in cache:
            cache[kind.name] = Live(kind, tmp_path_factory.mktemp(kind.name))
        return cache[kind.name]

    yield get
    for one in cache.values():
        one.ckpt.close()


def trip_asyncckpt_to_asyncckpt(kind, tmp_path, live):
    path, want = live(kind).first
    _restore_and_check(kind, path, want, "asyncckpt")


def trip_asyncckpt_to_tensorflow(kind, tmp_path, live):
    path, want = live(kind).first
    live(kind).ckpt.sync()  # plain TensorFlow cannot wait for a save in flight
    _restore_and_check(kind, path, want, "tensorflow")


def trip_tensorflow_to_asyncckpt(kind, tmp_path, live):
    objects = kind.build(SAVED)
    want = kind.values(objects)
    path = tf.train.Checkpoint(**objects).save(str(tmp_path / "ckpt"))
    _restore_and_check(kind, path, want, "asyncckpt", own=False)


def trip_manager(kind, tmp_path, live):
    one = live(kind)
    directory = str(tmp_path / "run")
    with at.CheckpointManager(one.ckpt, directory, max_to_keep=2) as mgr:
        first = mgr.save()
        kind.mutate(one.objects)
        want = kind.values(one.objects)
        second = mgr.save()
        assert mgr.latest_checkpoint == second
    assert mgr.checkpoints == [first, second]
    assert tf.train.latest_checkpoint(directory) == second
    for reader in READERS:
        _restore_and_check(kind, second, want, reader)
    target = kind.make_target(TARGET)
    with at.CheckpointManager(tf.train.Checkpoint(**target), directory, max_to_keep=2) as again:
        assert again.restore_or_initialize() == second
        if kind.settle is not None:
            kind.settle(target)
    assert_same(kind.values(target), want)


def trip_write_read(kind, tmp_path, live):
    one = live(kind)
    want = kind.values(one.objects)
    prefix = str(tmp_path / "written")
    assert one.ckpt.write(prefix) == prefix
    one.ckpt.sync()
    for reader in READERS:
        _restore_and_check(kind, prefix, want, reader, method="read")


@contextlib.contextmanager
def _background_copies_held():
    """Holds asyncckpt's real background copies (``_copy``) until the block ends."""
    release = threading.Event()
    real = _copy.DeferredCopy.run

    def run(self):
        assert release.wait(120), "the test never released the copies"
        return real(self)

    _copy.DeferredCopy.run = run
    try:
        yield
    finally:
        release.set()
        _copy.DeferredCopy.run = real


def trip_mutated_after_save(kind, tmp_path, live):
    one = live(kind)
    want = kind.values(one.objects)
    with _background_copies_held():  # every change lands before the copies and the write
        path = one.ckpt.save(str(tmp_path / "ckpt"))
        kind.mutate(one.objects)
        assert not unchanged_labels(want, kind.values(one.objects))  # every value changed
    one.ckpt.sync()
    for reader in READERS:
        _restore_and_check(kind, path, want, reader)


def _outcome(call) -> str:
    try:
        call()
    except Exception as e:  # the verdict: which exception, if any
        return type(e).__name__
    return "ok"


def trip_verdicts(kind, tmp_path, live):
    path, want = live(kind).first
    live(kind).ckpt.sync()
    situations = {  # name: (method, extra objects to restore into)
        "exact": ("restore", False),
        # read() leaves the save counter (saved by save()) unrestored
        "checkpoint_has_more": ("read", False),
        "objects_have_more": ("restore", True),
    }
    for situation, (method, extra_target) in situations.items():
        verdicts = {}
        for reader in READERS:
            extra = {"extra_target": tf.Variable(1.0)} if extra_target else None
            objects, status, _ = _restore(kind, path, reader, method=method, extra=extra)
            verdicts[reader] = [_outcome(getattr(status, m)) for m in (
                "assert_consumed", "assert_existing_objects_matched",
                "assert_nontrivial_match")]
            assert status.expect_partial() is status
            assert_same(kind.values(objects), want)
        assert verdicts["asyncckpt"] == verdicts["tensorflow"], (situation, verdicts)
        if situation == "exact":
            assert verdicts["asyncckpt"][1:] == ["ok", "ok"], verdicts
            assert (verdicts["asyncckpt"][0] == "ok") == kind.consumed, verdicts
        else:
            assert verdicts["asyncckpt"][0] == "AssertionError", (situation, verdicts)


TRIPS = {name[len("trip_"):]: fn for name, fn in globals().items() if name.startswith("trip_")}


@pytest.mark.parametrize("trip", list(TRIPS))
@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_round_trip(kind, trip, tmp_path, live):
    TRIPS[trip](kind, tmp_path, live)
