"""Keras's own callback tests, unchanged, against asyncckpt's callbacks, on both backends.

Runs the installed ``keras/src/callbacks/backup_and_restore_test.py`` and
``model_checkpoint_test.py`` (Keras 3.15; loaded from the installed package,
never copied) in one pytest subprocess per backend (``KERAS_BACKEND`` must be
set before Keras loads), with the ``tests.clients.keras_substitution`` plugin
handing those modules asyncckpt's ``BackupAndRestore`` and ``ModelCheckpoint``
in place of Keras's. Every case must pass, and every case must have built
asyncckpt's callback and never Keras's own (so the run cannot pass without
the substitution). No expected value of these cases is changed by asyncckpt's
exact resumes: with the plain arrays they use, a mid-epoch backup resumes at
its epoch's first batch, as Keras's does (``docs/compat.md``).

Both files, every case (9): the slowest, ``test_model_checkpoint_options``,
is kept because each of its sub-cases is a decision ``ModelCheckpoint``
makes (modes, ``save_best_only``, ``save_freq``, file name fields,
``initial_value_threshold``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.clients.keras_substitution import REPORT_ENV
from tests.helpers import subprocess_env

keras = pytest.importorskip("keras")

FILES = ("backup_and_restore_test.py", "model_checkpoint_test.py")
EXPECTED = {  # test -> the callbacks it builds
    "BackupAndRestoreCallbackTest::test_save_freq_unknown_error": "BackupAndRestore",
    "BackupAndRestoreCallbackTest::test_best_case_step": "BackupAndRestore",
    "BackupAndRestoreCallbackTest::test_best_case_epoch": "BackupAndRestore",
    "BackupAndRestoreCallbackTest::test_backup_corrupted": "BackupAndRestore",
    "BackupAndRestoreCallbackTest::test_model_deleted_case_epoch": "BackupAndRestore",
    "BackupAndRestoreCallbackTest::test_backup_dir_empty_error": "BackupAndRestore",
    "BackupAndRestoreCallbackTest::test_backup_dir_none_error": "BackupAndRestore",
    "ModelCheckpointTest::test_model_checkpoint_options": "ModelCheckpoint",
    "ModelCheckpointTest::test_model_checkpoint_loading": "ModelCheckpoint",
}
BACKENDS = ("tensorflow", "jax")


def _keras_tests_dir() -> Path:
    return Path(keras.__file__).resolve().parent / "src" / "callbacks"


def _start(backend: str, tmp: Path) -> tuple[subprocess.Popen, Path]:
    """pytest on Keras's installed files, in a child with ``KERAS_BACKEND=backend``."""
    run_dir = tmp / backend
    run_dir.mkdir()
    (run_dir / "pytest.ini").write_text("[pytest]\n")  # not this repo's configuration
    report = run_dir / "report.json"
    tests = _keras_tests_dir()
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
        "-c", str(run_dir / "pytest.ini"), "--rootdir", str(tests.parent.parent),
        "-p", "tests.clients.keras_substitution",
        *(str(tests / name) for name in FILES),
    ]
    env = subprocess_env(KERAS_BACKEND=backend, **{REPORT_ENV: str(report)})
    proc = subprocess.Popen(command, cwd=run_dir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    return proc, report


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, tuple[dict, str]]:
    """Each backend's report and output; the two children run at the same time."""
    tmp = tmp_path_factory.mktemp("keras-own-tests")
    started = {backend: _start(backend, tmp) for backend in BACKENDS}
    out = {}
    for backend, (proc, report) in started.items():
        output, _ = proc.communicate(timeout=900)
        assert report.exists(), f"{backend}: no report\n{output[-5000:]}"
        out[backend] = (json.loads(report.read_text()), output)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_keras_callback_tests_pass_against_asyncckpt(reports, backend):
    report, output = reports[backend]
    assert report["backend"] == backend
    assert sorted(report["substituted_in"]) == [
        "keras.src.callbacks.backup_and_restore_test",
        "keras.src.callbacks.model_checkpoint_test",
    ]
    tests = {nodeid.split(".py::", 1)[1]: entry for nodeid, entry in report["tests"].items()}
    assert sorted(tests) == sorted(EXPECTED), output[-3000:]
    failed = {name: e.get("message", "")[-1500:] for name, e in tests.items()
              if e["outcome"] != "passed"}
    assert not failed, f"{backend}: {json.dumps(failed, indent=1)}"
    for name, kind in EXPECTED.items():
        built = tests[name]["constructed"]
        assert built.get(f"asyncckpt.{kind}", 0) >= 1, (name, built)
        assert not any(key.startswith("keras.") for key in built), (name, built)

