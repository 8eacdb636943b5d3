"""``asyncckpt list|inspect|verify`` on s3:// and gs:// URLs."""

from __future__ import annotations

import numpy as np
import pytest

from asyncckpt.cli import main
from asyncckpt.storage.stores import open_store

jax = pytest.importorskip("jax")

import asyncckpt.jax as aj  # noqa: E402


def test_list_inspect_verify_urls(remote_url, capsys):
    with aj.CheckpointManager(remote_url) as mgr:
        for step in (10, 20):
            mgr.save(step, {"w": np.full((8, 4), step, np.float32), "b": np.arange(3)})
    store = open_store(remote_url)
    store.put("30/default/w/0", b"partial upload, no marker")  # must stay invisible

    assert main(["list", remote_url]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]  # below the header
    assert [row.split()[0] for row in rows] == ["10", "20"]  # names, not timestamps

    assert main(["inspect", remote_url]) == 0
    out = capsys.readouterr().out
    assert "step 20" in out and "[8, 4]" in out

    assert main(["verify", remote_url]) == 0
    assert "2/2 checkpoint(s) verified" in capsys.readouterr().out

    # The largest file of the item: OCDBT's node holding w's 128 bytes inline (or a data file).
    key = max((o for o in store.list("10/default/")), key=lambda o: o.size).key
    data = bytearray(store.get(key))
    data[-1] ^= 0xFF
    store.put(key, bytes(data))
    assert main(["verify", remote_url]) == 1
    out = capsys.readouterr().out
    assert "FAIL  10" in out and "CRC32" in out and "OK    20" in out
    assert main(["verify", remote_url, "20"]) == 0


def test_inspect_and_verify_take_one_checkpoints_own_url(remote_url, capsys):
    with aj.CheckpointManager(remote_url) as mgr:
        for step in (10, 20):
            mgr.save(step, {"w": np.full((2, step), step, np.float32)})

    assert main(["inspect", f"{remote_url}/10"]) == 0
    out = capsys.readouterr().out
    assert "step 10" in out and "[2, 10]" in out and "step 20" not in out
    assert main(["verify", f"{remote_url}/10/"]) == 0  # a trailing slash as well
    assert "OK    10" in capsys.readouterr().out

    assert main(["inspect", f"{remote_url}/30"]) == 1  # no such checkpoint: as locally
    assert "no checkpoints" in capsys.readouterr().out

    tf = pytest.importorskip("tensorflow")
    import asyncckpt.tf as at

    v = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3))
    with at.CheckpointManager(at.Checkpoint(v=v), f"{remote_url}/tf", max_to_keep=3) as mgr:
        first = mgr.save()
        v.assign_add(tf.ones_like(v))
        mgr.save()
    assert first == f"{remote_url}/tf/ckpt-1"
    assert main(["inspect", first]) == 0
    out = capsys.readouterr().out
    assert "tensorflow, step 1" in out and "[2, 3]" in out
    assert main(["verify", first]) == 0
    assert "1/1 checkpoint(s) verified" in capsys.readouterr().out


def test_unsupported_url_is_a_clear_error(capsys):
    assert main(["list", "hdfs://nn/run"]) == 2
    assert "s3://" in capsys.readouterr().err
