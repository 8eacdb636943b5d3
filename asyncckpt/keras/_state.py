"""Reading and writing a Keras 3 model's whole training state as named arrays.

The state is what the trainers themselves carry from step to step, in their
order: trainable variables, non-trainable variables (BatchNorm statistics and
``SeedGenerator`` states included), optimizer variables (``iterations``, slots,
loss-scale state) and metric accumulators, plus the global seed generator when
one exists. Arrays are named ``<group>/<index>``; the variables' paths are
recorded beside them and checked on restore.

On the JAX backend ``fit`` keeps the current state in ``model._jax_state``
during an epoch and purges the variables (reading them then would give the
initializers' values). The snapshot reads that state directly, without the
sync the ``Callback.model`` property would run.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from asyncckpt.jobrunner.store import host_view

GROUPS = ("trainable", "non_trainable", "optimizer", "metrics")
MODEL_GROUPS = GROUPS[:3]  # all but the metric accumulators
_JAX_KEYS = {
    "trainable": "trainable_variables",
    "non_trainable": "non_trainable_variables",
    "optimizer": "optimizer_variables",
    "metrics": "metrics_variables",
}
GLOBAL_SEED = "global_seed/0000"


def _variables(model: Any, group: str) -> list:
    if group == "trainable":
        return list(model.trainable_variables)
    if group == "non_trainable":
        return list(model.non_trainable_variables)
    if group == "optimizer":
        opt = getattr(model, "optimizer", None)
        return list(opt.variables) if opt is not None and opt.built else []
    return list(model.metrics_variables)


def _global_seed_generator() -> Any | None:
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute("global_seed_generator")


def _to_host(value: Any) -> Any:
    """An array-like NumPy can view without an extra copy where the backend allows.

    On TensorFlow, a variable's read and a CPU tensor are viewed in place (the
    staging copy is then the only copy); JAX values are left to the store.
    """
    if keras.backend.backend() == "tensorflow":
        return host_view(value)
    return value


def _tf_variable(v: Any) -> Any | None:
    """The ``tf.Variable`` behind a Keras variable on the TensorFlow backend, if plain."""
    import tensorflow as tf

    inner = getattr(v, "_value", None)
    return inner if isinstance(inner, tf.Variable) else None


def tf_reader() -> Any:
    """A reader of TensorFlow variables in one batched call (keep one per model)."""
    from asyncckpt.keras._tfread import BatchedReader

    return BatchedReader()


def _read_tf(reader: Any, arrays: dict[str, Any]) -> None:
    """Replaces the TensorFlow variables in ``arrays`` by one batched read of them all."""
    names, variables = [], []
    for name, v in arrays.items():
        inner = _tf_variable(v)
        if inner is not None:
            names.append(name)
            variables.append(inner)
    if variables:
        for name, value in zip(names, reader.read(variables), strict=True):
            arrays[name] = value


def snapshot_sources(
    model: Any, reader: Any = None
) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """The model's training state as ``{name: array-like}`` and variable paths per group.

    Values are views or device arrays, not copies: the caller copies them
    (into a staging slot) before training continues. On TensorFlow, with a
    ``reader`` (``tf_reader()``), every variable is read in one batched call.
    """
    tensorflow = keras.backend.backend() == "tensorflow"
    jax_state = None
    if keras.backend.backend() == "jax" and not getattr(model, "_jax_state_synced", True):
        jax_state = getattr(model, "_jax_state", None) or None
    arrays: dict[str, Any] = {}
    paths: dict[str, list[str]] = {}
    for group in GROUPS:
        variables = _variables(model, group)
        paths[group] = [v.path for v in variables]
        live = jax_state.get(_JAX_KEYS[group]) if jax_state is not None else None
        if live is not None and len(live) != len(variables):
            raise RuntimeError(
                f"Keras's JAX trainer holds {len(live)} {group} values for "
                f"{len(variables)} variables"
            )
        for i, v in enumerate(variables):
            if tensorflow:
                arrays[f"{group}/{i:04d}"] = v  # read below, all at once
                continue
            value = live[i] if live is not None else v.value
            if value is None:
                raise RuntimeError(
                    f"variable {v.path} has no value (purged by the JAX trainer) and the "
                    "trainer holds no state for it"
                )
            arrays[f"{group}/{i:04d}"] = _to_host(value)
    sg = _global_seed_generator()
    if sg is not None:
        arrays[GLOBAL_SEED] = sg.state if tensorflow else sg.state.value
    if tensorflow:
        if reader is not None:
            _read_tf(reader, arrays)
        for name, value in arrays.items():
            arrays[name] = host_view(value)
    return arrays, paths


def count_variables(model: Any) -> dict[str, int]:
    return {g: len(_variables(model, g)) for g in GROUPS}


def fully_built(model: Any) -> bool:
    """Whether every layer, the compiled loss and the compiled metrics are built."""
    if not all(layer.built for layer in model._flatten_layers()):
        return False
    for attr in ("_compile_metrics", "_compile_loss"):
        part = getattr(model, attr, None)
        if part is not None and not part.built:
            return False
    return True


def ensure_optimizer_built(model: Any) -> None:
    opt = getattr(model, "optimizer", None)
    if opt is not None and not opt.built and model.built:
        opt.build(model.trainable_variables)


def assign_state(model: Any, arrays: dict[str, np.ndarray], paths: dict[str, list[str]],
                 groups: tuple[str, ...] = GROUPS) -> None:
    """Assigns restored arrays to the model's variables, checking names and shapes.

    ``groups`` selects what is assigned (every group is checked).

    Raises:
        ValueError: the model's variables do not match the checkpoint's.
    """
    if keras.backend.backend() == "jax":
        # Variables are the source of truth outside an epoch; make sure they
        # are current before overwriting them.
        sync = getattr(model, "jax_state_sync", None)
        if sync is not None:
            sync()
    for group in GROUPS:
        variables = _variables(model, group)
        saved = paths.get(group, [])
        if len(saved) != len(variables):
            raise ValueError(
                f"the checkpoint holds {len(saved)} {group} variables, the model has "
                f"{len(variables)}: was the model or its compile() arguments changed?"
            )
        for i, v in enumerate(variables):
            arr = arrays[f"{group}/{i:04d}"]
            if tuple(arr.shape) != tuple(v.shape):
                raise ValueError(
                    f"variable {v.path}: checkpoint shape {tuple(arr.shape)} "
                    f"(saved as {saved[i]}), model shape {tuple(v.shape)}"
                )
            if group in groups:
                v.assign(arr)
    sg = _global_seed_generator()
    if GLOBAL_SEED in arrays:
        if sg is None:
            from keras.src.random.seed_generator import global_seed_generator

            sg = global_seed_generator()
        sg.state.assign(arrays[GLOBAL_SEED])
