"""Checkpoints written by an earlier version restore and verify unchanged.

``tests/data/0ce3841/`` holds small checkpoints written by commit 0ce3841,
before the one-transaction redesign (issue 34), by
``tests/data/make_checkpoints.py``: a TensorFlow manager's directory, a JAX
manager's in each layout (OCDBT and zarr files, arrays sharded over 8
devices), and the job runner's store. This code must list, verify and
restore each, with its own reader and with the framework's, and keep saving
into the same directories.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from asyncckpt import catalog
from tests.data.make_checkpoints import values

tf = pytest.importorskip("tensorflow")

import jax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402

import asyncckpt.jax as aj  # noqa: E402
import asyncckpt.tf as at  # noqa: E402
from asyncckpt.jobrunner.store import ArrayStore  # noqa: E402
from tests.tfrestore import restore_both  # noqa: E402

WRITTEN = Path(__file__).parent / "data" / "0ce3841"


@pytest.fixture
def old(tmp_path) -> Path:
    """A copy of the old checkpoints (a manager may write beside them)."""
    shutil.copytree(WRITTEN, tmp_path / "old")
    return tmp_path / "old"


def _same(got: dict, step: int) -> None:
    want = values(step)
    for name in ("w", "big"):
        arr = np.asarray(got[name])
        assert arr.dtype == want[name].dtype, name
        np.testing.assert_array_equal(arr, want[name])


@pytest.mark.parametrize("kind", ["tf", "jax-ocdbt", "jax-zarr", "arrays"])
def test_every_old_checkpoint_is_listed_and_verifies(old, kind):
    infos = catalog.list_checkpoints(str(old / kind))
    assert [i.step for i in infos] == [1, 2]
    for info in infos:
        assert catalog.verify(info).files  # sizes and checksums, as recorded then


def test_an_old_tensorflow_directory_restores_with_both_readers_and_takes_new_saves(old):
    directory = old / "tf"

    def make():
        return {"w": tf.Variable(np.zeros((3, 4), np.float32)),
                "big": tf.Variable(np.zeros(4, np.int64))}

    for step in (1, 2):
        restore_both(str(directory / f"ckpt-{step}"), make,
                     lambda o, s=step: _same({k: v.numpy() for k, v in o.items()}, s))
    objects = make()
    with at.CheckpointManager(tf.train.Checkpoint(**objects), str(directory),
                              max_to_keep=2) as mgr:
        assert mgr.restore_or_initialize().endswith("ckpt-2")
        _same({k: v.numpy() for k, v in objects.items()}, 2)
        objects["w"].assign(values(3)["w"])
        objects["big"].assign(values(3)["big"])
        mgr.save(checkpoint_number=3)
    assert [i.step for i in catalog.list_checkpoints(str(directory))] == [2, 3]
    assert tf.train.latest_checkpoint(str(directory)).endswith("ckpt-3")


@pytest.mark.parametrize("kind", ["jax-ocdbt", "jax-zarr"])
def test_an_old_jax_directory_restores_with_both_readers_and_takes_new_saves(old, kind):
    directory = old / kind
    with ocp.CheckpointManager(directory) as theirs:
        for step in (1, 2):
            _same(theirs.restore(step), step)
    with aj.CheckpointManager(directory, max_to_keep=2) as mgr:
        assert mgr.all_steps() == [1, 2]
        for step in (1, 2):
            got = mgr.restore(step)
            _same(got, step)
        assert isinstance(got["w"], jax.Array) and len(got["w"].sharding.device_set) == 8
        mgr.save(3, {k: np.asarray(v) for k, v in values(3).items()})
        mgr.wait_until_finished()
        assert mgr.all_steps() == [2, 3]
        _same(mgr.restore(3), 3)


def test_an_old_job_runner_store_restores_and_takes_new_saves(old):
    with ArrayStore(old / "arrays", max_to_keep=2) as store:
        for step in (1, 2):
            _same(store.restore(step).arrays, step)
        store.save(3, values(3))
        store.wait_until_finished()
        assert store.all_steps() == [2, 3]
        _same(store.restore().arrays, 3)
