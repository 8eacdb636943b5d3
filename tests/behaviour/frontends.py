"""The front ends the behaviour suite runs every scenario on, behind one interface.

Each front end saves the same state, a vector of ``N`` float32 values all
equal to one number (``values(x)``), as numbered checkpoints, with its own
public API: ``asyncckpt.tf.Checkpoint.write``, ``asyncckpt.tf.CheckpointManager``,
``asyncckpt.jax.CheckpointManager`` in either layout (OCDBT, zarr files),
and the job runner's ``ArrayStore`` (under ``JobRunner`` and the Keras
backups). A scenario asks a ``Frontend`` for a ``Saver`` (the front end's
object, made by ``open``), saves, restores, damages files, and reads the
checkpoints back with asyncckpt's reader and the framework's own.

Faults are injected by wrapping the real components a save goes through,
each a subclass of the real one, set through the front end's own seams (its
save job class, and on the job the transaction's ``writer_class`` and
``destination``, the JAX job's ``database_class``): see ``Faults``.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from asyncckpt import RestoreOptions, layout
from asyncckpt._engine.destinations import Destination
from asyncckpt._engine.files import DurableWriter

N = 1000  # values in each checkpoint


def values(x: float) -> np.ndarray:
    """The state a checkpoint of ``x`` holds."""
    return np.full(N, float(x), np.float32)


class Gate:
    """Holds save jobs before their write until ``release()``; ``entered`` counts arrivals."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self.entered = threading.Semaphore(0)

    def wait_here(self) -> None:
        self.entered.release()
        assert self._open.wait(60), "the test never released the gate"

    def release(self) -> None:
        self._open.set()


@dataclass
class Faults:
    """What a saver's save jobs wrap; read when a save is staged (set between saves).

    Attributes:
        writer: The transaction's file writer (a ``DurableWriter`` subclass).
        database: The JAX job's OCDBT database writer (an ``_ocdbt.DatabaseWriter``
            subclass); only the JAX front ends have one.
        destination: Wraps the transaction's destination (a ``Destination``
            subclass taking the real one).
        gate: Holds each save's write until released.
    """

    writer: type[DurableWriter] | None = None
    database: type | None = None
    destination: Callable[[Destination], Destination] | None = None
    gate: Gate | None = None


def _faulty(base: type, faults: Faults) -> type:
    """A subclass of the save job ``base`` that wraps what ``faults`` names."""

    class Job(base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            txn = self.transaction
            if faults.writer is not None:
                txn.writer_class = faults.writer
            if faults.destination is not None:
                txn.destination = faults.destination(txn.destination)
            if faults.database is not None:
                self.database_class = faults.database

        def write(self):
            if faults.gate is not None:
                faults.gate.wait_here()
            super().write()

    Job.__name__ = Job.__qualname__ = f"Faulty{base.__name__}"
    return Job


def disk_full_writer(is_data: Callable[[str], bool]) -> type[DurableWriter]:
    """The real file writer on a disk that fails at the files ``is_data`` names.

    Writing one fails (``ENOSPC``); so does taking in one something else
    wrote (``EIO``: reading it back, or its size check; TensorFlow's bundle).
    """

    class DiskFullWriter(DurableWriter):
        def write(self, name, chunks):
            if is_data(name):
                raise OSError(errno.ENOSPC, "No space left on device", name)
            return super().write(name, chunks)

        def add_existing(self, name, **kwargs):
            if is_data(name):
                raise OSError(errno.EIO, "Input/output error", name)
            return super().add_existing(name, **kwargs)

    return DiskFullWriter


class FlushErrorWriter(DurableWriter):
    """The real file writer, except that making the files durable hits an I/O error."""

    def finish(self):
        super().finish()
        raise OSError(errno.EIO, "Input/output error", self.root)


class _Delegating(Destination):
    """A destination wrapping the real one (every call goes to it)."""

    def __init__(self, real: Destination):
        self.real = real
        self.path = real.path

    def open(self) -> str:
        return self.real.open()

    def publish(self, workdir, names) -> None:
        self.real.publish(workdir, names)

    def complete(self) -> None:
        self.real.complete()

    def discard(self, workdir) -> None:
        self.real.discard(workdir)

    def release(self, workdir) -> None:
        self.real.release(workdir)


class FailingPublish(_Delegating):
    """The real destination, on a file system whose publish (a rename) fails."""

    def publish(self, workdir, names) -> None:
        raise OSError(errno.EIO, "Input/output error", self.path)


class HeldPublish(_Delegating):
    """The real destination; its publish waits, with every file written, for ``gate``."""

    def __init__(self, real: Destination, gate: Gate):
        super().__init__(real)
        self.gate = gate

    def publish(self, workdir, names) -> None:
        self.gate.wait_here()
        self.real.publish(workdir, names)


class Saver:
    """A front end's saving object (a manager, a checkpoint, a store)."""

    def save(self, step: int, x: float) -> None:
        raise NotImplementedError

    def wait(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def steps(self) -> list[int]:
        """The steps it lists (in flight ones included where it lists them)."""
        raise NotImplementedError

    def restore(self, step: int | None = None) -> tuple[int, np.ndarray]:
        """``(step, values)`` restored by asyncckpt: ``step``, or the newest that verifies."""
        raise NotImplementedError

    @property
    def last_save(self):
        return self.obj.last_save


class Frontend:
    """One front end over one directory (see the module docstring).

    Attributes:
        name: The pytest id.
        retains: It applies ``max_to_keep`` and falls back to the newest
            checkpoint that verifies (a manager, not a bare checkpoint).
        lists_in_flight: A step is listed from its ``save`` call on (else once durable).
        waits_for_in_flight: ``restore(step)`` of a step in flight waits for it.
        campaign: ``benchmarks/crash_campaign.py``'s ``--framework`` for it, if any.
    """

    name = ""
    retains = True
    lists_in_flight = True
    waits_for_in_flight = True
    campaign: str | None = None

    def __init__(self, directory: Path):
        self.directory = directory

    # -- saving -------------------------------------------------------------------

    def open(self, *, max_to_keep: int | None = None, faults: Faults | None = None,
             checksums: bool = True) -> Saver:
        raise NotImplementedError

    # -- on disk --------------------------------------------------------------------

    def path(self, step: int) -> str:
        """The checkpoint's path (a directory, or a TensorFlow prefix)."""
        return str(self.directory / str(step))

    def cli_name(self, step: int) -> str:
        """Its name in the CLI's output and in messages."""
        return str(step)

    def manifest(self, step: int) -> Path:
        return Path(self.path(step)) / layout.JAX_MANIFEST_NAME

    def data_file(self, step: int) -> tuple[Path, str]:
        """A file holding the values, and how messages name it (relative to the directory)."""
        raise NotImplementedError

    def is_data(self, name: str) -> bool:
        """Whether ``name`` (relative to a checkpoint) is a file of the values."""
        raise NotImplementedError

    def data_fault(self) -> Faults:
        """Writing the values hits a full disk."""
        return Faults(writer=disk_full_writer(self.is_data))

    def listing(self, steps: list[int], *, closed: bool = False) -> list[str]:
        """Every name the directory holds with exactly ``steps`` committed, sorted.

        ``closed``: every writer of the directory closed (the last one to close
        removes the directory's lock file).
        """
        return sorted([*([] if closed else [".asyncckpt.lock"]), *map(str, steps)])

    def framework_steps(self) -> list[int]:
        """The checkpoints the framework's own reader sees on disk."""
        raise NotImplementedError

    def framework_read(self, step: int) -> np.ndarray:
        """The values of ``step`` read by the framework's own reader."""
        raise NotImplementedError

    def asyncckpt_read(self, step: int) -> np.ndarray:
        """The values of ``step`` read by asyncckpt from the directory (a fresh reader)."""
        raise NotImplementedError

    def read_both(self, step: int) -> np.ndarray:
        """``step`` read by asyncckpt and by the framework, which must agree."""
        ours, theirs = self.asyncckpt_read(step), self.framework_read(step)
        np.testing.assert_array_equal(ours, theirs)
        return ours

    def verify(self, step: int) -> None:
        """Checks ``step`` against its manifest (raises ``CorruptCheckpointError``)."""
        from asyncckpt import catalog

        (info,) = catalog.select(str(self.directory), str(step))  # as `asyncckpt verify`
        catalog.verify(info)

    # -- the CLI's view of a good directory ---------------------------------------------

    cli_framework = ""  # the framework column of `asyncckpt list` (and the manifest's)
    inspect_names: tuple[str, ...] = ()  # what `asyncckpt inspect` shows of a checkpoint
    stray: tuple[str, ...] = ()  # directories the framework's killed saves leave

    def files(self, step: int) -> list[str]:
        """Files the manifest of ``step`` lists (some of them)."""
        raise NotImplementedError

    # -- a second process holding the directory's lock -------------------------------

    holder = ""  # a script: saves step 1 into argv[1], prints "holding", waits on stdin


# -- TensorFlow ---------------------------------------------------------------------------


def _tf():
    import tensorflow as tf

    return tf


class _ManagerSaver(Saver):
    """A saver whose object waits, closes and lists as orbax's manager does."""

    def wait(self) -> None:
        self.obj.wait_until_finished()

    def close(self) -> None:
        self.obj.close()

    def steps(self) -> list[int]:
        return self.obj.all_steps()


class _TFSaver(Saver):
    def __init__(self, frontend: TFFrontend, faults: Faults | None, checksums: bool):
        import asyncckpt.tf as at
        from asyncckpt.tf._job import TFSaveJob

        tf = _tf()
        self.frontend = frontend
        self.v = tf.Variable(np.zeros(N, np.float32))
        job = _faulty(TFSaveJob, faults or Faults())
        self.checkpoint_class = type("FaultyCheckpoint", (at.Checkpoint,), {"_job_class": job})
        self.restore_options = RestoreOptions(checksums=checksums)

    def assign(self, x: float) -> None:
        self.v.assign(values(x))

    def wait(self) -> None:
        self.obj.sync()

    def close(self) -> None:
        self.obj.close()

    def read(self, step: int) -> np.ndarray:
        import asyncckpt.tf as at

        tf = _tf()
        fresh = tf.Variable(np.zeros(N, np.float32))
        at.Checkpoint(v=fresh, restore_options=self.restore_options).read(
            self.frontend.path(step)).expect_partial()
        return fresh.numpy()


class _TFCheckpointSaver(_TFSaver):
    """``asyncckpt.tf.Checkpoint.write`` of ``<dir>/ckpt-<step>``."""

    def __init__(self, frontend, faults, checksums):
        super().__init__(frontend, faults, checksums)
        self.obj = self.checkpoint_class(v=self.v, restore_options=self.restore_options)

    def save(self, step: int, x: float) -> None:
        self.assign(x)
        self.obj.write(self.frontend.path(step))

    def steps(self) -> list[int]:
        return self.frontend.framework_steps()

    def restore(self, step: int | None = None) -> tuple[int, np.ndarray]:
        assert step is not None, "a Checkpoint restores a path, not the newest valid one"
        return step, self.read(step)


class _TFManagerSaver(_TFSaver):
    """``asyncckpt.tf.CheckpointManager`` over a ``tf.train.Checkpoint``."""

    def __init__(self, frontend, faults, checksums, max_to_keep):
        import asyncckpt.tf as at

        super().__init__(frontend, faults, checksums)
        tf = _tf()
        self.ckpt = self.checkpoint_class.wrap(tf.train.Checkpoint(v=self.v),
                                               restore_options=self.restore_options)
        self.obj = at.CheckpointManager(self.ckpt, str(frontend.directory),
                                        max_to_keep=max_to_keep)

    def save(self, step: int, x: float) -> None:
        self.assign(x)
        self.obj.save(checkpoint_number=step)

    def steps(self) -> list[int]:
        return [int(p.rsplit("-", 1)[1]) for p in self.obj.checkpoints]

    def restore(self, step: int | None = None) -> tuple[int, np.ndarray]:
        if step is not None:
            self.ckpt.restore(self.frontend.path(step))
            return step, self.v.numpy().copy()
        path = self.obj.restore_or_initialize()
        assert path is not None, "nothing to restore"
        return int(path.rsplit("-", 1)[1]), self.v.numpy().copy()


class TFFrontend(Frontend):
    """TensorFlow: checkpoints ``<dir>/ckpt-<step>``."""

    cli_framework = "tensorflow"
    inspect_names = ("v/.ATTRIBUTES/VARIABLE_VALUE",)

    def path(self, step: int) -> str:
        return str(self.directory / f"ckpt-{step}")

    def cli_name(self, step: int) -> str:
        return f"ckpt-{step}"

    def manifest(self, step: int) -> Path:
        return Path(self.path(step) + ".asyncckpt-manifest.json")

    def data_file(self, step: int) -> tuple[Path, str]:
        name = f"ckpt-{step}.data-00000-of-00001"
        return self.directory / name, name

    def is_data(self, name: str) -> bool:
        return ".data-" in name

    def files(self, step: int) -> list[str]:
        return [f"ckpt-{step}.index", f"ckpt-{step}.data-00000-of-00001"]

    def listing(self, steps: list[int], *, closed: bool = False) -> list[str]:
        # TensorFlow's writers lock per checkpoint, under .asyncckpt-locks/ (made by the
        # first save); the ownership record (and a manager's state file) come with the
        # first commit.
        names = [".asyncckpt-locks", *([".asyncckpt-owned.json"] if steps else [])]
        for s in steps:
            names += [f"ckpt-{s}.index", f"ckpt-{s}.data-00000-of-00001",
                      f"ckpt-{s}.asyncckpt-manifest.json"]
        return sorted(names)

    def framework_steps(self) -> list[int]:
        # TensorFlow's reader needs the index: a prefix without one is no checkpoint.
        return sorted(int(os.path.basename(p)[len("ckpt-"):-len(".index")])
                      for p in glob.glob(str(self.directory / "ckpt-*.index")))

    def _read_with(self, reader: str, step: int) -> np.ndarray:
        from tests.tfrestore import checkpoint_class

        tf = _tf()
        fresh = tf.Variable(np.zeros(N, np.float32))
        checkpoint_class(reader)(v=fresh).read(self.path(step)).expect_partial()
        return fresh.numpy()

    def framework_read(self, step: int) -> np.ndarray:
        return self._read_with("tensorflow", step)

    def asyncckpt_read(self, step: int) -> np.ndarray:
        from tests.tfrestore import OwnReader

        with OwnReader() as spy:
            got = self._read_with("asyncckpt", step)
        spy.assert_read_by_asyncckpt(self.path(step))  # its own reader, not TensorFlow's
        return got

    def verify(self, step: int) -> None:
        import asyncckpt.tf as at

        assert at.verify_checkpoint(self.path(step))


class TFCheckpoint(TFFrontend):
    name = "tf-checkpoint"
    retains = False

    def open(self, *, max_to_keep=None, faults=None, checksums=True) -> Saver:
        assert max_to_keep is None, "a Checkpoint keeps every checkpoint"
        return _TFCheckpointSaver(self, faults, checksums)


class TFManager(TFFrontend):
    name = "tf-manager"
    campaign = "tf"
    holder = """
import sys
import numpy as np
import tensorflow as tf
import asyncckpt.tf as at
v = tf.Variable(np.full(1000, 1.0, np.float32))
mgr = at.CheckpointManager(tf.train.Checkpoint(v=v), sys.argv[1], max_to_keep=None)
mgr.save(checkpoint_number=1)
mgr.sync()
print("holding", flush=True)
sys.stdin.readline()  # holds the lock until the test says so (or kills it)
"""

    def listing(self, steps: list[int], *, closed: bool = False) -> list[str]:
        return sorted([*super().listing(steps, closed=closed),
                       *(["checkpoint"] if steps else [])])

    def framework_steps(self) -> list[int]:
        """What TensorFlow's state file names, each with its index (as ``latest_checkpoint``)."""
        tf = _tf()
        state = tf.train.get_checkpoint_state(str(self.directory))
        named = [] if state is None else list(state.all_model_checkpoint_paths)
        assert sorted(super().framework_steps()) == sorted(  # nothing on disk unnamed
            int(p.rsplit("-", 1)[1]) for p in named if os.path.exists(p + ".index"))
        latest = tf.train.latest_checkpoint(str(self.directory))
        assert latest == (named[-1] if named else None)
        return [int(p.rsplit("-", 1)[1]) for p in named]

    def open(self, *, max_to_keep=None, faults=None, checksums=True) -> Saver:
        return _TFManagerSaver(self, faults, checksums, max_to_keep)


# -- JAX --------------------------------------------------------------------------------


def _target() -> dict:
    return {"w": np.zeros(N, np.float32), "step": 0}


class _JaxSaver(_ManagerSaver):
    def __init__(self, frontend: JaxFrontend, faults, checksums, max_to_keep):
        import asyncckpt.jax as aj
        from asyncckpt.jax._job import JaxSaveJob

        job = _faulty(JaxSaveJob, faults or Faults())
        manager = type("FaultyManager", (aj.CheckpointManager,), {"_job_class": job})
        self.obj = manager(frontend.directory, max_to_keep=max_to_keep,
                           format_options=frontend.format_options(),
                           restore_options=RestoreOptions(checksums=checksums))

    def save(self, step: int, x: float) -> None:
        import jax.numpy as jnp

        # force: saved whatever the save interval says (a failed step saved again)
        self.obj.save(step, {"w": jnp.asarray(values(x)), "step": step}, force=True,
                      custom_metadata={"total_run_calls": step * 10})

    def restore(self, step: int | None = None) -> tuple[int, np.ndarray]:
        got = self.obj.restore(step, target=_target())
        return int(got["step"]), np.asarray(got["w"])


class JaxFrontend(Frontend):
    """``asyncckpt.jax.CheckpointManager``: steps ``<dir>/<step>/default``."""

    campaign = "jax"
    cli_framework = "jax"
    inspect_names = ("w ", "total_run_calls")  # the arrays, the custom metadata
    stray = ("4.orbax-checkpoint-tmp-99",)
    ocdbt = True
    holder = """
import sys
import numpy as np
import jax.numpy as jnp
import asyncckpt.jax as aj
mgr = aj.CheckpointManager(sys.argv[1], format_options=aj.FormatOptions(use_ocdbt=%r))
mgr.save(1, {"w": jnp.full(1000, 1.0), "step": 1})
mgr.wait_until_finished()
print("holding", flush=True)
sys.stdin.readline()  # holds the lock until the test says so (or kills it)
"""

    def __init__(self, directory):
        super().__init__(directory)
        self.holder = JaxFrontend.holder % self.ocdbt

    def format_options(self):
        import asyncckpt.jax as aj

        return aj.FormatOptions(use_ocdbt=self.ocdbt)

    def open(self, *, max_to_keep=None, faults=None, checksums=True) -> Saver:
        return _JaxSaver(self, faults, checksums, max_to_keep)

    def framework_steps(self) -> list[int]:
        import orbax.checkpoint as ocp

        with ocp.CheckpointManager(str(self.directory)) as theirs:
            return list(theirs.all_steps(read=True))

    def framework_read(self, step: int) -> np.ndarray:
        import orbax.checkpoint as ocp

        with ocp.StandardCheckpointer() as theirs:
            got = theirs.restore(Path(self.path(step)) / "default", _target())
        assert int(got["step"]) == step
        return np.asarray(got["w"])

    def asyncckpt_read(self, step: int) -> np.ndarray:
        import asyncckpt.jax as aj

        with aj.CheckpointManager(self.directory) as ours:
            got = ours.restore(step, target=_target())
        assert int(got["step"]) == step
        return np.asarray(got["w"])


class JaxOcdbt(JaxFrontend):
    name = "jax-ocdbt"

    def files(self, step: int) -> list[str]:
        return ["default/manifest.ocdbt", "default/ocdbt.process_0/manifest.ocdbt",
                "default/_METADATA", "_CHECKPOINT_METADATA"]

    def data_fault(self) -> Faults:
        """The values' chunks go into the OCDBT database: its writes hit a full disk."""
        from asyncckpt.jax._ocdbt import DatabaseWriter

        class DiskFullDatabase(DatabaseWriter):
            def put(self, key, data):
                if key.startswith("w/") and not key.endswith(".zarray"):
                    raise OSError(errno.ENOSPC, "No space left on device", key)
                return super().put(key, data)

        return Faults(database=DiskFullDatabase)

    def data_file(self, step: int) -> tuple[Path, str]:
        data = self.directory / str(step) / "default" / "ocdbt.process_0" / "ocdbt_data"
        (chunk,) = data.iterdir()
        return chunk, f"{step}/default/ocdbt.process_0/ocdbt_data/{chunk.name}"


class JaxZarr(JaxFrontend):
    name = "jax-zarr"
    ocdbt = False
    campaign = None  # the campaign runs the default layout

    def data_file(self, step: int) -> tuple[Path, str]:
        return self.directory / str(step) / "default" / "w" / "0", f"{step}/default/w/0"

    def is_data(self, name: str) -> bool:
        return "/w/" in name


# -- the job runner's ArrayStore (JobRunner, Keras's BackupAndRestore) --------------------


class _ArraysSaver(_ManagerSaver):
    def __init__(self, frontend: Arrays, faults, max_to_keep):
        from asyncckpt.jobrunner.store import ArrayStore

        job = _faulty(ArrayStore.job_class, faults or Faults())
        store = type("FaultyStore", (ArrayStore,), {"job_class": job})
        self.obj = store(frontend.directory, max_to_keep=max_to_keep)

    def save(self, step: int, x: float) -> None:
        self.obj.save(step, {"w": values(x)}, {"step": step})

    def restore(self, step: int | None = None) -> tuple[int, np.ndarray]:
        got = self.obj.restore(step)
        assert got.metadata["step"] == got.step
        return got.step, got.arrays["w"]


class Arrays(Frontend):
    """``ArrayStore``: steps ``<dir>/<step>/`` holding ``arrays.bin`` and ``index.json``.

    Its format is asyncckpt's own: the framework's reader is NumPy reading
    ``arrays.bin`` at the offsets ``index.json`` gives.
    """

    name = "arrays"
    lists_in_flight = False  # a step is listed once durable (its restore waits for it)
    cli_framework = "arrays"
    inspect_names = ("w ",)
    holder = """
import sys
import numpy as np
from asyncckpt.jobrunner.store import ArrayStore
store = ArrayStore(sys.argv[1], max_to_keep=None)
store.save(1, {"w": np.full(1000, 1.0, np.float32)}, {"step": 1})
store.wait_until_finished()
print("holding", flush=True)
sys.stdin.readline()  # holds the lock until the test says so (or kills it)
"""

    def open(self, *, max_to_keep=None, faults=None, checksums=True) -> Saver:
        assert checksums, "an ArrayStore always checks what it restores"
        return _ArraysSaver(self, faults, max_to_keep)

    def data_file(self, step: int) -> tuple[Path, str]:
        return self.directory / str(step) / "arrays.bin", f"{step}/arrays.bin"

    def is_data(self, name: str) -> bool:
        return name == "arrays.bin"

    def files(self, step: int) -> list[str]:
        return ["arrays.bin", "index.json"]

    def framework_steps(self) -> list[int]:
        from asyncckpt.jobrunner.store import ArrayStore

        return ArrayStore.committed_steps(str(self.directory))

    def framework_read(self, step: int) -> np.ndarray:
        step_dir = self.directory / str(step)
        entry = json.loads((step_dir / "index.json").read_text())["arrays"]["w"]
        return np.fromfile(step_dir / "arrays.bin", dtype=entry["dtype"],
                           count=int(np.prod(entry["shape"])), offset=entry["offset"])

    def asyncckpt_read(self, step: int) -> np.ndarray:
        from asyncckpt.jobrunner.store import ArrayStore

        got = ArrayStore(self.directory).restore(step)
        return got.arrays["w"]


FRONTENDS: dict[str, type[Frontend]] = {
    f.name: f for f in (TFCheckpoint, TFManager, JaxOcdbt, JaxZarr, Arrays)
}


def on(*, retains: bool | None = None, waits_for_in_flight: bool | None = None,
       campaign: bool = False, only: tuple[str, ...] | None = None):
    """``@pytest.mark.parametrize`` over the front ends with these properties."""
    names = [name for name, f in FRONTENDS.items()
             if (retains is None or f.retains == retains)
             and (waits_for_in_flight is None or f.waits_for_in_flight == waits_for_in_flight)
             and (not campaign or f.campaign is not None)
             and (only is None or name in only)]
    return pytest.mark.parametrize("frontend", names, indirect=True)
