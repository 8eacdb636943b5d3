"""pytest plugin: ``tf.train.CheckpointManager(...)`` builds an ``asyncckpt.tf.CheckpointManager``.

Loaded (``-p tests.clients.tf_manager_plugin``) into a pytest run of a
third-party test file that is run unchanged, such as orbit's
``controller_test.py``: wherever that code constructs
``tf.train.CheckpointManager``, it gets asyncckpt's manager, with the same
arguments. Instance and subclass checks against the patched name stay
TensorFlow's own (``isinstance(m, tf.train.CheckpointManager)`` asks about
TensorFlow's real class), so a client's type checks test asyncckpt's manager
exactly as they would in user code.

After each test its managers are closed (a background error fails the
test), and a JSON report at ``$ASYNCCKPT_CLIENTS_REPORT`` records, per test,
its outcome, the managers built, how many of them saved, and how many of
their checkpoints carry an asyncckpt manifest, so the caller can check the
cases really exercised asyncckpt.
"""

from __future__ import annotations

import json
import os

import pytest
import tensorflow as tf

import asyncckpt.tf as at

_TF_MANAGER = tf.train.CheckpointManager
_built: list = []
_report: dict[str, dict] = {}


class _BuildsAsyncckptManagers(type):
    def __call__(cls, *args, **kwargs):
        manager = at.CheckpointManager(*args, **kwargs)
        _built.append(manager)
        return manager

    def __instancecheck__(cls, obj) -> bool:
        return isinstance(obj, _TF_MANAGER)

    def __subclasscheck__(cls, sub) -> bool:
        return issubclass(sub, _TF_MANAGER)


class CheckpointManager(metaclass=_BuildsAsyncckptManagers):
    """Stands for ``tf.train.CheckpointManager`` while the plugin is loaded."""


def pytest_configure(config):
    tf.train.CheckpointManager = CheckpointManager


def pytest_unconfigure(config):
    tf.train.CheckpointManager = _TF_MANAGER
    path = os.environ.get("ASYNCCKPT_CLIENTS_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(_report, f, indent=1, sort_keys=True)


def _entry(nodeid: str) -> dict:
    return _report.setdefault(nodeid, {"outcome": "passed", "managers": 0, "saved": 0,
                                       "asyncckpt_checkpoints": 0})


def pytest_runtest_setup(item):
    _built.clear()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)
    finally:
        managers = list(_built)
        _built.clear()
        entry = _entry(item.nodeid)
        entry["managers"] = len(managers)
        for manager in managers:
            manager.close()  # durable, or the background error is raised here
            if manager.last_save is not None:
                entry["saved"] += 1
            entry["asyncckpt_checkpoints"] += sum(
                at.verify_checkpoint(path) for path in manager.checkpoints)


def pytest_runtest_logreport(report):
    entry = _entry(report.nodeid)
    if report.failed:
        entry["outcome"] = "failed"
    elif report.skipped and report.when != "teardown":
        entry["outcome"] = "skipped"
