"""pytest plugin: Keras's own callback tests, run against asyncckpt's callbacks.

Loaded with ``-p tests.clients.keras_substitution`` into a pytest that runs
Keras's installed test files unchanged (``keras/src/callbacks/*_test.py``).
Those files reach the callbacks as ``callbacks.BackupAndRestore`` and
``callbacks.ModelCheckpoint``, ``callbacks`` being the module global bound
by ``from keras.src import callbacks``. After collection, that global of each
collected module is replaced by a namespace that hands out
``asyncckpt.keras.BackupAndRestore`` / ``ModelCheckpoint`` under those two
names and Keras's own objects under every other name.

So that a run cannot pass without asyncckpt's callbacks, every construction
of either kind of callback is counted per test, asyncckpt's and Keras's own
(a construction of exactly Keras's class); the counts and each test's outcome
are written as JSON to ``$ASYNCCKPT_KERAS_REPORT`` for the calling test to
check. Keras's conftest is not installed; its one marker used here is
registered.
"""

from __future__ import annotations

import functools
import json
import os
import types

import pytest

REPORT_ENV = "ASYNCCKPT_KERAS_REPORT"
SUBSTITUTED = ("BackupAndRestore", "ModelCheckpoint")

_counts: dict[str, int] = {}
_per_test: dict[str, dict] = {}
_modules: list[str] = []
_backend: list[str] = []


def _count(key: str, init, only_exact: type | None = None):
    @functools.wraps(init)
    def counted(self, *args, **kwargs):
        if only_exact is None or type(self) is only_exact:
            _counts[key] = _counts.get(key, 0) + 1
        return init(self, *args, **kwargs)

    return counted


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "requires_trainable_backend: Keras's marker (a trainable backend is in use)")
    import keras
    from keras.src import callbacks as keras_callbacks

    import asyncckpt.keras as ak

    for name in SUBSTITUTED:
        ours, theirs = getattr(ak, name), getattr(keras_callbacks, name)
        ours.__init__ = _count(f"asyncckpt.{name}", ours.__init__)
        theirs.__init__ = _count(f"keras.{name}", theirs.__init__, only_exact=theirs)
    _backend.append(keras.backend.backend())


def _substitute(module: types.ModuleType) -> None:
    import asyncckpt.keras as ak

    real = module.callbacks
    namespace = types.SimpleNamespace(**{
        n: getattr(real, n) for n in dir(real) if not n.startswith("__")})
    for name in SUBSTITUTED:
        setattr(namespace, name, getattr(ak, name))
    module.callbacks = namespace
    _modules.append(module.__name__)


def pytest_collection_modifyitems(session, config, items):
    seen = set()
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and id(module) not in seen:
            seen.add(id(module))
            _substitute(module)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _counts.clear()
    _per_test[item.nodeid] = {"outcome": "passed"}
    yield
    _per_test[item.nodeid]["constructed"] = dict(_counts)


def pytest_runtest_logreport(report):
    entry = _per_test.get(report.nodeid)
    if entry is None:
        return
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else f"error in {report.when}"
        entry["message"] = str(report.longrepr)[-2000:]
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"backend": _backend[0], "substituted_in": _modules,
                       "tests": _per_test}, f, indent=1)
