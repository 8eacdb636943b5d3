"""Writes the small checkpoints of ``tests/test_written_before.py`` with this checkout's code.

Usage (from a checkout's root, its code first on ``sys.path``):

    PYTHONPATH=. python tests/data/make_checkpoints.py tests/data/<commit>

The checkpoints of ``tests/data/0ce3841`` were written by commit 0ce3841
(before the one-transaction redesign): later code must restore and verify
them unchanged. Only public API is used, so any version can run it.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np


def values(step: int) -> dict:
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4) + step,
            "big": np.arange(4, dtype=np.int64) + 2**40 + step}


def main(out: str) -> None:
    import jax
    import tensorflow as tf

    import asyncckpt.jax as aj
    import asyncckpt.tf as at
    from asyncckpt.jobrunner.store import ArrayStore

    os.makedirs(out, exist_ok=False)
    # TensorFlow: a manager's directory, two checkpoints.
    w = tf.Variable(np.zeros((3, 4), np.float32))
    big = tf.Variable(np.zeros(4, np.int64))
    mgr = at.CheckpointManager(tf.train.Checkpoint(w=w, big=big), os.path.join(out, "tf"),
                               max_to_keep=3)
    for step in (1, 2):
        w.assign(values(step)["w"])
        big.assign(values(step)["big"])
        mgr.save(checkpoint_number=step)
    mgr.close()
    # JAX: a manager's directory per layout, sharded over the 8 CPU devices.
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "x"))
    for name, ocdbt in (("jax-ocdbt", True), ("jax-zarr", False)):
        with aj.CheckpointManager(os.path.join(out, name),
                                  format_options=aj.FormatOptions(use_ocdbt=ocdbt)) as jm:
            for step in (1, 2):
                v = values(step)
                jm.save(step, {"w": jax.device_put(v["w"], sharding), "big": v["big"]})
            jm.wait_until_finished()
    # The job runner's store.
    with ArrayStore(os.path.join(out, "arrays"), max_to_keep=None) as store:
        for step in (1, 2):
            store.save(step, values(step))
        store.wait_until_finished()


if __name__ == "__main__":
    main(sys.argv[1])
