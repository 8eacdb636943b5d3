"""Re-saving a prefix-named checkpoint: the old one is kept until the new one is in.

A child process is SIGKILLed exactly while publishing each file of the new
checkpoint; the recovery a manager runs before its first save must find the
old checkpoint whole.
"""

from __future__ import annotations

import os
import signal
import threading

import pytest

from asyncckpt._engine import commit
from asyncckpt._engine.commit import cleanup_stale_temps, make_temp_dir, publish_files
from asyncckpt._engine.files import DurableWriter
from asyncckpt._engine.manifest import Manifest, read_manifest, verify_files
from asyncckpt._engine.writer import AsyncEngine
from tests.helpers import run_python, write_script
from tests.jobs import DirJob


def _write_checkpoint(directory, name, payload: bytes):
    """A prefix-named checkpoint: data, manifest, marker (published marker last)."""
    tmp = make_temp_dir(directory, name)
    writer = DurableWriter(tmp, fsync=True, checksums=True)
    writer.write(f"{name}.data", [payload])
    writer.write(f"{name}.index", [payload[:8]])
    records = writer.finish()
    m = Manifest(framework="test", label=name, step=None, files=tuple(records))
    with open(os.path.join(tmp, f"{name}.manifest"), "w") as f:
        f.write(m.to_json())
    return tmp, [f"{name}.data", f"{name}.manifest", f"{name}.index"]


def _verify(directory, name) -> bytes:
    m = read_manifest(os.path.join(directory, f"{name}.manifest"))
    verify_files(directory, m.files, checksums=True, checkpoint=name)
    with open(os.path.join(directory, f"{name}.data"), "rb") as f:
        return f.read()


_KILL_IN_PUBLISH = """
import os, signal, sys
sys.path.insert(0, sys.argv[2])
from tests.test_engine_publish import _write_checkpoint
from asyncckpt._engine.commit import publish_files

directory, victim = sys.argv[1], sys.argv[3]
tmp, names = _write_checkpoint(directory, "ck", b"NEW-" * 1000)
real_replace = os.replace
def replace(src, dst):
    if os.path.basename(dst) == victim:
        print("killed while publishing", victim, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    real_replace(src, dst)
os.replace = replace
publish_files(tmp, directory, names, fsync=True, replaces=names)
"""


@pytest.mark.parametrize("victim", ["ck.data", "ck.manifest", "ck.index"])
def test_resave_killed_mid_publish_keeps_the_old_checkpoint(tmp_path, victim):
    directory = str(tmp_path)
    tmp, names = _write_checkpoint(directory, "ck", b"OLD-" * 1000)
    publish_files(tmp, directory, names, fsync=True)
    script = write_script(tmp_path, "kill.py", _KILL_IN_PUBLISH)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = run_python(script, directory, root, victim, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert f"killed while publishing {victim}" in proc.stdout
    cleanup_stale_temps(directory)  # what a manager does before its first save
    assert _verify(directory, "ck") == b"OLD-" * 1000  # the old checkpoint, whole
    assert sorted(os.listdir(tmp_path)) == ["ck.data", "ck.index", "ck.manifest", "kill.py"]


def test_resave_replaces_the_old_checkpoint_and_leaves_no_backup(tmp_path):
    directory = str(tmp_path)
    tmp, names = _write_checkpoint(directory, "ck", b"OLD-" * 1000)
    publish_files(tmp, directory, names, fsync=True)
    (tmp_path / "ck.extra").write_bytes(b"old shard")  # an old file the new one lacks
    tmp, names = _write_checkpoint(directory, "ck", b"NEW-" * 10)
    publish_files(tmp, directory, names, fsync=True, replaces=[*names, "ck.extra"])
    assert _verify(directory, "ck") == b"NEW-" * 10
    assert sorted(os.listdir(tmp_path)) == ["ck.data", "ck.index", "ck.manifest"]


class _GatedDirJob(DirJob):
    """Writes its temporary directory, then waits for the test before committing."""

    def __init__(self, root, name, written, gate):
        super().__init__(root, name, [b"x"], written=written)
        self._hold = gate

    def write(self):
        super().write()
        assert self._hold.wait(60)


def test_cleanup_leaves_temporaries_this_process_is_writing(tmp_path):
    """Another manager of the directory in this process starts while a save is in flight."""
    written, gate = threading.Event(), threading.Event()
    stale = make_temp_dir(str(tmp_path), "dead")  # as if left by a killed run...
    commit.forget_temp(stale)  # ...that is, by no one in this process
    with AsyncEngine() as engine:
        handle = engine.save(lambda s: _GatedDirJob(str(tmp_path), "7", written, gate), label="7")
        assert written.wait(60)
        removed = cleanup_stale_temps(str(tmp_path))
        gate.set()
        handle.result(60)
    assert removed == [stale]
    assert (tmp_path / "7" / "data.bin").read_bytes() == b"x"
