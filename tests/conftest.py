"""Shared fixtures. Runs before any test imports a framework.

Sets up several CPU devices for both frameworks the way the real multi-device
paths need them: XLA's host-platform device count for JAX (an environment
variable read when JAX starts), and logical CPU devices for TensorFlow (which
must be configured before TensorFlow creates its runtime).
"""

from __future__ import annotations

import gc
import os
import threading

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest

TF_LOGICAL_CPUS = 4


def _configure_tensorflow() -> None:
    try:
        import tensorflow as tf
    except ImportError:
        return
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration() for _ in range(TF_LOGICAL_CPUS)]
    )


_configure_tensorflow()


_last_module: list[str] = [""]


def pytest_runtest_setup(item: pytest.Item) -> None:
    """At each new test module: what is alive is collected once, then frozen.

    The suite's process ends up holding about a million objects (TensorFlow,
    JAX, orbax, Keras and what earlier modules keep): every full collection
    then walked them all, 0.5 s each on a 2-core VM, 157 times a run, landing
    wherever a test allocated. One in the grace period of a preemption test
    (4.8 s) made its final save miss the remote tier. Frozen objects are
    skipped by later collections; a test's own objects never are, as
    freezing happens only between modules.
    """
    module = item.nodeid.partition("::")[0]
    if module != _last_module[0]:
        _last_module[0] = module
        gc.collect()
        gc.freeze()


@pytest.fixture
def ckpt_dir(tmp_path):
    """A fresh directory for checkpoints."""
    d = tmp_path / "ckpts"
    d.mkdir()
    return d


class WriteGate:
    """Holds TensorFlow saves in their background write while the gate is closed.

    ``Checkpoint`` is an ``asyncckpt.tf.Checkpoint`` whose saves' format
    writer (``TFSaveJob``, through the class's ``_job_class``) waits at this
    gate before writing its bundle; ``Checkpoint.wrap(plain)`` wraps a
    ``tf.train.Checkpoint`` for a manager. Tests close the gate
    (``open.clear()``) to hold a save in its background write, learn that a
    write reached it from ``entered``, and open it to let it go.
    """

    def __init__(self):
        import asyncckpt.tf as at
        from asyncckpt.tf._job import TFSaveJob

        self.at = at

        self.open = threading.Event()
        self.open.set()
        self.entered = threading.Semaphore(0)
        gate = self

        class GatedJob(TFSaveJob):
            def write_bundle(self, prefix, state):
                gate.entered.release()
                assert gate.open.wait(60), "the test never opened the gate"
                return super().write_bundle(prefix, state)

        self.job_class = GatedJob
        self.Checkpoint = type("GatedCheckpoint", (at.Checkpoint,), {"_job_class": GatedJob})


@pytest.fixture
def gate():
    """A ``WriteGate`` (its ``Checkpoint`` saves through it), opened again at the end."""
    g = WriteGate()
    yield g
    g.open.set()
