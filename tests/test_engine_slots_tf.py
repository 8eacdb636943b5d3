"""TensorFlow's batched reader is traced off the training thread (issue 13.3)."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import asyncckpt.tf as at


def test_batched_read_is_traced_in_the_background_and_saves_the_values_at_the_call(tmp_path):
    rng = np.random.default_rng(0)
    variables = {f"v{i}": tf.Variable(rng.random((32, 64 + i)).astype(np.float32))
                 for i in range(6)}
    ckpt = at.Checkpoint(**variables)
    expected = []
    for i in range(4):
        ckpt.write(str(tmp_path / f"c{i}"))
        expected.append({k: v.numpy().copy() for k, v in variables.items()})
        if i == 0:
            plan = ckpt._asyncckpt.stager._plan
            assert plan is not None and plan.traced.wait(60)
            assert plan._batched is not None
        for v in variables.values():  # the training step after the save
            v.assign_add(tf.ones_like(v))
    ckpt.sync()
    fn = ckpt._asyncckpt.stager._plan._batched
    assert fn is plan._batched and fn.experimental_get_tracing_count() == 1
    for i, want in enumerate(expected):
        for k, value in want.items():
            got = tf.train.load_variable(str(tmp_path / f"c{i}"), f"{k}/.ATTRIBUTES/VARIABLE_VALUE")
            np.testing.assert_array_equal(got, value)
