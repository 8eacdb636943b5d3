"""asyncckpt.jax.CheckpointManager used as orbax's CheckpointManager is, behaviour by behaviour.

One test (or a few) per row of the orbax table in docs/compat.md. Each one is
written from orbax 0.12.8's documented behaviour, and where files are
involved orbax's own manager reads what asyncckpt wrote, or the reverse.
"""

from __future__ import annotations

import datetime
import gc
import logging
import os
import threading
import weakref

import numpy as np
import pytest

jax = pytest.importorskip("jax")
ocp = pytest.importorskip("orbax.checkpoint")

import jax.numpy as jnp  # noqa: E402

import asyncckpt.jax as aj  # noqa: E402
from asyncckpt.jax import _view  # noqa: E402
from asyncckpt.jax import manager as manager_mod  # noqa: E402
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


# -- CheckpointManagerOptions -----------------------------------------------------------


def test_options_object_and_refused_fields(ckpt_dir):
    with aj.CheckpointManager(ckpt_dir, options=_opts(max_to_keep=2)) as mgr:
        for s in range(4):
            mgr.save(s, args=ocp.args.StandardSave(_state(s)))
        assert mgr.all_steps() == [2, 3]  # at once, as orbax
    with pytest.raises(ValueError, match="step_name_format"):
        aj.CheckpointManager(ckpt_dir, options=_opts(
            step_name_format=ocp.step.standard_name_format(step_prefix="x")))
    with pytest.raises(ValueError, match="preservation_policy"):
        aj.CheckpointManager(ckpt_dir, options=_opts(
            preservation_policy=ocp.checkpoint_managers.LatestN(n=1)))
    with pytest.raises(ValueError, match="either options= or the keyword"):
        aj.CheckpointManager(ckpt_dir, options=_opts(), max_to_keep=3)


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


class _GatedJob(manager_mod.JaxSaveJob):
    """The real save job, held before writing until the test opens the gate."""

    gate = threading.Event()

    def write(self) -> None:
        self.gate.wait()
        super().write()


def test_listing_changes_at_save_and_restore_waits_for_the_step(ckpt_dir, monkeypatch):
    monkeypatch.setattr(manager_mod, "JaxSaveJob", _GatedJob)
    _GatedJob.gate.clear()
    with aj.CheckpointManager(ckpt_dir) as mgr:
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


def test_check_for_errors_reraises_a_background_failure(ckpt_dir, monkeypatch):
    class Failing(manager_mod.JaxSaveJob):
        def write(self) -> None:
            raise OSError("disk full (injected)")

    monkeypatch.setattr(manager_mod, "JaxSaveJob", Failing)
    with aj.CheckpointManager(ckpt_dir) as mgr:
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


def test_a_failed_retention_delete_does_not_fail_the_save(ckpt_dir, monkeypatch, caplog):
    real = _view.delete_step_dir
    failures = []

    def flaky(view, step, subdir):
        if not failures:
            failures.append(step)
            raise PermissionError(f"cannot delete step {step} (injected)")
        real(view, step, subdir)

    monkeypatch.setattr(_view, "delete_step_dir", flaky)
    with aj.CheckpointManager(ckpt_dir, options=_opts(max_to_keep=1)) as mgr:
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
mgr = aj.CheckpointManager(sys.argv[1], options=ocp.CheckpointManagerOptions(
    save_interval_steps=10**9))
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


def test_saves_at_jax_preemption_sync_point_off_interval(tmp_path):
    script = write_script(tmp_path, "preempt.py", _PREEMPT)
    done = run_python(script, str(tmp_path / "ckpts"), timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "before False" in done.stdout
    line = next(x for x in done.stdout.splitlines() if x.startswith("saved"))
    step = int(line.split()[1])
    assert 0 < step < 10**9 and f"saved {step} True [0, {step}]" == line
