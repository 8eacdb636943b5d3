"""Small pieces of orbax compatibility: its error type, handlers, preemption sync point.

orbax is imported only when one of these is used, never at import time.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from asyncckpt.errors import AsyncCkptError


@functools.cache
def step_already_exists_error() -> type[ValueError]:
    """``StepAlreadyExistsError``: a subclass of orbax's when orbax is installed."""
    try:
        from orbax.checkpoint.checkpoint_manager import StepAlreadyExistsError as base
    except ImportError:
        base = ValueError
    return type("StepAlreadyExistsError", (base, AsyncCkptError), {
        "__module__": "asyncckpt.jax",
        "__doc__": "The step is already saved, or being saved, in this directory.",
    })


# Values that a JSON round trip gives back unchanged (as the same type and value).
_JSON_SCALARS = frozenset((str, int, float, bool, type(None)))


def json_checked(value: Any, what: str) -> Any:
    """``value`` as JSON gives it back (a copy); raises TypeError if it is not JSON."""
    if value is None:
        return None
    # A flat dict of plain values (metrics, usually) comes back as a copy of
    # itself: made directly, without the encoder and decoder on a save's clock.
    if type(value) is dict and all(type(k) is str and type(v) in _JSON_SCALARS
                                   for k, v in value.items()):
        return dict(value)
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-serializable: {e}") from e


def handler_item_names(item_handlers: Any) -> tuple[str, ...] | None:
    if item_handlers is None:
        return None
    if not isinstance(item_handlers, dict):
        raise ValueError("item_handlers must map item names to handlers (one unnamed handler "
                         "is the default item: leave it out)")
    for name, handler in item_handlers.items():
        kind = type(handler).__name__
        if kind not in ("StandardCheckpointHandler", "PyTreeCheckpointHandler",
                        "JsonCheckpointHandler"):
            raise ValueError(f"item {name!r}: handler {kind} is not supported (Standard, "
                             "PyTree and Json checkpoint handlers are)")
    return tuple(item_handlers)


@functools.cache
def _distributed_state() -> Any:
    # Imported once: a ``from`` import of a package runs Python code on every call.
    from jax._src import distributed

    return distributed.global_state


def preemption_reached(step: int) -> bool:
    """JAX's preemption sync point (``multihost_utils.reached_preemption_sync_point``)."""
    state = _distributed_state()
    if state.client is None:
        return False
    if state.preemption_sync_manager is None:
        return False  # the preemption service is off: no notice can arrive
    from jax.experimental import multihost_utils

    return bool(multihost_utils.reached_preemption_sync_point(step))
