"""JAX manager on s3:// and gs:// directories, and with a local + remote tier."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import jax.numpy as jnp  # noqa: E402

import asyncckpt.jax as aj  # noqa: E402
from asyncckpt.storage import StorageError, UnsupportedURLError  # noqa: E402
from asyncckpt.storage.protocol import ORBAX_COMMIT_NAME, list_committed  # noqa: E402
from asyncckpt.storage.stores import open_store  # noqa: E402
from asyncckpt.storage.tier import RemoteOptions  # noqa: E402


def _state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {"w": jnp.asarray(rng.standard_normal((64, 32), dtype=np.float32)),
            "b": rng.integers(0, 100, 17).astype(np.int64), "step": step}


def _same(a: dict, b: dict) -> bool:
    return (np.array_equal(np.asarray(a["w"]), np.asarray(b["w"]))
            and np.array_equal(np.asarray(a["b"]), np.asarray(b["b"])) and a["step"] == b["step"])


def test_url_directory_round_trip(remote_url):
    with aj.CheckpointManager(remote_url, max_to_keep=2) as mgr:
        for step in (1, 2, 3):
            assert mgr.save(step, _state(step), custom_metadata={"step": step})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 3]
    store = open_store(remote_url)
    assert [c.name for c in list_committed(store)] == ["2", "3"]
    keys = {o.key for o in store.list()}
    assert f"3/{ORBAX_COMMIT_NAME}" in keys and not any(k.startswith("1/") for k in keys)
    # A new manager (fresh scratch directory) finds and restores the remote steps.
    with aj.CheckpointManager(remote_url, max_to_keep=2) as mgr:
        assert mgr.all_steps() == [2, 3]
        assert mgr.metadata(2).custom_metadata == {"step": 2}  # only the remote has it
        assert _same(mgr.restore(target=_state(0)), _state(3))
        assert _same(mgr.restore(2, target=_state(0)), _state(2))
        # The restores fetched steps 2 and 3 into a private cache, not the scratch
        # directory: a committed step saved again is refused by its commit marker.
        assert mgr.save(3, _state(3), force=True)
        with pytest.raises(StorageError, match="already committed"):
            mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 3]


@pytest.mark.parametrize("bad", ["hdfs://nn/run", "gs:/bucket/run", "foo://x"])
def test_unsupported_directory_fails_at_construction(bad, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedURLError, match="gs://"):
        aj.CheckpointManager(bad)
    assert os.listdir(tmp_path) == []  # no local folder named after the URL


def test_two_tiers_upload_every_n_and_restore_from_remote(remote_url, tmp_path):
    local = str(tmp_path / "local")
    opts = RemoteOptions(every_n_steps=2, max_to_keep=2)
    with aj.CheckpointManager(local, max_to_keep=1, remote=remote_url,
                              remote_options=opts) as mgr:
        for step in range(1, 8):
            assert mgr.save(step, _state(step))
            mgr.wait_until_finished()
        assert sorted(os.listdir(local)) == [".asyncckpt.lock", "7"]
        assert mgr.all_steps() == [4, 6, 7]
    assert [c.name for c in list_committed(open_store(remote_url))] == ["4", "6"]
    shutil.rmtree(local)  # the VM and its disk are gone
    with aj.CheckpointManager(str(tmp_path / "new"), remote=remote_url,
                              remote_options=opts) as mgr:
        assert mgr.latest_step() == 6
        assert _same(mgr.restore(target=_state(0)), _state(6))


def test_prefixed_fixed_length_step_names_on_a_url_directory_and_a_remote_tier(remote_url,
                                                                                tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    options = ocp.CheckpointManagerOptions(step_prefix="ckpt", step_format_fixed_length=6,
                                           max_to_keep=2)
    with aj.CheckpointManager(remote_url, options=options) as mgr:
        for step in (1, 2, 3):
            assert mgr.save(step, _state(step))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 3]
    store = open_store(remote_url)
    committed = list_committed(store)
    assert [(c.name, c.step) for c in committed] == [("ckpt_000002", 2), ("ckpt_000003", 3)]
    assert f"ckpt_000003/{ORBAX_COMMIT_NAME}" in {o.key for o in store.list()}
    # A fresh scratch directory lists, restores and keeps retaining the remote steps.
    with aj.CheckpointManager(remote_url, options=options) as mgr:
        assert mgr.all_steps() == [2, 3]
        assert _same(mgr.restore(target=_state(0)), _state(3))
        assert _same(mgr.restore(2, target=_state(0)), _state(2))
        assert mgr.save(4, _state(4))
        mgr.wait_until_finished()
        assert mgr.all_steps() == [3, 4]
    assert [c.name for c in list_committed(store)] == ["ckpt_000003", "ckpt_000004"]
    # Two tiers with the same names: the local copy gone, the step comes from the remote.
    local = tmp_path / "local"
    with aj.CheckpointManager(local, options=options, remote=remote_url) as mgr:
        assert mgr.save(5, _state(5))
        mgr.wait_until_finished()
        assert sorted(os.listdir(local))[-1] == "ckpt_000005"
    shutil.rmtree(local)
    with aj.CheckpointManager(tmp_path / "new", options=options, remote=remote_url) as mgr:
        assert mgr.all_steps() == [4, 5]
        assert _same(mgr.restore(target=_state(0)), _state(5))
