"""Every kind of TensorFlow state the issue names: round trip through both readers.

Each checkpoint asyncckpt saves here is restored with TensorFlow's
``tf.train.Checkpoint`` and with ``asyncckpt.tf.Checkpoint``, whose own
reader must read it (``tests/tfrestore.py``).
"""

from __future__ import annotations

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
keras = pytest.importorskip("keras")

# Internal, but the only way to build a ShardedVariable without a parameter-server cluster.
from tensorflow.python.distribute.sharded_variable import ShardedVariable  # noqa: E402
from tensorflow.tpu.experimental.embedding import (  # noqa: E402
    SGD,
    FeatureConfig,
    TableConfig,
    TPUEmbeddingForServing,
)

import asyncckpt.tf as at  # noqa: E402
from tests.conftest import TF_LOGICAL_CPUS  # noqa: E402
from tests.tfrestore import restore_both  # noqa: E402


def _save_and_sync(ckpt_dir, **objects) -> str:
    with at.Checkpoint(**objects) as ckpt:
        path = ckpt.save(str(ckpt_dir / "ckpt"))
        ckpt.sync()
    return path


def _mlp(width: int = 16) -> keras.Model:
    return keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(width, activation="relu"), keras.layers.Dense(2)]
    )


def _fit_one_epoch(model, optimizer) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype("float32")
    y = rng.normal(size=(32, 2)).astype("float32")
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)


def test_logical_cpu_devices_are_configured():
    assert len(tf.config.list_logical_devices("CPU")) == TF_LOGICAL_CPUS


def test_mirrored_strategy_variables(ckpt_dir):
    devices = [f"/cpu:{i}" for i in range(TF_LOGICAL_CPUS)]
    strategy = tf.distribute.MirroredStrategy(devices)
    with strategy.scope():
        model = _mlp()
        optimizer = keras.optimizers.Adam(0.01)
    _fit_one_epoch(model, optimizer)
    assert len(model.weights[0].value.values) == TF_LOGICAL_CPUS  # really mirrored
    with at.Checkpoint(model=model, optimizer=optimizer) as ckpt:
        ckpt.save(str(ckpt_dir / "ckpt"))
        _fit_one_epoch(model, optimizer)
        weights = [w.numpy() for w in model.weights]
        slots = [v.numpy() for v in optimizer.variables]
        path = ckpt.save(str(ckpt_dir / "ckpt"))  # second save: the batched read path

    def make():
        fresh, fresh_opt = _mlp(), keras.optimizers.Adam(0.01)
        fresh_opt.build(fresh.trainable_variables)
        return {"model": fresh, "optimizer": fresh_opt}

    def check(o):
        for a, b in zip(weights, o["model"].weights, strict=True):
            np.testing.assert_array_equal(a, b.numpy())
        for a, b in zip(slots, o["optimizer"].variables, strict=True):
            np.testing.assert_array_equal(a, b.numpy())

    restore_both(path, make, check)


def test_sharded_variable_restores_into_other_shard_counts(ckpt_dir):
    full = np.arange(24 * 3, dtype=np.float32).reshape(24, 3)
    shards = []
    for i, part in enumerate(np.split(full, 3)):
        with tf.device(f"/cpu:{i}"):
            shards.append(tf.Variable(part))
    path = _save_and_sync(ckpt_dir, emb=ShardedVariable(shards))

    for shards in (2, 3):
        restore_both(
            path,
            lambda shards=shards: {"emb": ShardedVariable(
                [tf.Variable(tf.zeros((24 // shards, 3))) for _ in range(shards)])},
            lambda o: np.testing.assert_array_equal(
                np.concatenate([v.numpy() for v in o["emb"].variables]), full))


def test_keras3_optimizer_slots_round_trip(ckpt_dir):
    model, optimizer = _mlp(), keras.optimizers.Adam(0.01)
    _fit_one_epoch(model, optimizer)
    assert len(optimizer.variables) > 2  # momenta and velocities exist
    saved = [v.numpy() for v in optimizer.variables]
    path = _save_and_sync(ckpt_dir, model=model, optimizer=optimizer)

    def make():
        fresh, fresh_opt = _mlp(), keras.optimizers.Adam(0.5)
        fresh_opt.build(fresh.trainable_variables)
        return {"model": fresh, "optimizer": fresh_opt}

    def check(o):
        restored = [v.numpy() for v in o["optimizer"].variables]
        assert len(restored) == len(saved)
        for i, (a, b) in enumerate(zip(saved, restored, strict=True)):
            np.testing.assert_array_equal(a, b, err_msg=f"optimizer variable {i}")

    restore_both(path, make, check)


def test_keras3_optimizer_before_it_is_built(ckpt_dir):
    # TensorFlow 2.21's own async checkpoint fails on exactly this case.
    model, optimizer = _mlp(), keras.optimizers.Adam(0.123)
    assert not optimizer.built
    path = _save_and_sync(ckpt_dir, model=model, optimizer=optimizer)
    weights = [w.numpy() for w in model.weights]

    def check(o):
        assert float(o["optimizer"].learning_rate.numpy()) == pytest.approx(0.123)
        assert int(o["optimizer"].iterations.numpy()) == 0
        for a, b in zip(weights, o["model"].weights, strict=True):
            np.testing.assert_array_equal(a, b.numpy())

    restore_both(path, lambda: {"model": _mlp(), "optimizer": keras.optimizers.Adam(0.5)},
                 check, verdict=None)
    # Training continues after the early save, and a later save has the slots.
    _fit_one_epoch(model, optimizer)
    path2 = _save_and_sync(ckpt_dir, model=model, optimizer=optimizer)

    def make_built():
        later_opt = keras.optimizers.Adam(0.5)
        later_model = _mlp()
        later_opt.build(later_model.trainable_variables)
        return {"model": later_model, "optimizer": later_opt}

    def check_built(o):
        assert int(o["optimizer"].iterations.numpy()) == int(optimizer.iterations.numpy()) > 0

    restore_both(path2, make_built, check_built)


def test_compat_v1_optimizer_slots(ckpt_dir):
    v = tf.Variable(np.linspace(-1, 1, 10).astype(np.float32))
    opt = tf.compat.v1.train.AdamOptimizer(0.1)
    for _ in range(3):
        opt.minimize(lambda: tf.reduce_sum(v**2), var_list=[v])
    assert sorted(opt.get_slot_names()) == ["m", "v"]
    saved = {name: opt.get_slot(v, name).numpy() for name in opt.get_slot_names()}
    saved_v = v.numpy()
    path = _save_and_sync(ckpt_dir, v=v, opt=opt)

    def make():
        v2 = tf.Variable(np.zeros(10, np.float32))
        opt2 = tf.compat.v1.train.AdamOptimizer(0.1)
        opt2.minimize(lambda: tf.reduce_sum((v2 - 5.0) ** 2), var_list=[v2])  # creates slots
        return {"v": v2, "opt": opt2}

    def check(o):
        np.testing.assert_array_equal(o["v"].numpy(), saved_v)
        for name, value in saved.items():
            np.testing.assert_array_equal(o["opt"].get_slot(o["v"], name).numpy(), value)

    restore_both(path, make, check)


def _embedding(cls=TPUEmbeddingForServing, seed: int = 0):
    tables = [
        TableConfig(vocabulary_size=32, dim=4, name="users",
                    initializer=tf.initializers.RandomUniform(seed=seed)),
        TableConfig(vocabulary_size=16, dim=8, name="items",
                    initializer=tf.initializers.RandomUniform(seed=seed + 1)),
    ]
    features = {t.name: FeatureConfig(table=t) for t in tables}
    emb = cls(feature_config=features, optimizer=SGD(0.1))
    emb.build()
    return emb


def _tables(emb) -> dict[str, np.ndarray]:
    return {t.name: v.numpy() for t, v in emb.embedding_tables.items()}


def test_tpu_embedding_tables_for_serving(ckpt_dir):
    emb = _embedding(seed=1)
    saved = _tables(emb)
    path = _save_and_sync(ckpt_dir, embedding=emb)
    assert not np.array_equal(_tables(_embedding(seed=7))["users"], saved["users"])

    def check(o):
        for name, value in saved.items():
            np.testing.assert_array_equal(_tables(o["embedding"])[name], value)

    restore_both(path, lambda: {"embedding": _embedding(seed=7)}, check)

