"""orbax's checkpoint handlers inside asyncckpt's commit (issue 35, item 1).

Items asyncckpt does not write itself (orbax's Proto, Array and random-key
handlers, a user's ``AsyncCheckpointHandler``, grain's iterator handler) are
saved by their own handlers into the step's transaction: written at the call,
their futures awaited by the background commit, their files in the manifest,
committed with the rest of the step, restored by their own ``restore`` after
the manifest check. Each restore is checked with asyncckpt's manager and
with orbax's.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import signal
import threading
from typing import Any

import numpy as np
import pytest

from tests.helpers import start_python, write_script

jax = pytest.importorskip("jax")
ocp = pytest.importorskip("orbax.checkpoint")
grain = pytest.importorskip("grain")

import jax.numpy as jnp  # noqa: E402
from google.protobuf import duration_pb2  # noqa: E402

import asyncckpt.jax as aj  # noqa: E402
from asyncckpt import CorruptCheckpointError  # noqa: E402
from asyncckpt._engine.manifest import read_manifest  # noqa: E402


def _state(k: int) -> dict:
    return {"w": jnp.arange(8, dtype=jnp.float32) + k}


def _abstract() -> dict:
    return {"w": jax.ShapeDtypeStruct((8,), jnp.float32)}


# -- a user's handler: writes in its future, records its calls ------------------------------


class ValuesHandler(ocp.AsyncCheckpointHandler):
    """Copies the values at the call; its future writes them (held by ``gate``, or failing)."""

    gate: threading.Event | None = None
    fail: BaseException | None = None
    finalized: list[str] = []

    def __init__(self):
        self._pool = concurrent.futures.ThreadPoolExecutor(1)

    def _write(self, directory, values: np.ndarray) -> None:
        if ValuesHandler.gate is not None:
            assert ValuesHandler.gate.wait(60)
        if ValuesHandler.fail is not None:
            raise ValuesHandler.fail
        with open(directory / "values.npy", "wb") as f:
            np.save(f, values)

    async def async_save(self, directory, args):
        values = np.array(args.values, copy=True)  # the blocking part: the values of the call
        return [self._pool.submit(self._write, directory, values)]

    def save(self, directory, args):
        self._write(directory, np.array(args.values, copy=True))

    def restore(self, directory, args=None):
        with open(directory / "values.npy", "rb") as f:
            return np.load(f)

    def finalize(self, directory):
        ValuesHandler.finalized.append(os.fspath(directory))

    def close(self):
        self._pool.shutdown()


@ocp.args.register_with_handler(ValuesHandler, for_save=True)
@dataclasses.dataclass
class ValuesSave(ocp.args.CheckpointArgs):
    values: Any


@ocp.args.register_with_handler(ValuesHandler, for_restore=True)
@dataclasses.dataclass
class ValuesRestore(ocp.args.CheckpointArgs):
    pass


@pytest.fixture(autouse=True)
def _reset_values_handler():
    ValuesHandler.gate, ValuesHandler.fail, ValuesHandler.finalized = None, None, []
    yield
    ValuesHandler.gate, ValuesHandler.fail = None, None


# -- each handler kind: saved with the step, in its manifest, restored by both ---------------


@dataclasses.dataclass(frozen=True)
class Kind:
    handler: Any
    save: Any  # step -> save args
    restore: Any  # () -> restore args
    check: Any  # (restored, step) -> None


KINDS = {
    "proto": Kind(ocp.ProtoCheckpointHandler,
                  lambda k: ocp.args.ProtoSave(duration_pb2.Duration(seconds=k)),
                  lambda: ocp.args.ProtoRestore(duration_pb2.Duration),
                  lambda r, k: (r.seconds == k) or pytest.fail(f"{r} is not {k} s")),
    "array": Kind(ocp.ArrayCheckpointHandler,
                  lambda k: ocp.args.ArraySave(jnp.arange(5, dtype=jnp.int32) * k),
                  lambda: ocp.args.ArrayRestore(),
                  lambda r, k: np.testing.assert_array_equal(np.asarray(r), np.arange(5) * k)),
    "rng": Kind(ocp.JaxRandomKeyCheckpointHandler,
                lambda k: ocp.args.JaxRandomKeySave(jax.random.key(k)),
                lambda: ocp.args.JaxRandomKeyRestore(),
                lambda r, k: np.testing.assert_array_equal(
                    jax.random.key_data(r), jax.random.key_data(jax.random.key(k)))),
    "user": Kind(ValuesHandler, lambda k: ValuesSave(np.full(3, k, np.int64) + 2**40),
                 lambda: ValuesRestore(),
                 lambda r, k: np.testing.assert_array_equal(r, np.full(3, k, np.int64) + 2**40)),
}


def _composite_save(kind: Kind, k: int) -> Any:
    return ocp.args.Composite(state=ocp.args.StandardSave(_state(k)), extra=kind.save(k))


def _composite_restore(kind: Kind) -> Any:
    return ocp.args.Composite(state=ocp.args.StandardRestore(_abstract()), extra=kind.restore())


def _item_files(step_dir, item: str) -> list[str]:
    manifest = read_manifest(os.path.join(step_dir, "asyncckpt.manifest.json"))
    return [r.name for r in manifest.files if r.name.startswith(item + "/")]


@pytest.mark.parametrize("name", sorted(KINDS))
def test_a_handler_item_is_committed_with_its_step_and_restored_by_both(tmp_path, name, caplog):
    kind = KINDS[name]
    directory = tmp_path / "run"
    handlers = {"state": ocp.StandardCheckpointHandler(), "extra": kind.handler()}
    with aj.CheckpointManager(directory, item_handlers=handlers) as mgr:
        for k in (1, 2):
            mgr.save(k, args=_composite_save(kind, k))
        mgr.wait_until_finished()
        restored = mgr.restore(2, args=_composite_restore(kind))
    np.testing.assert_array_equal(restored.state["w"], np.asarray(_state(2)["w"]))
    kind.check(restored.extra, 2)
    files = _item_files(directory / "2", "extra")
    assert files, "the handler's files are not in the manifest"
    assert not [n for n in os.listdir(directory) if "tmp" in n], "a temporary was left"
    with ocp.CheckpointManager(directory, item_names=("state", "extra")) as theirs:
        kind.check(theirs.restore(2, args=_composite_restore(kind)).extra, 2)
    # Damage to a handler's file is caught by the manifest, before its restore runs.
    with open(directory / "2" / files[-1], "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0x40
        f.seek(0)
        f.write(data)
    with aj.CheckpointManager(directory, item_names=("state", "extra")) as mgr:
        with pytest.raises(CorruptCheckpointError) as err:
            mgr.restore(2, args=_composite_restore(kind))
        assert err.value.file.endswith(files[-1])
        with caplog.at_level(logging.WARNING):
            older = mgr.restore(None, args=_composite_restore(kind))  # the newest that verifies
    kind.check(older.extra, 1)
    assert "skipping checkpoint step 2" in caplog.text


def test_the_handlers_futures_are_awaited_by_the_background_commit(tmp_path):
    ValuesHandler.gate = threading.Event()
    directory = tmp_path / "run"
    values = np.arange(4, dtype=np.int64)
    with aj.CheckpointManager(directory, item_names=("state", "extra")) as mgr:
        mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(1)),
                                            extra=ValuesSave(values)))
        values[:] = -1  # after the call: not what is saved
        assert mgr.all_steps() == [1] and not (directory / "1").exists()  # listed, in flight
        assert mgr.is_saving_in_progress() and ValuesHandler.finalized == []
        ValuesHandler.gate.set()
        mgr.wait_until_finished()
        assert len(ValuesHandler.finalized) == 1  # finalize ran before the publish...
        assert ".asyncckpt-tmp" in ValuesHandler.finalized[0]  # ...in the step's temporary
        assert _item_files(directory / "1", "extra") == ["extra/values.npy"]
        restored = mgr.restore(1, args=ocp.args.Composite(extra=ValuesRestore()))
    np.testing.assert_array_equal(restored.extra, np.arange(4))


def test_a_failing_handler_future_fails_the_save_and_publishes_nothing(tmp_path):
    ValuesHandler.fail = OSError(28, "No space left on device (injected)")
    directory = tmp_path / "run"
    with aj.CheckpointManager(directory, item_names=("state", "extra")) as mgr:
        mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(1)),
                                            extra=ValuesSave(np.ones(2))))
        with pytest.raises(OSError, match="injected"):
            mgr.wait_until_finished()
        assert mgr.all_steps() == []
        ValuesHandler.fail = None
        mgr.save(2, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(2)),
                                            extra=ValuesSave(np.ones(2))))
    assert sorted(n for n in os.listdir(directory) if not n.endswith(".lock")) == ["2"]


def test_the_args_type_chooses_the_handler_and_restore_without_args_uses_it(tmp_path):
    directory = tmp_path / "run"
    with aj.CheckpointManager(directory) as mgr:  # no handler given: orbax's registry decides
        mgr.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(_state(1)),
                                            extra=ValuesSave(np.full(2, 7))))
        mgr.wait_until_finished()
        everything = mgr.restore(1)  # each item by its handler, default args (as orbax)
    np.testing.assert_array_equal(everything.extra, np.full(2, 7))
    np.testing.assert_array_equal(everything.state["w"], np.asarray(_state(1)["w"]))
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    registry.add("extra", ValuesSave, ValuesHandler())
    registry.add("extra", ValuesRestore, ValuesHandler())
    with aj.CheckpointManager(directory, handler_registry=registry) as mgr:
        np.testing.assert_array_equal(mgr.restore(1).extra, np.full(2, 7))


def _grain_iterator():
    return iter(grain.MapDataset.range(40).shuffle(seed=5).batch(2).to_iter_dataset())


def test_restore_without_args_of_a_grain_item_is_orbaxs_error_not_corruption(tmp_path):
    directory = tmp_path / "run"
    it = _grain_iterator()
    next(it)
    with aj.CheckpointManager(directory, item_names=("data",)) as mgr:
        mgr.save(3, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        mgr.wait_until_finished()
        with pytest.raises(ValueError, match="CheckpointRestore") as err:
            mgr.restore(3)
        assert not isinstance(err.value, CorruptCheckpointError)
        fresh = _grain_iterator()
        restored = mgr.restore(3, args=ocp.args.Composite(
            data=grain.checkpoint.CheckpointRestore(fresh)))
    np.testing.assert_array_equal(next(restored.data), next(it))


# -- grain: a training loop killed and resumed ------------------------------------------------

_GRAIN_LOOP = r"""
import os, sys
import numpy as np, jax, jax.numpy as jnp
import orbax.checkpoint as ocp
import grain
import asyncckpt.jax as aj

directory, steps = sys.argv[1], int(sys.argv[2])
it = iter(grain.MapDataset.range(200).shuffle(seed=11).batch(5).to_iter_dataset())
state = {"acc": jnp.zeros((), jnp.int64 if jax.config.jax_enable_x64 else jnp.int32)}
with aj.CheckpointManager(directory, item_names=("state", "data"), max_to_keep=2) as mgr:
    start = mgr.latest_step()
    if start is not None:
        restored = mgr.restore(start, args=ocp.args.Composite(
            state=ocp.args.StandardRestore({"acc": jax.ShapeDtypeStruct((), state["acc"].dtype)}),
            data=grain.checkpoint.CheckpointRestore(it)))
        state, it = restored.state, restored.data
        print("RESUMED", start, flush=True)
    for step in range((start or 0) + 1, steps + 1):
        batch = next(it)
        state = {"acc": state["acc"] + int(np.sum(batch))}
        print("BATCH", step, " ".join(map(str, batch)), flush=True)
        if step % 3 == 0:
            mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                   data=grain.checkpoint.CheckpointSave(it)))
            if step == 3:
                mgr.wait_until_finished()  # at least one durable step before any kill
print("FINAL", int(state["acc"]), flush=True)
"""


def _run_loop(script, directory, steps, *, kill_after: int | None = None) -> dict[str, list]:
    """Runs the loop; with ``kill_after``, SIGKILLs it once that step's batch is printed."""
    proc = start_python(script, str(directory), str(steps))
    out: dict[str, list] = {"batches": [], "resumed": [], "final": []}
    killed = False
    for line in proc.stdout:
        word, _, rest = line.strip().partition(" ")
        if word == "BATCH":
            step, _, batch = rest.partition(" ")
            out["batches"].append((int(step), batch))
            if kill_after is not None and int(step) == kill_after:
                proc.send_signal(signal.SIGKILL)
                killed = True
                break
        elif word == "RESUMED":
            out["resumed"].append(int(rest))
        elif word == "FINAL":
            out["final"].append(int(rest))
    proc.wait(120)
    assert (proc.returncode == -signal.SIGKILL) if killed else (proc.returncode == 0), (
        proc.returncode, proc.stderr.read())
    return out


def test_a_grain_training_loop_killed_and_resumed_sees_the_same_batches(tmp_path):
    script = write_script(tmp_path, "grain_loop.py", _GRAIN_LOOP)
    reference = _run_loop(script, tmp_path / "reference", 20)
    assert len(reference["batches"]) == 20
    directory = tmp_path / "run"
    first = _run_loop(script, directory, 20, kill_after=11)  # saves at 3, 6, 9 (maybe in flight)
    assert first["batches"] == reference["batches"][:11]
    resumed = _run_loop(script, directory, 20)
    (start,) = resumed["resumed"]
    assert start in (3, 6, 9)  # the newest durable save before the kill
    assert resumed["batches"] == reference["batches"][start:]  # the remaining batches, exactly
    assert resumed["final"] == reference["final"]
    with ocp.CheckpointManager(directory, item_names=("state", "data")) as theirs:
        it = iter(grain.MapDataset.range(200).shuffle(seed=11).batch(5).to_iter_dataset())
        restored = theirs.restore(18, args=ocp.args.Composite(
            data=grain.checkpoint.CheckpointRestore(it)))
    assert " ".join(map(str, next(restored.data))) == reference["batches"][18][1]


def test_a_failed_handler_save_is_raised_by_the_next_save_as_orbax(tmp_path):
    """orbax's ``test_async_error_subsequent_save``: the next ``save()`` waits for the save
    with handler items before it (a handler writes one save at a time) and raises its failure
    once; nothing of either save is left (orbax leaves the failed save's temporary)."""
    ValuesHandler.gate = threading.Event()
    ValuesHandler.fail = SystemError("the handler's write failed (injected)")
    directory = tmp_path / "run"

    def args(k):
        return ocp.args.Composite(state=ocp.args.StandardSave(_state(k)),
                                  extra=ValuesSave(np.full(2, k)))

    with aj.CheckpointManager(directory, item_names=("state", "extra")) as mgr:
        assert mgr.save(0, args=args(0))
        opener = threading.Timer(0.1, ValuesHandler.gate.set)  # save 0's write goes on later
        opener.start()
        with pytest.raises(SystemError, match="injected"):
            mgr.save(1, args=args(1))  # waits for save 0, whenever it fails
        opener.join()
        assert mgr.all_steps() == []  # save 1 was not started
        assert os.listdir(directory) == [".asyncckpt.lock"]  # no temporary left
        mgr.wait_until_finished()  # raised once: not again
        ValuesHandler.fail = None
        assert mgr.save(2, args=args(2))
        mgr.wait_until_finished()
        restored = mgr.restore(2, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_abstract()), extra=ValuesRestore()))
    np.testing.assert_array_equal(restored.extra, np.full(2, 2))
    with ocp.CheckpointManager(directory, item_names=("state", "extra")) as theirs:
        got = theirs.restore(2, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_abstract()), extra=ValuesRestore()))
    np.testing.assert_array_equal(got.extra, np.full(2, 2))
    np.testing.assert_array_equal(np.asarray(got.state["w"]), np.asarray(_state(2)["w"]))


# -- checkpointers given any handler -----------------------------------------------------------


@pytest.mark.parametrize("cls", ["Checkpointer", "AsyncCheckpointer"])
def test_a_checkpointer_with_any_handler_commits_its_files_under_the_manifest(tmp_path, cls):
    ours, theirs = getattr(aj, cls), getattr(ocp, cls)
    cases = [
        ("json", ocp.JsonCheckpointHandler, ocp.args.JsonSave({"a": 1, "b": [2, 3]}),
         ocp.args.JsonRestore(), lambda r: r == {"a": 1, "b": [2, 3]}),
        ("user", ValuesHandler, ValuesSave(np.arange(5, dtype=np.int64) + 2**40),
         ValuesRestore(), lambda r: np.array_equal(r, np.arange(5) + 2**40)),
        ("composite", lambda: ocp.CompositeCheckpointHandler("state", "meta"),
         ocp.args.Composite(state=ocp.args.StandardSave(_state(3)),
                            meta=ocp.args.JsonSave({"k": 3})),
         ocp.args.Composite(state=ocp.args.StandardRestore(_abstract()),
                            meta=ocp.args.JsonRestore()),
         lambda r: r.meta == {"k": 3} and np.array_equal(r.state["w"], _state(3)["w"])),
    ]
    for name, handler, save, restore, check in cases:
        path = tmp_path / name
        with ours(handler()) as c:
            c.save(path, args=save)
            c.wait_until_finished()
            assert check(c.restore(path, args=restore)), name
        manifest = read_manifest(str(path / "asyncckpt.manifest.json"))
        names = {r.name for r in manifest.files}
        written = {os.path.relpath(os.path.join(p, f), path) for p, _, fs in os.walk(path)
                   for f in fs} - {"asyncckpt.manifest.json"}
        assert names == written, name  # every file the handler wrote, listed once
        with theirs(handler()) as c:
            assert check(c.restore(path, args=restore)), name
        # Damage to the handler's file: caught before the handler reads it.
        victim = sorted(n for n in names if not n.startswith(("_", "asyncckpt", "commit")))[0]
        with open(path / victim, "r+b") as f:
            first = f.read(1)
            f.seek(0)
            f.write(bytes([first[0] ^ 0x20]))
        with ours(handler()) as c, pytest.raises(CorruptCheckpointError) as err:
            c.restore(path, args=restore)
        assert err.value.file.endswith(victim), name


def test_a_checkpointer_handler_of_orbaxs_older_api_is_wrapped_as_orbax_wraps_it(tmp_path):
    class OldHandler(ocp.CheckpointHandler):  # no registered CheckpointArgs
        def save(self, directory, item):
            (directory / "old.txt").write_text(str(item))

        def restore(self, directory, item=None):
            return int((directory / "old.txt").read_text())

    with aj.Checkpointer(OldHandler()) as c:
        c.save(tmp_path / "old", 41)
        assert c.restore(tmp_path / "old") == 41
    assert "old.txt" in {r.name for r in read_manifest(
        str(tmp_path / "old" / "asyncckpt.manifest.json")).files}
    with ocp.Checkpointer(OldHandler()) as c:
        assert c.restore(tmp_path / "old") == 41


# -- orbax's pytree handlers, customized --------------------------------------------------------


class _CountingNumpyHandler(ocp.type_handlers.NumpyHandler):
    """orbax's own NumPy type handler, counting the values it serializes."""

    calls: list[int] = []

    async def serialize(self, values, infos, args=None):
        type(self).calls.append(len(values))
        return await super().serialize(values, infos, args)


def test_a_pytree_handler_with_its_own_type_handlers_writes_its_item_itself(tmp_path):
    """A ``PyTreeCheckpointHandler(type_handler_registry=...)`` is honoured: its type
    handlers serialize the leaves (inside asyncckpt's transaction, under its manifest),
    given to a checkpointer or as a manager's item handler; both libraries restore it."""
    from orbax.checkpoint._src.serialization import type_handler_registry

    registry = type_handler_registry.create_type_handler_registry(
        (np.ndarray, _CountingNumpyHandler()))

    def handler():
        return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)

    tree = {"a": np.arange(4, dtype=np.int64) + 2**40, "b": np.ones(3, np.float32)}

    def same(got):
        assert got["a"].dtype == np.int64
        np.testing.assert_array_equal(got["a"], tree["a"])
        np.testing.assert_array_equal(got["b"], tree["b"])

    _CountingNumpyHandler.calls.clear()
    with aj.Checkpointer(handler()) as c:
        c.save(tmp_path / "one", args=ocp.args.PyTreeSave(tree))
        assert _CountingNumpyHandler.calls == [2]  # the user's type handler wrote them
        same(c.restore(tmp_path / "one"))
    listed = {r.name for r in read_manifest(str(tmp_path / "one" / "asyncckpt.manifest.json"))
              .files}
    assert "manifest.ocdbt" in listed and "_METADATA" in listed
    with ocp.Checkpointer(handler()) as theirs:
        same(theirs.restore(tmp_path / "one"))

    with aj.CheckpointManager(tmp_path / "run", item_handlers={"s": handler()}) as mgr:
        mgr.save(1, args=ocp.args.Composite(s=ocp.args.PyTreeSave(tree)))
        mgr.wait_until_finished()
        assert _CountingNumpyHandler.calls == [2, 2]
        same(mgr.restore(1, args=ocp.args.Composite(s=ocp.args.PyTreeRestore())).s)
    with ocp.CheckpointManager(tmp_path / "run", item_handlers={"s": handler()}) as theirs:
        same(theirs.restore(1, args=ocp.args.Composite(s=ocp.args.PyTreeRestore())).s)


def test_stock_pytree_handlers_keep_asyncckpts_own_writer():
    from orbax.checkpoint._src.metadata.tree import PyTreeMetadataOptions

    from asyncckpt.jax import _handlers

    assert _handlers.customized(ocp.PyTreeCheckpointHandler(use_zarr3=True)) is None
    assert _handlers.customized(ocp.StandardCheckpointHandler(use_ocdbt=False)) is None
    rich = ocp.StandardCheckpointHandler(
        pytree_metadata_options=PyTreeMetadataOptions(support_rich_types=True))
    assert "support_rich_types" in _handlers.customized(rich)
