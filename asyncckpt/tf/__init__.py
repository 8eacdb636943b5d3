"""TensorFlow front end: drop-ins for ``tf.train.Checkpoint`` and ``CheckpointManager``.

Importing this subpackage imports TensorFlow; ``import asyncckpt`` alone does not.
A missing checkpoint raises an error that is both ``asyncckpt.CheckpointNotFoundError``
and TensorFlow's ``tf.errors.NotFoundError``: catch either.
"""

from asyncckpt import _deprecation
from asyncckpt.tf._partial import PartialRestore
from asyncckpt.tf._urls import latest_checkpoint
from asyncckpt.tf.checkpoint import Checkpoint, verify_checkpoint
from asyncckpt.tf.manager import CheckpointManager

__all__ = [
    "Checkpoint",
    "CheckpointManager",
    "PartialRestore",
    "latest_checkpoint",
    "verify_checkpoint",
]

# Names that left this namespace in asyncckpt 0.2: they warn, for one release.
__getattr__ = _deprecation.moved(__name__, {
    "CheckpointNotFoundError": (
        "asyncckpt.tf.checkpoint", "CheckpointNotFoundError",
        "catch asyncckpt.CheckpointNotFoundError or tf.errors.NotFoundError (what the "
        "TensorFlow front end raises is both)"),
})
