"""Damaged and hostile TensorFlow checkpoints: nothing read outside, nothing sized on trust.

Three checkpoints (``ckpt-1..3``, every value the checkpoint's number) are
written by ``asyncckpt.tf.CheckpointManager``; the newest is then damaged
or crafted, its manifest written again where the test says the checksums
are recomputed (``tests/hostile.py``). Each test checks the exact outcome:
the checkpoint restored (by asyncckpt's manager and by
``tf.train.Checkpoint``'s own reader) or the error and the file it names;
and that nothing outside the checkpoint directory was opened (``Outside``).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import asyncckpt.tf as at
from asyncckpt import cli
from asyncckpt._engine import fastcrc
from asyncckpt._engine.varint import varint
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.tf import _bundle, _sstable
from tests.helpers import subprocess_env
from tests.hostile import Outside, no_hang, replace_with, rewrite_manifest

SHAPE = [4, 4]


def _manager(directory, v):
    return at.CheckpointManager(tf.train.Checkpoint(v=v), str(directory), max_to_keep=5)


@pytest.fixture
def tf_dir(tmp_path):
    """``ckpts/ckpt-{1,2,3}``, each holding ``v`` filled with its number."""
    d = tmp_path / "ckpts"
    v = tf.Variable(tf.zeros(SHAPE))
    with _manager(d, v) as m:
        for i in (1, 2, 3):
            v.assign(tf.fill(SHAPE, float(i)))
            m.save()
    return d


@pytest.fixture
def outside(tmp_path):
    o = Outside(tmp_path / "outside")
    yield o
    o.disarm()


def restore_newest(directory) -> tuple[str | None, np.ndarray, list[str]]:
    """asyncckpt's manager: ``restore_or_initialize`` into zeros; the path, values, listing.

    As a new process would: the directory's view (kept weakly while a manager
    of it lives) is gone, so the manager reads the directory.
    """
    gc.collect()
    v = tf.Variable(tf.zeros(SHAPE))
    with no_hang(), _manager(directory, v) as m:
        path = m.restore_or_initialize()
        listed = [os.path.basename(p) for p in m.checkpoints]
    return path, v.numpy(), listed


def tf_reads(path) -> np.ndarray:
    """TensorFlow's own reader (``tf.train.Checkpoint.restore``) of ``path``."""
    v = tf.Variable(tf.zeros(SHAPE))
    tf.train.Checkpoint(v=v).restore(str(path)).assert_existing_objects_matched()
    return v.numpy()


def assert_restores(directory, number: int) -> None:
    """The newest checkpoint that verifies is ``ckpt-<number>``, for asyncckpt and TensorFlow."""
    path, values, _ = restore_newest(directory)
    assert path == str(directory / f"ckpt-{number}")
    np.testing.assert_array_equal(values, np.full(SHAPE, float(number)))
    np.testing.assert_array_equal(tf_reads(path), np.full(SHAPE, float(number)))


def run_cli(capsys, *argv) -> tuple[int, str]:
    with no_hang():
        rc = cli.main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out + out.err


def manifest_of(directory, number: int):
    return directory / f"ckpt-{number}.asyncckpt-manifest.json"


# -- 1. containment ----------------------------------------------------------------


@pytest.mark.parametrize("form", ["relative", "absolute"])
def test_a_manifest_entry_outside_is_never_opened(tf_dir, outside, capsys, form):
    planted = outside.write("evil", b"planted bytes")
    name = "../outside/evil" if form == "relative" else str(planted)
    rewrite_manifest(manifest_of(tf_dir, 3), tf_dir, add=(name,))
    outside.arm()

    assert_restores(tf_dir, 2)
    with pytest.raises(CorruptCheckpointError) as e:
        at.verify_checkpoint(str(tf_dir / "ckpt-3"))
    assert e.value.file == str(manifest_of(tf_dir, 3))
    with pytest.raises(CorruptCheckpointError) as e:
        at.Checkpoint(v=tf.Variable(tf.zeros(SHAPE))).restore(str(tf_dir / "ckpt-3"))
    assert e.value.file == str(manifest_of(tf_dir, 3))
    rc, out = run_cli(capsys, "verify", tf_dir)
    assert rc == 1 and f"FAIL  ckpt-3: manifest {str(manifest_of(tf_dir, 3))!r}" in out
    assert "2/3 checkpoint(s) verified" in out
    rc, out = run_cli(capsys, "list", tf_dir)
    assert rc == 0 and "manifest damaged" in out
    rc, out = run_cli(capsys, "inspect", tf_dir, "3")
    assert rc == 2 and str(manifest_of(tf_dir, 3)) in out
    outside.assert_untouched()


@pytest.mark.parametrize("form", ["relative", "absolute"])
def test_a_state_file_naming_a_checkpoint_outside_is_rebuilt_not_followed(
        tf_dir, outside, capsys, caplog, form):
    elsewhere = tf.train.Checkpoint(v=tf.Variable(tf.fill(SHAPE, 9.0)))
    planted = elsewhere.write(str(outside.dir / "ckpt-9"))  # a whole TensorFlow checkpoint
    named = "../outside/ckpt-9" if form == "relative" else planted
    (tf_dir / "checkpoint").write_text(
        f'model_checkpoint_path: "{named}"\nall_model_checkpoint_paths: "{named}"\n')
    outside.arm()

    with caplog.at_level(logging.WARNING, logger="asyncckpt.tf._statefile"):
        path, values, listed = restore_newest(tf_dir)
    assert path == str(tf_dir / "ckpt-3")
    np.testing.assert_array_equal(values, np.full(SHAPE, 3.0))
    assert listed == ["ckpt-1", "ckpt-2", "ckpt-3"]  # rebuilt from the manifests
    assert f"checkpoint state file {tf_dir / 'checkpoint'} is damaged" in caplog.text
    assert at.latest_checkpoint(str(tf_dir)) == str(tf_dir / "ckpt-3")
    np.testing.assert_array_equal(tf_reads(path), np.full(SHAPE, 3.0))
    rc, out = run_cli(capsys, "verify", tf_dir)
    assert rc == 1
    assert f"FAIL  checkpoint: the state file {str(tf_dir / 'checkpoint')!r} names" in out
    assert "(not followed)" in out and "3/3 checkpoint(s) verified" in out
    outside.assert_untouched()


def test_a_symlinked_data_file_whose_contents_verify_still_restores(tf_dir, tmp_path):
    data = tf_dir / "ckpt-3.data-00000-of-00001"
    kept = tmp_path / "elsewhere" / data.name
    kept.parent.mkdir()
    os.replace(data, kept)
    os.symlink(kept, data)
    assert_restores(tf_dir, 3)
    assert at.verify_checkpoint(str(tf_dir / "ckpt-3")) is True


def test_a_data_file_the_manifest_does_not_list_is_an_integrity_error(tf_dir, capsys):
    # The index says the bundle has 2 data files; the second one is there, unlisted.
    edit_index(tf_dir / "ckpt-3", header=lambda h: setattr(h, "num_shards", 2),
               entry=lambda key, e: None)
    for old, new in (("00000-of-00001", "00000-of-00002"),):
        os.replace(tf_dir / f"ckpt-3.data-{old}", tf_dir / f"ckpt-3.data-{new}")
    (tf_dir / "ckpt-3.data-00001-of-00002").write_bytes(b"\0" * 64)
    rewrite_manifest(manifest_of(tf_dir, 3), tf_dir,
                     names=["ckpt-3.data-00000-of-00002", "ckpt-3.index"])
    unlisted = str(tf_dir / "ckpt-3.data-00001-of-00002")

    assert_restores(tf_dir, 2)
    with pytest.raises(CorruptCheckpointError) as e:
        at.Checkpoint(v=tf.Variable(tf.zeros(SHAPE))).restore(str(tf_dir / "ckpt-3"))
    assert e.value.file == unlisted


# -- 2. validate before allocating or calling into TensorFlow -----------------------


def _trailed(block: bytes, kind: int) -> bytes:
    crc = fastcrc.crc32c_extend(fastcrc.crc32c_extend(0, block), bytes([kind]))
    return block + bytes([kind]) + fastcrc.mask(crc).to_bytes(4, "little")


def snappy_table(raw: bytes) -> bytes:
    """The same one-data-block table with that block Snappy-compressed (TensorFlow reads it).

    Literals only (valid Snappy); a new index block maps a key past every
    key to it. The entries are then out of reach of a reader of
    uncompressed blocks only.
    """
    footer = raw[-48:]
    meta_offset, pos = _bundle.read_varint(footer, 0)
    meta_size, _ = _bundle.read_varint(footer, pos)
    data = raw[:meta_offset - 5]  # the one data block, then its trailer
    packed = bytearray(varint(len(data)))
    for i in range(0, len(data), 60):
        packed += bytes([(len(data[i:i + 60]) - 1) << 2]) + data[i:i + 60]
    out = _trailed(bytes(packed), 1)
    meta_at = len(out)
    out += raw[meta_offset:meta_offset + meta_size + 5]
    handle = varint(0) + varint(len(packed))
    index = bytes([0, 1, len(handle)]) + b"\xff" + handle + (0).to_bytes(4, "little") + (
        1).to_bytes(4, "little")
    index_at = len(out)
    out += _trailed(index, 0)
    handles = (varint(meta_at) + varint(meta_size)
               + varint(index_at) + varint(len(index)))
    return out + handles.ljust(40, b"\x00") + footer[-8:]


def edit_index(prefix, *, entry, header=None, snappy: bool = False) -> None:
    """Rewrites ``prefix.index`` with ``entry(key, proto)`` applied to each tensor's entry
    (and ``header`` to the header; ``snappy``: its data block compressed), then its
    manifest (checksums recomputed)."""
    head, stored = _bundle.stored_entries((prefix.parent / (prefix.name + ".index")).read_bytes())
    if header is not None:
        header(head)
    items = [(b"", head.SerializeToString())]
    for key, proto in stored:
        entry(key, proto)
        items.append((key, proto.SerializeToString()))
    table = _sstable.build_table(sorted(items))
    (prefix.parent / (prefix.name + ".index")).write_bytes(
        snappy_table(table) if snappy else table)
    manifest = prefix.parent / (prefix.name + ".asyncckpt-manifest.json")
    if manifest.exists():
        rewrite_manifest(manifest, prefix.parent)


def _shape(dims):
    def edit(key, e):
        if key.startswith(b"v/"):
            del e.shape.dim[:]
            for d in dims:
                e.shape.dim.add().size = d
    return edit


def _offset(key, e):
    if key.startswith(b"v/"):
        e.offset = 1 << 20


INDEX_EDITS = {  # name: (edit, in a Snappy block, words of the error)
    "negative dimension": (_shape([-4, -4]), False, "with the shape (-4, -4)"),
    "4 TiB shape": (_shape([1 << 40]), False,
                    "of shape [1099511627776] (which needs 4398046511104)"),
    "bytes past the data file": (_offset, False, "at bytes 1048576..1048640 of a data file of"),
    "negative dimension, Snappy": (_shape([-4, -4]), True, "with the shape (-4, -4)"),
}

# Restores each crafted checkpoint in a child process: without the checks, TensorFlow's
# reader aborts it (SIGABRT) on a negative dimension, which must not take pytest with it.
_CHILD = textwrap.dedent("""
    import json, resource, sys
    import numpy as np, tensorflow as tf
    import asyncckpt.tf as at
    from asyncckpt import catalog
    from asyncckpt.errors import CorruptCheckpointError

    out = {}
    for d, prefix in json.loads(sys.argv[1]):
        v = tf.Variable(tf.zeros([4, 4]))
        got = {}
        if d is not None:
            with at.CheckpointManager(tf.train.Checkpoint(v=v), d, max_to_keep=5) as m:
                got["restored"] = m.restore_or_initialize()
            got["values"] = v.numpy().tolist()
        for what, call in (
                ("restore", lambda: at.Checkpoint(v=v).restore(prefix)),
                ("inspect", lambda: catalog.describe_arrays(catalog.checkpoint_at(prefix)))):
            try:
                call()
                got[what] = None
            except CorruptCheckpointError as e:
                got[what] = [type(e).__name__, e.file, str(e)]
        out[prefix] = got
    out["maxrss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(out))
""")


def test_an_index_describing_the_impossible_is_refused_before_anything_is_sized(tmp_path):
    cases = []
    for n, (edit, snappy, _) in enumerate(INDEX_EDITS.values()):
        d = tmp_path / f"case{n}"
        v = tf.Variable(tf.zeros(SHAPE))
        with _manager(d, v) as m:
            for i in (1, 2, 3):
                v.assign(tf.fill(SHAPE, float(i)))
                m.save()
        edit_index(d / "ckpt-3", entry=edit, snappy=snappy)
        cases.append((str(d), str(d / "ckpt-3")))
    # A checkpoint TensorFlow wrote (no manifest) goes to TensorFlow's reader: checked first.
    plain = tmp_path / "plain" / "ckpt"
    tf.train.Checkpoint(v=tf.Variable(tf.ones(SHAPE))).write(str(plain))
    edit_index(plain, entry=_shape([-4, 4]))
    cases.append((None, str(plain)))

    child = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(cases)],
                           capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]  # (-6: SIGABRT)
    got = json.loads(child.stdout.strip().splitlines()[-1])
    for (d, prefix), (name, (*_, words)) in zip(cases, INDEX_EDITS.items(), strict=False):
        one = got[prefix]
        assert one["restored"] == os.path.join(d, "ckpt-2"), name
        assert one["values"] == np.full(SHAPE, 2.0).tolist(), name
        for what in ("restore", "inspect"):
            cls, file, text = one[what]
            assert (cls, file) == ("CorruptCheckpointError", prefix + ".index"), (name, what)
            assert words in text, (name, what, text)
        np.testing.assert_array_equal(tf_reads(one["restored"]), np.full(SHAPE, 2.0))
    cls, file, text = got[str(plain)]["restore"]
    assert (cls, file) == ("CorruptCheckpointError", str(plain) + ".index")
    assert "with the shape (-4, 4)" in text
    assert got["maxrss_mib"] < 4096  # nothing sized from the 4 TiB shape


# -- 3. structural damage falls back ---------------------------------------------------


@pytest.mark.parametrize("kind", ["directory", "fifo"])
@pytest.mark.parametrize("which", ["asyncckpt-manifest.json", "data-00000-of-00001"])
def test_a_directory_or_fifo_where_a_file_should_be_falls_back(tf_dir, capsys, which, kind):
    path = tf_dir / f"ckpt-3.{which}"
    replace_with(path, kind)
    assert_restores(tf_dir, 2)
    with no_hang(), pytest.raises(CorruptCheckpointError) as e:
        at.verify_checkpoint(str(tf_dir / "ckpt-3"))
    assert e.value.file == str(path)
    rc, out = run_cli(capsys, "verify", tf_dir)
    assert rc == 1 and str(path) in out and "FAIL  ckpt-3" in out


@pytest.mark.parametrize("damage", ["missing", "directory", "fifo"])
def test_an_index_missing_or_replaced_falls_back_and_fails_verify(tf_dir, capsys, damage):
    index = tf_dir / "ckpt-3.index"
    if damage == "missing":
        os.remove(index)
    else:
        replace_with(index, damage)
    assert_restores(tf_dir, 2)
    rc, out = run_cli(capsys, "verify", tf_dir)
    assert rc == 1
    assert f"FAIL  checkpoint: the state file {str(tf_dir / 'checkpoint')!r} names " in out
    assert str(index) in out and "1 problem(s) with the state file" in out


def _flip_colon(path):
    data = bytearray(path.read_bytes())
    data[data.index(b":")] ^= 0x20  # ':' becomes a control character
    path.write_bytes(bytes(data))


STATE_DAMAGE = {
    "bit flip": _flip_colon,
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:30]),
    "garbage": lambda p: p.write_bytes(b"\x13\x37 not a checkpoint state {{{"),
    "not UTF-8": lambda p: p.write_bytes(b"model_checkpoint_path: \"ckpt-\xff\"\n"),
    "directory": lambda p: replace_with(p, "directory"),
    "fifo": lambda p: replace_with(p, "fifo"),
}


@pytest.mark.parametrize("damage", list(STATE_DAMAGE))
def test_a_damaged_state_file_is_rebuilt_from_the_committed_checkpoints(
        tf_dir, capsys, caplog, damage):
    STATE_DAMAGE[damage](tf_dir / "checkpoint")
    with caplog.at_level(logging.WARNING, logger="asyncckpt.tf._statefile"):
        path, values, listed = restore_newest(tf_dir)
    assert path == str(tf_dir / "ckpt-3")
    np.testing.assert_array_equal(values, np.full(SHAPE, 3.0))
    assert listed == ["ckpt-1", "ckpt-2", "ckpt-3"]
    assert "rebuilt from the 3 committed checkpoint(s)" in caplog.text
    with no_hang():
        assert at.latest_checkpoint(str(tf_dir)) == str(tf_dir / "ckpt-3")
    np.testing.assert_array_equal(tf_reads(path), np.full(SHAPE, 3.0))
    rc, out = run_cli(capsys, "verify", tf_dir)
    assert rc == 1 and "3/3 checkpoint(s) verified" in out
    assert f"FAIL  checkpoint: the state file {str(tf_dir / 'checkpoint')!r}" in out or (
        f"{str(tf_dir / 'checkpoint')!r} is a" in out)


def test_the_next_save_writes_a_whole_state_file_again(tf_dir):
    STATE_DAMAGE["garbage"](tf_dir / "checkpoint")
    v = tf.Variable(tf.zeros(SHAPE))
    with _manager(tf_dir, v) as m:
        m.restore_or_initialize()
        v.assign(tf.fill(SHAPE, 4.0))
        m.save()
    assert tf.train.latest_checkpoint(str(tf_dir)) == str(tf_dir / "ckpt-4")
    state = tf.train.get_checkpoint_state(str(tf_dir))
    assert [os.path.basename(p) for p in state.all_model_checkpoint_paths] == [
        "ckpt-1", "ckpt-2", "ckpt-3", "ckpt-4"]
