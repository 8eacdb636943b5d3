"""``TerminationConfig`` and the platform presets it is completed from.

A preemption handler needs three answers from the platform: how a
termination notice arrives, how long the job has between the notice and the
end (the grace period), and how to exit so that the job is restarted. The
answers differ between a GCE VM with GPUs (a one-hour maintenance notice), a
GCE VM without GPUs (60 seconds), a Spot VM (30 seconds) and anything else (a
SIGTERM from a scheduler). ``TerminationConfig`` holds what the user chose;
``resolve_termination_config`` fills every field the user left out from the
preset of the detected platform.

Imports ``platform`` (detection), never the other way round.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any

from asyncckpt.preemption.platform import Platform, detect_platform

logger = logging.getLogger(__name__)

# Exit codes TensorFlow's handler uses, so restart policies written for it keep
# working: 143 (128 + SIGTERM) on GCE, 42 elsewhere (Borg's restart code).
EXIT_CODE_GCE = 143
EXIT_CODE_OTHER = 42

# GCE: "Compute Engine gives GPU VMs a 1-hour stopping notice, while normal VMs
# receive only a 60-second notice" (GPU host maintenance documentation).
GRACE_GCE_GPU_S = 3600.0
GRACE_GCE_OTHER_S = 60.0
# GCE Spot and preemptible VMs: 30 s from the preemption notice to the hard stop.
SPOT_NOTICE_S = 30.0


@dataclass(frozen=True, kw_only=True)
class PlatformPreset:
    """The defaults of one platform.

    Attributes:
        platform: The platform.
        grace_period: Seconds from a maintenance (or user) notice to termination.
        exit_code: Exit code of the default ``exit_fn``.
        watch_metadata: Watch the GCE metadata server for maintenance and Spot
            preemption notices.
        sigterm_grace_cap: Upper bound on the grace period after a SIGTERM
            (None: the configured grace period applies). On GCE a SIGTERM means
            the VM is already shutting down, so the checkpoint is saved at once.
        spot_grace_cap: Upper bound on the grace period after a Spot
            preemption notice.
    """

    platform: Platform
    grace_period: float
    exit_code: int
    watch_metadata: bool
    sigterm_grace_cap: float | None
    spot_grace_cap: float


PRESETS: dict[Platform, PlatformPreset] = {
    Platform.GCE_GPU: PlatformPreset(
        platform=Platform.GCE_GPU,
        grace_period=GRACE_GCE_GPU_S,
        exit_code=EXIT_CODE_GCE,
        watch_metadata=True,
        sigterm_grace_cap=0.0,
        spot_grace_cap=SPOT_NOTICE_S,
    ),
    Platform.GCE_TPU: PlatformPreset(
        platform=Platform.GCE_TPU,
        grace_period=GRACE_GCE_OTHER_S,
        exit_code=EXIT_CODE_GCE,
        watch_metadata=True,
        sigterm_grace_cap=0.0,
        spot_grace_cap=SPOT_NOTICE_S,
    ),
    Platform.GCE_CPU: PlatformPreset(
        platform=Platform.GCE_CPU,
        grace_period=GRACE_GCE_OTHER_S,
        exit_code=EXIT_CODE_GCE,
        watch_metadata=True,
        sigterm_grace_cap=0.0,
        spot_grace_cap=SPOT_NOTICE_S,
    ),
    Platform.OTHER: PlatformPreset(
        platform=Platform.OTHER,
        grace_period=0.0,
        exit_code=EXIT_CODE_OTHER,
        watch_metadata=False,
        sigterm_grace_cap=None,
        spot_grace_cap=SPOT_NOTICE_S,
    ),
}


def exit_process(code: int) -> None:
    """The default ``exit_fn``: ends the process with ``code``.

    On the main thread this raises ``SystemExit``: ``finally`` blocks and
    context managers run, then the interpreter shuts down in order (TensorFlow's
    and JAX's coordination clients leave their clusters cleanly, and the peers,
    which exit at the same step, are not left waiting on a vanished task).
    From another thread ``SystemExit`` would only end that thread, so the
    process is ended with ``os._exit`` after flushing the standard streams; the
    checkpoint is already durable at that point.
    """
    if threading.current_thread() is threading.main_thread():
        sys.exit(code)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


@dataclass(frozen=True)
class TerminationConfig:
    """How a job learns of, and reacts to, an upcoming termination.

    Every field left as None is filled from the preset of the detected
    platform (see ``docs/preemption.md``). The first four fields are
    TensorFlow's ``tf.distribute.experimental.TerminationConfig`` arguments,
    in its order, so ``TerminationConfig(watcher, exit_fn, 60)`` means the same
    in both; the fields asyncckpt adds are keyword-only.

    Attributes:
        termination_watcher_fn: Called about once a second on a background
            thread; returning True is a termination notice. Watched in addition
            to SIGTERM and, on GCE, the metadata server. It should return
            quickly.
        exit_fn: Called after the final checkpoint is durable on every worker.
            Default: exit with 143 on GCE, 42 elsewhere (see ``exit_process``).
            If it returns, training may go on; the handler stops watching.
        grace_period: Seconds from a notice to termination. With a positive
            grace period, training continues after the notice and the final
            save starts just early enough to be durable before the deadline;
            with 0 the checkpoint is saved at the next step boundary.
        save_fn: Called instead of the manager's ``save`` to write the
            checkpoint, with the arguments given to
            ``save_checkpoint_if_preempted``. The handler still waits for the
            engine to make it durable.
        platform: Skip detection and use this platform's preset.
        poll_interval_s: How often ``termination_watcher_fn`` is called.
    """

    termination_watcher_fn: Callable[[], bool] | None = None
    exit_fn: Callable[[], object] | None = None
    grace_period: float | None = None
    save_fn: Callable[..., object] | None = None
    _: KW_ONLY
    platform: Platform | str | None = None
    poll_interval_s: float = 1.0

    def __post_init__(self) -> None:
        if self.grace_period is not None and self.grace_period < 0:
            raise ValueError(f"grace_period must be >= 0, got {self.grace_period!r}")
        if self.poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be > 0, got {self.poll_interval_s!r}")
        if self.platform is not None:
            object.__setattr__(self, "platform", Platform.parse(self.platform))


def termination_config_of(config: Any) -> TerminationConfig:
    """``config`` as a ``TerminationConfig``; TensorFlow's own is read field by field.

    A ``tf.distribute.experimental.TerminationConfig`` (or any object with
    its four attributes) keeps its meaning: its watcher, exit function, grace
    period and save function are taken as they are. None is the default config.

    Raises:
        TypeError: ``config`` is neither.
    """
    if config is None:
        return TerminationConfig()
    if isinstance(config, TerminationConfig):
        return config
    fields = ("termination_watcher_fn", "exit_fn", "grace_period", "save_fn")
    if all(hasattr(config, name) for name in fields):
        return TerminationConfig(*(getattr(config, name) for name in fields))
    raise TypeError(
        "termination_config must be an asyncckpt.preemption.TerminationConfig or "
        f"TensorFlow's tf.distribute.experimental.TerminationConfig, got {type(config)!r}"
    )


@dataclass(frozen=True, kw_only=True)
class ResolvedTermination:
    """A ``TerminationConfig`` with every default filled in for one platform."""

    platform: Platform
    preset: PlatformPreset
    grace_period: float
    exit_code: int | None
    exit_fn: Callable[[], object]
    save_fn: Callable[..., object] | None
    termination_watcher_fn: Callable[[], bool] | None
    poll_interval_s: float

    def grace_for(self, source: str) -> float:
        """Grace period of a notice from ``source`` (see ``watchers.Notice``)."""
        grace = self.grace_period
        if source == "sigterm" and self.preset.sigterm_grace_cap is not None:
            grace = min(grace, self.preset.sigterm_grace_cap)
        elif source == "gce-preempted":
            grace = min(grace, self.preset.spot_grace_cap)
        return grace


def resolve_termination_config(
    config: Any,
    *,
    framework: str | None = None,
    detect: Callable[..., Platform] | None = None,
) -> ResolvedTermination:
    """Completes ``config`` from the preset of the platform it runs on.

    Args:
        config: What the user set (``TerminationConfig``, or TensorFlow's:
            see ``termination_config_of``); None takes every default.
        framework: ``"tensorflow"`` or ``"jax"``: where detection asks for the
            device kind when the metadata server cannot tell.
        detect: Platform detection (default: ``platform.detect_platform``).
    """
    config = termination_config_of(config)
    if config.platform is not None:
        platform = Platform.parse(config.platform)
    else:
        platform = (detect or detect_platform)(framework=framework)
    preset = PRESETS[platform]
    grace = preset.grace_period if config.grace_period is None else float(config.grace_period)
    if config.exit_fn is not None:
        exit_fn, exit_code = config.exit_fn, None
    else:
        exit_fn, exit_code = functools.partial(exit_process, preset.exit_code), preset.exit_code
    resolved = ResolvedTermination(
        platform=platform,
        preset=preset,
        grace_period=grace,
        exit_code=exit_code,
        exit_fn=exit_fn,
        save_fn=config.save_fn,
        termination_watcher_fn=config.termination_watcher_fn,
        poll_interval_s=config.poll_interval_s,
    )
    logger.info(
        "preemption: platform %s, grace period %.0f s, exit %s",
        platform.value,
        grace,
        f"code {exit_code}" if exit_code is not None else "by the configured exit_fn",
    )
    return resolved
