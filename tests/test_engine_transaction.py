"""The engine's one transaction: temp -> write -> manifest -> publish, through each destination."""

from __future__ import annotations

import os

import pytest

from asyncckpt import AsyncOptions, CorruptCheckpointError
from asyncckpt._engine import commit
from asyncckpt._engine.destinations import MarkedDirectory, PrefixFiles, RenamedDirectory, Uploaded
from asyncckpt._engine.manifest import read_manifest, verify_files
from asyncckpt._engine.transaction import Transaction

OPTS = AsyncOptions(fsync=True)


def _txn(destination, *, label="ck", manifest="manifest.json", mode=None) -> Transaction:
    return Transaction(destination, framework="test", label=label, step=7,
                       manifest_name=manifest, options=OPTS, mode=mode)


def _temps(root) -> list[str]:
    return [n for n in os.listdir(root) if commit.is_temp_name(n)]


def test_renamed_directory_commits_every_file_under_its_manifest(tmp_path):
    txn = _txn(RenamedDirectory(str(tmp_path / "7"), fsync=True))
    workdir = txn.begin()
    assert commit.is_temp_name(os.path.basename(workdir)) and not (tmp_path / "7").exists()
    txn.files.write("a/data.bin", [b"x" * 1000])
    with open(os.path.join(workdir, "foreign.json"), "w") as f:  # written by someone else
        f.write('{"k": 1}')
    txn.adopt(["foreign.json"])
    manifest = txn.commit({"nbytes": 1000}, {"why": "test"})
    assert txn.published and not _temps(tmp_path)
    assert sorted(r.name for r in manifest.files) == ["a/data.bin", "foreign.json"]
    on_disk = read_manifest(str(tmp_path / "7" / "manifest.json"))
    assert (on_disk.step, on_disk.extra, on_disk.framework) == (7, {"why": "test"}, "test")
    verify_files(str(tmp_path / "7"), on_disk.files, checksums=True, checkpoint="7")
    # The adopted file is checksummed like the others: damage to it is caught.
    (tmp_path / "7" / "foreign.json").write_text('{"k": 2}')
    with pytest.raises(CorruptCheckpointError, match=r"foreign\.json"):
        verify_files(str(tmp_path / "7"), on_disk.files, checksums=True, checkpoint="7")


def test_abort_before_the_publish_leaves_nothing(tmp_path):
    txn = _txn(RenamedDirectory(str(tmp_path / "7"), fsync=True))
    txn.begin()
    txn.files.write("data.bin", [b"x"])
    txn.abort()
    assert os.listdir(tmp_path) == []


def test_adopt_tree_records_every_file_below_an_item(tmp_path):
    txn = _txn(RenamedDirectory(str(tmp_path / "7"), fsync=True))
    workdir = txn.begin()
    os.makedirs(os.path.join(workdir, "item", "sub"))
    for name in ("item/one", "item/sub/two"):
        with open(os.path.join(workdir, name), "wb") as f:
            f.write(name.encode())
    txn.adopt_tree("item")
    manifest = txn.commit({})
    assert [r.name for r in manifest.files] == ["item/one", "item/sub/two"]


def test_marked_directory_is_committed_by_its_marker_created_last(tmp_path):
    path = str(tmp_path / "7")
    txn = _txn(MarkedDirectory(path, "commit_success.txt", replace_stale=True, fsync=True))
    assert txn.begin() == path  # written in place
    txn.files.write("data.bin", [b"x"])
    assert not os.path.exists(os.path.join(path, "commit_success.txt"))
    txn.commit({})
    assert sorted(os.listdir(path)) == ["commit_success.txt", "data.bin", "manifest.json"]
    with pytest.raises(FileExistsError):  # committed once
        commit.commit_in_place(path, "commit_success.txt", "again", fsync=False)


def test_prefix_files_publish_the_marker_last_and_replace_an_older_checkpoint(tmp_path):
    def save(data: bytes) -> None:
        txn = _txn(PrefixFiles(str(tmp_path), "ck.index", fsync=True,
                               replaces=lambda: [n for n in os.listdir(tmp_path)
                                                 if n.startswith("ck.")]),
                   manifest="ck.manifest")
        txn.begin()
        txn.files.write("ck.data", [data])
        txn.files.write("ck.index", [b"index"])
        txn.commit({})

    save(b"old")
    (tmp_path / "ck.extra").write_bytes(b"a file the new checkpoint lacks")
    save(b"new")
    assert sorted(os.listdir(tmp_path)) == ["ck.data", "ck.index", "ck.manifest"]
    assert (tmp_path / "ck.data").read_bytes() == b"new"
    manifest = read_manifest(str(tmp_path / "ck.manifest"))
    verify_files(str(tmp_path), manifest.files, checksums=True, checkpoint="ck")


def test_prefix_files_without_the_marker_is_not_published(tmp_path):
    txn = _txn(PrefixFiles(str(tmp_path), "ck.index", fsync=True), manifest="ck.manifest")
    txn.begin()
    txn.files.write("ck.data", [b"x"])
    with pytest.raises(FileNotFoundError, match=r"ck\.index"):
        txn.commit({})
    txn.abort()
    assert os.listdir(tmp_path) == []


class _FailingUpload(Exception):
    pass


def test_a_failed_upload_fails_the_commit_and_keeps_the_local_checkpoint(tmp_path):
    uploads = []

    def upload():
        uploads.append(sorted(os.listdir(tmp_path / "7")))  # published locally first
        raise _FailingUpload("bucket unreachable (injected)")

    # Written in place: an abort that removed its working directory would delete the step.
    local = MarkedDirectory(str(tmp_path / "7"), "done", replace_stale=True, fsync=True)
    txn = _txn(Uploaded(local, upload))
    txn.begin()
    txn.files.write("data.bin", [b"x"])
    with pytest.raises(_FailingUpload):
        txn.commit({})
    txn.abort()  # what the engine does after a failed commit: nothing of it is removed
    assert uploads == [["data.bin", "done", "manifest.json"]]
    assert sorted(os.listdir(tmp_path / "7")) == ["data.bin", "done", "manifest.json"]


def test_the_mode_is_given_to_every_directory_and_file(tmp_path):
    old = os.umask(0o022)
    try:
        txn = _txn(RenamedDirectory(str(tmp_path / "7"), fsync=True, mode=0o750), mode=0o750)
        workdir = txn.begin()
        txn.files.write("a/b/data.bin", [b"x"])
        os.makedirs(os.path.join(workdir, "other"))  # made by someone else, with the umask
        txn.commit({})
    finally:
        os.umask(old)
    root = tmp_path / "7"
    assert os.stat(root).st_mode & 0o777 == 0o750
    for parent, dirs, files in os.walk(root):
        for d in dirs:
            assert os.stat(os.path.join(parent, d)).st_mode & 0o777 == 0o750, d
        for f in files:
            assert os.stat(os.path.join(parent, f)).st_mode & 0o777 == 0o640, f
