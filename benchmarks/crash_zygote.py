"""The crash campaign's zygote: imports the frameworks once, forks a saving child per trial.

Run by ``crash_campaign.py`` as ``python crash_zygote.py tf,jax``; it reads one
``<framework> <directory> <floats>`` line per trial on stdin, forks a child
that restores the newest checkpoint through the manager and then saves a
deterministic state in a loop, prints ``pid <pid>``, and prints
``exit <pid> <code>`` once it has reaped the child. The child reports phase
boundaries of the real save job (``mark <pid> <event> <step> <monotonic>``)
through the same pipe, each line in one ``write(2)``, so every marker of a
killed child is read before its exit line. Forking after the imports (and
before any framework runtime starts: no TensorFlow op, no JAX backend in the
zygote) makes a trial cost a fork instead of a multi-second import.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import traceback

MAX_TO_KEEP = 3
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count=8"


def environment() -> dict[str, str]:
    """The environment of the zygote: this checkout first, quiet TF, 8 CPU devices."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("JAX_PLATFORMS", "cpu")
    if "xla_force_host_platform_device_count" not in env.get("XLA_FLAGS", ""):
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + DEVICE_COUNT_FLAG).strip()
    return env


def expected_arrays(step: int, n: int) -> tuple:
    """The state saved at ``step``: two float32 arrays of ``n`` that differ at every step."""
    import numpy as np

    base = np.arange(n, dtype=np.float32)
    return base + np.float32(step), base * np.float32(2) - np.float32(step)


def step_of(label: str) -> int:
    """Step of a job label: ``ckpt-7`` (TF) or ``7`` (JAX)."""
    return int(label.rsplit("-", 1)[-1])


# -- phase probes: the real job classes, wrapped ------------------------------------------

_SINK: list = [lambda event, label, detail="": None]


def set_probe_sink(sink) -> None:
    """Where the probes report: ``sink(event, label, detail)``, on the writer thread."""
    _SINK[0] = sink


def install_phase_probes(framework: str) -> None:
    """Wraps the real save job's ``write`` and ``commit`` to report phase boundaries.

    Reports go to ``_SINK[0](event, label, detail)`` on the writer thread,
    just before and just after the real method runs (``*-error`` when it
    raises). Installing twice is a no-op.
    """
    if framework == "tf":
        from asyncckpt.tf._job import TFSaveJob as job_class
    else:
        from asyncckpt.jax._job import JaxSaveJob as job_class
    for phase in ("write", "commit"):
        real = getattr(job_class, phase)
        if getattr(real, "crash_probe", False):
            continue

        def probed(self, *args, _real=real, _phase=phase):
            _SINK[0](f"{_phase}-start", self.label)
            _WRITING[0] = self.label if _phase == "write" else None
            try:
                result = _real(self, *args)
            except BaseException as e:
                _SINK[0](f"{_phase}-error", self.label, type(e).__name__)
                raise
            finally:
                _WRITING[0] = None
            _SINK[0](f"{_phase}-end", self.label)
            return result

        probed.crash_probe = True
        setattr(job_class, phase, probed)
    _probe_file_writes()


_WRITING: list = [None]  # label of the save whose write is running (the writer thread's)


def _probe_file_writes() -> None:
    """Reports each file a job's write finishes through the engine's ``DurableWriter``.

    JAX writes one file per shard this way, so a kill sent on the k-th file of
    a write lands inside that write however slow the machine is. (TensorFlow
    writes its bundle in one ``SaveV2`` call; its kills are aimed by time.)
    """
    from asyncckpt._engine.files import DurableWriter

    real = DurableWriter.write
    if getattr(real, "crash_probe", False):
        return

    def probed(self, name, chunks):
        record = real(self, name, chunks)
        if _WRITING[0] is not None:
            _SINK[0]("file-written", _WRITING[0])
        return record

    probed.crash_probe = True
    DurableWriter.write = probed
    _probe_database_puts()


def _probe_database_puts() -> None:
    """Reports each value a JAX write puts into its OCDBT database, as a file of its own.

    In the OCDBT layout (the default) a shard is a value of the process's
    database rather than a file: a kill sent on the k-th value lands inside
    the write (before the data file is written, the values being recorded),
    and the data file, B-tree and manifests that follow are files the probe
    on ``DurableWriter.write`` reports.
    """
    from asyncckpt.jax._ocdbt import DatabaseWriter

    real = DatabaseWriter.put
    if getattr(real, "crash_probe", False):
        return

    def probed(self, key, data):
        real(self, key, data)
        if _WRITING[0] is not None:
            _SINK[0]("file-written", _WRITING[0])

    probed.crash_probe = True
    DatabaseWriter.put = probed


# -- the zygote and its children -----------------------------------------------------------


def _out(line: str) -> None:
    """One line to stdout in one write(2): atomic on a pipe, never buffered in Python."""
    os.write(1, (line + "\n").encode())


def _die_with_parent() -> None:
    """Asks the kernel to SIGKILL this process when its parent dies (no orphaned savers)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _child_tf(directory: str, n: int) -> None:
    """A restarted TF job: resume through the manager, report it, save forever."""
    import numpy as np
    import tensorflow as tf

    import asyncckpt.tf as at

    a, b = (tf.Variable(np.zeros(n, np.float32)) for _ in range(2))
    step = tf.Variable(-1, dtype=tf.int64)
    mgr = at.CheckpointManager(tf.train.Checkpoint(a=a, b=b, step=step), directory,
                               max_to_keep=MAX_TO_KEEP)
    s = 0
    if mgr.restore_or_initialize() is not None:
        s = int(step.numpy())
        ea, eb = expected_arrays(s, n)
        exact = np.array_equal(a.numpy(), ea) and np.array_equal(b.numpy(), eb)
        _out(f"mark {os.getpid()} resume {s} {int(exact)} {time.monotonic():.6f}")
        s += 1
    while True:
        ea, eb = expected_arrays(s, n)
        a.assign(ea)
        b.assign(eb)
        step.assign(s)
        mgr.save(checkpoint_number=s)
        s += 1


def _child_jax(directory: str, n: int) -> None:
    """A restarted JAX job (8 CPU devices, sharded state): resume, report, save forever."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import asyncckpt.jax as aj

    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), P("d"))
    spec = jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sharding)
    mgr = aj.CheckpointManager(directory, max_to_keep=MAX_TO_KEEP)
    s = 0
    if mgr.latest_step() is not None:
        got = mgr.restore(target={"a": spec, "b": spec, "step": 0})
        s = int(got["step"])
        ea, eb = expected_arrays(s, n)
        exact = (np.array_equal(np.asarray(got["a"]), ea)
                 and np.array_equal(np.asarray(got["b"]), eb))
        _out(f"mark {os.getpid()} resume {s} {int(exact)} {time.monotonic():.6f}")
        s += 1
    while True:
        ea, eb = expected_arrays(s, n)
        mgr.save(s, {"a": jax.device_put(ea, sharding), "b": jax.device_put(eb, sharding),
                     "step": s})
        s += 1


def zygote_main(frameworks: list[str]) -> None:
    """Imports everything once, then forks a saving child per line read on stdin."""
    _die_with_parent()
    import numpy  # noqa: F401

    for framework in frameworks:
        if framework == "tf":
            import tensorflow  # noqa: F401

            import asyncckpt.tf
        else:
            import jax  # noqa: F401  (the backend starts in the child, not here)

            import asyncckpt.jax  # noqa: F401
        install_phase_probes(framework)
    set_probe_sink(lambda event, label, detail="": _out(
        f"mark {os.getpid()} {event} {step_of(label)} {time.monotonic():.6f}"))
    _out("zygote-ready")
    for line in sys.stdin:
        framework, directory, n = line.split()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _die_with_parent()
                (_child_tf if framework == "tf" else _child_jax)(directory, int(n))
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
            finally:
                os._exit(code)
        _out(f"pid {pid}")
        _, status = os.waitpid(pid, 0)
        _out(f"exit {pid} {os.waitstatus_to_exitcode(status)}")


class CampaignError(AssertionError):
    """The campaign could not go on (a child died by itself, a wait timed out)."""


class Zygote:
    """The parent's handle on the zygote process and its line stream."""

    def __init__(self, frameworks: list[str], log_path: str):
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), ",".join(frameworks)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            env=environment(),
        )
        self.lines: queue.Queue[list[str] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.child: int | None = None

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.split())
        self.lines.put(None)

    def log_tail(self, n: int = 3000) -> str:
        with open(self.log_path) as f:
            return f.read()[-n:]

    def next(self, timeout: float) -> list[str] | None:
        """The next line, or None when ``timeout`` passes first."""
        try:
            fields = self.lines.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None
        if fields is None:
            raise CampaignError(f"the zygote exited: {self.log_tail()}")
        return fields

    def expect(self, kind: str, timeout: float, sink: list | None = None) -> list[str]:
        """Reads lines until one of ``kind``; marks met on the way go to ``sink``."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.next(deadline - time.monotonic())
            if fields is None:
                raise CampaignError(f"no {kind!r} line within {timeout} s: {self.log_tail()}")
            if fields[0] == kind:
                return fields
            if fields[0] == "mark" and sink is not None:
                sink.append(fields)
            elif fields[0] == "exit":
                raise CampaignError(f"child exited by itself ({fields}): {self.log_tail()}")

    def start(self, framework: str, directory: str, n: int) -> int:
        """Forks a child saving ``n``-float arrays into ``directory``; returns its pid."""
        self.proc.stdin.write(f"{framework} {directory} {n}\n")
        self.proc.stdin.flush()
        self.child = int(self.expect("pid", 120)[1])
        return self.child

    def close(self) -> None:
        """Kills a child still running, then ends the zygote (its stdin closes)."""
        if self.child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


if __name__ == "__main__":
    zygote_main(sys.argv[1].split(","))
