"""Measurement procedures of ``python -m benchmarks``.

Everything for one state size runs in one process with the cases interleaved
(each repetition runs every case once, in rotating order, after letting every
engine finish its writes), so the machine's noise hits all cases alike.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.suite import engines as eng


def _stats(xs: list[float]) -> dict:
    if not xs:
        return {}
    s = sorted(xs)
    p95 = s[min(len(s) - 1, math.ceil(0.95 * len(s)) - 1)]
    return {"median": statistics.median(s), "p95": p95, "min": s[0], "all": xs}


class RSSSampler:
    """Samples this process's resident memory to find the peak of a phase."""

    def __init__(self, period_s: float = 0.005):
        self._period = period_s
        self._page = os.sysconf("SC_PAGE_SIZE")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.base = 0
        self.peak = 0

    def rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def __enter__(self) -> RSSSampler:
        self.base = self.peak = self.rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._period):
            self.peak = max(self.peak, self.rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def delta(self) -> int:
        return self.peak - self.base


@dataclass
class Progress:
    """Progress lines on stderr, with elapsed time."""

    quiet: bool = False
    start: float = field(default_factory=time.perf_counter)

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{time.perf_counter() - self.start:7.1f}s] {msg}", file=sys.stderr, flush=True)


def _safe(fn: Callable[[], object], errors: dict, key: str) -> bool:
    try:
        fn()
        return True
    except Exception as e:
        errors[key] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        traceback.print_exc(file=sys.stderr)
        return False


def _with_other(recorded: dict, durable_s: float) -> dict:
    """A save's phases, with two more: ``other``, the time to its commit that no phase on the
    writer's way accounts for (phases on helper threads, ``OVERLAPPED``, overlap the others
    and are left out), and ``retention wait``, from the engine's work after the commit to the
    engine's wait returning (a manager's retention deleting old steps in the background)."""
    from asyncckpt._engine.metrics import AFTER_COMMIT, OVERLAPPED

    seconds = dict(recorded.get("seconds", {}))
    committed = recorded.get("committed_s", durable_s)
    after = seconds.get(AFTER_COMMIT, 0.0)
    on_path = sum(v for k, v in seconds.items() if k not in OVERLAPPED and k != AFTER_COMMIT)
    seconds["other"] = committed - on_path
    seconds["retention wait"] = durable_s - committed - after
    return {**recorded, "seconds": seconds, "durable_s": durable_s}


def _phase_medians(runs: list[dict]) -> dict:
    """Median seconds, count and bytes of each phase over the saves of one engine."""
    names: list[str] = []
    for r in runs:
        names += [n for n in r.get("seconds", {}) if n not in names]
    out = {}
    for n in names:
        out[n] = {
            "median_s": statistics.median(r.get("seconds", {}).get(n, 0.0) for r in runs),
            "count": statistics.median(r.get("counts", {}).get(n, 0) for r in runs),
            "bytes": statistics.median(r.get("bytes", {}).get(n, 0) for r in runs),
        }
    return out


def measure_size(
    nbytes: int,
    *,
    frameworks: list[str],
    engine_names: list[str],
    reps: int,
    workdir: str,
    progress: Progress,
    tensors: int | None = None,
) -> dict:
    """Blocking, durable, back-to-back, restore and memory for one state size.

    ``tensors``: arrays the state is split into (default ``tensors_for``).
    """
    tensors = tensors or eng.tensors_for(nbytes)
    label = f"{nbytes / 2**20:.0f} MiB in {tensors}"
    states = {}
    if "tf" in frameworks:
        states["tf"] = eng.TFState(nbytes, tensors)
    if "jax" in frameworks:
        states["jax"] = eng.JAXState(nbytes, tensors)
    floors = eng.Floors(nbytes, tensors, os.path.join(workdir, "floors"))
    engines: dict[str, eng.Engine] = {}
    errors: dict[str, str] = {}
    for name in engine_names:
        cls = eng.ENGINES[name]
        if cls.framework not in states:
            continue
        sub = os.path.join(workdir, name.replace(" ", "_"))
        eng.clear_dir(sub)
        ok = _safe(lambda cls=cls, sub=sub: engines.__setitem__(cls.name, cls(states[cls.framework],
                                                                                sub)),
                   errors, name)
        if not ok:
            progress(f"{label}: {name} could not start: {errors[name]}")

    floor_cases = {
        "memcpy": floors.memcpy,
        "memcpy per tensor": floors.memcpy_per_tensor,
        "raw write+fsync": floors.raw_write,
        "crc32c": floors.crc32c,
    }
    if "jax" in states:
        floor_cases["memcpy jax arrays"] = states["jax"].memcpy_floor()
        pinned = states["jax"].pinned_host_floor() if states["jax"].platform != "cpu" else None
        if pinned is not None:  # an accelerator: its device-to-host copy bounds a save
            floor_cases[eng.D2H_FLOOR] = pinned
    blocking: dict[str, list[float]] = {k: [] for k in [*floor_cases, *engines]}
    durable: dict[str, list[float]] = {k: [] for k in engines}
    phases: dict[str, list[dict]] = {k: [] for k in engines}
    raw_parts: dict[str, list[float]] = {"raw write (no fsync)": [], "one fsync": []}
    peak: dict[str, int] = dict.fromkeys(engines, 0)

    def settle() -> None:
        """Every engine idle, old checkpoints pruned, and the disk quiet: engines that
        do not fsync (TensorFlow's, orbax's) leave dirty pages whose writeback would
        otherwise land in the next timed call, whichever engine's it is."""
        for name, e in engines.items():
            e.wait()
            if name not in errors:
                _safe(e.prune, errors, name)
        os.sync()

    def run_engine(name: str, record: bool) -> None:
        e = engines[name]
        settle()
        with RSSSampler() as mem:
            t0 = time.perf_counter()
            e.save()
            t1 = time.perf_counter()
            e.wait()
            t2 = time.perf_counter()
        if record:
            blocking[name].append(t1 - t0)
            durable[name].append(t2 - t0)
            peak[name] = max(peak[name], mem.delta)
            recorded = e.phases()
            if recorded is not None:
                phases[name].append(_with_other(recorded, t2 - t0))

    order = [*floor_cases, *engines]
    for rep in range(reps + 2):  # repetitions 0-1 warm up (allocations, tracing)
        progress(f"{label}: repetition {rep - 1}/{reps}" + (" (warm-up)" if rep < 2 else ""))
        k = rep % len(order)
        for name in order[k:] + order[:k]:
            if name in floor_cases:
                settle()
                t0 = time.perf_counter()
                floor_cases[name]()
                if rep > 1:
                    blocking[name].append(time.perf_counter() - t0)
                    if name == "raw write+fsync":
                        raw_parts["raw write (no fsync)"].append(floors.last_write_s)
                        raw_parts["one fsync"].append(floors.last_fsync_s)
            elif name not in errors and not _safe(lambda n=name, r=rep: run_engine(n, r > 1),
                                                   errors, name):
                progress(f"{label}: {name} failed: {errors[name]}")
    settle()
    # The copy floors are measured: free their buffers (three states' worth
    # with the JAX arrays' floor) before the phases that grow the engines'
    # slots and restore new states; at 1 GiB with both frameworks they took
    # the process past 24 GiB.
    floor_names = list(floor_cases)
    floor_cases.clear()
    floors.keep_read_buffer_only()

    # Back to back: a save every training step while the previous write runs.
    back_to_back: dict[str, list[float]] = {}
    back_to_back_rss: dict[str, int] = {}
    for name, e in engines.items():
        if name in errors:
            continue
        progress(f"{label}: back-to-back saves with {name}")
        settle()
        times = []

        def three(e=e, times=times) -> None:
            # Once untimed, so every staging slot has been used before (a slot's
            # buffers are allocated on first use) and a pool that grows has
            # seen the burst, then timed.
            for timed in (False, True):
                for _ in range(3):
                    t0 = time.perf_counter()
                    e.save()
                    if timed:
                        times.append(time.perf_counter() - t0)
                    e.state.step()
                    # JAX dispatches the step asynchronously: finish it here,
                    # or the next save's copy waits for the step's compute.
                    getattr(e.state, "block", lambda: None)()
                e.wait()

        # Memory too: staging slots a burst makes an engine add (or its
        # copies of the state in flight) count in the peak it reports.
        with RSSSampler() as mem:
            ok = _safe(three, errors, name)
        if ok:
            back_to_back[name] = times
            back_to_back_rss[name] = mem.delta
            peak[name] = max(peak[name], mem.delta)

    # Restore, from files evicted from the page cache, against a raw read.
    # Each engine is closed after its restore, so its staging slots are
    # freed before the next one restores a new state.
    restore: dict[str, float] = {}
    closed: set[str] = set()
    settle()  # nothing is written while a restore is timed
    for name, e in list(engines.items()):
        if name in errors:
            continue
        progress(f"{label}: restore with {name}")
        eng.evict_from_page_cache(e.files())
        t0 = time.perf_counter()
        if _safe(e.restore, errors, name):
            restore[name] = time.perf_counter() - t0
        _safe(e.close, errors, name)
        closed.add(name)
    eng.evict_from_page_cache([floors.path])
    t0 = time.perf_counter()
    floors.raw_read()
    raw_read_s = time.perf_counter() - t0

    for name, e in engines.items():
        if name not in closed:
            _safe(e.close, errors, name)
    eng.clear_dir(workdir)

    raw_write = statistics.median(blocking["raw write+fsync"])
    result = {
        "nbytes": floors.nbytes,
        "tensors": tensors,
        "floors": {k: _stats(blocking[k]) for k in floor_names},
        "raw_read_s": raw_read_s,
        "engines": {},
    }
    result["floors"]["raw read"] = {"median": raw_read_s}
    for k, xs in raw_parts.items():
        result["floors"][k] = _stats(xs)
    result["breakdown"] = {
        name: {"phases": _phase_medians(runs),
               "durable_s": statistics.median(r["durable_s"] for r in runs)}
        for name, runs in phases.items() if runs
    }
    for name in engines:
        d = durable[name]
        result["engines"][name] = {
            "framework": engines[name].framework,
            "blocking": _stats(blocking[name]),
            "durable": _stats(d),
            "durable_throughput_vs_raw_write": (raw_write / statistics.median(d)) if d else None,
            "back_to_back": back_to_back.get(name),
            "back_to_back_rss_delta_bytes": back_to_back_rss.get(name),
            "restore_s": restore.get(name),
            "restore_vs_raw_read": (restore[name] / raw_read_s) if name in restore else None,
            "peak_rss_delta_bytes": peak[name],
            "error": errors.get(name),
        }
    for name, err in errors.items():
        result["engines"].setdefault(name, {"error": err})
    return result


def train_loop(state, engine: eng.Engine | None, steps: int, every: int,
                tails: list[float] | None = None) -> float:
    """Seconds for ``steps`` training steps, saving every ``every`` steps.

    The clock stops when the last step is done. Waiting for the last save to
    become durable comes after, untimed: engines differ in what "done" means
    (asyncckpt fsyncs, orbax does not), and that wait is not training time.
    The last save is ``every`` steps before the end, so an engine that keeps
    up has finished it by then anyway; how long the wait still took is
    appended to ``tails``.
    """
    block = getattr(state, "block", lambda: None)
    if engine is not None:
        engine.wait()
    block()
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        state.step()
        if engine is not None and i % every == 0 and i < steps:
            engine.save()
    block()
    elapsed = time.perf_counter() - t0
    if engine is not None:
        engine.wait()
        if tails is not None:
            tails.append(time.perf_counter() - t0 - elapsed)
    return elapsed


def _train_framework(fw: str, nbytes: int, names: list[str], workdir: str, saves: int,
                     reps: int, progress: Progress) -> dict:
    tensors = eng.tensors_for(nbytes)
    state = eng.TFState(nbytes, tensors) if fw == "tf" else eng.JAXState(nbytes, tensors)
    engines: dict[str, eng.Engine] = {}
    errors: dict[str, str] = {}
    # The floor runs first, beside the engines, so its cost is read off the same rounds.
    makers = {eng.BackgroundRawWrite.name: eng.BackgroundRawWrite,
              **{n: eng.ENGINES[n] for n in names}}
    for n, cls in makers.items():
        sub = os.path.join(workdir, n.replace(" ", "_").replace(":", ""))
        eng.clear_dir(sub)
        try:
            engines[n] = cls(state, sub)
        except Exception as e:
            errors[n] = f"{type(e).__name__}: {e}"
    train_loop(state, None, 3, 1)  # warm-up
    step_s = train_loop(state, None, 10, 1) / 10
    write_s = 0.0
    for n, e in engines.items():  # timed saves, which also warm each engine up
        for _ in range(2):
            t0 = time.perf_counter()
            if _safe(lambda e=e: (e.save(), e.wait()), errors, n):
                write_s = max(write_s, time.perf_counter() - t0)
    every = max(2, math.ceil(write_s / step_s) + 1)
    steps = every * (saves + 1)
    progress(f"training ({fw}): step {step_s * 1e3:.0f} ms, slowest save {write_s:.2f} s "
             f"-> a save every {every} steps, {steps} steps per run")
    # Rounds: each runs every engine once, each preceded by a baseline run
    # without checkpoints, in rotating order; medians over the rounds.
    base: list[float] = []
    runs: dict[str, list[float]] = {n: [] for n in engines}
    tails: dict[str, list[float]] = {n: [] for n in engines}
    live = [n for n in engines if n not in errors]
    for r in range(reps):
        progress(f"training ({fw}): round {r + 1}/{reps}")
        k = r % max(1, len(live))
        for n in live[k:] + live[:k]:
            if n in errors:
                continue
            base.append(train_loop(state, None, steps, every))
            try:
                runs[n].append(train_loop(state, engines[n], steps, every, tails[n]))
            except Exception as ex:
                errors[n] = f"{type(ex).__name__}: {ex}"
    base.append(train_loop(state, None, steps, every))
    base_s = statistics.median(base)
    results = {n: statistics.median(ts) for n, ts in runs.items() if ts and n not in errors}
    for e in engines.values():
        _safe(e.close, errors, e.name)
    return {
        "step_s": step_s,
        "every_k_steps": every,
        "steps": steps,
        "baseline_s": base_s,
        "rounds": reps,
        "engines": {
            n: {
                "total_s": t,
                "overhead_pct": 100.0 * (t - base_s) / base_s,
                "durable_wait_after_last_step_s": statistics.median(tails[n]),
            }
            for n, t in results.items()
        },
        "errors": errors,
    }


def measure_training(
    nbytes: int,
    *,
    frameworks: list[str],
    engine_names: list[str],
    workdir: str,
    saves: int,
    reps: int = 3,
    progress: Progress,
) -> dict:
    """Training-loop overhead of checkpointing every K steps, per engine.

    K is chosen so that K steps take at least as long as the slowest save
    measured here (call to durable), the regime where an asynchronous engine
    can hide its write entirely. Baseline runs without checkpoints are
    interleaved with the engines' runs, ``reps`` rounds, medians reported.
    """
    out: dict = {"nbytes": nbytes, "frameworks": {}}
    for fw in frameworks:
        names = [n for n in engine_names if eng.ENGINES[n].framework == fw]
        out["frameworks"][fw] = _train_framework(
            fw, nbytes, names, os.path.join(workdir, fw), saves, reps, progress
        )
    eng.clear_dir(workdir)
    return out


def unbuilt_optimizer_case(workdir: str, engine_names: list[str]) -> dict[str, str]:
    """Save, build the optimizer by training, save again, per TensorFlow engine."""
    import keras
    import numpy as np
    import tensorflow as tf

    import asyncckpt.tf as at

    x = np.ones((8, 8), np.float32)
    y = np.ones((8, 4), np.float32)
    outcome = {}
    for name in engine_names:
        if eng.ENGINES[name].framework != "tf":
            continue
        # TensorFlow's own failure shows on the save after the optimizer is built.
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        optimizer = keras.optimizers.Adam()
        model.compile(optimizer=optimizer, loss="mse")
        path = os.path.join(workdir, "unbuilt", name.replace(" ", "_"), "ckpt")
        try:
            if name == "asyncckpt tf":
                with at.Checkpoint(model=model, optimizer=optimizer) as c:
                    c.write(path + "-1")
                    model.fit(x, y, verbose=0)
                    c.write(path + "-2")
            else:
                c = tf.train.Checkpoint(model=model, optimizer=optimizer)
                opts = (tf.train.CheckpointOptions(enable_async=True)
                        if name == "tf built-in async" else None)
                c.write(path + "-1", options=opts)
                model.fit(x, y, verbose=0)
                c.write(path + "-2", options=opts)
                c.sync()
            outcome[name] = "ok"
        except Exception as e:
            outcome[name] = f"FAILS: {type(e).__name__}: {str(e).splitlines()[0][:90]}"
    eng.clear_dir(os.path.join(workdir, "unbuilt"))
    return outcome
