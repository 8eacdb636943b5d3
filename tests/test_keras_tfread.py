"""The Keras backup's batched read of TensorFlow variables (the TF front end's traced plan)."""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from asyncckpt.keras._tfread import BatchedReader  # noqa: E402


def _address(t) -> int:
    return t._numpy().ctypes.data


def test_batched_read_is_current_aliases_the_buffers_and_follows_the_variable_list():
    rng = np.random.default_rng(0)
    variables = [tf.Variable(rng.standard_normal(s).astype(np.float32))
                 for s in [(64, 32), (32,), (32, 8), (8,)]]
    variables.append(tf.Variable(3, dtype=tf.int64))
    reader = BatchedReader()
    first = reader.read(variables)  # eager reads; the batched one is traced meanwhile
    for v, got in zip(variables, first, strict=True):
        np.testing.assert_array_equal(got.numpy(), v.numpy())
    plan = reader._plan
    assert plan is not None and plan.traced.wait(60)
    assert plan._batched is not None and not plan._batched_failed
    for i, v in enumerate(variables):
        v.assign(v + tf.cast(i + 1, v.dtype))
    got = reader.read(variables)  # now one call of the traced read
    assert reader._concrete is not None and not plan._batched_failed
    for v, value in zip(variables, got, strict=True):
        np.testing.assert_array_equal(value.numpy(), v.numpy())  # current, not stale
        if v.shape.rank:
            assert _address(value) == _address(v.value())  # a view of the variable: no copy
    # Another list (a variable more, another order): a new plan, values in the new order.
    extra = tf.Variable(np.ones((4, 4), np.float32))
    changed = [extra, *reversed(variables)]
    got = reader.read(changed)
    assert reader._plan is not plan
    for v, value in zip(changed, got, strict=True):
        np.testing.assert_array_equal(value.numpy(), v.numpy())
    # A variable listed twice cannot be one checkpoint entry per name: read one by one.
    got = reader.read([extra, extra])
    assert reader._plan is None
    np.testing.assert_array_equal(got[1].numpy(), extra.numpy())
