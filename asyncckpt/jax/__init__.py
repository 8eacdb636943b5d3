"""JAX front end: orbax's ``CheckpointManager`` for pytrees of sharded arrays, asynchronous.

Checkpoints are written asynchronously in orbax's zarr layout, so
``orbax.checkpoint`` restores them too; orbax's ``args=`` and
``CheckpointManagerOptions`` spellings are accepted (see ``docs/compat.md``).
Importing this subpackage imports JAX; ``import asyncckpt`` alone does not,
and orbax is imported only when its types are used (the checkpointers, one
pytree to one path, subclass orbax's ``AbstractCheckpointer``: they are
made on first use).
"""

try:
    import jax as _jax  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "asyncckpt.jax needs JAX: pip install 'asyncckpt[jax]' (or pip install jax)"
    ) from e

from asyncckpt import _deprecation
from asyncckpt.jax._args import PLACEHOLDER
from asyncckpt.jax._compat import step_already_exists_error
from asyncckpt.jax._metadata import RootMetadata, StepMetadata
from asyncckpt.jax._ocdbt import FormatOptions
from asyncckpt.jax.manager import CheckpointManager

# asyncckpt.jax.checkpointer imports orbax (its base class): loaded on first use.
_CHECKPOINTERS = frozenset(
    {"AsyncCheckpointer", "Checkpointer", "PyTreeCheckpointer", "StandardCheckpointer"})

__all__ = [
    "PLACEHOLDER",
    "AsyncCheckpointer",
    "CheckpointManager",
    "Checkpointer",
    "FormatOptions",
    "PyTreeCheckpointer",
    "RootMetadata",
    "StandardCheckpointer",
    "StepAlreadyExistsError",
    "StepMetadata",
]


# Names that left this namespace in asyncckpt 0.2: they warn, for one release.
_moved = _deprecation.moved(__name__, {
    "CoordinationError": ("asyncckpt.errors", "CoordinationError",
                          "use asyncckpt.CoordinationError (the preemption handler raises it too)"),
})


def __getattr__(name: str):
    # Made on first use: a subclass of orbax's StepAlreadyExistsError when
    # orbax is installed, so importing asyncckpt.jax does not import orbax.
    if name == "StepAlreadyExistsError":
        return step_already_exists_error()
    if name in _CHECKPOINTERS:
        from asyncckpt.jax import checkpointer

        return getattr(checkpointer, name)
    return _moved(name, stacklevel=2)
