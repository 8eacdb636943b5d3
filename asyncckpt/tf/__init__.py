"""TensorFlow front end: drop-ins for ``tf.train.Checkpoint`` and ``CheckpointManager``.

Importing this subpackage imports TensorFlow; ``import asyncckpt`` alone does not.
"""

from asyncckpt.tf._partial import PartialRestore
from asyncckpt.tf._urls import latest_checkpoint
from asyncckpt.tf.checkpoint import Checkpoint, CheckpointNotFoundError, verify_checkpoint
from asyncckpt.tf.manager import CheckpointManager

__all__ = [
    "Checkpoint",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "PartialRestore",
    "latest_checkpoint",
    "verify_checkpoint",
]
