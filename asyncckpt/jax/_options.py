"""The manager's settings, from keyword arguments or from orbax's ``CheckpointManagerOptions``.

``ManagerConfig`` is what the manager works from. ``from_orbax`` maps every
field of ``orbax.checkpoint.CheckpointManagerOptions`` onto it: fields with
an asyncckpt meaning are honoured, performance hints with no effect on what
is saved are accepted, and every other field set away from orbax's default
is refused with an error naming it, so no setting is silently ignored.
orbax is never imported here: its options object is read by attribute.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import re
from collections.abc import Callable, Container
from dataclasses import dataclass
from typing import Any, Literal

from asyncckpt._engine import retention

logger = logging.getLogger(__name__)

# Fields of orbax's CheckpointManagerOptions that only schedule orbax's own
# work; asyncckpt's behaviour with any value is what orbax's is (why, for each,
# in docs/compat.md), so any value is accepted.
_HINTS = frozenset({
    "num_deletion_threads",  # the writer thread deletes
    "lightweight_initialize",  # step records are read lazily, when a rule needs them
    "single_host_load_and_broadcast",  # listing is one local directory read
})

# Fields honoured by ManagerConfig.
_HONOURED = frozenset({
    "save_interval_steps", "max_to_keep", "keep_time_interval", "keep_period", "best_fn",
    "best_mode", "keep_checkpoints_without_metrics", "step_prefix", "step_format_fixed_length",
    "create", "save_on_steps", "todelete_subdir", "read_only", "enable_async_checkpointing",
    "should_save_fn", "save_root_metadata", "prevent_write_metrics", "save_decision_policy",
    "preservation_policy", "enable_should_save_is_saving_in_progress_check", "async_options",
    "temporary_path_class", "atomicity_options", "cleanup_tmp_directories", "file_options",
    "enable_background_delete",
})

# Why the others are refused when set, and what to use instead.
_REFUSED = {
    "step_name_format": "custom NameFormat classes (use step_prefix / step_format_fixed_length)",
    "todelete_full_path": "soft deletion to a bucket path (GCS only; use todelete_subdir)",
    "multiprocessing_options": "orbax's MultiprocessingOptions (asyncckpt coordinates all "
                               "JAX processes itself, process 0 as primary: leave it default)",
    "enable_per_process_directory_creation": "per-process step directories (leave it False)",
}

# orbax's temporary path classes (``orbax.checkpoint.path.atomicity``) by name:
# whether a step is committed by a marker file instead of a rename.
_TEMPORARY_PATHS = {"AtomicRenameTemporaryPath": False, "CommitFileTemporaryPath": True}

# The file that commits a step written in place (orbax's ``commit_success.txt``).
COMMIT_FILE = "commit_success.txt"


@dataclass(frozen=True, kw_only=True)
class StepNames:
    """How a step's directory is named: ``[prefix_]<step, zero padded to fixed_length>``.

    The same rule as orbax's standard name format, so either manager finds
    the other's steps.
    """

    prefix: str | None = None
    fixed_length: int | None = None

    def __post_init__(self) -> None:
        if self.prefix is not None and (not self.prefix or "/" in self.prefix
                                        or self.prefix.startswith(".")):
            raise ValueError(f"step_prefix must be a plain name, got {self.prefix!r}")
        if self.fixed_length is not None and self.fixed_length < 0:
            raise ValueError(f"step_format_fixed_length must be >= 0, got {self.fixed_length}")
        n = self.fixed_length
        digits = rf"(0\d{{{n - 1}}}|[1-9]\d{{{n - 1}}}\d*)" if n else r"(0|[1-9]\d*)"
        head = re.escape(f"{self.prefix}_") if self.prefix else ""
        object.__setattr__(self, "_pattern", re.compile(f"{head}{digits}"))

    def name(self, step: int) -> str:
        digits = f"{step:0{self.fixed_length}d}" if self.fixed_length else str(step)
        return f"{self.prefix}_{digits}" if self.prefix else digits

    def parse(self, name: str) -> int | None:
        """The step a directory name stands for, or None if it is not a step."""
        m = self._pattern.fullmatch(name)  # type: ignore[attr-defined]
        return int(m.group(1)) if m else None


@dataclass(frozen=True, kw_only=True)
class ManagerConfig:
    """Everything that decides when the manager saves, what it keeps and how it names steps.

    Attributes:
        max_to_keep: Checkpoints kept (None: all; 0: none, as orbax: every
            save is deleted once written, unless a preserving rule keeps it).
        keep_time_interval_s: Preserve one checkpoint per this many seconds.
        keep_period: Preserve every step divisible by this.
        best_fn: Ranks checkpoints by their metrics (with ``max_to_keep``).
        best_mode: ``"max"`` or ``"min"``.
        keep_checkpoints_without_metrics: With ``best_fn``, keep checkpoints
            saved without metrics.
        save_interval_steps: ``should_save`` is true on multiples of this.
        save_on_steps: Further steps ``should_save`` is true on.
        should_save_fn: ``(step, latest_step) -> bool``; replaces the two above.
        names: Step directory names.
        read_only: Saves and deletes are skipped (with a warning).
        create: Create the directory at construction.
        todelete_subdir: Deleted steps are moved into this subdirectory.
        enable_async: False makes ``save`` return only once the step is durable.
        save_root_metadata: Write the manager-level ``metadata=`` once.
        write_metrics: Write the ``metrics`` item orbax's ``best_fn`` reads.
        save_decision_policy: orbax ``SaveDecisionPolicy`` (or any object with
            its ``should_save``); replaces the save rules above.
        preservation_policy: orbax ``PreservationPolicy`` (or any object with
            its ``should_preserve``); replaces the retention rules above.
        multiprocessing_options: orbax's ``MultiprocessingOptions``, handed to
            the save-decision policy in its ``DecisionContext``.
        saving_in_progress_check: Tell the save-decision policy whether a save
            is in flight (orbax's ``enable_should_save_is_saving_in_progress_check``).
        commit_marker: Steps are written in place and committed by this file
            (orbax's ``CommitFileTemporaryPath``); None: by a rename.
        legacy_rename_ok: With ``commit_marker``, a step directory without the
            marker counts as committed too (orbax's ``allow_legacy_atomic_rename``).
        cleanup_tmp_directories: Before the first save, also remove orbax's
            temporaries (and, with ``commit_marker``, uncommitted step directories).
        save_timeout_s: A save not committed this long after its ``save()``
            call fails with ``TimeoutError`` (orbax's ``AsyncOptions.timeout_secs``).
        post_finalization_callback: Called with no argument on the writer
            thread once each save is committed (orbax's ``AsyncOptions``).
        create_directories_asynchronously: False makes ``save()`` create the
            step's directory before it returns (orbax's ``AsyncOptions``).
        path_permission_mode: Permission bits of the directories the manager
            creates (its own, each step's and everything in it) and, less the
            execute bits, of its files (orbax's ``FileOptions``); None: the
            umask's default.
        background_delete: ``wait_until_finished()`` and ``delete()`` do not
            wait for deleted steps' files to be gone; ``close()`` does
            (orbax's ``enable_background_delete``). A deleted step leaves
            the listing at once either way.
    """

    max_to_keep: int | None = None
    keep_time_interval_s: float | None = None
    keep_period: int | None = None
    best_fn: Callable[[Any], float] | None = None
    best_mode: Literal["max", "min"] = "max"
    keep_checkpoints_without_metrics: bool = True
    save_interval_steps: int = 1
    save_on_steps: frozenset[int] = frozenset()
    should_save_fn: Callable[[int, int | None], bool] | None = None
    names: StepNames = StepNames()
    read_only: bool = False
    create: bool = True
    todelete_subdir: str | None = None
    enable_async: bool = True
    save_root_metadata: bool = True
    write_metrics: bool = True
    save_decision_policy: Any = None
    preservation_policy: Any = None
    multiprocessing_options: Any = None
    saving_in_progress_check: bool = True
    commit_marker: str | None = None
    legacy_rename_ok: bool = False
    cleanup_tmp_directories: bool = False
    save_timeout_s: float | None = None
    post_finalization_callback: Callable[[], Any] | None = None
    create_directories_asynchronously: bool = True
    path_permission_mode: int | None = None
    background_delete: bool = False

    def __post_init__(self) -> None:
        retention.check_max_to_keep(self.max_to_keep, allow_zero=True)  # orbax keeps none at 0
        _check_int("keep_period", self.keep_period, minimum=1, optional=True)
        _check_int("save_interval_steps", self.save_interval_steps, minimum=0)
        if self.best_mode not in ("max", "min"):
            raise ValueError(f"best_mode must be 'max' or 'min', got {self.best_mode!r}")
        if self.keep_time_interval_s is not None and self.keep_time_interval_s <= 0:
            raise ValueError(f"keep_time_interval must be positive, got "
                             f"{self.keep_time_interval_s} s")
        if self.todelete_subdir is not None and (
            not self.todelete_subdir or self.names.parse(self.todelete_subdir.split("/")[0])
            is not None
        ):
            raise ValueError(f"todelete_subdir must be a name that is not a step, got "
                             f"{self.todelete_subdir!r}")
        if self.save_decision_policy is not None and not callable(
                getattr(self.save_decision_policy, "should_save", None)):
            raise TypeError(f"save_decision_policy {self.save_decision_policy!r} has no "
                            "should_save(step, previous_steps, *, context) method")
        if self.preservation_policy is not None and not callable(
                getattr(self.preservation_policy, "should_preserve", None)):
            raise TypeError(f"preservation_policy {self.preservation_policy!r} has no "
                            "should_preserve(checkpoints, *, context) method")
        if self.save_timeout_s is not None and self.save_timeout_s <= 0:
            raise ValueError(f"the save timeout must be positive, got {self.save_timeout_s} s")
        if self.path_permission_mode is not None and not (
                isinstance(self.path_permission_mode, int)
                and 0 <= self.path_permission_mode <= 0o7777):
            raise ValueError(f"path_permission_mode must be a permission mode such as 0o750, "
                             f"got {self.path_permission_mode!r}")
        if self.post_finalization_callback is not None and not callable(
                self.post_finalization_callback):
            raise TypeError(f"post_finalization_callback {self.post_finalization_callback!r} "
                            "is not callable")

    def metric(self, metrics: Any) -> float | None:
        """``best_fn(metrics)``; None without ``best_fn`` or metrics, or if it fails."""
        if self.best_fn is None or not metrics:
            return None
        try:
            return float(self.best_fn(metrics))
        except Exception as e:  # metrics of an older run that best_fn does not expect
            logger.warning("best_fn failed on metrics %r (%r): ranking the checkpoint as one "
                           "without metrics", metrics, e)
            return None

    def on_schedule(self, step: int, latest: int | None) -> bool:
        """Whether the save rules (not preemption, not the first save) pick ``step``."""
        if self.should_save_fn is not None:
            return bool(self.should_save_fn(step, latest))
        if self.save_interval_steps and step % self.save_interval_steps == 0:
            return True
        return step in self.save_on_steps


def _check_int(name: str, value: Any, *, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not hasattr(value, "__index__") or int(value) < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}{' or None' if optional else ''}, "
                         f"got {value!r}")


def from_orbax(options: Any) -> ManagerConfig:
    """A ``ManagerConfig`` from an ``orbax.checkpoint.CheckpointManagerOptions``.

    Raises:
        ValueError: a field asyncckpt cannot honour is set away from orbax's
            default (the field is named, with what to use instead), or
            fields that orbax refuses together.
        TypeError: ``options`` is not orbax's options dataclass.
    """
    if not dataclasses.is_dataclass(options) or type(options).__name__ != (
        "CheckpointManagerOptions"
    ):
        raise TypeError(f"options must be orbax.checkpoint.CheckpointManagerOptions, got "
                        f"{type(options).__module__}.{type(options).__qualname__}")
    defaults = type(options)()
    for f in dataclasses.fields(options):
        if f.name in _HONOURED or f.name in _HINTS:
            continue
        value = getattr(options, f.name)
        if value == getattr(defaults, f.name):
            continue
        why = _REFUSED.get(f.name, "an option this version of asyncckpt does not know")
        raise ValueError(
            f"CheckpointManagerOptions.{f.name}={value!r} is not supported by "
            f"asyncckpt.jax.CheckpointManager: {why}"
        )
    if options.preservation_policy is not None and (
            options.keep_time_interval or options.max_to_keep or options.keep_period):
        raise ValueError("preservation_policy and the delete options (max_to_keep, "
                         "keep_time_interval, keep_period) are mutually exclusive, as in orbax")
    interval = options.keep_time_interval
    if isinstance(interval, datetime.timedelta):
        interval_s: float | None = interval.total_seconds()
    else:
        interval_s = None if interval is None else float(interval)
    marker, legacy = _commit_mode(options.temporary_path_class, options.atomicity_options)
    timeout_s, callback, dirs_async = _async_options(options.async_options,
                                                     options.enable_async_checkpointing)
    return ManagerConfig(
        max_to_keep=options.max_to_keep,
        keep_time_interval_s=interval_s,
        keep_period=options.keep_period,
        best_fn=options.best_fn,
        best_mode=options.best_mode,
        keep_checkpoints_without_metrics=options.keep_checkpoints_without_metrics,
        save_interval_steps=options.save_interval_steps or 0,  # None: no interval rule
        save_on_steps=_steps(options.save_on_steps),
        should_save_fn=options.should_save_fn,
        names=StepNames(prefix=options.step_prefix,
                        fixed_length=options.step_format_fixed_length),
        read_only=options.read_only,
        create=options.create,
        todelete_subdir=options.todelete_subdir,
        enable_async=options.enable_async_checkpointing,
        save_root_metadata=options.save_root_metadata,
        write_metrics=not options.prevent_write_metrics,
        save_decision_policy=options.save_decision_policy,
        preservation_policy=options.preservation_policy,
        multiprocessing_options=options.multiprocessing_options,
        saving_in_progress_check=options.enable_should_save_is_saving_in_progress_check,
        commit_marker=marker,
        legacy_rename_ok=legacy,
        cleanup_tmp_directories=options.cleanup_tmp_directories,
        save_timeout_s=timeout_s,
        post_finalization_callback=callback,
        create_directories_asynchronously=dirs_async,
        path_permission_mode=_file_options(options.file_options),
        background_delete=options.enable_background_delete,
    )


def _file_options(file_options: Any) -> int | None:
    """orbax's ``FileOptions``: the permission mode (None: the umask's default).

    Raises:
        ValueError: ``skip_sync_file_validations`` is set (asyncckpt's checks
            before a save read its in-memory listing; there is nothing to skip).
    """
    if file_options is None:
        return None
    if getattr(file_options, "skip_sync_file_validations", False):
        raise ValueError(
            "FileOptions.skip_sync_file_validations=True is not supported by "
            "asyncckpt.jax.CheckpointManager: its checks before a save read the listing it "
            "keeps in memory (a stat of the directory), so there is no file system check to "
            "skip; leave it False")
    return getattr(file_options, "path_permission_mode", None)


def with_checkpointers(config: ManagerConfig, *, use_async: bool | None,
                       timeout_s: float | None, async_options_given: bool) -> ManagerConfig:
    """``config`` with what orbax takes from its older positional ``checkpointers``.

    Only synchronous ``Checkpointer``s: synchronous saves (and directories made
    in ``save()``). An ``AsyncCheckpointer``: its timeout, unless orbax's
    ``AsyncOptions`` gave one. ``use_async`` None: no checkpointers were given.

    Raises:
        ValueError: a post-finalization callback with synchronous checkpointers
            only (orbax refuses it too).
    """
    if use_async is None:
        return config
    if not use_async:
        if config.post_finalization_callback is not None:
            raise ValueError("AsyncOptions.post_finalization_callback needs an "
                             "AsyncCheckpointer, as in orbax")
        return dataclasses.replace(config, enable_async=False,
                                   create_directories_asynchronously=False)
    if not async_options_given and timeout_s is not None:
        return dataclasses.replace(config, save_timeout_s=timeout_s)
    return config


def _commit_mode(path_class: Any, atomicity: Any) -> tuple[str | None, bool]:
    """How steps are committed: ``(marker file or None for a rename, legacy renames count)``.

    orbax's ``temporary_path_class`` wins over ``atomicity_options.mode``, as in
    orbax; ``AUTO`` is a rename (what orbax picks for a local directory).

    Raises:
        ValueError: a temporary path class other than orbax's two.
    """
    legacy = bool(getattr(atomicity, "allow_legacy_atomic_rename", False))
    if path_class is not None:
        name = getattr(path_class, "__name__", None)
        if (name not in _TEMPORARY_PATHS
                or not getattr(path_class, "__module__", "").startswith("orbax.")):
            raise ValueError(
                f"CheckpointManagerOptions.temporary_path_class={path_class!r} is not supported "
                "by asyncckpt.jax.CheckpointManager: it commits steps as orbax's "
                "AtomicRenameTemporaryPath (a rename) or CommitFileTemporaryPath (a "
                f"{COMMIT_FILE} file) do; use one of those")
        return (COMMIT_FILE if _TEMPORARY_PATHS[name] else None), legacy
    mode = getattr(getattr(atomicity, "mode", None), "value", "auto")
    if mode == "commit_file":
        return COMMIT_FILE, legacy
    if mode in ("auto", "atomic_rename"):
        return None, legacy
    raise ValueError(f"AtomicityOptions.mode={mode!r} is not supported (use AUTO, "
                     "ATOMIC_RENAME or COMMIT_FILE)")


def _async_options(async_options: Any, enable_async: bool
                   ) -> tuple[float | None, Callable[[], Any] | None, bool]:
    """orbax's ``AsyncOptions``: ``(timeout, post-finalization callback, dirs made async)``.

    Raises:
        ValueError: ``barrier_sync_fn`` is set, or a post-finalization
            callback without asynchronous saves (orbax refuses that too).
    """
    if async_options is None:
        return None, None, True
    if getattr(async_options, "barrier_sync_fn", None) is not None:
        raise ValueError("AsyncOptions.barrier_sync_fn is not supported by "
                         "asyncckpt.jax.CheckpointManager: it synchronises JAX processes "
                         "through jax.distributed's key-value store; leave it None")
    callback = async_options.post_finalization_callback
    if callback is not None and not enable_async:
        raise ValueError("AsyncOptions.post_finalization_callback needs asynchronous saves "
                         "(enable_async_checkpointing=True), as in orbax")
    timeout = async_options.timeout_secs
    return (None if timeout is None else float(timeout), callback,
            bool(async_options.create_directories_asynchronously) and enable_async)


def _steps(steps: Container[int] | None) -> frozenset[int]:
    if steps is None:
        return frozenset()
    try:
        return frozenset(int(s) for s in steps)  # type: ignore[attr-defined]
    except TypeError as e:
        raise ValueError(f"save_on_steps must be an iterable of steps, got {steps!r}") from e
