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
internal and may change. The coordination errors it raises
(``CoordinationError``, ``CoordinationTimeoutError``, ``PeerFailedError``)
are ``asyncckpt``'s, shared with the JAX manager's multi-process commit.
Importing this package imports neither TensorFlow nor JAX.
"""

from asyncckpt import _deprecation
from asyncckpt.preemption.agreement import AgreementOptions
from asyncckpt.preemption.config import TerminationConfig
from asyncckpt.preemption.grace import GraceOptions
from asyncckpt.preemption.handler import PreemptionCheckpointHandler, PreemptionSave
from asyncckpt.preemption.platform import Platform, detect_platform

__all__ = [
    "AgreementOptions",
    "GraceOptions",
    "Platform",
    "PreemptionCheckpointHandler",
    "PreemptionSave",
    "TerminationConfig",
    "detect_platform",
]

# Names that left this namespace in asyncckpt 0.2: they warn, for one release.
__getattr__ = _deprecation.moved(__name__, {
    name: ("asyncckpt.errors", name, f"use asyncckpt.{name} (the JAX manager raises it too)")
    for name in ("CoordinationError", "CoordinationTimeoutError", "PeerFailedError")
})
