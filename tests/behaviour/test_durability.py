"""Durability on every front end: kills, fsyncs, damaged files, the directory lock, the CLI.

Each scenario is written once and run on each front end it applies to
(``frontends.on``); every checkpoint a scenario restores is read with
asyncckpt's reader and the framework's own (``Frontend.read_both``).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

from asyncckpt import CorruptCheckpointError, DirectoryLockedError, layout
from asyncckpt._engine import fastcrc
from asyncckpt._engine.files import DurableWriter
from tests.behaviour.frontends import Faults, _Delegating, on, values
from tests.helpers import (
    LineWatcher,
    check_crash_campaign,
    flip_byte,
    run_crash_campaign,
    start_python,
    subprocess_env,
    test_seed,
    write_script,
)

CRASH_KILLS = int(os.environ.get("ASYNCCKPT_CRASH_KILLS", "16"))


@on(campaign=True)
def test_sigkill_mostly_during_writes_never_loses_or_lists_a_partial_checkpoint(
        frontend, tmp_path):
    """A short run of benchmarks/crash_campaign.py: SIGKILLs and a full disk."""
    seed = test_seed(f"{frontend.campaign} crash campaign")
    stats = run_crash_campaign(frontend.campaign, tmp_path, kills=CRASH_KILLS, io_errors=3,
                               seed=seed)
    check_crash_campaign(stats, CRASH_KILLS, 3)


# -- every file and directory is durable before the publish ---------------------------------


class _Events:
    """What the writers made durable and when the publish came, in order (any thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.synced: list[str] = []
        self.published: list[tuple[int, list[str]]] = []  # (syncs before it, what it held)


def _recorded(events: _Events) -> Faults:
    class RecordingWriter(DurableWriter):  # the real writer, recording each fsync
        def sync(self, path):
            super().sync(path)
            with events.lock:
                events.synced.append(os.path.realpath(path))

    class RecordingPublish(_Delegating):  # the real destination, recording its publish
        def publish(self, workdir, names):
            held = []
            for parent, dirs, files in os.walk(workdir):
                held += [os.path.realpath(os.path.join(parent, n)) for n in dirs + files]
            with events.lock:
                events.published.append((len(events.synced), [os.path.realpath(workdir),
                                                               *held]))
            super().publish(workdir, names)

    return Faults(writer=RecordingWriter, destination=RecordingPublish)


@on()
def test_every_file_and_directory_is_fsynced_before_the_publish(frontend):
    events = _Events()
    saver = frontend.open(faults=_recorded(events))
    saver.save(1, 1.0)
    saver.close()
    (before, held), = events.published
    synced = set(events.synced[:before])
    manifest = os.path.basename(frontend.manifest(1))
    # The manifest is written (and fsynced) by the transaction itself, last.
    missing = [p for p in held if p not in synced and os.path.basename(p) != manifest]
    assert not missing, missing
    assert len(held) > 2
    np.testing.assert_array_equal(frontend.read_both(1), values(1))


# -- damaged files ---------------------------------------------------------------------------


def _three_checkpoints(frontend) -> None:
    saver = frontend.open()
    for step in (1, 2, 3):
        saver.save(step, float(step))
    saver.close()


def _cli(*args, expect: int) -> str:
    out = subprocess.run([sys.executable, "-m", "asyncckpt", *map(str, args)],
                         capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert out.returncode == expect, out.stdout + out.stderr
    return out.stdout + out.stderr


DAMAGES = [(f, d) for f in ("tf-manager", "jax-ocdbt", "jax-zarr", "arrays")
           for d in ("flip", "truncate")] + [("jax-zarr", "flip-zlib")]


@pytest.mark.parametrize("frontend,damage", DAMAGES, indirect=["frontend"])
def test_a_damaged_file_is_named_and_the_newest_good_checkpoint_restored(
        frontend, damage, caplog, monkeypatch):
    """A flipped byte is caught under either checksum: CRC32C, or zlib's CRC32 ("-zlib").

    The zlib checkpoints are saved as where no native CRC32C is installed;
    they are restored and verified (also by the CLI) with it installed again.
    """
    if damage == "flip-zlib":
        monkeypatch.setattr(fastcrc, "available", lambda: False)  # the environment
    _three_checkpoints(frontend)
    monkeypatch.undo()
    manifest = json.loads(frontend.manifest(3).read_text())
    zlib_wanted = damage == "flip-zlib" or not fastcrc.available()
    assert all(("crc32" if zlib_wanted else "crc32c") in f for f in manifest["files"])
    path, where = frontend.data_file(3)
    if damage.startswith("flip"):
        flip_byte(path)
    else:
        os.truncate(path, os.path.getsize(path) - 7)

    saver = frontend.open()
    with pytest.raises(CorruptCheckpointError) as err:
        saver.restore(3)
    assert err.value.file == str(path)
    assert where in str(err.value)
    with caplog.at_level(logging.WARNING):
        step, got = saver.restore()
    assert step == 2
    np.testing.assert_array_equal(got, values(2))
    assert frontend.cli_name(3) in caplog.text and where in caplog.text
    saver.close()
    np.testing.assert_array_equal(frontend.read_both(2), values(2))
    if frontend.name != "arrays":  # a store checks every array it reads, always
        # Turning checksums off keeps the size check: a truncated file is still caught.
        quick = frontend.open(checksums=False)
        if damage == "truncate":
            with pytest.raises(CorruptCheckpointError, match="truncated"):
                quick.restore(3)
        else:
            assert quick.restore(3)[0] == 3  # the flipped byte goes unseen
        quick.close()

    out = _cli("verify", frontend.directory, expect=1)
    assert f"FAIL  {frontend.cli_name(3)}" in out and f"OK    {frontend.cli_name(2)}" in out
    _cli("verify", frontend.directory, 2, expect=0)


@on(retains=True)
@pytest.mark.parametrize("damage", ["edited", "missing"])
def test_a_damaged_or_missing_manifest_is_corruption_and_restore_falls_back(frontend, damage):
    _three_checkpoints(frontend)
    manifest = frontend.manifest(3)
    if damage == "edited":
        text = manifest.read_text()
        assert '"step": 3' in text
        manifest.write_text(text.replace('"step": 3', '"step": 4'))
    else:
        manifest.unlink()
    with pytest.raises(CorruptCheckpointError, match="manifest"):
        frontend.verify(3)
    saver = frontend.open()
    with pytest.raises(CorruptCheckpointError, match="manifest"):
        saver.restore(3)
    step, got = saver.restore()
    assert step == 2
    np.testing.assert_array_equal(got, values(2))
    saver.close()
    np.testing.assert_array_equal(frontend.read_both(2), values(2))


# -- the CLI on good checkpoints ----------------------------------------------------------


@on(retains=True, only=("tf-manager", "jax-ocdbt", "arrays"))
def test_cli_list_inspect_verify_and_the_manifest_of_good_checkpoints(frontend):
    _three_checkpoints(frontend)
    # What killed saves leave: never listed.
    (frontend.directory / ".asyncckpt-tmp-4-0123456789ab").mkdir()
    for name in frontend.stray:
        (frontend.directory / name).mkdir()

    listed = _cli("list", frontend.directory, expect=0)
    rows = [line.split() for line in listed.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [
        (frontend.cli_name(s), frontend.cli_framework) for s in (1, 2, 3)]
    verified = _cli("verify", frontend.directory, expect=0)
    assert "3/3 checkpoint(s) verified" in verified
    inspected = _cli("inspect", frontend.directory, 2, expect=0)
    for name in frontend.inspect_names:
        assert name in inspected
    assert "[1000]" in inspected and "4000" in inspected
    missing = _cli("verify", frontend.directory, 9, expect=2)
    assert "no checkpoint '9'" in missing

    manifest = json.loads(frontend.manifest(2).read_text())
    assert manifest["framework"] == frontend.cli_framework and manifest["step"] == 2
    assert manifest["stats"]["nbytes"] > 0 and manifest["asyncckpt_version"]
    assert set(frontend.files(2)) <= {f["name"] for f in manifest["files"]}
    algorithm = "crc32c" if fastcrc.available() else "crc32"
    assert all(f[algorithm] is not None for f in manifest["files"])
    assert layout.JAX_MANIFEST_NAME not in {f["name"] for f in manifest["files"]}


# -- one writer per directory -----------------------------------------------------------------


@on(retains=True, only=("jax-ocdbt", "arrays"))
def test_second_writer_is_refused_and_dead_writers_lock_is_taken_over(
        frontend, tmp_path, caplog):
    script = write_script(tmp_path, "holder.py", frontend.holder)
    proc = start_python(script, str(frontend.directory), stdin=True)
    try:
        LineWatcher(proc.stdout).wait_for("holding")
        saver = frontend.open()
        with pytest.raises(DirectoryLockedError) as err:
            saver.save(2, 2.0)
        assert f"pid {proc.pid}" in str(err.value) and "host" in str(err.value)
        # Restoring needs no lock.
        step, got = saver.restore()
        assert step == 1
        np.testing.assert_array_equal(got, values(1))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    with caplog.at_level(logging.WARNING):
        saver.save(2, 2.0)  # the holder is dead: its lock is taken over
    assert "Taking over" in caplog.text and str(proc.pid) in caplog.text
    saver.wait()
    assert saver.steps() == [1, 2] and frontend.framework_steps() == [1, 2]
    # A second writer in the same process shares the directory (and its listing).
    other = frontend.open()
    other.save(3, 3.0)
    other.wait()
    assert saver.steps() == other.steps() == [1, 2, 3]
    saver.close()
    other.save(4, 4.0)
    other.close()
    assert frontend.framework_steps() == [1, 2, 3, 4]
    np.testing.assert_array_equal(frontend.read_both(4), values(4))
