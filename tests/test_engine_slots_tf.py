"""How a kept TensorFlow plan reads the variables: one traced call, or one eager op each.

A plan of many values is read by one traced ``tf.function`` call (traced at
the first save, issue 13.3); a plan of a few plain variables by one eager op
per variable, without tracing (issue 13.4). Both save the values at the call.
"""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

import asyncckpt.tf as at
from asyncckpt.tf import _snapshot
from tests.tfrestore import restore_both


def test_batched_read_is_traced_at_the_first_save_and_saves_the_values_at_the_call(tmp_path):
    rng = np.random.default_rng(0)
    variables = {f"v{i}": tf.Variable(rng.random((32, 64 + i)).astype(np.float32))
                 for i in range(_snapshot._DIRECT_MAX + 4)}
    ckpt = at.Checkpoint(**variables)
    expected = []
    for i in range(4):
        ckpt.write(str(tmp_path / f"c{i}"))
        expected.append({k: v.numpy().copy() for k, v in variables.items()})
        if i == 0:
            plan = ckpt._asyncckpt.stager._plan
            assert plan is not None and plan.traced.wait(60)
            assert plan._batched is not None and plan.variables is None
        for v in variables.values():  # the training step after the save
            v.assign_add(tf.ones_like(v))
    ckpt.sync()
    fn = ckpt._asyncckpt.stager._plan._batched
    assert fn is plan._batched and fn.experimental_get_tracing_count() == 1
    for i, want in enumerate(expected):
        for k, value in want.items():
            got = tf.train.load_variable(str(tmp_path / f"c{i}"), f"{k}/.ATTRIBUTES/VARIABLE_VALUE")
            np.testing.assert_array_equal(got, value)


def test_few_plain_variables_are_read_one_op_each_without_tracing(tmp_path):
    rng = np.random.default_rng(3)
    variables = {f"v{i}": tf.Variable(rng.random((16, 8 + i)).astype(np.float32))
                 for i in range(3)}
    variables["step"] = tf.Variable(0, dtype=tf.int64)
    ckpt = at.Checkpoint(**variables)
    expected = []
    for i in range(3):
        ckpt.write(str(tmp_path / f"c{i}"))
        expected.append({k: v.numpy().copy() for k, v in variables.items()})
        for v in variables.values():  # in place (assign_add) and by replacement (assign)
            v.assign_add(tf.ones_like(v))
        variables["v0"].assign(rng.random((16, 8)).astype(np.float32))
    plan = ckpt._asyncckpt.stager._plan
    assert plan is not None and plan.variables is not None and plan.uses == 3
    assert plan._batched is None and not plan.traced.is_set()  # never traced
    ckpt.sync()
    for i, want in enumerate(expected):
        for k, value in want.items():
            got = tf.train.load_variable(str(tmp_path / f"c{i}"), f"{k}/.ATTRIBUTES/VARIABLE_VALUE")
            np.testing.assert_array_equal(got, value)
    ckpt.close()


@pytest.mark.parametrize("direct_max", [0, _snapshot._DIRECT_MAX], ids=["traced", "direct"])
def test_structure_changes_after_the_plan_is_reused_restore_exactly(
    tmp_path, monkeypatch, direct_max
):
    """A kept plan (its readers, and the slot's views) never outlives its graph."""
    import keras

    monkeypatch.setattr(_snapshot, "_DIRECT_MAX", direct_max)

    rng = np.random.default_rng(1)
    module = tf.Module()
    module.layers = [tf.Variable(rng.random((8, 4)).astype(np.float32)) for _ in range(3)]
    module.free = tf.Variable(rng.random((4, 4)).astype(np.float32), shape=tf.TensorShape(None))
    optimizer = keras.optimizers.Adam(0.1)
    ckpt = at.Checkpoint(module=module, optimizer=optimizer)
    saved = []

    def save(name):
        ckpt.write(str(tmp_path / name))
        values = {"free": module.free.numpy().copy()}
        values.update({f"l{i}": v.numpy().copy() for i, v in enumerate(module.layers)})
        values.update({f"opt{i}": v.numpy().copy() for i, v in enumerate(optimizer.variables)})
        saved.append((name, values))

    for i in range(3):  # the plan is kept and its batched reader traced
        save(f"same{i}")
        for v in module.layers:
            v.assign_add(tf.ones_like(v))
    plan = ckpt._asyncckpt.stager._plan
    if direct_max:
        assert plan is not None and plan.variables is not None
    else:
        assert plan is not None and plan.traced.wait(60) and plan._batched is not None
    save("reused")
    module.free.assign(rng.random((6, 2)).astype(np.float32))  # a variable's shape changes
    save("reshaped")
    module.layers = list(module.layers)[:2]  # a variable removed
    save("removed")
    module.layers.append(tf.Variable(rng.random((5,)).astype(np.float32)))  # one added
    save("added")
    optimizer.build(module.layers)  # optimizer slot variables appear
    optimizer.apply([tf.ones_like(v) for v in module.layers], module.layers)
    save("slots")
    ckpt.sync()
    for name, values in saved:
        path = str(tmp_path / name)
        keys = {k for k, _ in tf.train.list_variables(path)}
        layer_keys = {k for k in keys if k.startswith("module/layers/")}
        assert len(layer_keys) == sum(1 for k in values if k.startswith("l")), name
        got = tf.train.load_variable(path, "module/free/.ATTRIBUTES/VARIABLE_VALUE")
        np.testing.assert_array_equal(got, values["free"], err_msg=name)
        for k, want in values.items():
            if k.startswith("l"):
                got = tf.train.load_variable(
                    path, f"module/layers/{k[1:]}/.ATTRIBUTES/VARIABLE_VALUE")
                np.testing.assert_array_equal(got, want, err_msg=f"{name} {k}")
    # The slot variables restore into a fresh optimizer, read by TensorFlow and by asyncckpt.
    def make():
        fresh = tf.Module()
        fresh.layers = [tf.Variable(tf.zeros_like(v)) for v in module.layers]
        fresh.free = tf.Variable(tf.zeros((1,)), shape=tf.TensorShape(None))
        fresh_opt = keras.optimizers.Adam(0.1)
        fresh_opt.build(fresh.layers)
        return {"module": fresh, "optimizer": fresh_opt}

    def check(o):
        last = saved[-1][1]
        for i, v in enumerate(o["optimizer"].variables):
            np.testing.assert_array_equal(v.numpy(), last[f"opt{i}"], err_msg=f"optimizer {i}")
        assert len(o["optimizer"].variables) > 2

    restore_both(str(tmp_path / "slots"), make, check, method="read")
    ckpt.close()
