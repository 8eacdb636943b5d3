"""Durability of the JAX path: crashes, I/O errors, corruption, locking, the CLI."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import asyncckpt.jax as aj  # noqa: E402
from asyncckpt import (  # noqa: E402
    CorruptCheckpointError,
    DirectoryLockedError,
    RestoreOptions,
)
from asyncckpt._engine import fastcrc  # noqa: E402
from asyncckpt._engine import files as files_lib  # noqa: E402
from asyncckpt._engine import transaction as transaction_lib  # noqa: E402
from asyncckpt.jax import _ocdbt  # noqa: E402
from tests.helpers import (  # noqa: E402
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


def test_sigkill_mostly_during_writes_never_loses_or_lists_a_partial_checkpoint(tmp_path):
    """A short run of benchmarks/crash_campaign.py: SIGKILLs and a full disk, JAX."""
    seed = test_seed("JAX crash campaign")
    stats = run_crash_campaign("jax", tmp_path, kills=CRASH_KILLS, io_errors=3, seed=seed)
    check_crash_campaign(stats, CRASH_KILLS, 3)


class _DiskFullWriter(files_lib.DurableWriter):
    """The real writer, except that chunk files of the array `w` hit a full disk."""

    def write(self, name, chunks):
        if "/w/" in name:
            raise OSError(errno.ENOSPC, "No space left on device", name)
        return super().write(name, chunks)


class _DiskFullDatabase(_ocdbt.DatabaseWriter):
    """The real OCDBT database writer, except that the chunks of the array `w` hit a full disk."""

    def put(self, key, data):
        if key.startswith("w/") and not key.endswith(".zarray"):
            raise OSError(errno.ENOSPC, "No space left on device", key)
        return super().put(key, data)


PLAIN = aj.FormatOptions(use_ocdbt=False)


class _FlushErrorWriter(files_lib.DurableWriter):
    """The real writer, except that making the files durable hits an I/O error."""

    def finish(self):
        super().finish()
        raise OSError(errno.EIO, "Input/output error", self.root)


@pytest.mark.parametrize("writer", [_DiskFullWriter, _DiskFullDatabase, _FlushErrorWriter])
def test_io_error_raises_on_the_next_call_and_keeps_earlier_checkpoints(
    ckpt_dir, monkeypatch, writer
):
    """A full disk in either layout (chunk files, OCDBT), a failed flush in the default one."""
    state = {"w": jnp.arange(64.0), "step": 1}
    plain = writer is _DiskFullWriter
    mgr = aj.CheckpointManager(ckpt_dir, max_to_keep=1, format_options=PLAIN if plain else None)
    mgr.save(1, state)
    mgr.wait_until_finished()
    if writer is _DiskFullDatabase:
        monkeypatch.setattr(_ocdbt, "DatabaseWriter", writer)
    else:
        monkeypatch.setattr(transaction_lib, "DurableWriter", writer)
    assert mgr.save(2, {"w": jnp.zeros(64), "step": 2})  # staging succeeds; the write fails
    assert mgr.last_save.committed.exception(60) is not None  # the failure has happened
    with pytest.raises(OSError) as err:
        mgr.save(3, {"w": jnp.zeros(64), "step": 3})  # the next call reports it
    assert err.value.errno in (errno.ENOSPC, errno.EIO)
    monkeypatch.undo()
    mgr.wait_until_finished()
    assert mgr.all_steps() == [1]
    assert sorted(os.listdir(ckpt_dir)) == [".asyncckpt.lock", "1"]  # no temporary left
    got = mgr.restore(target={"w": np.zeros(64, np.float32), "step": 0})
    np.testing.assert_array_equal(got["w"], np.arange(64.0, dtype=np.float32))
    # The manager still works; a failed step can be saved again with force.
    assert mgr.save(2, {"w": jnp.ones(64), "step": 2}, force=True)
    mgr.close()
    assert mgr.all_steps() == [2]


def test_background_error_is_raised_by_close(ckpt_dir, monkeypatch):
    mgr = aj.CheckpointManager(ckpt_dir)
    monkeypatch.setattr(_ocdbt, "DatabaseWriter", _DiskFullDatabase)
    mgr.save(1, {"w": jnp.ones(8)})
    with pytest.raises(OSError, match="No space left"):
        mgr.close()
    assert mgr.all_steps() == []


def _three_checkpoints(ckpt_dir, format_options=None) -> None:
    with aj.CheckpointManager(ckpt_dir, format_options=format_options) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": jnp.full((1000,), float(step)), "step": step},
                     custom_metadata={"total_run_calls": step * 10})


@pytest.mark.parametrize("damage,layout", [("flip", "zarr files"), ("flip-zlib", "zarr files"),
                                           ("truncate", "zarr files"), ("flip", "ocdbt"),
                                           ("truncate", "ocdbt")])
def test_corruption_is_detected_named_and_skipped(ckpt_dir, caplog, monkeypatch, damage, layout):
    """A flipped byte is caught under either checksum: CRC32C, or zlib's CRC32 ("-zlib").

    The zlib checkpoints are saved as where no native CRC32C is installed;
    they are restored and verified (also by the CLI) with it installed again.
    In the OCDBT layout the damaged file is the data file holding ``w``.
    """
    if damage == "flip-zlib":
        monkeypatch.setattr(fastcrc, "available", lambda: False)
    _three_checkpoints(ckpt_dir, PLAIN if layout == "zarr files" else None)
    monkeypatch.undo()
    manifest = json.loads((ckpt_dir / "3" / "asyncckpt.manifest.json").read_text())
    zlib_wanted = damage == "flip-zlib" or not fastcrc.available()
    assert all(("crc32" if zlib_wanted else "crc32c") in f for f in manifest["files"])
    if layout == "ocdbt":
        data = ckpt_dir / "3" / "default" / "ocdbt.process_0" / "ocdbt_data"
        (chunk,) = data.iterdir()
        where = f"3/default/ocdbt.process_0/ocdbt_data/{chunk.name}"
    else:
        chunk = ckpt_dir / "3" / "default" / "w" / "0"
        where = "3/default/w/0"
    if damage.startswith("flip"):
        flip_byte(chunk)
    else:
        os.truncate(chunk, os.path.getsize(chunk) - 7)
    target = {"w": np.zeros(1000, np.float32), "step": 0}
    mgr = aj.CheckpointManager(ckpt_dir)
    with pytest.raises(CorruptCheckpointError) as err:
        mgr.restore(3, target=target)
    assert err.value.file == str(chunk)
    assert where in str(err.value)
    with caplog.at_level(logging.WARNING):
        got = mgr.restore(target=target)
    assert got["step"] == 2
    np.testing.assert_array_equal(got["w"], np.full(1000, 2.0, np.float32))
    assert "step 3" in caplog.text and where in caplog.text
    # Turning checksums off keeps the size check: a truncated chunk is still caught.
    quick = aj.CheckpointManager(ckpt_dir, restore_options=RestoreOptions(checksums=False))
    if damage == "truncate":
        with pytest.raises(CorruptCheckpointError, match="truncated"):
            quick.restore(3, target=target)
    else:
        assert quick.restore(3, target=target)["step"] == 3  # the flipped byte goes unseen
    mgr.close()
    quick.close()

    cli = [sys.executable, "-m", "asyncckpt", "verify", str(ckpt_dir)]
    out = subprocess.run(cli, capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAIL  3" in out.stdout and "OK    2" in out.stdout
    one = subprocess.run([*cli, "2"], capture_output=True, text=True, env=subprocess_env(),
                         timeout=120)
    assert one.returncode == 0, one.stdout


def test_damaged_manifest_is_detected(ckpt_dir):
    _three_checkpoints(ckpt_dir)
    manifest = ckpt_dir / "3" / "asyncckpt.manifest.json"
    manifest.write_text(manifest.read_text().replace('"step": 3', '"step": 4'))
    mgr = aj.CheckpointManager(ckpt_dir)
    with pytest.raises(CorruptCheckpointError, match="manifest"):
        mgr.restore(3)
    assert mgr.restore()["step"] == 2
    mgr.close()


def test_cli_list_inspect_verify_on_jax_checkpoints(ckpt_dir):
    _three_checkpoints(ckpt_dir)
    (ckpt_dir / "4.orbax-checkpoint-tmp-99").mkdir()
    env = subprocess_env()

    def run(*args):
        return subprocess.run([sys.executable, "-m", "asyncckpt", *args], capture_output=True,
                              text=True, env=env, timeout=120)

    listed = run("list", str(ckpt_dir))
    assert listed.returncode == 0
    rows = [line.split() for line in listed.stdout.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [("1", "jax"), ("2", "jax"), ("3", "jax")]
    verified = run("verify", str(ckpt_dir))
    assert verified.returncode == 0 and "3/3 checkpoint(s) verified" in verified.stdout
    inspected = run("inspect", str(ckpt_dir), "2")
    assert inspected.returncode == 0, inspected.stderr
    assert "w " in inspected.stdout and "[1000]" in inspected.stdout and "4000" in inspected.stdout
    assert "total_run_calls" in inspected.stdout
    manifest = json.loads((ckpt_dir / "2" / "asyncckpt.manifest.json").read_text())
    assert manifest["framework"] == "jax" and manifest["step"] == 2
    assert manifest["stats"]["nbytes"] > 0 and manifest["asyncckpt_version"]
    names = {f["name"] for f in manifest["files"]}
    expected = {"default/manifest.ocdbt", "default/ocdbt.process_0/manifest.ocdbt",
                "default/_METADATA", "_CHECKPOINT_METADATA"}
    assert expected <= names
    algorithm = "crc32c" if fastcrc.available() else "crc32"
    assert all(f[algorithm] is not None for f in manifest["files"])


LOCK_HOLDER = """
import sys
import jax.numpy as jnp
import asyncckpt.jax as aj
mgr = aj.CheckpointManager(sys.argv[1])
mgr.save(1, {"w": jnp.ones(3)})
mgr.wait_until_finished()
print("holding", flush=True)
sys.stdin.readline()  # holds the lock until the test says so (or kills it)
"""


def test_second_writer_is_refused_and_dead_writers_lock_is_taken_over(ckpt_dir, tmp_path, caplog):
    script = write_script(tmp_path, "holder.py", LOCK_HOLDER)
    proc = start_python(script, str(ckpt_dir), stdin=True)
    try:
        LineWatcher(proc.stdout).wait_for("holding")
        mgr = aj.CheckpointManager(ckpt_dir)
        with pytest.raises(DirectoryLockedError) as err:
            mgr.save(2, {"w": jnp.zeros(3)})
        assert f"pid {proc.pid}" in str(err.value)
        assert mgr.restore(target={"w": np.zeros(3, np.float32)})["w"].sum() == 3
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    with caplog.at_level(logging.WARNING):
        assert mgr.save(2, {"w": jnp.zeros(3)})  # the holder is dead: its lock is taken over
    assert "Taking over" in caplog.text and str(proc.pid) in caplog.text
    mgr.close()
    assert mgr.all_steps() == [1, 2]
