"""A TensorFlow restore reads only the tensors it restores, each verified before it is assigned.

Bytes read are counted by wrapping the real ``_engine.reads.read_all``;
TensorFlow's own reads of tensors by wrapping the ``RestoreV2`` it would
call. The checkpoint: a model (two variables) and its Adam state (two slot
variables per model variable, plus the optimizer's own variables).
"""

from __future__ import annotations

import numpy as np
import pytest

from asyncckpt._engine import fastcrc, reads
from tests.helpers import flip_byte, test_seed

tf = pytest.importorskip("tensorflow")

import asyncckpt.tf as at  # noqa: E402
from asyncckpt import CorruptCheckpointError  # noqa: E402
from asyncckpt.tf import _bundle, _bundleread, _restore  # noqa: E402

pytestmark = pytest.mark.skipif(not fastcrc.available(),
                                reason="partial reads need the hardware CRC32C")

OBJECT_GRAPH = "_CHECKPOINTABLE_OBJECT_GRAPH"


class Counted:
    """Counts what the real reads read and what TensorFlow's own ``RestoreV2`` was asked."""

    def __init__(self):
        self.bytes = 0
        self.tf_keys: list[str] = []

    def reset(self):
        self.bytes = 0
        self.tf_keys.clear()


@pytest.fixture
def counted(monkeypatch):
    """A ``Counted`` over the real ``reads.read_all`` and the ``RestoreV2`` the hook calls."""
    c = Counted()
    real_read = reads.read_all

    def read_all(file_reads, **kwargs):
        c.bytes += sum(len(p.view) for r in file_reads for p in r.pieces)
        return real_read(file_reads, **kwargs)

    monkeypatch.setattr(reads, "read_all", read_all)
    _restore._hook(+1)  # installed throughout: TensorFlow's RestoreV2 is the one it keeps
    real_restore = _restore._original_restore_v2

    def restore_v2(prefix, names, slices, dtypes, name=None):
        c.tf_keys += [n if isinstance(n, str) else n.decode() for n in names]
        return real_restore(prefix, names, slices, dtypes, name=name)

    _restore._original_restore_v2 = restore_v2
    try:
        yield c
    finally:
        _restore._original_restore_v2 = real_restore
        _restore._hook(-1)


def _model(seed_name="tf partial"):
    rng = np.random.default_rng(test_seed(seed_name))
    model = tf.Module()
    model.kernel = tf.Variable(rng.standard_normal((64, 32)).astype(np.float32))
    model.bias = tf.Variable(rng.standard_normal(32).astype(np.float32))
    return model


def _zeros_like(model):
    fresh = tf.Module()
    fresh.kernel = tf.Variable(tf.zeros_like(model.kernel))
    fresh.bias = tf.Variable(tf.zeros_like(model.bias))
    return fresh


@pytest.fixture
def saved(ckpt_dir):
    """A model + Adam checkpoint: (path, model, optimizer, index)."""
    model = _model()
    opt = tf.compat.v1.train.AdamOptimizer(0.1)
    for _ in range(2):
        opt.minimize(lambda: tf.reduce_sum(model.kernel ** 2) + tf.reduce_sum(model.bias),
                     var_list=[model.kernel, model.bias])
    with at.Checkpoint(model=model, optimizer=opt) as ckpt:
        path = ckpt.save(str(ckpt_dir / "ckpt"))
        ckpt.sync()
    with open(path + ".index", "rb") as f:
        index = _bundle.parse_index(f.read())
    return path, model, opt, index


def _size(index, *keys):
    return sum(index.entries[k].size for k in keys)


def _keys(index, *starts):
    return [k for k in index.entries if k.startswith(starts)]


def _model_keys(index):  # the model's own values (its slot variables' keys start alike)
    return [k for k in _keys(index, "model/") if ".OPTIMIZER_SLOT" not in k]


def _data(path, index):
    return _bundle.data_file(path, 0, index.num_shards)


def test_model_only_restore_reads_only_the_models_bytes(saved, counted):
    path, model, opt, index = saved
    model_keys = _model_keys(index)
    assert len(model_keys) == 2 and len(index.entries) > 6  # slots, Adam's powers, counter
    needed = _size(index, *model_keys, OBJECT_GRAPH, "save_counter/.ATTRIBUTES/VARIABLE_VALUE")
    assert needed * 2 < _size(index, *index.entries)  # the optimizer's state is most of it

    fresh = _zeros_like(model)
    at.Checkpoint(model=fresh).restore(path).expect_partial()
    np.testing.assert_array_equal(fresh.kernel.numpy(), model.kernel.numpy())
    np.testing.assert_array_equal(fresh.bias.numpy(), model.bias.numpy())
    assert counted.bytes == needed
    assert [k for k in counted.tf_keys if k != OBJECT_GRAPH] == []  # TensorFlow read none

    counted.reset()  # restore_partial(only=...): the same reads
    fresh = _zeros_like(model)
    report = at.Checkpoint(model=fresh, optimizer=tf.compat.v1.train.AdamOptimizer(0.1)
                           ).restore_partial(path, only=["model"])
    assert set(report.skipped_objects) and "model/kernel" in report.restored
    np.testing.assert_array_equal(fresh.kernel.numpy(), model.kernel.numpy())
    assert counted.bytes == needed and counted.tf_keys == []

    counted.reset()  # a full restore still reads every byte, checked as before
    fresh = _zeros_like(model)
    opt2 = tf.compat.v1.train.AdamOptimizer(0.1)
    opt2.minimize(lambda: tf.reduce_sum(fresh.kernel) + tf.reduce_sum(fresh.bias),
                  var_list=[fresh.kernel, fresh.bias])
    at.Checkpoint(model=fresh, optimizer=opt2).restore(path).assert_consumed()
    for name in ("m", "v"):
        np.testing.assert_array_equal(opt2.get_slot(fresh.kernel, name).numpy(),
                                      opt.get_slot(model.kernel, name).numpy())
    assert counted.bytes >= _size(index, *index.entries) and counted.tf_keys == []


def test_a_flipped_byte_fails_only_a_restore_that_uses_it(saved):
    path, model, _, index = saved
    data = _data(path, index)
    kernel = index.entries["model/kernel/.ATTRIBUTES/VARIABLE_VALUE"]
    flip_byte(data, kernel.offset + kernel.size - 1, mask=0x01)
    fresh = _zeros_like(model)
    with pytest.raises(CorruptCheckpointError) as err:
        at.Checkpoint(model=fresh).restore(path)
    assert err.value.file == data and "CRC32C" in str(err.value)
    assert not fresh.kernel.numpy().any() and not fresh.bias.numpy().any()  # nothing assigned
    flip_byte(data, kernel.offset + kernel.size - 1, mask=0x01)

    # A byte of the optimizer's state: not read, so not noticed (as TensorFlow's own
    # restore, which checks only the tensors it reads); a full restore refuses it.
    slot = index.entries[_keys(index, "model/kernel/.OPTIMIZER_SLOT/")[0]]
    flip_byte(data, slot.offset + 3, mask=0x01)
    at.Checkpoint(model=fresh).restore(path).expect_partial()
    np.testing.assert_array_equal(fresh.kernel.numpy(), model.kernel.numpy())
    with pytest.raises(CorruptCheckpointError):
        at.Checkpoint(model=_zeros_like(model), optimizer=tf.compat.v1.train.AdamOptimizer(0.1)
                      ).restore(path)


def test_deferred_restorations_are_read_by_us_and_verified(saved, counted):
    path, model, opt, index = saved
    data = _data(path, index)
    fresh = tf.Module()
    fresh.kernel = tf.Variable(tf.zeros_like(model.kernel))
    status = at.Checkpoint(model=fresh).restore(path)
    counted.reset()
    fresh.bias = tf.Variable(tf.zeros_like(model.bias))  # created later: restored now
    np.testing.assert_array_equal(fresh.bias.numpy(), model.bias.numpy())
    assert counted.tf_keys == []
    assert counted.bytes == _size(index, "model/bias/.ATTRIBUTES/VARIABLE_VALUE")
    status.expect_partial()

    bias = index.entries["model/bias/.ATTRIBUTES/VARIABLE_VALUE"]
    flip_byte(data, bias.offset, mask=0x01)
    fresh = tf.Module()
    fresh.kernel = tf.Variable(tf.zeros_like(model.kernel))
    status = at.Checkpoint(model=fresh).restore(path)  # the bias is not read yet
    np.testing.assert_array_equal(fresh.kernel.numpy(), model.kernel.numpy())
    late = tf.Variable(tf.zeros_like(model.bias))
    with pytest.raises(CorruptCheckpointError):
        fresh.bias = late
    assert not late.numpy().any()  # not assigned
    flip_byte(data, bias.offset, mask=0x01)
    status.expect_partial()

    # Slot variables created after the restore (the optimizer's first step).
    counted.reset()
    fresh = _zeros_like(model)
    opt2 = tf.compat.v1.train.AdamOptimizer(0.1)
    status = at.Checkpoint(model=fresh, optimizer=opt2).restore(path)
    opt2._create_slots([fresh.kernel, fresh.bias])  # what the first minimize() does
    status.assert_consumed()
    for var, want in ((fresh.kernel, model.kernel), (fresh.bias, model.bias)):
        for name in ("m", "v"):
            np.testing.assert_array_equal(opt2.get_slot(var, name).numpy(),
                                          opt.get_slot(want, name).numpy())
    assert counted.tf_keys == []


def test_tensors_not_predicted_are_read_when_asked_and_checked_first(saved, monkeypatch,
                                                                   counted):
    """Correctness never depends on the prediction: a wrong one costs a read, no check."""
    path, model, _, index = saved
    kernel_key = "model/kernel/.ATTRIBUTES/VARIABLE_VALUE"
    real_predict = _bundleread.predict

    def forgetful(root, bundle):  # the real prediction, less the kernel
        keys = real_predict(root, bundle)
        keys.discard(kernel_key)
        return keys

    monkeypatch.setattr(_bundleread, "predict", forgetful)
    fresh = _zeros_like(model)
    at.Checkpoint(model=fresh).restore(path).expect_partial()
    np.testing.assert_array_equal(fresh.kernel.numpy(), model.kernel.numpy())
    np.testing.assert_array_equal(fresh.bias.numpy(), model.bias.numpy())
    assert counted.bytes == _size(index, *_model_keys(index), OBJECT_GRAPH,
                                  "save_counter/.ATTRIBUTES/VARIABLE_VALUE")
    assert counted.tf_keys == []

    data = _data(path, index)
    entry = index.entries[kernel_key]
    flip_byte(data, entry.offset + 5, mask=0x01)
    fresh = _zeros_like(model)
    with pytest.raises(CorruptCheckpointError):
        at.Checkpoint(model=fresh).restore(path)
    # Kernel and bias go in one RestoreV2 call: neither was assigned.
    assert not fresh.kernel.numpy().any() and not fresh.bias.numpy().any()


def test_keras_model_only_restore_follows_the_object_graph_not_the_key_names(ckpt_dir, counted):
    """Keras 3 keys the model's variables under the optimizer (its shortest path).

    The prediction follows TensorFlow's matching of the object graph, so a
    model-only restore still reads exactly the model's tensors; an optimizer
    built after the restore gets its state by deferred restoration, read here.
    """
    keras = pytest.importorskip("keras")

    def build():
        return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32),
                                 keras.layers.Dense(4)])

    model = build()
    opt = keras.optimizers.Adam()
    opt.build(model.trainable_variables)
    for i, v in enumerate(opt.variables):
        v.assign(tf.fill(v.shape, float(i + 1)))
    with at.Checkpoint(model=model, optimizer=opt) as ckpt:
        path = ckpt.save(str(ckpt_dir / "ckpt"))
        ckpt.sync()
    with open(path + ".index", "rb") as f:
        index = _bundle.parse_index(f.read())
    assert not _keys(index, "model/")  # every key names the optimizer
    model_bytes = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_variables)

    counted.reset()
    fresh = build()
    for v in fresh.trainable_variables:
        v.assign(tf.zeros_like(v))
    at.Checkpoint(model=fresh).restore(path).expect_partial()
    for got, want in zip(fresh.trainable_variables, model.trainable_variables, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert counted.bytes == model_bytes + _size(index, OBJECT_GRAPH,
                                                "save_counter/.ATTRIBUTES/VARIABLE_VALUE")
    assert counted.tf_keys == []

    counted.reset()
    fresh, opt2 = build(), keras.optimizers.Adam()
    status = at.Checkpoint(model=fresh, optimizer=opt2).restore(path)
    opt2.build(fresh.trainable_variables)  # its variables, created now, restored now
    status.assert_consumed()
    for got, want in zip(opt2.variables, opt.variables, strict=True):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert counted.tf_keys == []
