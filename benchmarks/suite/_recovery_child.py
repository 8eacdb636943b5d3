"""One recovery, in a fresh process: ``python -m benchmarks.suite._recovery_child CASE DIR ROWS N``.

Prints one JSON line of wall-clock marks (``time.time()``): ``imports``
(framework and checkpointing library imported), ``listed`` (state built
uninitialized, latest checkpoint found), ``restored`` (values read, checked
and placed), ``step`` (first training step after the restore finished).
The parent subtracts its own time from just before it started the process.
"""

from __future__ import annotations

import json
import sys
import time


def _tf(case: str, directory: str, rows: int, tensors: int) -> dict:
    import tensorflow as tf

    if case == "asyncckpt-tf":
        import asyncckpt.tf as at

        make = at.Checkpoint
    else:
        make = tf.train.Checkpoint
    marks = {"imports": time.time()}
    from benchmarks.suite.engines import MATRIX_COLS, rotation

    variables = {f"w{i}": tf.Variable(tf.zeros([rows, MATRIX_COLS])) for i in range(tensors)}
    ckpt = make(**variables)
    path = tf.train.latest_checkpoint(directory)
    marks["listed"] = time.time()
    ckpt.restore(path).assert_consumed()
    marks["restored"] = time.time()
    mix = tf.constant(rotation())

    @tf.function
    def step():
        for v in variables.values():
            v.assign(tf.matmul(v, mix))

    step()
    float(tf.add_n([tf.reduce_sum(v[:1]) for v in variables.values()]))  # the step has run
    marks["step"] = time.time()
    return marks


def _jax(case: str, directory: str, rows: int, tensors: int) -> dict:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    if case == "asyncckpt-jax":
        import asyncckpt.jax as aj
    else:
        import orbax.checkpoint as ocp
    marks = {"imports": time.time()}
    from benchmarks.suite.engines import MATRIX_COLS, rotation

    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("d",)), PartitionSpec("d"))
    target = {f"w{i}": jax.ShapeDtypeStruct((rows, MATRIX_COLS), np.float32, sharding=sharding)
              for i in range(tensors)}
    if case == "asyncckpt-jax":
        manager = aj.CheckpointManager(directory)
        step_no = manager.latest_step()
        marks["listed"] = time.time()
        tree = jax.block_until_ready(manager.restore(step_no, target=target))
    else:
        manager = ocp.CheckpointManager(directory)
        step_no = manager.latest_step()
        marks["listed"] = time.time()
        tree = jax.block_until_ready(
            manager.restore(step_no, args=ocp.args.StandardRestore(target)))
    marks["restored"] = time.time()
    mix = jax.numpy.asarray(rotation())
    update = jax.jit(lambda t: {k: v @ mix for k, v in t.items()}, donate_argnums=0)
    jax.block_until_ready(update(tree))
    marks["step"] = time.time()
    manager.close()
    return marks


def _raw(path: str) -> dict:
    import os

    import numpy as np

    marks = {"imports": time.time()}
    size = os.path.getsize(path)
    buf = np.empty(size, dtype=np.uint8)
    marks["listed"] = time.time()
    with open(path, "rb", buffering=0) as f:
        view = memoryview(buf)
        got = 0
        while got < size and (n := f.readinto(view[got:])):
            got += n
    marks["restored"] = marks["step"] = time.time()
    return marks


def main(argv: list[str]) -> None:
    case, directory, rows, tensors = argv[0], argv[1], int(argv[2]), int(argv[3])
    if case == "raw":
        marks = _raw(directory)
    elif case in ("asyncckpt-tf", "tf"):
        marks = _tf(case, directory, rows, tensors)
    else:
        marks = _jax(case, directory, rows, tensors)
    print(json.dumps(marks), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
