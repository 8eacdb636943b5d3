"""The checkpoint engines and physical floors the benchmark compares.

Each engine saves the same in-memory state that a synthetic training step
updates: TensorFlow variables for the TensorFlow engines, a pytree of
sharded ``jax.Array``s for the JAX ones. ``save`` returns when the engine's
save call returns (the blocking part); ``wait`` returns when the checkpoint
is durable (or at least complete, for engines that never fsync).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import sys
import threading
from collections.abc import Callable

import numpy as np

MATRIX_COLS = 64  # state tensors are [rows, 64]; the step multiplies them by a 64x64 matrix
D2H_FLOOR = "d2h pinned_host"  # the floor of a JAX save on an accelerator (pinned_host_floor)


def _rows_per_tensor(nbytes: int, tensors: int) -> int:
    return max(1, nbytes // tensors // 4 // MATRIX_COLS)


def rotation() -> np.ndarray:
    """A fixed orthogonal matrix: the step changes every value, never its scale.

    So values stay finite however long a benchmark trains, and the data stays
    as incompressible as the random start (no engine gains from compression).
    """
    q, _ = np.linalg.qr(np.random.default_rng(2).standard_normal((MATRIX_COLS, MATRIX_COLS)))
    return q.astype(np.float32)


class TFState:
    """TensorFlow variables holding ``nbytes`` of float32, and a training step."""

    def __init__(self, nbytes: int, tensors: int):
        import tensorflow as tf

        rows = _rows_per_tensor(nbytes, tensors)
        rng = np.random.default_rng(0)
        self.variables = {
            f"w{i}": tf.Variable(rng.standard_normal((rows, MATRIX_COLS), dtype=np.float32))
            for i in range(tensors)
        }
        self.nbytes = rows * MATRIX_COLS * 4 * tensors
        mix = tf.constant(rotation())
        variables = list(self.variables.values())

        @tf.function
        def step():
            for v in variables:  # a matmul and an in-place update of every tensor
                v.assign(tf.matmul(v, mix))

        self._step = step
        step()

    def step(self) -> None:
        self._step()


class JAXState:
    """A pytree of ``jax.Array``s sharded over every device, and a donating step."""

    def __init__(self, nbytes: int, tensors: int):
        import jax
        import jax.numpy as jnp
        from jax.sharding import Mesh, NamedSharding, PartitionSpec

        devices = np.array(jax.devices())
        mesh = Mesh(devices, ("d",))
        rows = _rows_per_tensor(nbytes, tensors)
        rows -= rows % len(devices)
        rows = max(rows, len(devices))
        sharding = NamedSharding(mesh, PartitionSpec("d"))
        # Random values made on the devices, already sharded.
        normal = jax.jit(
            lambda key: jax.random.normal(key, (rows, MATRIX_COLS), jnp.float32),
            out_shardings=sharding,
        )
        keys = jax.random.split(jax.random.key(0), tensors)
        self.tree = {f"w{i}": normal(keys[i]) for i in range(tensors)}
        self.nbytes = rows * MATRIX_COLS * 4 * tensors
        mix = jnp.asarray(rotation())

        def update(tree):
            return {k: v @ mix for k, v in tree.items()}

        self._update = jax.jit(update, donate_argnums=0)
        self.step()
        jax.block_until_ready(self.tree)

    def step(self) -> None:
        self.tree = self._update(self.tree)

    def block(self) -> None:
        import jax

        jax.block_until_ready(self.tree)

    def memcpy_floor(self) -> Callable[[], None]:
        """A memcpy of every shard from XLA's own buffers into warm host arrays.

        The copy a save cannot avoid, from the memory it copies: XLA keeps
        its buffers on 4 KiB pages, where the bench's ``memcpy`` floor copies
        a NumPy array on transparent huge pages (NumPy advises them), so a
        copy from the state itself walks 512 times the page-table entries.
        After a step replaced the tree (a donated buffer is gone), the first
        call takes views of the new shards, as a save must; the destinations
        are made and warmed once, outside the copy.
        """
        cached: list = [None, []]  # tree, (destination, shard view) pairs

        def pairs() -> list[tuple[np.ndarray, np.ndarray]]:
            if cached[0] is not self.tree:
                views = [np.asarray(shard.data) for leaf in self.tree.values()
                         for shard in leaf.addressable_shards]
                dsts = [d for d, _ in cached[1]]
                if [(d.shape, d.dtype) for d in dsts] != [(v.shape, v.dtype) for v in views]:
                    dsts = [np.empty_like(v) for v in views]
                    for dst, src in zip(dsts, views, strict=True):
                        np.copyto(dst, src)  # destinations warm, as a slot's are
                cached[:] = [self.tree, list(zip(dsts, views, strict=True))]
            return cached[1]

        pairs()

        def memcpy() -> None:
            for dst, src in pairs():
                np.copyto(dst, src)

        return memcpy

    def pinned_host_floor(self) -> Callable[[], None] | None:
        """The device-to-host floor: the state put into pinned host memory, as a save does.

        On a GPU or TPU a JAX save's blocking part is one ``device_put`` of the
        state into ``pinned_host`` memory, at the device-to-host bandwidth, so
        no save there blocks for less. None where the devices have no pinned
        host memory. (On CPU it is one more host copy: ``memcpy jax arrays``
        is the floor there, and the runner measures this one on accelerators
        only.)
        """
        import jax

        try:
            kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
        except Exception:  # a backend without memory kinds
            return None
        if "pinned_host" not in kinds:
            return None

        def put() -> None:
            jax.block_until_ready({k: jax.device_put(a, a.sharding.with_memory_kind("pinned_host"))
                                   for k, a in self.tree.items()})

        return put

    @property
    def platform(self) -> str:
        """Where the state lives: ``cpu``, ``gpu``, ``tpu``."""
        return next(iter(next(iter(self.tree.values())).sharding.device_set)).platform


# Checkpoints an engine keeps on disk; restores read the newest. The managers
# (orbax's, asyncckpt's JAX one) delete old steps in the background
# (``enable_background_delete``) and the other engines between timed calls
# (``prune``), so no engine's durable time includes deleting another checkpoint.
KEEP = 2
_CKPT_FILE = re.compile(r"ckpt-(\d+)\.")  # files of the ``ckpt-N`` prefixes the TF engines write


class Engine:
    """A checkpoint engine under test. Subclasses implement the four calls."""

    name = "engine"
    framework = "tf"

    def __init__(self, state, workdir: str):
        self.state = state
        self.workdir = workdir
        self.step_no = 0
        os.makedirs(workdir, exist_ok=True)

    def save(self) -> None:
        raise NotImplementedError

    def wait(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def phases(self) -> dict | None:
        """Where the last save's time went (``SaveStats.phases``); None for other engines."""
        return None

    def prune(self) -> None:
        """Deletes the checkpoints older than the newest ``KEEP`` (between timed calls).

        Engines whose manager has retention set ``max_to_keep=KEEP`` there
        instead. Without either, the 1 GiB rows alone left 65 GB on disk.
        """
        for name in os.listdir(self.workdir):
            m = _CKPT_FILE.match(name)
            if m and int(m.group(1)) <= self.step_no - KEEP:
                os.unlink(os.path.join(self.workdir, name))

    def files(self) -> list[str]:
        """Files of everything written so far (to evict them from the page cache)."""
        out = []
        for root, _, names in os.walk(self.workdir):
            out.extend(os.path.join(root, n) for n in names)
        return out

    def close(self) -> None:
        self.wait()


class TFSync(Engine):
    name = "tf sync"

    def __init__(self, state: TFState, workdir: str):
        import tensorflow as tf

        super().__init__(state, workdir)
        self.ckpt = tf.train.Checkpoint(**state.variables)
        self.last = None

    def save(self) -> None:
        self.step_no += 1
        self.last = self.ckpt.write(os.path.join(self.workdir, f"ckpt-{self.step_no}"))

    def wait(self) -> None:
        pass

    def restore(self) -> None:
        self.ckpt.read(self.last).assert_consumed()


class TFBuiltinAsync(TFSync):
    name = "tf built-in async"

    def __init__(self, state: TFState, workdir: str):
        import tensorflow as tf

        super().__init__(state, workdir)
        self.options = tf.train.CheckpointOptions(enable_async=True)

    def save(self) -> None:
        self.step_no += 1
        path = os.path.join(self.workdir, f"ckpt-{self.step_no}")
        self.last = self.ckpt.write(path, options=self.options)

    def wait(self) -> None:
        self.ckpt.sync()

    def restore(self) -> None:
        self.ckpt.sync()
        self.ckpt.read(self.last)


class AsyncckptTF(Engine):
    name = "asyncckpt tf"

    def __init__(self, state: TFState, workdir: str):
        import asyncckpt.tf as at

        super().__init__(state, workdir)
        self.ckpt = at.Checkpoint(**state.variables)
        self.last = None

    def save(self) -> None:
        self.step_no += 1
        self.last = self.ckpt.write(os.path.join(self.workdir, f"ckpt-{self.step_no}"))

    def wait(self) -> None:
        self.ckpt.sync()

    def restore(self) -> None:
        self.ckpt.read(self.last).assert_consumed()

    def phases(self) -> dict | None:
        handle = self.ckpt.last_save
        return None if handle is None else _phases(handle.result())

    def close(self) -> None:
        self.ckpt.close()


class Orbax(Engine):
    name = "orbax async"
    framework = "jax"

    def __init__(self, state: JAXState, workdir: str):
        import orbax.checkpoint as ocp

        super().__init__(state, workdir)
        self.ocp = ocp
        self.manager = ocp.CheckpointManager(
            workdir, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=True,
                                                          max_to_keep=KEEP,
                                                          enable_background_delete=True)
        )

    def save(self) -> None:
        self.step_no += 1
        self.manager.save(self.step_no, args=self.ocp.args.StandardSave(self.state.tree))

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def restore(self) -> None:
        import jax

        self.wait()
        target = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
            self.state.tree,
        )
        restored = self.manager.restore(self.step_no, args=self.ocp.args.StandardRestore(target))
        jax.block_until_ready(restored)

    def close(self) -> None:
        self.wait()
        self.manager.close()


class AsyncckptJAX(Engine):
    name = "asyncckpt jax"
    framework = "jax"

    def __init__(self, state: JAXState, workdir: str):
        import orbax.checkpoint as ocp

        import asyncckpt.jax as aj

        super().__init__(state, workdir)
        self.manager = aj.CheckpointManager(workdir, options=ocp.CheckpointManagerOptions(
            max_to_keep=KEEP, enable_background_delete=True))

    def save(self) -> None:
        self.step_no += 1
        self.manager.save(self.step_no, self.state.tree, force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def restore(self) -> None:
        import jax

        self.wait()
        target = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
            self.state.tree,
        )
        jax.block_until_ready(self.manager.restore(self.step_no, target=target))

    def phases(self) -> dict | None:
        handle = self.manager.last_save
        return None if handle is None else _phases(handle.result())

    def close(self) -> None:
        self.manager.close()


def _phases(stats) -> dict | None:
    """A save's ``SaveStats.phases``, with the time from its call to its commit."""
    phases = getattr(stats, "phases", None)  # None before asyncckpt recorded them
    if phases is None:
        return None
    return {**phases, "committed_s": stats.durable_s}


class BackgroundRawWrite(Engine):
    """The floor of the training-loop overhead: a bare write + fsync of the state's bytes.

    Each save writes ``nbytes`` from a preallocated buffer on a thread at the
    priority asyncckpt's writer uses by default: what writing the bytes costs
    a training loop on this machine before any checkpoint format or checksum.
    """

    name = "floor: raw write in background"
    framework = "any"

    def __init__(self, state, workdir: str):
        super().__init__(state, workdir)
        from asyncckpt import AsyncOptions

        self._nice = AsyncOptions().writer_nice
        self._floors = Floors(state.nbytes, 1, workdir)
        self._thread: threading.Thread | None = None

    def save(self) -> None:
        self.wait()
        self._thread = threading.Thread(target=self._write, name="raw-write")
        self._thread.start()

    def _write(self) -> None:
        # This thread's niceness raised as the writer raises its own (Linux: per thread).
        if self._nice > 0 and sys.platform.startswith("linux"):
            tid = threading.get_native_id()
            with contextlib.suppress(OSError):  # refused: the floor runs unniced, as the writer
                os.setpriority(os.PRIO_PROCESS, tid,
                               os.getpriority(os.PRIO_PROCESS, tid) + self._nice)
        self._floors.raw_write()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def restore(self) -> None:
        self._floors.raw_read()


ENGINES: dict[str, type[Engine]] = {
    e.name: e for e in (TFSync, TFBuiltinAsync, AsyncckptTF, Orbax, AsyncckptJAX)
}


class Floors:
    """The physical floors for ``nbytes``: host memcpy, CRC32C, raw write + fsync, raw read.

    ``raw_write`` also keeps its two parts (``last_write_s``, the ``write()``
    calls into the page cache, and ``last_fsync_s``, the one fsync), the
    floors of a save's write and fsync phases.
    """

    def __init__(self, nbytes: int, tensors: int, workdir: str):
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "raw.bin")
        rng = np.random.default_rng(1)
        self.src = rng.random(nbytes // 4, dtype=np.float32)
        self.dst = np.zeros_like(self.src)
        n = len(self.src) // tensors
        self.parts = [(np.zeros(n, np.float32), self.src[i * n : (i + 1) * n].copy())
                      for i in range(tensors)]
        self.nbytes = self.src.nbytes

    def memcpy(self) -> None:
        np.copyto(self.dst, self.src)

    def memcpy_per_tensor(self) -> None:
        for d, s in self.parts:
            np.copyto(d, s)

    last_write_s = last_fsync_s = 0.0

    def raw_write(self) -> None:
        import time

        t0 = time.perf_counter()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(self.src).cast("B")
            for start in range(0, len(view), 64 << 20):
                part = view[start : start + (64 << 20)]
                while part:
                    part = part[os.write(fd, part):]
            t1 = time.perf_counter()
            os.fsync(fd)
        finally:
            os.close(fd)
        self.last_write_s, self.last_fsync_s = t1 - t0, time.perf_counter() - t1

    def crc32c(self) -> None:
        """The checksum a save computes over the state's bytes (asyncckpt's CRC32C)."""
        from asyncckpt._engine import fastcrc

        fastcrc.crc32c_extend(0, self.src)

    def keep_read_buffer_only(self) -> None:
        """Frees the copy floors' buffers (``raw_read``'s stays): a state's worth x3."""
        del self.src, self.parts

    def raw_read(self) -> None:
        with open(self.path, "rb", buffering=0) as f:
            buf = memoryview(self.dst).cast("B")
            pos = 0
            while pos < len(buf):
                n = f.readinto(buf[pos:])
                if not n:
                    break
                pos += n


def evict_from_page_cache(paths: list[str]) -> None:
    """Asks the kernel to drop cached pages of these files (no root needed)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def clear_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, exist_ok=True)


def tensors_for(nbytes: int) -> int:
    """How many tensors a state of this size is split into (16 MiB-ish each, 4 to 64)."""
    return int(min(64, max(4, math.ceil(nbytes / (16 << 20)))))


Maker = Callable[[object, str], Engine]
