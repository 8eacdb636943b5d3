"""JAX front end: an orbax-style ``CheckpointManager`` for pytrees of sharded arrays.

Checkpoints are written asynchronously in orbax's zarr layout, so
``orbax.checkpoint`` restores them too. Importing this subpackage imports JAX;
``import asyncckpt`` alone does not.
"""

try:
    import jax as _jax  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "asyncckpt.jax needs JAX: pip install 'asyncckpt[jax]' (or pip install jax)"
    ) from e

from asyncckpt.jax._distributed import CoordinationError
from asyncckpt.jax.manager import CheckpointManager, StepMetadata

__all__ = ["CheckpointManager", "CoordinationError", "StepMetadata"]
