"""The kinds of TensorFlow state the round-trip matrix checkpoints, one registry entry each.

A ``Kind`` builds the objects a user hands to ``tf.train.Checkpoint`` (as
its keyword arguments), reads their values as NumPy arrays, and changes
every one of them in place. Another kind is one more entry in ``KINDS``;
every trip of ``test_matrix.py`` then runs on it.

Values are compared byte for byte (``assert_same``), so every dtype,
NaN payloads and signed zeros included, must come back exactly.
"""

from __future__ import annotations

import functools
import io
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import tensorflow as tf

# Internal, but what ParameterServerStrategy itself builds its partitioned variables from.
from tensorflow.python.distribute.sharded_variable import ShardedVariable

from tests.conftest import TF_LOGICAL_CPUS


@dataclass(frozen=True)
class Kind:
    """One kind of state.

    Attributes:
        name: The test id part.
        build: seed -> the objects saved (``Checkpoint`` keyword arguments);
            other seeds give other values of the same structure.
        values: objects -> label -> NumPy array, independent of layout (a
            sharded variable reads as its whole value).
        mutate: Changes every value of the objects in place.
        target: seed -> the objects restored into, when they differ from
            ``build``'s (another number of shards, an optimizer not built yet).
        settle: Called on the restored objects after the restore: creates
            what a deferred restoration then fills (an optimizer's slots).
        consumed: Whether ``assert_consumed()`` holds after restore and settle.
    """

    name: str
    build: Callable[[int], dict]
    values: Callable[[dict], dict]
    mutate: Callable[[dict], None]
    target: Callable[[int], dict] | None = None
    settle: Callable[[dict], None] | None = None
    consumed: bool = True

    def make_target(self, seed: int) -> dict:
        return (self.target or self.build)(seed)


_MUTATIONS = itertools.count(1000)  # each mutation gets new values, also the 2nd of an object


def _bytes(a) -> np.ndarray:
    a = np.asarray(a)
    return a if a.dtype == object else a.reshape(-1).view(np.uint8)


def assert_same(got: dict, want: dict) -> None:
    """Same labels; each value of the same shape, dtype and bytes (strings: same items)."""
    assert sorted(got) == sorted(want)
    for label, w in want.items():
        g = np.asarray(got[label])
        w = np.asarray(w)
        assert (g.shape, g.dtype) == (w.shape, w.dtype), label
        assert (_bytes(g) == _bytes(w)).all(), f"{label}: {g!r} != {w!r}"


def unchanged_labels(before: dict, after: dict) -> set[str]:
    """Labels of non-empty values that are the same (a mutation must leave none)."""
    return {k for k in before if np.asarray(before[k]).size and (
        np.asarray(before[k]).shape == np.asarray(after[k]).shape
        and (_bytes(before[k]) == _bytes(after[k])).all())}


# --- plain variables of every dtype and shape -----------------------------------------


def _variables_kind(name: str, arrays: Callable[[np.random.Generator], dict]) -> Kind:
    """Variables holding ``arrays(rng)``, in a dict."""

    def build(seed):
        rng = np.random.default_rng(seed)
        return {"vars": {k: tf.Variable(tf.constant(a)) for k, a in arrays(rng).items()}}

    def values(objects):
        return {k: v.numpy() for k, v in objects["vars"].items()}

    def mutate(objects):
        new = arrays(np.random.default_rng(next(_MUTATIONS)))
        for k, v in objects["vars"].items():
            v.assign(tf.logical_not(v) if v.dtype == tf.bool else tf.constant(new[k]))

    return Kind(name, build, values, mutate)


def _numeric(rng) -> dict:
    """Every dtype asyncckpt's reader reads itself (``_bundleread.PLAIN``)."""
    normal = rng.standard_normal
    return {
        "float16": normal((3, 2)).astype(np.float16),
        "bfloat16": normal(5).astype(ml_dtypes.bfloat16),
        "float32": normal((4, 3)).astype(np.float32),
        "float64": normal(3),
        "int8": rng.integers(-128, 128, 6, dtype=np.int8),
        "int16": rng.integers(-(2**15), 2**15, 4, dtype=np.int16),
        "int32": rng.integers(-(2**31), 2**31, (2, 2), dtype=np.int32),
        "int64": rng.integers(-(2**63), 2**63, 3, dtype=np.int64),
        "uint8": rng.integers(0, 256, 5, dtype=np.uint8),
        "uint16": rng.integers(0, 2**16, 3, dtype=np.uint16),
        "uint32": rng.integers(0, 2**32, 3, dtype=np.uint32),
        "uint64": rng.integers(0, 2**64, 3, dtype=np.uint64),
        "bool": rng.random(9) > 0.5,
        "complex64": (normal(3) + 1j * normal(3)).astype(np.complex64),
        "complex128": normal((2, 2)) - 1j * normal((2, 2)),
    }


def _strings(rng) -> dict:
    words = [bytes(rng.integers(0, 256, n, dtype=np.uint8)) for n in (0, 1, 7, 300)]
    return {
        "vector": np.array([*words, b"a\x00b\xffc"], dtype=object),
        "matrix": np.array([[words[2], b""], [b"\xff\x00", words[3]]], dtype=object),
        "scalar": np.array(words[2], dtype=object),
        "empty": np.zeros((0, 2), dtype=object),
    }


def _float8(rng) -> dict:
    """The 1-byte floats TensorFlow 2.21 has variables of.

    The ``fnuz`` float8 variants (e4m3fnuz, e4m3b11fnuz, e5m2fnuz) are not
    here: TensorFlow 2.21 registers no CPU ``AssignVariableOp`` kernel for
    them, so there are no such variables to checkpoint.
    """
    x = rng.standard_normal((3, 4)).astype(np.float32) * 4
    return {"float8_e4m3fn": x.astype(ml_dtypes.float8_e4m3fn),
            "float8_e5m2": x.T.astype(ml_dtypes.float8_e5m2),
            "float4_e2m1fn": x[0].astype(ml_dtypes.float4_e2m1fn)}


def _int4(rng) -> dict:
    """Sub-byte integers: TensorFlow 2.21 variables hold them (one element per byte)."""
    return {"int4": rng.integers(-8, 8, (2, 5)).astype(ml_dtypes.int4),
            "uint4": rng.integers(0, 16, 7).astype(ml_dtypes.uint4),
            "int2": rng.integers(-2, 2, 6).astype(ml_dtypes.int2),
            "uint2": rng.integers(0, 4, 6).astype(ml_dtypes.uint2)}


def _shapes(rng) -> dict:
    return {
        "scalar_f32": np.float32(rng.standard_normal()),
        "scalar_i64": np.int64(rng.integers(-(2**40), 2**40)),
        "scalar_bool": np.bool_(rng.random() > 0.5),
        "scalar_bf16": np.array(rng.standard_normal(), ml_dtypes.bfloat16),
        "empty": np.zeros((0,), np.float32),
        "empty_rows": np.zeros((0, 4), np.int32),
        "empty_middle": np.zeros((3, 0, 2), np.float64),
        "rank5": rng.standard_normal((2, 1, 3, 1, 2)).astype(np.float32),
    }


# --- partitioned variables: ShardedVariable, as ParameterServerStrategy builds them ----


def ps_sharded(name: str, value: np.ndarray, shards: int) -> ShardedVariable:
    """A ShardedVariable of ``value`` built as ``ParameterServerStrategy`` builds one.

    Rows split as the strategy splits them (the first ``rows % shards``
    shards one row longer), shard ``i`` named ``<name>/part_<i>`` and placed
    round-robin on the parameter-server devices (here the logical CPUs).
    """
    variables = []
    for i, part in enumerate(np.array_split(value, shards)):
        with tf.device(f"/cpu:{i % TF_LOGICAL_CPUS}"):
            variables.append(tf.Variable(part, name=f"{name}/part_{i}"))
    return ShardedVariable(variables)


_ROWS, _COLS = 420, 2  # 420 rows: every shard count from 1 to 7 divides it and splits it
_SHARD_COUNTS = range(1, 8)


def _tuned(make: Callable[[int], object], n: int, around: int) -> object:
    """``make(b)`` for the byte bound ``b`` nearest ``around`` that gives ``n`` shards."""
    shape, dtype = tf.TensorShape([_ROWS, _COLS]), tf.float32
    for delta in range(4 * _COLS * _ROWS):
        for b in (around - delta, around + delta):
            if b > 0 and make(b)(shape, dtype)[0] == n:
                return make(b)
    raise AssertionError(f"no byte bound gives {n} shards")


def _partitioners() -> dict[str, Callable[[int], object]]:
    """Partitioner name -> shard count -> a partitioner that gives that many shards."""
    p = tf.distribute.experimental.partitioners
    total = 4 * _ROWS * _COLS
    return {
        "fixed_shards": lambda n: p.FixedShardsPartitioner(n),
        "min_size": lambda n: _tuned(lambda b: p.MinSizePartitioner(b, max_shards=7), n,
                                     total // n),
        "max_size": lambda n: _tuned(lambda b: p.MaxSizePartitioner(b), n, -(-total // n)),
    }


def _sharded_kind(partitioner: str) -> Kind:
    """One ShardedVariable per shard count (1 to 7), restored into another count.

    Saved with ``n`` shards, restored into ``n % 7 + 1``: every count is
    read into another, 7 into 1 and 1 into 2 included.
    """
    make = _partitioners()[partitioner]

    def sharded(seed, count):
        rng = np.random.default_rng(seed)
        out = {}
        for n in _SHARD_COUNTS:
            value = rng.standard_normal((_ROWS, _COLS)).astype(np.float32)
            shards = make(count(n))(tf.TensorShape(value.shape), tf.float32)[0]
            assert shards == count(n), (partitioner, n, shards)
            out[f"n{n}"] = ps_sharded(f"{partitioner}_{n}", value, shards)
        return {"sharded": out}

    def values(objects):
        return {k: np.concatenate([v.numpy() for v in s.variables])
                for k, s in objects["sharded"].items()}

    def mutate(objects):
        for s in objects["sharded"].values():
            s.assign(-tf.convert_to_tensor(s) - 1.0)

    return Kind(f"sharded_{partitioner}", lambda seed: sharded(seed, lambda n: n), values,
                mutate, target=lambda seed: sharded(seed, lambda n: n % 7 + 1))


def _parameter_server_kind() -> Kind:
    """Variables as ``ParameterServerStrategy`` creates them, without its cluster.

    The strategy needs a running cluster (gRPC servers and a coordinator
    that reconnects this process's eager context), too costly and too
    invasive for a process that runs the whole suite. What it creates is
    what this builds: plain variables placed round-robin on the parameter
    servers, and, under a ``variable_partitioner``, ShardedVariables
    (``ps_sharded``). The embedding is restored into a different number of
    shards, as a job resumed on another cluster size does.
    """

    def build(seed, shards=3):
        rng = np.random.default_rng(seed)
        dense = {}
        for i, shape in enumerate([(6, 4), (4,), (4, 2)]):
            with tf.device(f"/cpu:{i % TF_LOGICAL_CPUS}"):
                dense[f"w{i}"] = tf.Variable(rng.standard_normal(shape).astype(np.float32))
        emb = ps_sharded("embedding", rng.standard_normal((50, 3)).astype(np.float32), shards)
        with tf.device("/cpu:0"):
            step = tf.Variable(np.int64(rng.integers(0, 1000)))
        return {"dense": dense, "embedding": emb, "step": step}

    def values(objects):
        out = {k: v.numpy() for k, v in objects["dense"].items()}
        out["embedding"] = np.concatenate([v.numpy() for v in objects["embedding"].variables])
        out["step"] = objects["step"].numpy()
        return out

    def mutate(objects):
        for v in objects["dense"].values():
            v.assign_add(tf.ones_like(v))
        objects["embedding"].assign(tf.convert_to_tensor(objects["embedding"]) * 2.0 + 1.0)
        objects["step"].assign_add(1)

    return Kind("parameter_server", build, values, mutate,
                target=lambda seed: build(seed, shards=5))


# --- MirroredStrategy -----------------------------------------------------------------


@functools.cache
def _mirrored() -> tf.distribute.MirroredStrategy:
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def _mirrored_kind() -> Kind:
    """Variables and Keras optimizer slots mirrored over two logical CPUs.

    Every replica's copy is compared, so a restore that fills only the
    primary fails.
    """
    import keras

    def build(seed):
        rng = np.random.default_rng(seed)
        strategy = _mirrored()
        with strategy.scope():
            w = tf.Variable(rng.standard_normal((4, 3)).astype(np.float32))
            b = tf.Variable(rng.standard_normal(3).astype(np.float32))
            count = tf.Variable(np.int64(rng.integers(0, 100)))
            optimizer = keras.optimizers.Adam(0.01)
            optimizer.build([w, b])
        for v in optimizer.variables[2:]:  # the slots: non-zero values
            v.assign(rng.standard_normal(v.shape).astype(np.float32))
        assert len(strategy.experimental_local_results(w)) == 2  # really mirrored
        return {"w": w, "b": b, "count": count, "optimizer": optimizer}

    def tracked(objects):
        return {"w": objects["w"], "b": objects["b"], "count": objects["count"],
                **{f"opt{i}": v for i, v in enumerate(objects["optimizer"].variables)}}

    def values(objects):
        return {f"{k}@{r}": t.numpy() for k, v in tracked(objects).items()
                for r, t in enumerate(_mirrored().experimental_local_results(v))}

    def mutate(objects):
        for v in tracked(objects).values():
            v.assign(v + tf.ones_like(v))

    return Kind("mirrored", build, values, mutate)


# --- Keras 3 and compat.v1 optimizers -------------------------------------------------


def _keras_model(rng):
    import keras

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    for w in model.weights:
        w.assign(rng.standard_normal(w.shape).astype(np.float32))
    return model


def _train_once(model, optimizer, rng) -> None:
    grads = [tf.constant(rng.standard_normal(w.shape).astype(np.float32))
             for w in model.trainable_variables]
    optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))


def _keras_kind(name: str, *, built: bool, target_built: bool, use_ema: bool = False) -> Kind:
    """A Keras 3 model and its Adam optimizer, saved before or after the optimizer's build.

    ``target_built=False`` with ``built=True``: the slots are restored when
    the optimizer is built after the restore (TensorFlow's deferred
    restoration, ``settle``).
    """
    import keras

    def make(seed, build_it):
        rng = np.random.default_rng(seed)
        model = _keras_model(rng)
        optimizer = keras.optimizers.Adam(float(rng.uniform(0.001, 0.1)), use_ema=use_ema,
                                          ema_momentum=0.5)
        if build_it:
            optimizer.build(model.trainable_variables)
            _train_once(model, optimizer, rng)
        return {"model": model, "optimizer": optimizer}

    def values(objects):
        out = {f"model{i}": w.numpy() for i, w in enumerate(objects["model"].weights)}
        out.update({f"opt{i}": v.numpy() for i, v in enumerate(objects["optimizer"].variables)})
        return out

    def mutate(objects):
        for v in [*objects["model"].weights, *objects["optimizer"].variables]:
            v.assign(v + tf.ones_like(v))

    def settle(objects):
        if not objects["optimizer"].built:
            objects["optimizer"].build(objects["model"].trainable_variables)

    return Kind(name, lambda seed: make(seed, built), values, mutate,
                target=lambda seed: make(seed, target_built),
                settle=settle if built and not target_built else None)


def _compat_v1_kind() -> Kind:
    """A ``tf.compat.v1.train.AdamOptimizer`` and its slots."""

    def build(seed):
        rng = np.random.default_rng(seed)
        v = tf.Variable(rng.standard_normal((5, 2)).astype(np.float32))
        optimizer = tf.compat.v1.train.AdamOptimizer(0.1)
        optimizer.minimize(lambda: tf.reduce_sum(v * v), var_list=[v])  # creates the slots
        return {"v": v, "optimizer": optimizer}

    def tracked(objects):
        v, optimizer = objects["v"], objects["optimizer"]
        beta1, beta2 = optimizer._get_beta_accumulators()  # their only accessor
        return {"v": v, "m": optimizer.get_slot(v, "m"), "v_slot": optimizer.get_slot(v, "v"),
                "beta1_power": beta1, "beta2_power": beta2}

    def values(objects):
        return {k: x.numpy() for k, x in tracked(objects).items()}

    def mutate(objects):
        for x in tracked(objects).values():
            x.assign(x * 0.5 + 1.0)

    return Kind("compat_v1_optimizer", build, values, mutate)


# --- other TensorFlow state -----------------------------------------------------------


def _lookup_tables_kind() -> Kind:
    """``MutableHashTable`` (string -> int64) and ``DenseHashTable`` (int64 -> float32)."""

    def build(seed):
        rng = np.random.default_rng(seed)
        mutable = tf.lookup.experimental.MutableHashTable(tf.string, tf.int64, default_value=-1)
        keys = [b"k%d" % i for i in rng.permutation(20)[:6]]
        mutable.insert(keys, rng.integers(0, 1000, len(keys)))
        dense = tf.lookup.experimental.DenseHashTable(
            tf.int64, tf.float32, default_value=-1.0, empty_key=-1, deleted_key=-2)
        dense.insert(rng.permutation(50)[:9].astype(np.int64),
                     rng.standard_normal(9).astype(np.float32))
        return {"tables": {"mutable": mutable, "dense": dense}}

    def values(objects):
        out = {}
        for name, table in objects["tables"].items():
            keys, vals = (x.numpy() for x in table.export())
            live = keys >= 0 if keys.dtype == np.int64 else np.ones(len(keys), bool)
            order = np.argsort(keys[live], kind="stable")
            out[f"{name}_keys"] = keys[live][order]
            out[f"{name}_values"] = vals[live][order]
        return out

    def mutate(objects):
        n = next(_MUTATIONS)
        mutable, dense = objects["tables"]["mutable"], objects["tables"]["dense"]
        keys, _ = mutable.export()
        mutable.insert(keys, tf.fill(tf.shape(keys), tf.constant(n, tf.int64)))
        mutable.insert([b"new%d" % n], tf.constant([1], tf.int64))
        dkeys, _ = dense.export()
        live = tf.boolean_mask(dkeys, dkeys >= 0)
        dense.insert(live, tf.fill(tf.shape(live), float(n)))
        dense.insert(tf.constant([n], tf.int64), tf.constant([3.0]))

    return Kind("lookup_tables", build, values, mutate)


def _random_kind() -> Kind:
    """``tf.random.Generator`` and a Keras ``SeedGenerator``'s state, mid-stream."""
    import keras

    def build(seed):
        generator = tf.random.Generator.from_seed(seed)
        generator.normal([3])
        seeds = keras.random.SeedGenerator(seed)
        seeds.next()
        # The SeedGenerator itself is not trackable; its state variable is what is saved.
        return {"generator": generator, "seed_state": seeds.state}

    def values(objects):
        return {"generator": objects["generator"].state.numpy(),
                "seed_state": objects["seed_state"].numpy()}

    def mutate(objects):
        objects["generator"].normal([5])
        objects["seed_state"].assign(objects["seed_state"] + 1)

    return Kind("random_generators", build, values, mutate)


class _Averaged(tf.Module):
    """Variables and their ``tf.train.ExponentialMovingAverage`` shadows, as a loop keeps them."""

    def __init__(self, rng):
        super().__init__()
        self.weights = {k: tf.Variable(rng.standard_normal(s).astype(np.float32))
                        for k, s in (("a", (3, 2)), ("b", (4,)))}
        self.ema = tf.train.ExponentialMovingAverage(0.5)  # not trackable: its shadows are
        self.ema.apply(list(self.weights.values()))
        for v in self.weights.values():
            v.assign(rng.standard_normal(v.shape).astype(np.float32))
        self.ema.apply(list(self.weights.values()))  # shadows now differ from the weights
        self.shadows = {k: self.ema.average(v) for k, v in self.weights.items()}


def _ema_kind() -> Kind:
    def values(objects):
        m = objects["averaged"]
        return {**{f"w_{k}": v.numpy() for k, v in m.weights.items()},
                **{f"shadow_{k}": v.numpy() for k, v in m.shadows.items()}}

    def mutate(objects):
        m = objects["averaged"]
        for v in m.weights.values():
            v.assign_add(tf.ones_like(v))
        m.ema.apply(list(m.weights.values()))

    return Kind("ema_shadows", lambda seed: {"averaged": _Averaged(np.random.default_rng(seed))},
                values, mutate)


class _Tree(tf.Module):
    """Nested modules, lists and dicts of them, and one variable reachable by two paths."""

    def __init__(self, rng, depth=3):
        super().__init__()
        self.w = tf.Variable(rng.standard_normal((depth + 1, 2)).astype(np.float32))
        self.layers = [tf.Module() for _ in range(2)]
        for i, layer in enumerate(self.layers):
            layer.v = tf.Variable(np.int32(rng.integers(0, 100) + i))
        self.named = {"x": tf.Variable(rng.standard_normal(3)), "sub": tf.Module()}
        self.named["sub"].flag = tf.Variable(rng.random(2) > 0.5)
        self.child = _Tree(rng, depth - 1) if depth else None
        self.alias = self.layers[0].v  # the same variable again: saved once

    def variables_by_path(self, prefix="") -> dict:
        out = {f"{prefix}w": self.w, f"{prefix}named.x": self.named["x"],
               f"{prefix}named.sub.flag": self.named["sub"].flag,
               **{f"{prefix}layers{i}": layer.v for i, layer in enumerate(self.layers)}}
        assert self.alias is self.layers[0].v
        if self.child is not None:
            out.update(self.child.variables_by_path(prefix + "child."))
        return out


def _nested_kind() -> Kind:
    def values(objects):
        return {k: v.numpy() for k, v in objects["tree"].variables_by_path().items()}

    def mutate(objects):
        for v in objects["tree"].variables_by_path().values():
            v.assign(tf.logical_not(v) if v.dtype == tf.bool else v + tf.ones_like(v))

    return Kind("nested_modules", lambda seed: {"tree": _Tree(np.random.default_rng(seed))},
                values, mutate)


_MANY = 1000


def _many_kind() -> Kind:
    """1,000 small variables in one list."""

    def build(seed):
        rng = np.random.default_rng(seed)
        block = rng.standard_normal((_MANY, 2)).astype(np.float32)
        return {"many": [tf.Variable(row) for row in block]}

    def values(objects):
        return {"all": np.stack([v.numpy() for v in objects["many"]])}

    def mutate(objects):
        for v in objects["many"]:
            v.assign_add([1.0, 1.0])

    return Kind("variables_1000", build, values, mutate)


class NumpyState(tf.train.experimental.PythonState):
    """Python state: a NumPy array, saved as the bytes of ``np.save``."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def serialize(self) -> bytes:
        buf = io.BytesIO()
        np.save(buf, self.array)
        return buf.getvalue()

    def deserialize(self, string_value) -> None:
        self.array = np.load(io.BytesIO(string_value))


def _python_state_kind() -> Kind:
    def build(seed):
        rng = np.random.default_rng(seed)
        return {"state": NumpyState(rng.standard_normal((3, 3))),
                "step": tf.Variable(np.int64(rng.integers(0, 99)))}

    def values(objects):
        return {"array": objects["state"].array.copy(), "step": objects["step"].numpy()}

    def mutate(objects):
        objects["state"].array += 1.0  # in place: the save must have serialized it already
        objects["step"].assign_add(1)

    return Kind("python_state", build, values, mutate)


def registry() -> list[Kind]:
    """Every kind, in test order."""
    return [
        _variables_kind("dtypes_plain", _numeric),
        _variables_kind("dtypes_string", _strings),
        _variables_kind("dtypes_float8", _float8),
        _variables_kind("dtypes_int4", _int4),
        _variables_kind("shapes_scalar_empty", _shapes),
        *(_sharded_kind(p) for p in ("fixed_shards", "min_size", "max_size")),
        _parameter_server_kind(),
        _mirrored_kind(),
        _keras_kind("keras_adam_built", built=True, target_built=True),
        _keras_kind("keras_adam_unbuilt", built=False, target_built=False),
        _keras_kind("keras_adam_deferred_slots", built=True, target_built=False),
        _keras_kind("keras_adam_use_ema", built=True, target_built=True, use_ema=True),
        _compat_v1_kind(),
        _lookup_tables_kind(),
        _random_kind(),
        _ema_kind(),
        _nested_kind(),
        _many_kind(),
        _python_state_kind(),
        # tf.data iterators and TPU embeddings go through the same seven trips, one test
        # id per (kind, trip), in tests/test_tf_iterators.py and
        # tests/test_tf_tpu_embedding.py: their checks (iterator positions, retrieve
        # and load hooks, byte identity with SaveV2) do not fit a kind's value check.
    ]


KINDS = registry()
