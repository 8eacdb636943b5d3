"""Preemption handling: save the last step in time, on every worker, then exit.

``PreemptionCheckpointHandler`` watches for termination notices (SIGTERM,
GCE maintenance and Spot preemption notices, a user function), makes every
worker agree on one step to save at, saves there through an asyncckpt
checkpoint manager (TensorFlow or JAX), waits until the checkpoint is
durable, and exits with the platform's restart code. With a grace period, it
keeps training and starts the final save just early enough, sized from the
measured write and step times. See ``docs/preemption.md``.

Importing this package imports neither TensorFlow nor JAX.
"""

from asyncckpt.preemption.agreement import AgreementOptions, Decision, StepAgreement
from asyncckpt.preemption.config import (
    EXIT_CODE_GCE,
    EXIT_CODE_OTHER,
    Platform,
    PlatformPreset,
    ResolvedTermination,
    TerminationConfig,
    exit_process,
    resolve_termination_config,
)
from asyncckpt.preemption.coordination import (
    CoordinationTimeoutError,
    Coordinator,
    InProcessCoordinator,
    JaxCoordinator,
    PeerFailedError,
    TFCoordinator,
    auto_coordinator,
)
from asyncckpt.preemption.grace import GraceClock, GraceOptions, margin_seconds
from asyncckpt.preemption.handler import PreemptionCheckpointHandler, PreemptionSave
from asyncckpt.preemption.platform import MetadataClient, detect_platform, metadata_host
from asyncckpt.preemption.watchers import Notice

__all__ = [
    "EXIT_CODE_GCE",
    "EXIT_CODE_OTHER",
    "AgreementOptions",
    "CoordinationTimeoutError",
    "Coordinator",
    "Decision",
    "GraceClock",
    "GraceOptions",
    "InProcessCoordinator",
    "JaxCoordinator",
    "MetadataClient",
    "Notice",
    "PeerFailedError",
    "Platform",
    "PlatformPreset",
    "PreemptionCheckpointHandler",
    "PreemptionSave",
    "ResolvedTermination",
    "StepAgreement",
    "TFCoordinator",
    "TerminationConfig",
    "auto_coordinator",
    "detect_platform",
    "exit_process",
    "margin_seconds",
    "metadata_host",
    "resolve_termination_config",
]
