"""Preemption handling: save the last step in time, on every worker, then exit.

``PreemptionCheckpointHandler`` watches for termination notices (SIGTERM,
GCE maintenance and Spot preemption notices, a user function), makes every
worker agree on one step to save at, saves there through an asyncckpt
checkpoint manager (TensorFlow or JAX), waits until the checkpoint is
durable, and exits with the platform's restart code. With a grace period, it
keeps training and starts the final save just early enough, sized from the
measured distributions of write and step times. See ``docs/preemption.md``.

The names below are the public API; the submodules (``config``,
``platform``, ``watchers``, ``agreement``, ``grace``, ``handler``) are
internal and may change. Importing this package imports neither TensorFlow
nor JAX.
"""

from asyncckpt._coordination import CoordinationError, CoordinationTimeoutError, PeerFailedError
from asyncckpt.preemption.agreement import AgreementOptions
from asyncckpt.preemption.config import TerminationConfig
from asyncckpt.preemption.grace import GraceOptions
from asyncckpt.preemption.handler import PreemptionCheckpointHandler, PreemptionSave
from asyncckpt.preemption.platform import Platform, detect_platform

__all__ = [
    "AgreementOptions",
    "CoordinationError",
    "CoordinationTimeoutError",
    "GraceOptions",
    "PeerFailedError",
    "Platform",
    "PreemptionCheckpointHandler",
    "PreemptionSave",
    "TerminationConfig",
    "detect_platform",
]
