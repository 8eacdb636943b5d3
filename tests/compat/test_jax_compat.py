"""asyncckpt.jax.CheckpointManager used as orbax's CheckpointManager is, behaviour by behaviour.

One test (or a few) per row of the orbax table in docs/compat.md. Each one is
written from orbax 0.12.8's documented behaviour, and where files are
involved orbax's own manager reads what asyncckpt wrote, or the reverse.
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import os
import threading
import weakref
from unittest import mock

import numpy as np
import pytest

jax = pytest.importorskip("jax")
ocp = pytest.importorskip("orbax.checkpoint")

import jax.numpy as jnp  # noqa: E402

import asyncckpt.jax as aj  # noqa: E402
from asyncckpt._engine._removals import BackgroundRemover  # noqa: E402
from asyncckpt.jax._job import JaxSaveJob  # noqa: E402
from tests.helpers import run_python, write_script  # noqa: E402

logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's INFO/WARNING chatter


def _state(step: int) -> dict:
    return {"w": jnp.full((4, 3), float(step)), "b": np.arange(3, dtype=np.int32) + step,
            "step": step}


def _abstract() -> dict:
    return {"w": jax.ShapeDtypeStruct((4, 3), jnp.float32), "b": np.zeros(3, np.int32),
            "step": 0}


def _opts(**kw) -> ocp.CheckpointManagerOptions:
    return ocp.CheckpointManagerOptions(**kw)


def _same(a, b) -> None:
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# -- args= spelling ------------------------------------------------------------------


def test_standard_and_pytree_args_save_and_restore(ckpt_dir):
    with aj.CheckpointManager(ckpt_dir) as mgr:
        assert mgr.save(1, args=ocp.args.StandardSave(_state(1)))
        assert mgr.save(2, args=ocp.args.PyTreeSave(_state(2)))
        assert mgr.save(3, _state(3))  # the short form still works
        got = mgr.restore(1, args=ocp.args.StandardRestore(_abstract()))
        _same(got, _state(1))
        assert isinstance(got["w"], jax.Array) and isinstance(got["b"], np.ndarray)
        _same(mgr.restore(2, args=ocp.args.PyTreeRestore(_abstract())), _state(2))
        _same(mgr.restore(3, target=_abstract()), _state(3))
        with pytest.raises(TypeError, match="either the state or args"):
            mgr.save(4, _state(4), args=ocp.args.StandardSave(_state(4)))


def test_composite_of_named_items_with_json(ckpt_dir):
    with aj.CheckpointManager(ckpt_dir, item_names=("state", "extra")) as mgr:
        mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(1)),
                                            extra=ocp.args.JsonSave({"lr": 0.1, "tag": "a"})))
        with pytest.raises(ValueError, match="item_names"):
            mgr.save(2, args=ocp.args.StandardSave(_state(2)))
        got = mgr.restore(1, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_abstract()), extra=ocp.args.JsonRestore()))
        assert isinstance(got, ocp.args.Composite)
        _same(got.state, _state(1))
        assert got["extra"] == {"lr": 0.1, "tag": "a"}
        # A subset of the items: the others are not restored.
        only = mgr.restore(1, args=ocp.args.Composite(extra=ocp.args.JsonRestore()))
        assert list(only.keys()) == ["extra"]
        # No args: every item, as saved.
        everything = mgr.restore(1)
        assert set(everything.keys()) == {"state", "extra"}
        assert everything.extra == {"lr": 0.1, "tag": "a"}
        meta = mgr.metadata(1).item_metadata
        assert meta.extra is None and meta.state["w"].shape == (4, 3)
    # orbax reads the same items.
    with ocp.CheckpointManager(str(ckpt_dir), item_names=("state", "extra")) as theirs:
        got = theirs.restore(1, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_abstract()), extra=ocp.args.JsonRestore()))
        _same(got.state, _state(1))
        assert got.extra == {"lr": 0.1, "tag": "a"}


def test_metrics_custom_metadata_and_force(ckpt_dir):
    best = _opts(max_to_keep=1, best_fn=lambda m: m["acc"], save_interval_steps=10)
    with aj.CheckpointManager(ckpt_dir, options=best) as mgr:
        assert mgr.save(0, args=ocp.args.StandardSave(_state(0)), metrics={"acc": 0.9},
                        custom_metadata={"run": "x"})
        assert not mgr.save(3, args=ocp.args.StandardSave(_state(3)), metrics={"acc": 0.1})
        assert mgr.save(3, args=ocp.args.StandardSave(_state(3)), metrics={"acc": 0.1},
                        force=True)
        mgr.wait_until_finished()
        assert mgr.best_step() == 0
        meta = mgr.metadata(0)
        assert meta.metrics == {"acc": 0.9} and meta.custom_metadata == {"run": "x"}
    # orbax's best_fn ranks the metrics asyncckpt wrote.
    with ocp.CheckpointManager(str(ckpt_dir), options=best) as theirs:
        assert theirs.best_step() == 0
        assert dict(theirs.metadata(0).custom_metadata) == {"run": "x"}


def _modes(root) -> set[tuple[str, int]]:
    """(kind, permission bits) of everything below ``root``."""
    found = set()
    for parent, dirs, files in os.walk(root):
        found |= {("dir", os.stat(os.path.join(parent, d)).st_mode & 0o7777) for d in dirs}
        found |= {("file", os.stat(os.path.join(parent, f)).st_mode & 0o7777) for f in files}
    return found


@pytest.mark.parametrize("use_ocdbt", [True, False])
def test_path_permission_mode_is_honoured(tmp_path, use_ocdbt):
    """kauldron's FileOptions(path_permission_mode=0o770): every directory made gets it."""
    old = os.umask(0o022)  # would give 0o755 / 0o644 otherwise
    try:
        fo = ocp.options.FileOptions(path_permission_mode=0o770)
        fmt = aj.FormatOptions(use_ocdbt=use_ocdbt)
        with aj.CheckpointManager(tmp_path / "run", options=_opts(file_options=fo),
                                  format_options=fmt) as mgr:
            mgr.save(1, args=ocp.args.StandardSave(_state(1)))
        with aj.StandardCheckpointer(file_options=fo, use_ocdbt=use_ocdbt) as c:
            c.save(tmp_path / "one" / "state", _state(2))
    finally:
        os.umask(old)
    assert os.stat(tmp_path / "run").st_mode & 0o777 == 0o770
    for root in (tmp_path / "run" / "1", tmp_path / "one" / "state"):
        assert os.stat(root).st_mode & 0o777 == 0o770
        assert _modes(root) <= {("dir", 0o770), ("file", 0o660)}, _modes(root)
        assert ("file", 0o660) in _modes(root)
    with aj.CheckpointManager(tmp_path / "run") as mgr:
        _same(mgr.restore(1, args=ocp.args.StandardRestore(_abstract())), _state(1))
    with ocp.CheckpointManager(tmp_path / "run") as theirs:
        _same(theirs.restore(1, args=ocp.args.StandardRestore(_abstract())), _state(1))
    with ocp.StandardCheckpointer() as theirs:
        _same(theirs.restore(tmp_path / "one" / "state", _abstract()), _state(2))


# -- CheckpointManagerOptions -----------------------------------------------------------


def test_options_object_and_refused_fields(ckpt_dir):
    with aj.CheckpointManager(ckpt_dir, options=_opts(max_to_keep=2)) as mgr:
        for s in range(4):
            mgr.save(s, args=ocp.args.StandardSave(_state(s)))
        assert mgr.all_steps() == [2, 3]  # at once, as orbax
    with pytest.raises(ValueError, match=r"step_name_format.*use step_prefix"):
        aj.CheckpointManager(ckpt_dir, options=_opts(
            step_name_format=ocp.step.standard_name_format(step_prefix="x")))
    with pytest.raises(ValueError, match="skip_sync_file_validations"):
        aj.CheckpointManager(ckpt_dir, options=_opts(
            file_options=ocp.options.FileOptions(skip_sync_file_validations=True)))
    with pytest.raises(ValueError, match="mutually exclusive"):  # as orbax
        aj.CheckpointManager(ckpt_dir, options=_opts(
            preservation_policy=ocp.checkpoint_managers.LatestN(n=1), max_to_keep=2))
    with pytest.raises(ValueError, match="either options= or the keyword"):
        aj.CheckpointManager(ckpt_dir, options=_opts(), max_to_keep=3)
    with pytest.raises(ValueError, match="mutually exclusive"):  # as orbax
        aj.CheckpointManager(ckpt_dir, item_names=("a",),
                             handler_registry=ocp.handlers.DefaultCheckpointHandlerRegistry())


class _HeldRemovals(BackgroundRemover):
    """The step directory's remover, each removal held until ``go`` is set."""

    def __init__(self, name: str):
        super().__init__(name)
        self.go = threading.Event()
        self.started = threading.Event()

    def remove(self, path: str) -> None:
        self.started.set()
        assert self.go.wait(30)
        super().remove(path)


@pytest.mark.parametrize("background", [False, True])
def test_enable_background_delete_is_honoured(tmp_path, background):
    # orbax's enable_background_delete=True: wait_until_finished() and delete() return
    # while deleted steps' files are still being removed; close() waits for them. False
    # (the default): both wait, as orbax's deletion at the end of each save does.
    with aj.CheckpointManager(tmp_path, options=_opts(
            max_to_keep=1, enable_background_delete=background)) as mgr:
        held = mgr._view.steps.removals = _HeldRemovals("test")  # the remover's one seam
        mgr.save(1, args=ocp.args.StandardSave(_state(1)))
        mgr.wait_until_finished()
        mgr.save(2, args=ocp.args.StandardSave(_state(2)))
        waiter = threading.Thread(target=mgr.wait_until_finished)
        waiter.start()
        assert held.started.wait(30)  # step 1's files are being removed
        waiter.join(1.0)
        assert waiter.is_alive() is not background
        assert mgr.all_steps() == [2]  # out of the listing at once either way
        held.go.set()
        waiter.join(30)
        assert not waiter.is_alive()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["2"]
    with aj.CheckpointManager(tmp_path) as ours:  # asyncckpt's reader
        np.testing.assert_array_equal(ours.restore(2, _abstract())["w"], _state(2)["w"])
    with ocp.CheckpointManager(tmp_path) as theirs:  # and orbax's
        np.testing.assert_array_equal(
            theirs.restore(2, args=ocp.args.StandardRestore(_abstract()))["w"], _state(2)["w"])


def test_should_save_first_step_interval_save_on_steps_and_fn(tmp_path):
    with aj.CheckpointManager(tmp_path / "a", options=_opts(save_interval_steps=2)) as mgr:
        assert mgr.should_save(1)  # no checkpoint yet: orbax saves the first step
        mgr.save(1, args=ocp.args.StandardSave(_state(1)))
        assert [s for s in range(1, 8) if mgr.should_save(s)] == [2, 4, 6]
    with aj.CheckpointManager(tmp_path / "b", options=_opts(
            save_interval_steps=5, save_on_steps=[3, 7])) as mgr:
        mgr.save(0, _state(0))
        assert [s for s in range(1, 11) if mgr.should_save(s)] == [3, 5, 7, 10]
    seen = []

    def fn(step, latest):
        seen.append((step, latest))
        return step % 3 == 0

    with aj.CheckpointManager(tmp_path / "c", options=_opts(should_save_fn=fn,
                                                            save_interval_steps=1)) as mgr:
        assert not mgr.should_save(1)  # should_save_fn replaces the other rules
        assert mgr.save(3, _state(3)) and not mgr.save(4, _state(4))
        assert seen[-1] == (4, 3)


def test_step_prefix_and_fixed_length_read_by_orbax_and_back(tmp_path):
    opts = dict(step_prefix="ckpt", step_format_fixed_length=6)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    with aj.CheckpointManager(ours, options=_opts(**opts)) as mgr:
        mgr.save(7, args=ocp.args.StandardSave(_state(7)))
        mgr.save(1234567, args=ocp.args.StandardSave(_state(8)))
    assert sorted(n for n in os.listdir(ours) if n.startswith("ckpt")) == [
        "ckpt_000007", "ckpt_1234567"]
    # The catalog (asyncckpt list / verify) finds and verifies them by step too.
    from asyncckpt import catalog

    found = catalog.list_checkpoints(str(ours))
    assert [(c.name, c.step) for c in found] == [("ckpt_000007", 7), ("ckpt_1234567", 1234567)]
    for c in found:
        assert catalog.verify(c).step == c.step
    with ocp.CheckpointManager(str(ours), options=_opts(**opts)) as mgr:
        assert mgr.all_steps() == [7, 1234567]
        _same(mgr.restore(7, args=ocp.args.StandardRestore(_abstract())), _state(7))
    with ocp.CheckpointManager(str(theirs), options=_opts(**opts)) as mgr:
        mgr.save(5, args=ocp.args.StandardSave(_state(5)))
    with aj.CheckpointManager(theirs, options=_opts(**opts)) as mgr:
        assert mgr.all_steps() == [5]
        _same(mgr.restore(5, args=ocp.args.StandardRestore(_abstract())), _state(5))
        _same(mgr.restore(None, args=ocp.args.StandardRestore(_abstract())), _state(5))


def test_we_restore_orbax_composite_with_restore_from_another_directory(tmp_path):
    with ocp.CheckpointManager(str(tmp_path / "orbax"), item_names=("state", "meta")) as mgr:
        mgr.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(2)),
                                            meta=ocp.args.JsonSave({"k": 1})))
    with aj.CheckpointManager(tmp_path / "mine") as mgr:
        got = mgr.restore(2, directory=tmp_path / "orbax", args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_abstract()), meta=ocp.args.JsonRestore()))
        _same(got.state, _state(2))
        assert got.meta == {"k": 1}


def test_create_and_read_only(tmp_path):
    made = tmp_path / "made"
    aj.CheckpointManager(made).close()
    assert made.is_dir()  # created at construction, as orbax
    absent = tmp_path / "absent"
    aj.CheckpointManager(absent, options=_opts(create=False)).close()
    assert not absent.exists()
    with aj.CheckpointManager(made) as mgr:
        mgr.save(1, _state(1))
    with aj.CheckpointManager(made, options=_opts(read_only=True, max_to_keep=1)) as mgr:
        assert not mgr.should_save(2)
        assert not mgr.save(2, _state(2), force=True)
        mgr.delete(1)  # skipped, as orbax
        assert mgr.all_steps() == [1]
        _same(mgr.restore(1, target=_abstract()), _state(1))


def test_max_to_keep_zero_keeps_nothing(ckpt_dir):
    with aj.CheckpointManager(ckpt_dir, options=_opts(max_to_keep=0, keep_period=4)) as mgr:
        for s in range(1, 6):
            assert mgr.save(s, _state(s))
            assert s not in mgr.all_steps() or s == 4
        mgr.wait_until_finished()
        assert mgr.all_steps() == [4]
    assert sorted(n for n in os.listdir(ckpt_dir) if n.isdigit()) == ["4"]


def test_keep_time_interval_preserves_one_per_interval(ckpt_dir):
    # Every save is within the hour of the first: only the first is preserved.
    with aj.CheckpointManager(ckpt_dir, options=_opts(
            max_to_keep=1, keep_time_interval=datetime.timedelta(hours=1))) as mgr:
        for s in range(1, 5):
            mgr.save(s, _state(s))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 4]


# orbax's own CheckpointManager cases with a controlled clock (checkpoint_manager_test.py):
# (options, metrics of step k or None, (last step of orbax's test, the steps it keeps)).
_CLOCK_CASES = {
    "time_interval": (dict(max_to_keep=2, keep_time_interval=datetime.timedelta(hours=3)),
                      None, (9, [0, 3, 6, 8, 9])),
    "time_interval_metrics": (dict(max_to_keep=3, best_mode="min", best_fn=lambda m: m["loss"],
                                   keep_time_interval=datetime.timedelta(hours=3)),
                              lambda k: {"loss": k}, (9, [0, 1, 2, 3, 6, 9])),
    "max_to_keep_zero_other_conditions": (
        dict(max_to_keep=0, keep_period=3, keep_time_interval=datetime.timedelta(hours=5)),
        None, (8, [0, 3, 5, 6])),
}


@pytest.mark.parametrize("todelete_subdir", [None, "ttl=1h"])
@pytest.mark.parametrize("case", sorted(_CLOCK_CASES))
def test_retention_takes_the_clock_orbax_takes(tmp_path, case, todelete_subdir):
    """The save time is ``datetime.datetime.now()`` at the call, as in orbax: a patched
    clock gets orbax's decisions after every save, and a restarted manager (the times
    recorded with the steps) goes on deciding as one that ran all along."""
    options, metrics, (last, kept) = _CLOCK_CASES[case]
    opts = _opts(todelete_subdir=todelete_subdir, **options)
    now = datetime.datetime.now(tz=datetime.UTC)
    ours, theirs = aj.CheckpointManager(tmp_path / "ours", options=opts), \
        ocp.CheckpointManager(tmp_path / "theirs", options=opts)
    again = aj.CheckpointManager(tmp_path / "again", options=opts)  # restarted half way
    with mock.patch("datetime.datetime", autospec=True) as clock:
        for k in range(12):
            clock.now.return_value = now + datetime.timedelta(hours=k)
            m = None if metrics is None else metrics(k)
            assert theirs.save(k, args=ocp.args.StandardSave(_state(k)), metrics=m)
            assert ours.save(k, args=ocp.args.StandardSave(_state(k)), metrics=m)
            assert again.save(k, args=ocp.args.StandardSave(_state(k)), metrics=m)
            expected = theirs.all_steps()
            if "best_fn" in options and k not in expected:
                expected.append(k)  # asyncckpt never deletes the newest by metric (compat.md)
            assert ours.all_steps() == again.all_steps() == expected, k
            if k == last:
                assert ours.all_steps() == kept  # orbax's own test's expectation
            if k == 6:  # a new process: nothing of the first manager is kept
                again.close()
                view, again = weakref.ref(again._view), None
                gc.collect()
                assert view() is None
                again = aj.CheckpointManager(tmp_path / "again", options=opts)
        for mgr in (ours, theirs, again):
            mgr.wait_until_finished()
    final = theirs.all_steps()
    if "best_fn" in options and 11 not in final:
        final.append(11)  # the newest, as above
    for mgr in (ours, again):
        assert mgr.all_steps() == final
        mgr.close()
    theirs.close()
    for name in ("ours", "again"):
        assert sorted(int(n) for n in os.listdir(tmp_path / name) if n.isdigit()) == final
    step = final[-1]
    with aj.CheckpointManager(tmp_path / "ours") as mgr:
        _same(mgr.restore(step, args=ocp.args.StandardRestore(_abstract())), _state(step))
    with ocp.CheckpointManager(tmp_path / "ours") as mgr:
        _same(mgr.restore(step, args=ocp.args.StandardRestore(_abstract())), _state(step))


def test_save_on_preemption_asks_jaxs_sync_point_as_orbax(tmp_path):
    """orbax's ``test_save_on_preemption``: whatever answers for JAX's
    ``reached_preemption_sync_point`` (here a function put in its place) decides."""
    from jax.experimental import multihost_utils

    opts = _opts(save_interval_steps=4)
    with (mock.patch.object(multihost_utils, "reached_preemption_sync_point",
                            side_effect=lambda step: step == 2),
          aj.CheckpointManager(tmp_path / "ours", options=opts) as ours,
          ocp.CheckpointManager(tmp_path / "theirs", options=opts) as theirs):
        for k in range(10):
            assert ours.reached_preemption(k) == theirs.reached_preemption(k) == (k == 2)
            assert (ours.save(k, args=ocp.args.StandardSave(_state(k)))
                    == theirs.save(k, args=ocp.args.StandardSave(_state(k))))
        ours.wait_until_finished()
        assert ours.all_steps() == theirs.all_steps() == [0, 2, 4, 8]
    with ocp.CheckpointManager(tmp_path / "ours") as mgr:
        _same(mgr.restore(2, args=ocp.args.StandardRestore(_abstract())), _state(2))


def test_delete_returns_once_the_step_is_gone_and_close_leaves_only_steps(ckpt_dir):
    """orbax's ``test_delete`` lists the directory after ``delete``: no deleted tree is
    left; the directory lock's file stays while the manager may save (docs/compat.md)."""
    with aj.CheckpointManager(ckpt_dir) as mgr:
        assert mgr.save(0, args=ocp.args.JsonSave({"a": 1, "b": "hello"}))
        assert mgr.save(1, args=ocp.args.StandardSave(_state(1)))
        mgr.wait_until_finished()
        mgr.delete(0)
        assert mgr.all_steps() == [1]
        assert sorted(os.listdir(ckpt_dir)) == [".asyncckpt.lock", "1"]
        mgr.delete(1)
        assert mgr.all_steps() == []
        assert os.listdir(ckpt_dir) == [".asyncckpt.lock"]
        assert mgr.save(2, args=ocp.args.StandardSave(_state(2)))
    assert os.listdir(ckpt_dir) == ["2"]
    with ocp.CheckpointManager(ckpt_dir) as theirs:
        assert theirs.all_steps() == [2]
        _same(theirs.restore(2, args=ocp.args.StandardRestore(_abstract())), _state(2))


def test_todelete_subdir_and_delete(ckpt_dir):
    with aj.CheckpointManager(ckpt_dir, options=_opts(max_to_keep=1,
                                                      todelete_subdir="trash")) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2]
        assert os.listdir(ckpt_dir / "trash") == ["1"]
        mgr.save(3, _state(3))
        assert mgr.all_steps() == [3]
        mgr.delete(3)  # waits for its save first
        assert mgr.all_steps() == []
        assert sorted(os.listdir(ckpt_dir / "trash")) == ["1", "2", "3"]
        with pytest.raises(FileNotFoundError):
            mgr.delete(7)


def test_enable_async_false_saves_synchronously(ckpt_dir):
    with aj.CheckpointManager(ckpt_dir, options=_opts(enable_async_checkpointing=False)) as mgr:
        mgr.save(1, _state(1))
        assert not mgr.is_saving_in_progress()
        assert (ckpt_dir / "1" / "default" / "_METADATA").exists()  # durable on return


# -- methods ----------------------------------------------------------------------------


class _GatedJob(JaxSaveJob):
    """The real save job, held before writing until the test opens the gate."""

    gate = threading.Event()

    def write(self) -> None:
        self.gate.wait()
        super().write()


def _manager(job: type[JaxSaveJob]) -> type[aj.CheckpointManager]:
    """asyncckpt's manager, its saves written by ``job`` (a subclass of the real job)."""
    return type("Manager", (aj.CheckpointManager,), {"_job_class": job})


def test_listing_changes_at_save_and_restore_waits_for_the_step(ckpt_dir):
    _GatedJob.gate.clear()
    with _manager(_GatedJob)(ckpt_dir) as mgr:
        mgr.save(1, _state(1))
        assert mgr.all_steps() == [1] and mgr.latest_step() == 1
        assert mgr.is_saving_in_progress() and not (ckpt_dir / "1").exists()
        with pytest.raises(aj.StepAlreadyExistsError):
            mgr.save(1, _state(1), force=True)
        got = {}
        reader = threading.Thread(target=lambda: got.update(v=mgr.restore(1, _abstract())))
        reader.start()
        _GatedJob.gate.set()
        reader.join()
        _same(got["v"], _state(1))
        assert not mgr.is_saving_in_progress()


def test_step_already_exists_is_orbax_error(ckpt_dir):
    with aj.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, _state(1))
        mgr.wait_until_finished()
        with pytest.raises(ocp.checkpoint_manager.StepAlreadyExistsError):
            mgr.save(1, _state(1), force=True)
    # After a restart, from the disk.
    with aj.CheckpointManager(ckpt_dir) as mgr, pytest.raises(
            ocp.checkpoint_manager.StepAlreadyExistsError):
        mgr.save(1, _state(1), force=True)


def test_reload_best_step_check_for_errors_and_root_metadata(ckpt_dir):
    opts = _opts(best_fn=lambda m: m["loss"], best_mode="min")
    with aj.CheckpointManager(ckpt_dir, options=opts, metadata={"version": 2}) as mgr:
        assert mgr.best_step() is None
        mgr.save(1, _state(1), metrics={"loss": 0.5})
        mgr.save(2, _state(2), metrics={"loss": 0.7})
        mgr.check_for_errors()
        mgr.wait_until_finished()
        assert mgr.best_step() == 1
        assert mgr.metadata().custom_metadata == {"version": 2}
        step_meta = mgr.metadata(2)
        assert step_meta.item_metadata["w"].shape == (4, 3)
        assert mgr.item_metadata(2)["b"].dtype == np.int32
        # Changed behind the manager's back: reload() reads it again.
        with ocp.CheckpointManager(str(ckpt_dir)) as theirs:
            theirs.save(3, args=ocp.args.StandardSave(_state(3)), metrics={"loss": 0.1})
        mgr.reload()
        assert mgr.all_steps() == [1, 2, 3]
    with ocp.CheckpointManager(str(ckpt_dir), options=opts) as theirs:
        assert theirs.metadata().custom_metadata == {"version": 2}
    with aj.CheckpointManager(ckpt_dir, metadata={"version": 3}) as mgr:
        assert mgr.metadata().custom_metadata == {"version": 2}  # written once, as orbax


def test_check_for_errors_reraises_a_background_failure(ckpt_dir):
    class Failing(JaxSaveJob):
        def write(self) -> None:
            raise OSError("disk full (injected)")

    with _manager(Failing)(ckpt_dir) as mgr:
        mgr.save(1, _state(1))
        assert isinstance(mgr.last_save.committed.exception(), OSError)  # waits for the writer
        with pytest.raises(OSError, match="injected"):
            mgr.check_for_errors()
        mgr.check_for_errors()  # reported once
        assert mgr.all_steps() == []


# -- partial restore --------------------------------------------------------------------


def _bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc")
def test_placeholder_and_partial_restore_read_only_the_selected_arrays(ckpt_dir):
    """In the zarr-file layout; OCDBT data files hold many arrays (tests/test_jax_ocdbt.py)."""
    big = np.random.default_rng(0).random((1024, 1024), dtype=np.float32)  # 4 MiB
    tree = {"big": big, "small": {"x": jnp.arange(4.0), "y": np.ones(2, np.int8)}}
    with aj.CheckpointManager(ckpt_dir, format_options=aj.FormatOptions(use_ocdbt=False)) as mgr:
        mgr.save(1, tree)
        mgr.wait_until_finished()
        before = _bytes_read()
        got = mgr.restore(1, args=ocp.args.PyTreeRestore(
            {"big": ocp.PLACEHOLDER, "small": {"x": jax.ShapeDtypeStruct((4,), jnp.float32),
                                               "y": ocp.PLACEHOLDER}}))
        assert _bytes_read() - before < big.nbytes // 8
        assert got["big"] is ocp.PLACEHOLDER and got["small"]["y"] is ocp.PLACEHOLDER
        _same(got["small"]["x"], tree["small"]["x"])
        before = _bytes_read()
        got = mgr.restore(1, args=ocp.args.PyTreeRestore(
            {"small": {"y": np.zeros(2, np.int8)}}, partial_restore=True))
        assert _bytes_read() - before < big.nbytes // 8
        assert list(got) == ["small"] and list(got["small"]) == ["y"]
        with pytest.raises(ValueError, match="partial_restore=True"):
            mgr.restore(1, args=ocp.args.PyTreeRestore({"small": {"y": np.zeros(2, np.int8)}}))
        # restore_args alone give the structure, types and shardings.
        got = mgr.restore(1, args=ocp.args.PyTreeRestore(restore_args={
            "big": ocp.RestoreArgs(restore_type=np.ndarray),
            "small": {"x": ocp.ArrayRestoreArgs(sharding=jax.sharding.SingleDeviceSharding(
                jax.devices()[0])), "y": ocp.RestoreArgs()}}))
        assert isinstance(got["big"], np.ndarray) and isinstance(got["small"]["x"], jax.Array)
        _same(got, tree)


@pytest.mark.parametrize("layout", ["ocdbt", "zarr"])
def test_a_placeholder_item_that_does_not_match_raises_orbaxs_error(tmp_path, layout):
    """orbax's ``test_partial_restore_with_placeholder``: a leaf left out of the item, or
    a ``PLACEHOLDER`` for a whole subtree, is orbax's ``ValueError`` by its words."""
    tree = {"a": np.arange(3.0), "c": {"a": np.ones(2, np.int32), "e": np.zeros(2)}}
    with aj.CheckpointManager(tmp_path / "ours", format_options=aj.FormatOptions(
            use_ocdbt=layout == "ocdbt")) as mgr:
        mgr.save(0, args=ocp.args.PyTreeSave(tree))
    items = {"missing_leaf": {"a": np.zeros(3), "c": {"e": ocp.PLACEHOLDER}},
             "non_leaf_placeholder": {"a": np.zeros(3), "c": ocp.PLACEHOLDER}}
    for item in items.values():
        for cls in (aj.CheckpointManager, ocp.CheckpointManager):
            with cls(tmp_path / "ours") as mgr, pytest.raises(
                    ValueError, match="User-provided restore item and on-disk value"):
                mgr.restore(0, args=ocp.args.PyTreeRestore(item))
    for cls in (aj.CheckpointManager, ocp.CheckpointManager):  # what matches is restored
        with cls(tmp_path / "ours") as mgr:
            got = mgr.restore(0, args=ocp.args.PyTreeRestore(
                {"a": np.zeros(3), "c": {"a": ocp.PLACEHOLDER, "e": np.ones(2)}}))
        assert got["c"]["a"] is ocp.PLACEHOLDER
        _same([got["a"], got["c"]["e"]], [tree["a"], tree["c"]["e"]])


# -- lifecycle ---------------------------------------------------------------------------


def test_two_managers_of_one_directory_cooperate_and_restart(ckpt_dir):
    first = aj.CheckpointManager(ckpt_dir, options=_opts(max_to_keep=3))
    second = aj.CheckpointManager(ckpt_dir, options=_opts(max_to_keep=3))
    first.save(1, _state(1))
    second.save(2, _state(2))  # no DirectoryLockedError naming our own pid
    assert first.all_steps() == second.all_steps() == [1, 2]
    with pytest.raises(aj.StepAlreadyExistsError):
        second.save(1, _state(1), force=True)
    del first  # dropped without close(): its save still completes
    second.wait_until_finished()
    for s in (3, 4):
        mgr = aj.CheckpointManager(ckpt_dir, options=_opts(max_to_keep=3))  # a "restart"
        mgr.save(s, _state(s))
        del mgr
    second.wait_until_finished()
    assert second.all_steps() == [2, 3, 4]
    _same(second.restore(4, _abstract()), _state(4))
    second.close()


def test_dropped_managers_are_collected(tmp_path):
    refs = []
    for i in range(5):
        mgr = aj.CheckpointManager(tmp_path / str(i % 2))
        mgr.save(i, _state(i))
        mgr.wait_until_finished()
        refs.append(weakref.ref(mgr))
        del mgr
    gc.collect()
    assert all(r() is None for r in refs)


def test_a_failed_retention_delete_does_not_fail_the_save(ckpt_dir, caplog):
    failures = []

    class Manager(aj.CheckpointManager):  # the real deletion, on a disk refusing the first
        @staticmethod
        def _delete_step(view, todelete_subdir, tiers, step):
            if not failures:
                failures.append(step)
                raise PermissionError(f"cannot delete step {step} (injected)")
            aj.CheckpointManager._delete_step(view, todelete_subdir, tiers, step)

    with Manager(ckpt_dir, options=_opts(max_to_keep=1)) as mgr:
        mgr.save(1, _state(1))
        with caplog.at_level(logging.WARNING):
            mgr.save(2, _state(2))
            mgr.wait_until_finished()  # the save itself succeeded
        assert "retrying at the next save" in caplog.text and failures == [1]
        assert mgr.all_steps() == [2] and (ckpt_dir / "1").exists()
        mgr.save(3, _state(3))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3]
    assert sorted(n for n in os.listdir(ckpt_dir) if n.isdigit()) == ["3"]


# -- preemption ---------------------------------------------------------------------------

_PREEMPT = """
import os, signal, socket, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
import jax, jax.numpy as jnp
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=1, process_id=0)
import orbax.checkpoint as ocp
import asyncckpt.jax as aj
policies = ocp.checkpoint_managers
options = (ocp.CheckpointManagerOptions(save_interval_steps=10**9) if sys.argv[2] == "interval"
           else ocp.CheckpointManagerOptions(save_decision_policy=policies.AnySavePolicy([
               policies.InitialSavePolicy(), policies.PreemptionCheckpointingPolicy()])))
mgr = aj.CheckpointManager(sys.argv[1], options=options)
mgr.save(0, args=ocp.args.StandardSave({"w": jnp.zeros(2)}))
print("before", mgr.reached_preemption(1), flush=True)
os.kill(os.getpid(), signal.SIGTERM)  # JAX's notifier takes it; its sync point follows
step = 1
while not mgr.should_save(step):
    step += 1
mgr.save(step, args=ocp.args.StandardSave({"w": jnp.full(2, step)}))
mgr.wait_until_finished()
print("saved", step, mgr.reached_preemption(step), mgr.all_steps(), flush=True)
mgr.close()
os._exit(0)
"""


@pytest.mark.parametrize("rules", ["interval", "PreemptionCheckpointingPolicy"])
def test_saves_at_jax_preemption_sync_point_off_interval(tmp_path, rules):
    """With orbax's policy object too: its DecisionContext says reached_preemption."""
    script = write_script(tmp_path, "preempt.py", _PREEMPT)
    done = run_python(script, str(tmp_path / "ckpts"), rules, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "before False" in done.stdout
    line = next(x for x in done.stdout.splitlines() if x.startswith("saved"))
    step = int(line.split()[1])
    assert 0 < step < 10**9 and f"saved {step} True [0, {step}]" == line


# -- orbax's policy objects --------------------------------------------------------------

_cm = ocp.checkpoint_managers


class _OddStepsAndNewest(_cm.PreservationPolicy):
    """A user's own policy: odd steps, and the newest."""

    def should_preserve(self, checkpoints, *, context):
        return [c.step % 2 == 1 or i == len(checkpoints) - 1
                for i, c in enumerate(checkpoints)]


_PRESERVATION = {
    "LatestN": _cm.LatestN(n=2),
    "EveryNSteps": _cm.EveryNSteps(interval_steps=3),
    "EveryNStepsClosest": _cm.EveryNStepsClosest(interval_steps=4, max_to_keep=2),
    "EveryNSeconds": _cm.EveryNSeconds(interval_secs=3600),
    "CustomSteps": _cm.CustomSteps(steps=[1, 4]),
    "BestN": _cm.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=2,
                       keep_checkpoints_without_metrics=False),
    "LatestDuration": _cm.LatestDuration(duration=datetime.timedelta(hours=1)),
    "PreserveAll": _cm.preservation_policy.PreserveAll(),
    "AnyPreservationPolicy": _cm.AnyPreservationPolicy([_cm.LatestN(n=1),
                                                        _cm.EveryNSteps(interval_steps=4)]),
    "subclass": _OddStepsAndNewest(),
}


@pytest.mark.parametrize("name", sorted(_PRESERVATION))
def test_orbax_preservation_policies_keep_what_orbax_keeps(tmp_path, name):
    """Each policy orbax 0.12.8 ships (and a subclass), next to orbax's own manager:
    the same steps listed after every save and left on disk."""
    policy = _PRESERVATION[name]
    seen = {}
    for who, manager in (("ours", aj.CheckpointManager), ("orbax", ocp.CheckpointManager)):
        with manager(tmp_path / who, options=_opts(preservation_policy=policy)) as mgr:
            listed = []
            for s in range(1, 7):  # metrics: 5 is the worst loss, the newest ranked last
                mgr.save(s, args=ocp.args.StandardSave(_state(s)),
                         metrics={"loss": 10 - s if s != 5 else 99})
                listed.append(mgr.all_steps())
            mgr.wait_until_finished()
        on_disk = sorted(int(n) for n in os.listdir(tmp_path / who) if n.isdigit())
        seen[who] = (listed, on_disk)
    assert seen["ours"] == seen["orbax"]
    kept = seen["ours"][1]
    with ocp.CheckpointManager(tmp_path / "ours") as theirs:
        _same(theirs.restore(kept[-1], args=ocp.args.StandardRestore(_abstract())),
              _state(kept[-1]))
    with aj.CheckpointManager(tmp_path / "ours") as mgr:
        _same(mgr.restore(kept[0], args=ocp.args.StandardRestore(_abstract())), _state(kept[0]))


def test_an_explicit_policy_may_delete_the_newest_step(ckpt_dir):
    """BestN is followed as given: the newest step, ranked worst, goes (as in orbax);
    without a policy the newest is never deleted (best_fn, docs/compat.md)."""
    policy = _cm.BestN(get_metric_fn=lambda m: m["loss"], reverse=True, n=1)
    with aj.CheckpointManager(ckpt_dir, options=_opts(preservation_policy=policy)) as mgr:
        mgr.save(1, _state(1), metrics={"loss": 0.1})
        mgr.save(2, _state(2), metrics={"loss": 0.9})
        assert mgr.all_steps() == [1]
        mgr.wait_until_finished()
    assert sorted(n for n in os.listdir(ckpt_dir) if n.isdigit()) == ["1"]


class _Recording(_cm.SaveDecisionPolicy):
    """A user's own save-decision policy that records what the manager gives it."""

    def __init__(self):
        self.calls = []

    def should_save(self, step, previous_steps, *, context):
        self.calls.append((step.step, step.metrics, [p.step for p in previous_steps],
                           [p.metrics for p in previous_steps],
                           all(isinstance(p.time, datetime.datetime) for p in previous_steps),
                           context.reached_preemption,
                           type(context.multiprocessing_options).__name__))
        return step.step % 2 == 0


_DECISION = {
    "FixedIntervalPolicy": _cm.FixedIntervalPolicy(3),
    "SpecificStepsPolicy": _cm.SpecificStepsPolicy(steps=[2, 5]),
    "InitialSavePolicy": _cm.InitialSavePolicy(),
    "PreemptionCheckpointingPolicy": _cm.PreemptionCheckpointingPolicy(),
    "AnySavePolicy": _cm.AnySavePolicy([_cm.FixedIntervalPolicy(4), _cm.InitialSavePolicy(),
                                        _cm.PreemptionCheckpointingPolicy()]),
    "ContinuousCheckpointingPolicy": _cm.ContinuousCheckpointingPolicy(
        minimum_interval_secs=3600),
}


@pytest.mark.parametrize("name", sorted(_DECISION))
def test_orbax_save_decision_policies_save_where_orbax_saves(tmp_path, name):
    saved = {}
    for who, manager in (("ours", aj.CheckpointManager), ("orbax", ocp.CheckpointManager)):
        opts = _opts(save_decision_policy=_DECISION[name])
        with manager(tmp_path / who, options=opts) as mgr:
            saved[who] = [s for s in range(1, 9)
                          if mgr.save(s, args=ocp.args.StandardSave(_state(s)))]
    assert saved["ours"] == saved["orbax"]
    if name == "PreemptionCheckpointingPolicy":
        assert saved["ours"] == []  # no preemption notice: never (the notice: test below)
        return
    with ocp.CheckpointManager(tmp_path / "ours") as theirs:
        last = saved["ours"][-1]
        _same(theirs.restore(last, args=ocp.args.StandardRestore(_abstract())), _state(last))


def test_a_user_save_decision_policy_gets_orbaxs_inputs(tmp_path):
    calls = {}
    for who, manager in (("ours", aj.CheckpointManager), ("orbax", ocp.CheckpointManager)):
        policy = _Recording()
        opts = _opts(save_decision_policy=policy, max_to_keep=None)
        with manager(tmp_path / who, options=opts) as mgr:
            for s in range(1, 6):
                mgr.save(s, args=ocp.args.StandardSave(_state(s)), metrics={"m": s})
            assert mgr.all_steps() == [2, 4]
        calls[who] = policy.calls
    assert calls["ours"] == calls["orbax"]
    assert calls["ours"][-1] == (5, None, [2, 4], [{"m": 2}, {"m": 4}], True, False,
                                 "MultiprocessingOptions")
    # After a restart the previous steps (times, metrics) come from the directory.
    policy = _Recording()
    with aj.CheckpointManager(tmp_path / "ours", options=_opts(save_decision_policy=policy)) as mgr:
        assert not mgr.should_save(7)
        assert policy.calls == [(7, None, [2, 4], [{"m": 2}, {"m": 4}], True, False,
                                 "MultiprocessingOptions")]


def test_decision_context_tells_whether_a_save_is_in_flight(tmp_path):
    """ContinuousCheckpointingPolicy saves only while no save is in flight; with
    enable_should_save_is_saving_in_progress_check=False it is not told."""
    _GatedJob.gate.clear()
    policy = _cm.ContinuousCheckpointingPolicy()
    managers = {check: _manager(_GatedJob)(tmp_path / str(check), options=_opts(
        save_decision_policy=policy, enable_should_save_is_saving_in_progress_check=check))
        for check in (True, False)}
    try:
        for check, mgr in managers.items():
            assert mgr.save(1, _state(1))  # held before its write: in flight
            assert mgr.should_save(2) is not check
        _GatedJob.gate.set()
        for mgr in managers.values():
            mgr.wait_until_finished()
            assert mgr.should_save(2)
    finally:
        _GatedJob.gate.set()
        for mgr in managers.values():
            mgr.close()


# -- how a step is committed: temporary_path_class, atomicity_options --------------------

_atomicity = ocp.path.atomicity


class _GatedCommit(JaxSaveJob):
    """The real save job, held once its files are written, before its commit."""

    gate = threading.Event()
    written = threading.Event()

    def commit(self, stats) -> None:
        self.written.set()
        self.gate.wait()
        super().commit(stats)


def test_commit_file_temporary_path_writes_in_place_and_commits_by_marker(ckpt_dir):
    _GatedCommit.gate.clear()
    opts = _opts(temporary_path_class=_atomicity.CommitFileTemporaryPath)
    (ckpt_dir / "3").mkdir()  # a save of step 3 that was killed before its commit
    (ckpt_dir / "3" / "half-written").write_text("x")
    try:
        with _manager(_GatedCommit)(ckpt_dir, options=opts) as mgr:
            assert mgr.all_steps() == []  # not committed: not a step (as orbax)
            mgr.save(1, _state(1))
            _GatedCommit.gate.set()
            mgr.wait_until_finished()
            _GatedCommit.gate.clear()
            _GatedCommit.written.clear()
            mgr.save(2, _state(2))
            assert _GatedCommit.written.wait(60)
            # In place, under its final name, without the marker until committed.
            assert (ckpt_dir / "2" / "default" / "_METADATA").exists()
            assert not (ckpt_dir / "2" / "commit_success.txt").exists()
            assert not any(n.startswith(".asyncckpt-tmp-2") for n in os.listdir(ckpt_dir))
            _GatedCommit.gate.set()
            mgr.save(3, _state(3))  # replaces the uncommitted directory
            mgr.wait_until_finished()
            assert (ckpt_dir / "2" / "commit_success.txt").exists()
            assert not (ckpt_dir / "3" / "half-written").exists()
            assert mgr.all_steps() == [1, 2, 3]
    finally:
        _GatedCommit.gate.set()
    with ocp.CheckpointManager(ckpt_dir, options=opts) as theirs:
        assert theirs.all_steps() == [1, 2, 3]
        _same(theirs.restore(3, args=ocp.args.StandardRestore(_abstract())), _state(3))
    # An uncommitted directory is not listed, by orbax nor by us.
    (ckpt_dir / "9").mkdir()
    with ocp.CheckpointManager(ckpt_dir, options=opts) as theirs:
        assert theirs.all_steps() == [1, 2, 3]
    with aj.CheckpointManager(ckpt_dir, options=_opts(
            atomicity_options=ocp.options.AtomicityOptions(
                mode=ocp.options.AtomicityMode.COMMIT_FILE))) as mgr:
        assert mgr.all_steps() == [1, 2, 3]
        _same(mgr.restore(2, args=ocp.args.StandardRestore(_abstract())), _state(2))


def test_atomic_rename_temporary_path_publishes_by_rename(ckpt_dir):
    _GatedJob.gate.clear()
    opts = _opts(temporary_path_class=_atomicity.AtomicRenameTemporaryPath)
    try:
        with _manager(_GatedJob)(ckpt_dir, options=opts) as mgr:
            mgr.save(1, _state(1))
            assert not (ckpt_dir / "1").exists()  # only a temporary until the rename
            _GatedJob.gate.set()
            mgr.wait_until_finished()
    finally:
        _GatedJob.gate.set()
    with ocp.CheckpointManager(ckpt_dir, options=opts) as theirs:
        _same(theirs.restore(1, args=ocp.args.StandardRestore(_abstract())), _state(1))
    with pytest.raises(ValueError, match="CommitFileTemporaryPath"):
        aj.CheckpointManager(ckpt_dir, options=_opts(
            temporary_path_class=type("Mine", (_atomicity.AtomicRenameTemporaryPath,), {})))


def test_cleanup_tmp_directories_removes_orbaxs_leftovers(tmp_path):
    def leftovers(d):
        d.mkdir()
        (d / "4.orbax-checkpoint-tmp-1700000000").mkdir()
        (d / "6").mkdir()  # commit-file mode: never committed
        return d

    commit_file = dict(temporary_path_class=_atomicity.CommitFileTemporaryPath)
    for cleanup in (False, True):
        d = leftovers(tmp_path / str(cleanup))
        with aj.CheckpointManager(d, options=_opts(cleanup_tmp_directories=cleanup,
                                                   **commit_file)) as mgr:
            mgr.save(1, _state(1))
        names = set(os.listdir(d))
        assert ({"4.orbax-checkpoint-tmp-1700000000", "6"} <= names) != cleanup
        with ocp.CheckpointManager(d, options=_opts(**commit_file)) as theirs:
            _same(theirs.restore(1, args=ocp.args.StandardRestore(_abstract())), _state(1))


# -- orbax's AsyncOptions -----------------------------------------------------------------


def test_async_options_post_finalization_callback_runs_after_each_commit(ckpt_dir):
    calls = []

    def callback():
        committed = sorted(n for n in os.listdir(ckpt_dir) if n.isdigit())
        calls.append((threading.current_thread() is threading.main_thread(), committed))

    opts = _opts(async_options=ocp.AsyncOptions(post_finalization_callback=callback))
    with aj.CheckpointManager(ckpt_dir, options=opts) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, _state(2))
        mgr.wait_until_finished()
    assert calls == [(False, ["1"]), (False, ["1", "2"])]  # on the writer, once committed
    with ocp.CheckpointManager(ckpt_dir) as theirs:
        _same(theirs.restore(2, args=ocp.args.StandardRestore(_abstract())), _state(2))

    def failing():
        raise RuntimeError("callback failed (injected)")

    opts = _opts(async_options=ocp.AsyncOptions(post_finalization_callback=failing))
    with aj.CheckpointManager(ckpt_dir, options=opts) as mgr:
        mgr.save(3, _state(3))
        with pytest.raises(RuntimeError, match="injected"):
            mgr.wait_until_finished()
        assert mgr.all_steps() == [1, 2, 3]  # the step itself is committed
    with pytest.raises(ValueError, match="asynchronous saves"):  # as orbax
        aj.CheckpointManager(ckpt_dir, options=_opts(
            enable_async_checkpointing=False,
            async_options=ocp.AsyncOptions(post_finalization_callback=callback)))


def test_async_options_timeout_fails_a_save_not_finished_in_time(ckpt_dir):
    _GatedJob.gate.clear()
    opts = _opts(async_options=ocp.AsyncOptions(timeout_secs=2))
    try:
        with _manager(_GatedJob)(ckpt_dir, options=opts) as mgr:
            mgr.save(1, _state(1))
            threading.Timer(2.5, _GatedJob.gate.set).start()  # the write is held past it
            with pytest.raises(TimeoutError, match="timeout_secs"):
                mgr.wait_until_finished()
            assert not (ckpt_dir / "1").exists()  # never committed
            mgr.save(2, _state(2))
            mgr.wait_until_finished()  # in time: committed
    finally:
        _GatedJob.gate.set()
    with ocp.CheckpointManager(ckpt_dir) as theirs:
        assert theirs.all_steps() == [2]
    with pytest.raises(ValueError, match="barrier_sync_fn"):
        aj.CheckpointManager(ckpt_dir, options=_opts(async_options=ocp.AsyncOptions(
            barrier_sync_fn=lambda **kw: None)))


def test_async_options_create_directories_synchronously(tmp_path):
    try:
        for asynchronously in (True, False):
            d = tmp_path / str(asynchronously)
            _GatedJob.gate.clear()
            opts = _opts(async_options=ocp.AsyncOptions(
                create_directories_asynchronously=asynchronously))
            with _manager(_GatedJob)(d, options=opts) as mgr:
                mgr.save(1, _state(1))
                made = any(n.startswith(".asyncckpt-tmp-1") for n in os.listdir(d))
                assert made != asynchronously  # False: made before save() returns
                _GatedJob.gate.set()
            with ocp.CheckpointManager(d) as theirs:
                _same(theirs.restore(1, args=ocp.args.StandardRestore(_abstract())), _state(1))
    finally:
        _GatedJob.gate.set()


def test_orbax_async_options_in_async_options_keyword_is_refused_naming_its_place(tmp_path):
    """Two classes named ``AsyncOptions``: the manager's keyword takes asyncckpt's only.

    orbax's goes where orbax's manager takes it (``options=``); given to the
    keyword, it is refused at construction, naming that place, and nothing
    is created in the directory.
    """
    from asyncckpt import AsyncOptions

    with pytest.raises(TypeError, match=r"CheckpointManagerOptions\(async_options="):
        aj.CheckpointManager(tmp_path / "a", async_options=ocp.AsyncOptions(timeout_secs=5))
    with pytest.raises(TypeError, match=r"must be asyncckpt\.AsyncOptions"):
        aj.CheckpointManager(tmp_path / "b", async_options={"num_slots": 1})
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    with aj.CheckpointManager(tmp_path / "c", async_options=AsyncOptions(num_slots=1),
                              options=_opts(async_options=ocp.AsyncOptions(timeout_secs=60))
                              ) as mgr:
        mgr.save(1, _state(1))
    with ocp.CheckpointManager(tmp_path / "c") as theirs:
        _same(theirs.restore(1, args=ocp.args.StandardRestore(_abstract())), _state(1))


# -- logger ------------------------------------------------------------------------------


class _Entries(ocp.logging.AbstractLogger):
    def __init__(self):
        self.entries = []

    def log_entry(self, entry):
        self.entries.append(entry)


def test_logger_gets_the_entries_orbax_logs(tmp_path):
    got = {}
    for who, manager in (("ours", aj.CheckpointManager), ("orbax", ocp.CheckpointManager)):
        logger = _Entries()
        with manager(tmp_path / who, options=_opts(save_interval_steps=2),
                     logger=logger) as mgr:
            for s in range(4):
                mgr.save(s, args=ocp.args.StandardSave(_state(s)))
            mgr.wait_until_finished()
            mgr.restore(2, args=ocp.args.StandardRestore(_abstract()))
        got[who] = logger.entries
    assert [(e["event_type"], e["step"]) for e in got["ours"]] == [
        (e["event_type"], e["step"]) for e in got["orbax"]] == [
        ("save", 0), ("save", 2), ("restore", 2)]
    for ours, theirs in zip(got["ours"], got["orbax"], strict=True):
        assert ours.keys() == theirs.keys()
        assert os.fspath(ours["directory"]) == os.fspath(tmp_path / "ours")
    assert got["ours"][1]["checkpoint_manager_blocking_duration_secs"] > 0
    with pytest.raises(TypeError, match="log_entry"):
        aj.CheckpointManager(tmp_path / "x", logger=object())


# -- items: item_names with item_handlers, one handler, checkpointers --------------------


def test_one_handler_as_item_handlers(ckpt_dir):
    handler = ocp.StandardCheckpointHandler(use_ocdbt=False)
    with aj.CheckpointManager(ckpt_dir, item_handlers=handler) as mgr:
        mgr.save(1, args=ocp.args.StandardSave(_state(1)))
        with pytest.raises(ValueError, match=r"save it with ocp\.args\.StandardSave"):
            mgr.save(2, args=ocp.args.JsonSave({"a": 1}))
        _same(mgr.restore(1, args=ocp.args.StandardRestore(_abstract())), _state(1))
    with ocp.CheckpointManager(ckpt_dir, item_handlers=ocp.StandardCheckpointHandler(
            use_ocdbt=False)) as theirs:
        _same(theirs.restore(1, args=ocp.args.StandardRestore(_abstract())), _state(1))
    json_dir = ckpt_dir / "json"
    with aj.CheckpointManager(json_dir, item_handlers=ocp.JsonCheckpointHandler()) as mgr:
        mgr.save(1, args=ocp.args.JsonSave({"epoch": 3}))
        assert mgr.restore(1, args=ocp.args.JsonRestore()) == {"epoch": 3}
    with ocp.CheckpointManager(json_dir, item_handlers=ocp.JsonCheckpointHandler()) as theirs:
        assert theirs.restore(1, args=ocp.args.JsonRestore()) == {"epoch": 3}
    with pytest.raises(ValueError, match="mutually exclusive"):  # as orbax
        aj.CheckpointManager(ckpt_dir, item_names=("a",), item_handlers=handler)


def test_item_names_together_with_item_handlers(ckpt_dir):
    handlers = {"state": ocp.PyTreeCheckpointHandler(use_ocdbt=False)}
    with aj.CheckpointManager(ckpt_dir, item_names=("state", "extra"),
                              item_handlers=handlers) as mgr:
        mgr.save(1, args=ocp.args.Composite(state=ocp.args.PyTreeSave(_state(1)),
                                            extra=ocp.args.JsonSave({"lr": 0.5})))
        with pytest.raises(ValueError, match="not among item_names"):
            mgr.save(2, args=ocp.args.Composite(other=ocp.args.JsonSave({})))
        got = mgr.restore(1, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(_abstract()), extra=ocp.args.JsonRestore()))
        _same(got.state, _state(1))
    with ocp.CheckpointManager(ckpt_dir, item_names=("state", "extra"), item_handlers={
            "state": ocp.PyTreeCheckpointHandler(use_ocdbt=False)}) as theirs:
        got = theirs.restore(1, args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(_abstract()), extra=ocp.args.JsonRestore()))
        _same(got.state, _state(1))
        assert got.extra == {"lr": 0.5}


def test_format_requests_are_honoured_however_the_handler_is_given(ckpt_dir):
    """use_zarr3=True writes zarr v3 and OCDBT (orbax's handler default) is
    honoured, however the handler is given; orbax's default reader restores both."""
    handler = ocp.PyTreeCheckpointHandler(use_ocdbt=False, use_zarr3=True)
    for name, spelling in (("one", handler), ("named", {"state": handler})):
        with aj.CheckpointManager(ckpt_dir / name, item_handlers=spelling) as mgr:
            if name == "one":
                mgr.save(1, args=ocp.args.PyTreeSave(_state(1)))
            else:
                mgr.save(1, args=ocp.args.Composite(state=ocp.args.PyTreeSave(_state(1))))
        item = ckpt_dir / name / "1" / ("default" if name == "one" else "state")
        assert json.loads((item / "_METADATA").read_text())["use_zarr3"] is True
        assert not list(item.glob("*/.zarray")) and list(item.glob("*/zarr.json"))
        with ocp.CheckpointManager(ckpt_dir / name) as theirs:
            args = ocp.args.PyTreeRestore(_state(0))
            got = theirs.restore(1, args=args if name == "one" else ocp.args.Composite(
                state=args))
        _same(got if name == "one" else got.state, _state(1))
    for n, spelling in enumerate((
            {"item_handlers": ocp.StandardCheckpointHandler()},
            {"checkpointers": ocp.PyTreeCheckpointer()})):
        directory = ckpt_dir / f"ocdbt{n}"
        if "checkpointers" in spelling:
            mgr = aj.CheckpointManager(directory, spelling["checkpointers"])
        else:
            mgr = aj.CheckpointManager(directory, **spelling)
        with mgr:
            mgr.save(1, _state(1))
            mgr.wait_until_finished()
        item = directory / "1" / "default"
        assert (item / "manifest.ocdbt").exists() or any(item.glob("ocdbt*")), sorted(
            p.name for p in item.iterdir())
        with ocp.CheckpointManager(directory) as theirs:
            _same(theirs.restore(1, args=ocp.args.StandardRestore(_state(0))), _state(1))
    with aj.CheckpointManager(ckpt_dir / "plain",
                              item_handlers=ocp.StandardCheckpointHandler(use_ocdbt=False)) as mgr:
        mgr.save(1, _state(1))
        mgr.save(2, args=ocp.args.PyTreeSave(_state(2), ocdbt_target_data_file_size=2**20))
    for step in (1, 2):  # a target file size without OCDBT sizes nothing, as in orbax
        assert not list((ckpt_dir / "plain" / str(step) / "default").glob("ocdbt*"))


def test_positional_checkpointers_form(tmp_path):
    sync = tmp_path / "sync"
    pytree = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=False))
    # Fresh options for each manager: orbax's sets their async_options.
    with aj.CheckpointManager(sync, pytree, _opts(max_to_keep=2)) as mgr:
        save_args = jax.tree_util.tree_map(lambda _: ocp.SaveArgs(), _state(1))
        mgr.save(1, _state(1), save_kwargs={"save_args": save_args})
        assert (sync / "1" / "default" / "_METADATA").exists()  # a Checkpointer: synchronous
        _same(mgr.restore(1), _state(1))
    with ocp.CheckpointManager(sync, ocp.Checkpointer(ocp.PyTreeCheckpointHandler(
            use_ocdbt=False)), _opts(max_to_keep=2)) as theirs:
        _same(theirs.restore(1), _state(1))

    named = tmp_path / "named"

    def checkpointers():
        return {"state": ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler(use_ocdbt=False),
                                               timeout_secs=300),
                "meta": ocp.Checkpointer(ocp.JsonCheckpointHandler())}

    with aj.CheckpointManager(named, checkpointers(), _opts(max_to_keep=2)) as mgr:
        assert mgr._config.enable_async and mgr._config.save_timeout_s == 300
        mgr.save(1, {"state": _state(1), "meta": {"epoch": 1}})
        mgr.save(2, {"state": _state(2), "meta": {"epoch": 2}})
        got = mgr.restore(2)
        _same(got.state, _state(2))
        assert got.meta == {"epoch": 2}
        with pytest.raises(ValueError, match="not among item_names"):
            mgr.save(3, _state(3))  # a dict of checkpointers: a dict of items by name
    with ocp.CheckpointManager(named, checkpointers(), _opts(max_to_keep=2)) as theirs:
        got = theirs.restore(2, items={"state": _abstract(), "meta": None})
        _same(got["state"], _state(2))
        assert got["meta"] == {"epoch": 2}


def test_directory_is_an_epath(ckpt_dir):
    from etils import epath

    with aj.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, _state(1))
        mgr.wait_until_finished()
        assert isinstance(mgr.directory, epath.Path)
        assert mgr.directory == epath.Path(ckpt_dir)
        assert "1" in [p.name for p in mgr.directory.iterdir()]


# -- SaveArgs ----------------------------------------------------------------------------


def _chunk_tree():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("a", "b"))
    x = jax.device_put(np.arange(64 * 32, dtype=np.float32).reshape(64, 32),
                       jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a")))
    y = jax.device_put(np.arange(32 * 6, dtype=np.int32).reshape(32, 6),
                       jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a", "b")))
    return {"x": x, "y": y, "n": np.arange(1000, dtype=np.int64), "s": 3}


def _zarray_chunks(item_dir):
    import json

    return {p: json.loads((item_dir / p / ".zarray").read_text())["chunks"]
            for p in ("x", "y", "n")}


def test_save_args_default_fields_change_nothing(tmp_path):
    tree = _chunk_tree()
    defaults = jax.tree_util.tree_map(lambda _: ocp.SaveArgs(), tree)
    files = aj.FormatOptions(use_ocdbt=False)  # a file per chunk, to compare them
    with aj.CheckpointManager(tmp_path / "a", format_options=files) as mgr:
        mgr.save(1, args=ocp.args.StandardSave(tree, save_args=defaults))
        mgr.save(2, args=ocp.args.StandardSave(tree))
        mgr.wait_until_finished()
        _same(mgr.restore(1), tree)
    first, second = (sorted(os.listdir(tmp_path / "a" / s / "default" / "x")) for s in "12")
    assert first == second
    assert _zarray_chunks(tmp_path / "a" / "1" / "default") == _zarray_chunks(
        tmp_path / "a" / "2" / "default")
    with ocp.CheckpointManager(tmp_path / "a") as theirs:
        _same(theirs.restore(1), tree)
    with aj.CheckpointManager(tmp_path / "b") as mgr, pytest.raises(ValueError,
                                                                    match="aggregate"):
        mgr.save(1, args=ocp.args.StandardSave(tree, save_args=jax.tree_util.tree_map(
            lambda _: ocp.SaveArgs(aggregate=True), tree)))


def test_save_args_chunk_byte_size_and_dtype_write_what_orbax_writes(tmp_path):
    tree = _chunk_tree()
    save_args = {"x": ocp.SaveArgs(chunk_byte_size=1024), "y": ocp.SaveArgs(
        chunk_byte_size=32, shard_axes=(1,)), "n": ocp.SaveArgs(chunk_byte_size=800),
        "s": ocp.SaveArgs(dtype=np.int16)}
    save_args["x"] = ocp.SaveArgs(chunk_byte_size=1024, dtype=jnp.dtype("bfloat16"))
    with aj.CheckpointManager(tmp_path / "ours",
                              format_options=aj.FormatOptions(use_ocdbt=False)) as mgr:
        mgr.save(1, args=ocp.args.StandardSave(tree, save_args=save_args))
        mgr.wait_until_finished()
        ours = mgr.restore(1)
    with ocp.CheckpointManager(tmp_path / "orbax", item_handlers=ocp.StandardCheckpointHandler(
            use_ocdbt=False)) as theirs:
        theirs.save(1, args=ocp.args.StandardSave(tree, save_args=save_args))
    item = tmp_path / "ours" / "1" / "default"
    assert _zarray_chunks(item) == _zarray_chunks(tmp_path / "orbax" / "1" / "default") == {
        "x": [8, 32], "y": [8, 1], "n": [100]}
    for p in ("x", "y", "n"):  # the same chunk files
        assert sorted(os.listdir(item / p)) == sorted(
            os.listdir(tmp_path / "orbax" / "1" / "default" / p))
    assert ours["x"].dtype == jnp.bfloat16 and np.asarray(ours["s"]).dtype == np.int16
    np.testing.assert_array_equal(np.asarray(ours["x"]), np.asarray(tree["x"].astype(
        jnp.bfloat16)))
    _same({k: ours[k] for k in "yn"}, {k: tree[k] for k in "yn"})
    with ocp.CheckpointManager(tmp_path / "ours") as theirs:
        got = theirs.restore(1)
        assert got["x"].dtype == jnp.bfloat16
        _same(got, ours)
    # The same chunks in OCDBT (the default layout), as orbax's own OCDBT save has them.
    with aj.CheckpointManager(tmp_path / "ocdbt") as mgr:
        mgr.save(1, args=ocp.args.StandardSave(tree, save_args=save_args))
        mgr.wait_until_finished()
        _same(mgr.restore(1), ours)
    import json

    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{tmp_path}/ocdbt/1/default"}).result()
    assert {p: json.loads(kv.read(f"{p}/.zarray").result().value)["chunks"]
            for p in ("x", "y", "n")} == {"x": [8, 32], "y": [8, 1], "n": [100]}
    with ocp.CheckpointManager(tmp_path / "ocdbt") as theirs:
        _same(theirs.restore(1), ours)


def test_chunk_shape_rule_is_orbaxs(tmp_path):
    from orbax.checkpoint._src.arrays import subchunking  # orbax's own rule, for comparison

    from asyncckpt.jax import _format

    rng = np.random.default_rng(27)
    for _ in range(300):
        rank = int(rng.integers(1, 4))
        write = tuple(int(d) for d in rng.integers(1, 65, rank))
        global_shape = tuple(w * int(rng.integers(1, 3)) for w in write)
        itemsize = int(rng.choice([1, 2, 4, 8]))
        target = int(rng.integers(itemsize, max(itemsize + 1, np.prod(write) * itemsize)))
        axes = tuple(sorted({int(a) for a in rng.integers(0, rank, int(rng.integers(0, 2)))}))
        want = subchunking.choose_chunk_shape(global_shape, write, np.dtype(f"i{itemsize}"),
                                              target, shard_axes=axes)
        assert _format.sub_chunk_shape(global_shape, write, itemsize, target, axes) == tuple(
            want), (global_shape, write, itemsize, target, axes)


def test_empty_namedtuple_subtree_is_recorded_as_orbax_does(ckpt_dir):
    """optax's EmptyState() (an empty NamedTuple) in an optimizer state: recorded in
    _METADATA as orbax records it, so orbax restores the state onto a target."""
    empty = type("EmptyState", (tuple,), {"_fields": ()})  # what NamedTuple('E', []) makes
    state = {"params": {"w": jnp.ones(3)}, "opt": ({"count": jnp.zeros((), jnp.int32)},
                                                  empty())}
    target = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    with aj.CheckpointManager(ckpt_dir) as mgr:
        mgr.save(1, args=ocp.args.StandardSave(state))
        mgr.wait_until_finished()
        _same(mgr.restore(1, args=ocp.args.StandardRestore(target)), state)
    with ocp.CheckpointManager(ckpt_dir) as theirs:
        got = theirs.restore(1, args=ocp.args.StandardRestore(target))
        _same(got, state)
        assert isinstance(got["opt"][1], empty)
