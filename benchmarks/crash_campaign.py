"""Crash campaign: real SIGKILLs and real I/O errors against the TF and JAX managers.

Usage::

    python benchmarks/crash_campaign.py --framework tf|jax|both --kills N --io-errors M --seed S

**Kills.** A *zygote* process (``crash_zygote.py``) imports TensorFlow/JAX
and asyncckpt once and then forks one child per trial, so a kill costs a fork
instead of a multi-second import. A child restores the newest checkpoint through the
manager (as a restarted job does), checks it is exact, and saves a
deterministic state (``a = base + step``, ``b = 2 * base - step``) in a loop.
The real save job's ``write`` and ``commit`` (and the engine's
``DurableWriter.write``) are wrapped in the child, nothing mocked, so each
phase boundary and each file a JAX write finishes is reported to the parent;
the zygote prints ``exit <pid>`` only after reaping the child, so every marker
of a dead child is read before its exit line. Kills are aimed from the seeded
RNG: 90% at a write (a JAX kill is sent on the k-th file of the aimed write,
a TF kill at a random fraction of the shortest recent such write, timed from
the child's own clock), the rest at a commit. The phase each kill actually
landed in is read from the markers, not assumed. After each kill the parent
checks: every listed checkpoint matches its manifest (no partial checkpoint is
listed), no checkpoint whose commit had returned is missing (unless retention
had the right to drop it), and the newest one restores exactly, with
TensorFlow's own reader for TF and the manager for JAX. The next child resumes after it.

**I/O errors.** Each run mounts a 4 MiB tmpfs (root), pre-fills it so that
only a random amount of space (0.3 to 2.8 checkpoints, or just short of a
whole number of checkpoints) is free, and saves until the disk is full. It
checks that every failed save surfaced as an exception to the caller, that no
save reported as durable is missing or damaged, that no temporary is left,
that the newest checkpoint restores exactly, and that saving works again once
space is freed. Without the right to mount, a checkpoint directory made
read-only in the middle of the run stands in (non-root only: root ignores
permission bits); the summary says which one was used.

Prints a table and, with ``--json PATH``, writes the numbers. Exits 1 when an
invariant broke (a lost checkpoint, a partial one listed, an inexact restore,
an error not surfaced) or when fewer than half of the kills landed in a write.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict, deque
from dataclasses import asdict, dataclass, field

from crash_zygote import (
    MAX_TO_KEEP,
    CampaignError,
    Zygote,
    environment,
    expected_arrays,
    install_phase_probes,
    set_probe_sink,
)

IO_MAX_TO_KEEP = 2
IO_SAVES = 5
IO_FS_MIB = 4
IO_FLOATS = 96 * 1024  # per array: two arrays of 384 KiB, about 0.75 MiB a checkpoint
WRITER_EVENTS = ("write-start", "write-end", "commit-start", "commit-end",
                 "write-error", "commit-error")
PHASE_OF_LAST_EVENT = {None: "before-write", "write-start": "write", "write-end": "between",
                       "commit-start": "commit", "commit-end": "after-commit",
                       "write-error": "error", "commit-error": "error"}
TARGET_WRITE_SHARE = 0.9  # the rest of the kills are aimed at commits
TEMP_PREFIX = ".asyncckpt-tmp-"


# -- the parent: kills and what is checked after each -------------------------------------


@dataclass
class Stats:
    """What one framework's campaign counted."""

    framework: str
    seed: int
    mib_per_checkpoint: float
    kills: int = 0
    kills_by_phase: dict = field(default_factory=dict)
    kills_during_write: int = 0
    kills_aimed_at_write: int = 0
    kills_aimed_by_file: int = 0
    write_ms_median: float = 0.0
    commit_ms_median: float = 0.0
    kill_late_ms_median: float = 0.0
    checkpoints_committed: int = 0
    checkpoints_lost: int = 0
    partial_checkpoints_listed: int = 0
    restores: int = 0
    restores_exact: int = 0
    resumes: int = 0
    resumes_exact: int = 0
    resumes_behind_newest_listed: int = 0
    leftovers_after_takeover: list = field(default_factory=list)
    io_filesystem: str = ""
    io_runs: int = 0
    io_runs_with_failed_save: int = 0
    io_errors_surfaced: int = 0
    io_error_phases: dict = field(default_factory=dict)
    io_error_types: dict = field(default_factory=dict)
    io_durable_saves_missing: int = 0
    io_published_then_reported_failed: int = 0
    io_temporaries_left: int = 0
    io_restores: int = 0
    io_restores_exact: int = 0
    io_recovered: int = 0
    failures: list = field(default_factory=list)
    wall_s: float = 0.0

    def problems(self) -> list[str]:
        """The invariants this campaign broke (empty when all hold)."""
        checks = {
            "a check failed (see FAILURE lines)": not self.failures,
            "a committed checkpoint was lost": self.checkpoints_lost == 0,
            "a partial checkpoint was listed": self.partial_checkpoints_listed == 0,
            "a restore was not exact": self.restores_exact == self.restores,
            "a restarted job did not resume exactly": self.resumes_exact == self.resumes,
            "at most half of the kills landed in a write": self.kills == 0
            or self.kills_during_write * 2 > self.kills,
            "an I/O error did not reach the caller": self.io_errors_surfaced
            == self.io_runs_with_failed_save,
            "a save reported durable is missing": self.io_durable_saves_missing == 0,
            "a temporary was left after an I/O error": self.io_temporaries_left == 0,
            "a restore after I/O errors was not exact": self.io_restores_exact
            == self.io_restores,
            "saving did not work again once space was freed": self.io_recovered == self.io_runs,
        }
        return [what for what, held in checks.items() if not held]


class Verifier:
    """Checks a checkpoint directory from outside the writer, with the real readers."""

    def __init__(self, framework: str, n: int):
        self.framework, self.n = framework, n
        if framework == "tf":
            import numpy as np
            import tensorflow as tf

            self._vars = {k: tf.Variable(np.zeros(n, np.float32)) for k in ("a", "b")}
            self._step = tf.Variable(-1, dtype=tf.int64)
            self._ckpt = tf.train.Checkpoint(step=self._step, **self._vars)

    def listed(self, directory: str, stats: Stats, context: str) -> list[int]:
        """Steps listed; counts (and records) any listed checkpoint that fails its manifest."""
        from asyncckpt import catalog

        steps = []
        for info in catalog.list_checkpoints(directory):
            try:
                catalog.verify(info)
            except Exception as e:
                stats.partial_checkpoints_listed += 1
                stats.failures.append(f"{context}: listed checkpoint {info.name} is partial: {e}")
            steps.append(info.step)
        if self.framework == "tf":
            import tensorflow as tf

            latest = tf.train.latest_checkpoint(directory)  # TensorFlow's own state file
            if latest is not None and os.path.basename(latest) not in {
                    f"ckpt-{s}" for s in steps}:
                stats.partial_checkpoints_listed += 1
                stats.failures.append(f"{context}: the state file names {latest}, not listed")
        return steps

    def restore_exact(self, directory: str, step: int) -> bool:
        """Restores ``step`` with the framework's reader; True when every value matches.

        A restore that raises counts as not exact (and is logged).
        """
        try:
            return self._restore_exact(directory, step)
        except Exception as e:
            print(f"restoring step {step} from {directory} failed: {e!r}", flush=True)
            return False

    def _restore_exact(self, directory: str, step: int) -> bool:
        import numpy as np

        ea, eb = expected_arrays(step, self.n)
        if self.framework == "tf":
            prefix = os.path.join(directory, f"ckpt-{step}")
            self._ckpt.restore(prefix).assert_consumed()
            got = int(self._step.numpy()), self._vars["a"].numpy(), self._vars["b"].numpy()
        else:
            import asyncckpt.jax as aj

            with aj.CheckpointManager(directory) as mgr:  # restoring takes no lock
                tree = mgr.restore(step, target={"a": np.zeros(self.n, np.float32),
                                                 "b": np.zeros(self.n, np.float32), "step": 0})
            got = int(tree["step"]), tree["a"], tree["b"]
        return got[0] == step and np.array_equal(got[1], ea) and np.array_equal(got[2], eb)


def _estimate(durations, default: float, quantile: float = 0.5) -> float:
    """A quantile of recent durations (the median by default), or ``default``."""
    if not durations:
        return default
    ordered = sorted(durations)
    return ordered[min(int(quantile * len(ordered)), len(ordered) - 1)]


class KillRun:
    """SIGKILLs one child per trial at a chosen point and checks the directory after each.

    Args:
        zygote: Forks the saving children.
        verifier: Checks listings and restores with the real readers.
        stats: Counters to fill.
        directory: The checkpoint directory every child saves into.
        rng: Seeded; decides where each kill is aimed.
        log: Takes one line per trial.
    """

    def __init__(self, zygote: Zygote, verifier: Verifier, stats: Stats, directory: str,
                 rng: random.Random, log=print):
        self.zygote, self.verifier, self.stats = zygote, verifier, stats
        self.directory, self.rng, self.log = directory, rng, log
        self.committed: set[int] = set()  # steps whose commit returned (acknowledged)
        self.listed: list[int] = []  # steps listed after the previous kill
        # Phase durations by (phase, n-th of its kind in a child): a child's first
        # write is several times longer than its later ones (fresh staging, first
        # use of the writer), so each is aimed with its own history.
        self.durations: defaultdict = defaultdict(lambda: deque(maxlen=15))
        self.files_per_write: list[int] = []  # JAX: one file per shard
        self.phases: Counter = Counter()
        self.lateness: list[float] = []

    def run(self, kills: int) -> None:
        for trial in range(kills):
            self._trial(trial)
        stats = self.stats
        stats.write_ms_median = 1e3 * _estimate(self.durations["write"], 0.0)
        stats.commit_ms_median = 1e3 * _estimate(self.durations["commit"], 0.0)
        stats.kill_late_ms_median = 1e3 * _estimate(self.lateness, 0.0)
        stats.kills_by_phase = dict(self.phases)
        stats.kills_during_write = self.phases["write"]
        stats.checkpoints_committed = len(self.committed)
        self._takeover()

    def _next(self, deadline: float, what: str) -> list[str]:
        fields = self.zygote.next(deadline - time.monotonic())
        if fields is None or fields[0] == "exit":
            raise CampaignError(f"{what} ({fields}): {self.zygote.log_tail()}")
        return fields

    def _trial(self, trial: int) -> None:
        rng, stats = self.rng, self.stats
        aim = "write" if rng.random() < TARGET_WRITE_SHARE else "commit"
        # Which of this child's writes (or commits) to hit: half the time the
        # first save after the restart (a long write), else one in steady state.
        # (The writer commits each save before it writes the next, so aiming at
        # the second or later one means this child commits at least once: an
        # empty directory is never left to the first save alone.)
        nth = rng.choice((1, 1, 2, 3) if self.listed else (2, 3))
        frac = rng.uniform(0.05, 0.6)
        acknowledged = set(self.committed)  # what the restarted child must honour
        pid = self.zygote.start(self.verifier.framework, self.directory, self.verifier.n)
        marks: list[list[str]] = []
        deadline = time.monotonic() + 180
        seen = 0
        while seen < nth:  # wait for the aimed phase to start (a real event)
            fields = self._next(deadline, f"trial {trial}: child {pid} never reached {aim} #{nth}")
            marks.append(fields)
            seen += fields[2] == f"{aim}-start"
        aimed_start, aimed_step = float(fields[-1]), fields[3]
        files = self.files_per_write[-5:]
        if aim == "write" and files and min(files) >= 4:
            # The files of this write come one by one: kill on one of the first
            # half of them, and the kill lands in the write however late it is sent.
            kth = rng.randint(1, min(files) // 2)
            got = 0
            while got < kth:
                fields = self._next(deadline, f"trial {trial}: no file #{kth} of {aimed_step}")
                marks.append(fields)
                got += fields[2] == "file-written" and fields[3] == aimed_step
                if fields[2] == "write-end" and fields[3] == aimed_step:
                    break
            kill_at = time.monotonic()
            how = f"on file {kth} of the write"
            stats.kills_aimed_by_file += 1
        else:
            # Timed from the phase's start on the child's clock (the same
            # CLOCK_MONOTONIC), so the marker's trip here does not count. A short
            # one of recent such phases (else the shortest of any ordinal) keeps
            # the kill inside most of the slower ones too.
            fallback = _estimate(self.durations[aim], 0.05, quantile=0.0)
            estimate = _estimate(self.durations[(aim, nth)], fallback, quantile=0.25)
            kill_at = aimed_start + frac * estimate
            how = f"{1e3 * (kill_at - aimed_start):.0f} ms after the {aim} began"
            while (left := kill_at - time.monotonic()) > 0:  # the random kill point
                fields = self.zygote.next(left)
                if fields is None:
                    break
                if fields[0] == "exit":
                    raise CampaignError(f"child {pid} exited by itself: "
                                        f"{self.zygote.log_tail()}")
                marks.append(fields)
        os.kill(pid, signal.SIGKILL)
        self.lateness.append(max(time.monotonic() - kill_at, 0.0))
        self.zygote.expect("exit", 60, sink=marks)  # every marker of the child precedes it
        self.zygote.child = None
        stats.kills += 1
        stats.kills_aimed_at_write += aim == "write"
        # Where the kill landed: the writer thread's last phase boundary.
        writer = [m for m in marks if m[2] in WRITER_EVENTS]
        phase = PHASE_OF_LAST_EVENT[writer[-1][2] if writer else None]
        self.phases[phase] += 1
        self._read_marks(marks, acknowledged, trial)
        context = f"seed={stats.seed} trial={trial} aim={aim}#{nth} frac={frac:.2f}"
        steps = self._check(context)
        temps = sum(name.startswith(TEMP_PREFIX) for name in os.listdir(self.directory))
        self.log(f"{context}: killed in {phase}, {how} (such a {aim} lasted "
                 f"{[round(1e3 * d) for d in self.durations[(aim, nth)]][-3:]} ms lately); "
                 f"{temps} temporary; listed {steps}")

    def _read_marks(self, marks: list[list[str]], acknowledged: set[int], trial: int) -> None:
        """Learns phase durations and commits from a dead child's markers; checks its resume."""
        starts: dict = {}
        ordinal: Counter = Counter()
        files_in: Counter = Counter()
        for m in marks:
            event, step, t = m[2], int(m[3]), float(m[-1])
            if event == "file-written":
                files_in[step] += 1
            elif event == "write-end":
                self.files_per_write.append(files_in[step])
            if event.endswith("-start"):
                ordinal[event[:-6]] += 1
                starts[(event[:-6], step)] = (t, ordinal[event[:-6]])
            elif event.endswith("-end") and (event[:-4], step) in starts:
                began, nth_of_kind = starts[(event[:-4], step)]
                self.durations[event[:-4]].append(t - began)
                self.durations[(event[:-4], min(nth_of_kind, 3))].append(t - began)
            if event == "commit-end":
                self.committed.add(step)
            elif event == "resume":
                self._check_resume(step, m[4] == "1", acknowledged, trial)

    def _check_resume(self, step: int, exact: bool, acknowledged: set[int], trial: int) -> None:
        # The manager must resume from a listed checkpoint no older than the
        # newest acknowledged one. (A TF checkpoint published but killed before
        # the state file named it is on disk, yet TensorFlow's manager, like
        # asyncckpt's, resumes from the state file's newest.)
        stats, listed = self.stats, self.listed
        stats.resumes += 1
        ok = exact and step in listed and step >= max(acknowledged, default=-1)
        stats.resumes_exact += ok
        stats.resumes_behind_newest_listed += ok and step != listed[-1]
        if not ok:
            stats.failures.append(f"trial {trial}: resumed at {step} (exact={exact}); listed "
                                  f"{listed}, acknowledged up to {max(acknowledged, default=None)}")

    def _check(self, context: str) -> list[int]:
        """Listing, losses and the newest restore after a kill; returns the listed steps."""
        stats = self.stats
        steps = self.listed = self.verifier.listed(self.directory, stats, context)
        # Retention may drop a checkpoint only once MAX_TO_KEEP newer ones exist.
        lost = sorted(c for c in self.committed
                      if c not in steps and sum(s > c for s in steps) < MAX_TO_KEEP)
        if lost:
            stats.failures.append(f"{context}: committed checkpoint(s) {lost} lost; on disk "
                                  f"{steps}")
        stats.checkpoints_lost += len(lost)
        self.committed -= set(lost)
        if steps:
            stats.restores += 1
            if self.verifier.restore_exact(self.directory, steps[-1]):
                stats.restores_exact += 1
            else:
                stats.failures.append(f"{context}: step {steps[-1]} did not restore exactly")
        return steps

    def _takeover(self) -> None:
        """A normal run after the last kill takes over the dead writer's lock and leftovers."""
        step = max(self.listed, default=-1) + 1
        saver = _Saver(self.verifier.framework, self.directory, self.verifier.n, MAX_TO_KEEP)
        saver.save(step)
        saver.close()
        if not self.verifier.restore_exact(self.directory, step):
            self.stats.failures.append(f"the save after the last kill (step {step}) is not exact")
        self.stats.leftovers_after_takeover = sorted(leftovers(self.directory))
        if self.stats.leftovers_after_takeover:
            self.stats.failures.append(
                f"left after a normal save: {self.stats.leftovers_after_takeover}")


def leftovers(directory: str) -> list[str]:
    """Temporaries, and TF checkpoint files whose index (the commit marker) is missing."""
    names = os.listdir(directory)
    found = [n for n in names if n.startswith(TEMP_PREFIX)]
    committed_files = (".data-", ".asyncckpt-manifest.json")
    found += [n for n in names if any(m in n for m in committed_files)
              and n.split(".", 1)[0] + ".index" not in names]
    return found


# -- I/O errors on a tiny, full filesystem --------------------------------------------------


@contextlib.contextmanager
def tiny_filesystem(path: str, kind: str):
    """A ``IO_FS_MIB`` MiB tmpfs at ``path`` (or a plain directory for ``read-only``)."""
    os.makedirs(path, exist_ok=True)
    if kind == "tmpfs":
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={IO_FS_MIB}m", "tmpfs", path],
                       check=True, capture_output=True)
    try:
        yield
    finally:
        if kind == "tmpfs":
            subprocess.run(["umount", "-l", path], check=False, capture_output=True)
        with contextlib.suppress(OSError):
            os.chmod(path, 0o755)
        shutil.rmtree(path, ignore_errors=True)


def choose_filesystem(workdir: str) -> str:
    """``tmpfs`` where mounting works, else ``read-only`` (non-root), else ``none``."""
    probe = os.path.join(workdir, "mount-probe")
    try:
        with tiny_filesystem(probe, "tmpfs"):
            pass
        return "tmpfs"
    except (subprocess.CalledProcessError, OSError):
        return "read-only" if os.geteuid() != 0 else "none"


class _Saver:
    """One framework's manager over the campaign's state, driven in this process."""

    def __init__(self, framework: str, directory: str, n: int = IO_FLOATS,
                 max_to_keep: int = IO_MAX_TO_KEEP):
        import numpy as np

        self.framework, self.n = framework, n
        if framework == "tf":
            import tensorflow as tf

            import asyncckpt.tf as at

            self.vars = [tf.Variable(np.zeros(n, np.float32)) for _ in range(2)]
            self.step = tf.Variable(0, dtype=tf.int64)
            self.mgr = at.CheckpointManager(
                tf.train.Checkpoint(a=self.vars[0], b=self.vars[1], step=self.step), directory,
                max_to_keep=max_to_keep)
        else:
            import asyncckpt.jax as aj

            self.mgr = aj.CheckpointManager(directory, max_to_keep=max_to_keep)

    def save(self, step: int):
        ea, eb = expected_arrays(step, self.n)
        if self.framework == "tf":
            self.vars[0].assign(ea)
            self.vars[1].assign(eb)
            self.step.assign(step)
            self.mgr.save(checkpoint_number=step)
        else:
            import jax.numpy as jnp

            self.mgr.save(step, {"a": jnp.asarray(ea), "b": jnp.asarray(eb), "step": step})
        return self.mgr.last_save

    def close(self) -> None:
        self.mgr.close()


def _checkpoint_bytes(framework: str, workdir: str) -> int:
    """Bytes one I/O-run checkpoint takes on a tmpfs (measured, not guessed)."""
    path = os.path.join(workdir, "calibrate")
    with tiny_filesystem(path, "tmpfs"):
        before = shutil.disk_usage(path).used
        saver = _Saver(framework, os.path.join(path, "ckpts"))
        saver.save(0)
        saver.close()
        return shutil.disk_usage(path).used - before


def run_io_errors(verifier: Verifier, stats: Stats, runs: int, rng: random.Random, workdir: str,
                  kind: str, log=print) -> None:
    """Saves into a filesystem that runs out of space (or turns read-only) mid-run."""
    stats.io_filesystem = kind
    if kind == "none" or runs == 0:
        return
    install_phase_probes(verifier.framework)
    events: list[tuple[str, str, str]] = []
    set_probe_sink(lambda event, label, detail="": events.append((event, label, detail)))
    ckpt_bytes = _checkpoint_bytes(verifier.framework, workdir) if kind == "tmpfs" else 0
    io_verifier = Verifier(verifier.framework, IO_FLOATS)
    phases: Counter = Counter()
    types: Counter = Counter()
    for run in range(runs):
        events.clear()
        root = os.path.join(workdir, f"io-{verifier.framework}-{run}")
        directory = os.path.join(root, "ckpts")
        with tiny_filesystem(root, kind):
            if kind == "tmpfs":
                if rng.random() < 0.6:
                    free = int(rng.uniform(0.3, 2.8) * ckpt_bytes)
                else:  # just short of a whole checkpoint: the last files hit the wall
                    free = rng.randint(1, 2) * ckpt_bytes - rng.randint(1, 16 << 10)
                with open(os.path.join(root, "filler"), "wb") as f:
                    f.write(b"\0" * max(shutil.disk_usage(root).free - free, 0))
            readonly_at = rng.randint(1, 3)
            saver = _Saver(verifier.framework, directory)
            handles, raised = {}, []
            for step in range(IO_SAVES):
                if kind == "read-only" and step == readonly_at:
                    os.chmod(directory, 0o555)
                try:
                    handles[step] = saver.save(step)
                except Exception as e:
                    raised.append(e)
                    phases["save-call"] += 1
            try:
                saver.close()
            except Exception as e:
                raised.append(e)
            failed = {s for s, h in handles.items() if h.committed.exception(60) is not None}
            failed_or_refused = bool(failed) or bool(raised)
            stats.io_runs += 1
            stats.io_runs_with_failed_save += failed_or_refused
            stats.io_errors_surfaced += failed_or_refused and bool(raised)
            for e in raised:
                types[type(e).__name__] += 1
            for event, _, _ in events:
                if event.endswith("-error"):
                    phases[event[:-6]] += 1
            if os.path.isdir(directory):
                os.chmod(directory, 0o755)
            context = f"seed={stats.seed} io run {run}"
            steps = io_verifier.listed(directory, stats, context)
            durable = {s for s in handles if s not in failed}
            missing = sorted(s for s in durable
                             if s not in steps and sum(t > s for t in steps) < IO_MAX_TO_KEEP)
            stats.io_durable_saves_missing += len(missing)
            if missing:
                stats.failures.append(f"{context}: saves {missing} reported durable are gone")
            stats.io_published_then_reported_failed += len(failed & set(steps))
            temps = [n for n in os.listdir(directory) if n.startswith(TEMP_PREFIX)]
            stats.io_temporaries_left += len(temps)
            if temps:
                stats.failures.append(f"{context}: temporaries left: {temps}")
            if steps:
                stats.io_restores += 1
                if io_verifier.restore_exact(directory, steps[-1]):
                    stats.io_restores_exact += 1
                else:
                    stats.failures.append(f"{context}: step {steps[-1]} not restored exactly")
            # Space back: the next run of the job saves again.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(root, "filler"))
            again = max(steps, default=-1) + 1
            try:
                saver = _Saver(verifier.framework, directory)
                saver.save(again)
                saver.close()
                if io_verifier.restore_exact(directory, again):
                    stats.io_recovered += 1
            except Exception as e:
                stats.failures.append(f"{context}: saving after space was freed failed: {e!r}")
            log(f"{context}: failed saves {sorted(failed)}, raised "
                f"{[type(e).__name__ for e in raised]}, listed {steps}")
    stats.io_error_phases = dict(phases)
    stats.io_error_types = dict(types)


# -- command line ---------------------------------------------------------------------------


def _table(all_stats: list[Stats]) -> str:
    rows = [
        ("kills", "kills"), ("kills during write", "kills_during_write"),
        ("kills by phase", "kills_by_phase"), ("kills aimed at a write", "kills_aimed_at_write"),
        ("kills sent on a file of a write", "kills_aimed_by_file"),
        ("write ms (median)", "write_ms_median"), ("commit ms (median)", "commit_ms_median"),
        ("kill later than aimed, ms (median)", "kill_late_ms_median"),
        ("checkpoints committed", "checkpoints_committed"),
        ("checkpoints lost", "checkpoints_lost"),
        ("partial checkpoints listed", "partial_checkpoints_listed"),
        ("restores exact", "restores_exact"), ("restores", "restores"),
        ("resumes exact (child)", "resumes_exact"), ("resumes", "resumes"),
        ("resumes behind newest listed", "resumes_behind_newest_listed"),
        ("I/O error filesystem", "io_filesystem"),
        ("I/O error runs", "io_runs"), ("runs with a failed save", "io_runs_with_failed_save"),
        ("I/O errors surfaced as errors", "io_errors_surfaced"),
        ("I/O error phases", "io_error_phases"), ("errors raised", "io_error_types"),
        ("durable saves missing", "io_durable_saves_missing"),
        ("published, reported failed", "io_published_then_reported_failed"),
        ("temporaries left", "io_temporaries_left"),
        ("I/O restores exact", "io_restores_exact"), ("recovered after space freed",
                                                       "io_recovered"),
        ("wall seconds", "wall_s"),
    ]
    lines = [f"{'':36}" + "".join(f"{s.framework:>40}" for s in all_stats)]
    for title, key in rows:
        values = [getattr(s, key) for s in all_stats]
        shown = [" ".join(f"{k}={n}" for k, n in sorted(v.items())) if isinstance(v, dict)
                 else (f"{v:.0f}" if isinstance(v, float) else str(v)) for v in values]
        lines.append(f"{title:36}" + "".join(f"{v:>40}" for v in shown))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=["tf", "jax", "both"], default="both")
    parser.add_argument("--kills", type=int, default=200, help="SIGKILLs per framework")
    parser.add_argument("--io-errors", type=int, default=50, help="I/O-error runs per framework")
    parser.add_argument("--seed", type=int,
                        default=int(os.environ.get("ASYNCCKPT_TEST_SEED", "0")))
    parser.add_argument("--mib", type=float, default=32.0, help="state size of the kill runs")
    parser.add_argument("--workdir", help="where checkpoints go (default: a temporary dir)")
    parser.add_argument("--json", help="write the numbers here")
    parser.add_argument("--quiet", action="store_true", help="no line per trial")
    args = parser.parse_args(argv)
    frameworks = ["tf", "jax"] if args.framework == "both" else [args.framework]
    os.environ.update({k: v for k, v in environment().items() if k != "PYTHONPATH"})
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    print(f"crash campaign: seed={args.seed} frameworks={frameworks} kills={args.kills} "
          f"io-errors={args.io_errors} state={args.mib} MiB", flush=True)
    workdir = args.workdir or tempfile.mkdtemp(prefix="crash-campaign-")
    os.makedirs(workdir, exist_ok=True)
    log = (lambda *a: None) if args.quiet else (lambda msg: print(msg, flush=True))
    zygote = Zygote(frameworks, os.path.join(workdir, "zygote.log"))
    all_stats = []
    try:
        zygote.expect("zygote-ready", 600)
        kind = choose_filesystem(workdir)
        n = int(args.mib * 2**20) // 8  # two float32 arrays
        n -= n % 8  # shards evenly over 8 devices
        for framework in frameworks:
            rng = random.Random(f"{args.seed}-{framework}")
            stats = Stats(framework, args.seed, 8 * n / 2**20)
            start = time.monotonic()
            verifier = Verifier(framework, n)
            directory = os.path.join(workdir, f"kills-{framework}")
            os.makedirs(directory, exist_ok=True)
            KillRun(zygote, verifier, stats, directory, rng, log).run(args.kills)
            run_io_errors(verifier, stats, args.io_errors, rng, workdir, kind, log)
            stats.wall_s = time.monotonic() - start
            all_stats.append(stats)
    finally:
        zygote.close()
    print(_table(all_stats))
    for s in all_stats:
        for failure in s.failures[:20]:
            print(f"FAILURE [{s.framework}] {failure}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(s) for s in all_stats], f, indent=1)
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    problems = [f"{s.framework}: {p}" for s in all_stats for p in s.problems()]
    ok = not problems
    print(f"verdict: {'OK' if ok else 'FAILED: ' + '; '.join(problems)} (seed={args.seed})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
