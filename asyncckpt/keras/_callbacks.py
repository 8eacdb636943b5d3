"""State of the other callbacks in the same ``fit()``, saved with each backup.

Keras's stateful callbacks keep counters and best values in attributes
(``EarlyStopping.wait``/``best``, ``ModelCheckpoint.best``, ...). Those
attributes are listed here per class; any callback can take part by defining
``get_state() -> dict`` (JSON) and ``set_state(dict)``. Arrays (EarlyStopping's
``best_weights``) are saved as arrays beside the model's.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import keras
import numpy as np

_KNOWN: list[tuple[type, tuple[str, ...], tuple[str, ...]]] = [
    # (class, JSON attributes, attributes holding a list of arrays or None)
    (keras.callbacks.EarlyStopping, ("wait", "stopped_epoch", "best", "best_epoch"),
     ("best_weights",)),
    (keras.callbacks.ReduceLROnPlateau, ("wait", "cooldown_counter", "best"), ()),
    (keras.callbacks.ModelCheckpoint,
     ("best", "_batches_seen_since_last_saving", "_last_batch_seen"), ()),
]


def to_json_value(value: Any) -> Any:
    """A callback's state value as JSON can hold it (NumPy scalars as Python ones, infinities)."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isinf(value):
        return {"inf": 1 if value > 0 else -1}
    return value


def from_json_value(value: Any) -> Any:
    """The value ``to_json_value`` stored."""
    if isinstance(value, dict) and set(value) == {"inf"}:
        return math.inf * value["inf"]
    return value


def find_siblings(callback: Any) -> tuple[list[Any], list[Any]]:
    """The other callbacks of the ``CallbackList`` now calling ``callback``.

    Returns them all, and those listed after ``callback`` (which have not yet
    run a hook that ``callback`` is running now). Keras gives a callback no
    handle on its list, so this looks for the ``CallbackList`` among the
    calling frames (it is the caller during ``on_train_begin``). Returns
    ([], []) when there is none (callback used alone).
    """
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.callbacks.CallbackList):
            position = next(
                (i for i, c in enumerate(owner.callbacks) if c is callback), None)
            if position is not None:
                listed = owner.callbacks
                return listed[:position] + listed[position + 1:], listed[position + 1:]
        frame = frame.f_back
    return [], []


def find_local(name: str, kind: type) -> Any | None:
    """A local variable ``name`` of type ``kind`` in one of the calling frames."""
    frame = sys._getframe(1)
    while frame is not None:
        value = frame.f_locals.get(name)
        if isinstance(value, kind):
            return value
        frame = frame.f_back
    return None


def _key(index: int, cb: Any) -> str:
    return f"{index}:{type(cb).__name__}"


def collect(callbacks: list[Any]) -> tuple[dict[str, dict], dict[str, Any]]:
    """JSON state and arrays of every stateful callback, keyed by position and class."""
    states: dict[str, dict] = {}
    arrays: dict[str, Any] = {}
    for i, cb in enumerate(callbacks):
        key = _key(i, cb)
        if hasattr(cb, "get_state") and hasattr(cb, "set_state"):
            states[key] = {"custom": cb.get_state()}
            continue
        for cls, attrs, array_attrs in _KNOWN:
            if isinstance(cb, cls):
                state = {a: to_json_value(getattr(cb, a, None)) for a in attrs}
                for a in array_attrs:
                    value = getattr(cb, a, None)
                    state[f"{a}#len"] = None if value is None else len(value)
                    for j, arr in enumerate(value or ()):
                        arrays[f"callbacks/{key}/{a}/{j:04d}"] = np.asarray(arr)
                states[key] = state
                break
    return states, arrays


def apply(callbacks: list[Any], states: dict[str, dict], arrays: dict[str, np.ndarray]) -> int:
    """Sets saved state back on the matching callbacks; returns how many matched."""
    matched = 0
    for i, cb in enumerate(callbacks):
        key = _key(i, cb)
        state = states.get(key)
        if state is None:
            continue
        matched += 1
        if "custom" in state and hasattr(cb, "set_state"):
            cb.set_state(state["custom"])
            continue
        for name, value in state.items():
            if name.endswith("#len"):
                attr = name[: -len("#len")]
                setattr(cb, attr, None if value is None else [
                    np.array(arrays[f"callbacks/{key}/{attr}/{j:04d}"]) for j in range(value)
                ])
            else:
                setattr(cb, name, from_json_value(value))
    return matched


def same_state(a: tuple[dict[str, dict], dict[str, Any]],
               b: tuple[dict[str, dict], dict[str, Any]]) -> bool:
    """Whether two ``collect`` results hold the same callback state."""
    (states_a, arrays_a), (states_b, arrays_b) = a, b
    if json.dumps(states_a, sort_keys=True, default=repr) != json.dumps(
            states_b, sort_keys=True, default=repr):
        return False
    if arrays_a.keys() != arrays_b.keys():
        return False
    return all(
        x is y or (x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y))
        for x, y in ((arrays_a[k], arrays_b[k]) for k in arrays_a)
    )
