"""``python -m benchmarks --restore``: restore and recovery time from a cold page cache.

Two measurements per state size, each against its peers and the physical
floor in the same run, cases interleaved in rotating order:

* **restore**: one restore call in this process, from files evicted from
  the page cache (after one untimed restore of every case):
  asyncckpt TensorFlow vs ``tf.train.Checkpoint.restore``
  (of TensorFlow's own save of the same variables), asyncckpt JAX vs
  orbax's ``CheckpointManager.restore`` (of orbax's save of the same
  pytree), against a raw ``readinto`` of the same number of bytes;
* **recovery**: a fresh process per case, from its start to the end of the
  first training step after the restore: Python start-up, imports, building
  the (uninitialized) state, listing the directory for the latest
  checkpoint, verifying, reading and placing, one step. The floor is a
  process that imports NumPy and raw-reads the bytes.

The page cache is emptied without root: each file is fsynced, then
``posix_fadvise(POSIX_FADV_DONTNEED)``; ``mincore`` then checks that no page
of the checkpoint files stayed resident, and the largest resident fraction
seen is reported.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.suite import child_env
from benchmarks.suite import engines as eng

DEFAULT_SIZES = "256,1024"
QUICK_SIZES = "64"

def _mincore(fd: int, size: int) -> tuple[int, int] | None:
    """``(resident, total)`` pages of an open file, by ``mincore(2)``; None where unavailable.

    The benchmark's own check, apart from the library's page-cache probes, so
    that an eviction is confirmed by other code than the code it measures.
    """
    if size == 0:
        return 0, 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long)
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    except (OSError, AttributeError, TypeError):  # no libc with mincore here
        return None
    addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:  # MAP_FAILED
        return None
    try:
        pages = -(-size // mmap.PAGESIZE)
        status = (ctypes.c_ubyte * pages)()
        if libc.mincore(addr, size, status) != 0:
            return None
        return int(np.count_nonzero(np.frombuffer(status, np.uint8) & 1)), pages
    finally:
        libc.munmap(addr, size)


def resident_fraction(paths: list[str]) -> float | None:
    """Fraction of these files' pages in the page cache (``mincore``); None if unknown."""
    total = resident = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            counted = _mincore(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        if counted is None:
            return None
        resident += counted[0]
        total += counted[1]
    return resident / total if total else 0.0


def checkpoint_files(directory: str) -> list[str]:
    """Every file under ``directory`` (a checkpoint's, to evict or to count)."""
    out = []
    for root, _, names in os.walk(directory):
        out.extend(os.path.join(root, n) for n in names)
    return out


def evict(paths: list[str], seen: list[float]) -> None:
    """Evicts ``paths`` from the page cache; appends the fraction still resident to ``seen``."""
    eng.evict_from_page_cache(paths)
    frac = resident_fraction(paths)
    if frac is not None:
        seen.append(frac)


# -- the cases ------------------------------------------------------------------


class _Case:
    def __init__(self, name: str, framework: str, directory: str, run, child: str):
        self.name, self.framework, self.dir, self.run, self.child = (
            name, framework, directory, run, child)


def _tf_cases(nbytes: int, tensors: int, work: str) -> tuple[list[_Case], dict]:
    import tensorflow as tf

    import asyncckpt.tf as at

    state = eng.TFState(nbytes, tensors)
    ours_dir, tf_dir = os.path.join(work, "asyncckpt_tf"), os.path.join(work, "tf")
    with at.Checkpoint(**state.variables) as saver:  # closed: its staging memory freed
        ours_path = saver.save(os.path.join(ours_dir, "ckpt"))
    ours = at.Checkpoint(**state.variables)
    peer = tf.train.Checkpoint(**state.variables)
    peer_path = peer.save(os.path.join(tf_dir, "ckpt"))
    shape = {"rows": int(state.variables["w0"].shape[0]), "tensors": tensors}
    return [
        _Case("asyncckpt tf", "tf", ours_dir,
              lambda: ours.restore(ours_path).assert_consumed(), "asyncckpt-tf"),
        _Case("tf.train.Checkpoint.restore", "tf", tf_dir,
              lambda: peer.restore(peer_path).assert_consumed(), "tf"),
    ], shape


def _jax_cases(nbytes: int, tensors: int, work: str) -> tuple[list[_Case], dict]:
    import jax
    import orbax.checkpoint as ocp

    import asyncckpt.jax as aj

    state = eng.JAXState(nbytes, tensors)
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                          state.tree)
    ours_dir, orbax_dir = os.path.join(work, "asyncckpt_jax"), os.path.join(work, "orbax")
    with aj.CheckpointManager(ours_dir) as saver:  # closed: its staging memory freed
        saver.save(1, state.tree, force=True)
    ours = aj.CheckpointManager(ours_dir)
    peer = ocp.CheckpointManager(orbax_dir)
    peer.save(1, args=ocp.args.StandardSave(state.tree))
    peer.wait_until_finished()
    shape = {"rows": int(state.tree["w0"].shape[0]), "tensors": tensors}
    return [
        _Case("asyncckpt jax", "jax", ours_dir,
              lambda: jax.block_until_ready(ours.restore(1, target=target)), "asyncckpt-jax"),
        _Case("orbax CheckpointManager.restore", "jax", orbax_dir,
              lambda: jax.block_until_ready(
                  peer.restore(1, args=ocp.args.StandardRestore(target))), "orbax"),
    ], shape


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def run_child(case: str, directory: str, shape: dict) -> dict:
    """One recovery in a fresh process (``_recovery_child``): its marks, from just before it."""
    env = child_env()
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    t0 = time.time()
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.suite._recovery_child", case, directory,
         str(shape["rows"]), str(shape["tensors"])],
        env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"recovery child {case} failed: {out.stderr[-2000:]}")
    marks = json.loads(out.stdout.strip().splitlines()[-1])
    return {k: v - t0 for k, v in marks.items()}


def measure(nbytes: int, *, frameworks: list[str], reps: int, recovery_reps: int,
            workdir: str, progress) -> dict:
    """Restore and recovery times for one state size (see the module docstring)."""
    tensors = eng.tensors_for(nbytes)
    label = f"{nbytes / 2**20:.0f} MiB"
    cases: list[_Case] = []
    shapes: dict[str, dict] = {}
    if "tf" in frameworks:
        progress(f"{label}: saving the TensorFlow state twice (asyncckpt, tf) ...")
        c, shapes["tf"] = _tf_cases(nbytes, tensors, workdir)
        cases += c
    if "jax" in frameworks:
        progress(f"{label}: saving the JAX state twice (asyncckpt, orbax) ...")
        c, shapes["jax"] = _jax_cases(nbytes, tensors, workdir)
        cases += c
    floors = eng.Floors(nbytes, 1, os.path.join(workdir, "floors"))
    floors.raw_write()
    floors.keep_read_buffer_only()
    raw = _Case("raw read", "any", os.path.join(workdir, "floors"), floors.raw_read, "raw")

    def fresh_read() -> None:
        # The same read into memory allocated for it, as any restore must:
        # what page-faulting fresh memory adds to the floor on this machine.
        floors.dst = np.empty_like(floors.dst)
        floors.raw_read()

    fresh = _Case("raw read into fresh memory", "any", raw.dir, fresh_read, "raw")
    everything = [raw, fresh, *cases]
    times: dict[str, list[float]] = {c.name: [] for c in everything}
    resident: list[float] = []
    # One untimed cold restore per case first: first-use costs of this process
    # (modules, thread pools, and memory the VM has never backed, which cost a
    # 2-core VM up to 7x the fault time of reused memory) are the recovery
    # measurement's; the repetitions compare steady restores.
    progress(f"{label}: one untimed restore per case")
    for c in everything:
        evict(checkpoint_files(c.dir), resident)
        c.run()
    for rep in range(reps):
        progress(f"{label}: restore repetition {rep + 1}/{reps}")
        k = rep % len(everything)
        for c in everything[k:] + everything[:k]:
            evict(checkpoint_files(c.dir), resident)
            t0 = time.perf_counter()
            c.run()
            times[c.name].append(time.perf_counter() - t0)
    recovery: dict[str, list[dict]] = {c.name: [] for c in everything}
    recovering = [c for c in everything if c is not fresh]
    for rep in range(recovery_reps):
        progress(f"{label}: recovery repetition {rep + 1}/{recovery_reps}")
        k = rep % len(recovering)
        for c in recovering[k:] + recovering[:k]:
            evict(checkpoint_files(c.dir), resident)
            shape = shapes.get(c.framework, {"rows": nbytes // 256, "tensors": 1})
            target = os.path.join(c.dir, "raw.bin") if c is raw else c.dir
            recovery[c.name].append(run_child(c.child, target, shape))
    raw_s = statistics.median(times[raw.name])
    result = {"nbytes": nbytes, "tensors": tensors, "reps": reps,
              "max_resident_fraction_after_evict": max(resident) if resident else None,
              "restore": {}, "recovery": {}}
    for c in everything:
        t = times[c.name]
        result["restore"][c.name] = {
            **_stats(t), "framework": c.framework,
            "vs_raw_read": statistics.median(t) / raw_s,
            "per_rep_vs_raw_read": [x / r for x, r in zip(t, times[raw.name], strict=True)],
        }
        if recovery[c.name]:
            phases = {k: statistics.median(m[k] for m in recovery[c.name])
                      for k in recovery[c.name][0]}
            result["recovery"][c.name] = {"framework": c.framework, "phases_s": phases,
                                          "total": _stats([m["step"]
                                                           for m in recovery[c.name]])}
    return result


def _pairs(results: dict) -> list[tuple[str, str]]:
    return [("asyncckpt tf", "tf.train.Checkpoint.restore"),
            ("asyncckpt jax", "orbax CheckpointManager.restore")]


def text(results: dict) -> str:
    """The report: times, and the ratios the targets are stated in."""
    lines = [f"machine: {results['machine']}", f"command: {results['command']}", ""]
    for size in results["sizes"]:
        mib = size["nbytes"] / 2**20
        lines.append(f"== {mib:.0f} MiB, {size['tensors']} tensors, {size['reps']} cold "
                     f"restores per case (max resident after eviction: "
                     f"{size['max_resident_fraction_after_evict']})")
        lines.append(f"{'restore (cold cache)':34} {'median ms':>9} {'min':>6} {'max':>6} "
                     f"{'/raw read':>9} {'per-rep /raw':>14}")
        for name, r in size["restore"].items():
            per = r["per_rep_vs_raw_read"]
            lines.append(f"{name:34} {r['median'] * 1e3:9.0f} {r['min'] * 1e3:6.0f} "
                         f"{r['max'] * 1e3:6.0f} {r['vs_raw_read']:8.2f}x "
                         f"{min(per):6.2f}-{max(per):.2f}x")
        for ours, peer in _pairs(results):
            a, b = size["restore"].get(ours), size["restore"].get(peer)
            if a and b:
                lines.append(f"  {ours} / {peer}: {a['median'] / b['median']:.2f}x")
        if size["recovery"]:
            lines.append(f"{'recovery (process start -> 1st step)':38} {'total ms':>8} "
                         f"{'imports':>8} {'listed':>7} {'restored':>9} {'/floor':>7}")
            floor = size["recovery"]["raw read"]["total"]["median"]
            for name, r in size["recovery"].items():
                ph = r["phases_s"]
                lines.append(f"{name:38} {r['total']['median'] * 1e3:8.0f} "
                             f"{ph['imports'] * 1e3:8.0f} {ph['listed'] * 1e3:7.0f} "
                             f"{ph['restored'] * 1e3:9.0f} {r['total']['median'] / floor:6.2f}x")
            for ours, peer in _pairs(results):
                a, b = size["recovery"].get(ours), size["recovery"].get(peer)
                if a and b:
                    ra = a["phases_s"]["restored"] - a["phases_s"]["listed"]
                    rb = b["phases_s"]["restored"] - b["phases_s"]["listed"]
                    lines.append(f"  {ours} / {peer}: total "
                                 f"{a['total']['median'] / b['total']['median']:.2f}x, "
                                 f"restore phase {ra / rb:.2f}x")
        lines.append("")
    return "\n".join(lines)


def run(args) -> int:
    """Entry point of ``python -m benchmarks --restore``."""
    from benchmarks.suite import report, runner

    frameworks = [f for f in args.frameworks.split(",") if f]
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    sizes = [int(s) for s in (args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES))
             .split(",") if s]
    reps = args.reps or (3 if args.quick else 7)
    out = args.out or os.path.join("bench-results", "restore-" + time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    scratch = args.scratch or os.path.abspath(out)
    os.makedirs(scratch, exist_ok=True)
    progress = runner.Progress(quiet=args.quiet)
    results = {"machine": report.machine(),
               "command": report.command_line(args),
               "started": time.strftime("%Y-%m-%d %H:%M:%S"), "sizes": []}
    for mib in sizes:
        with tempfile.TemporaryDirectory(prefix="bench-restore-", dir=scratch) as work:
            results["sizes"].append(measure(
                mib << 20, frameworks=frameworks, reps=reps,
                recovery_reps=0 if args.no_recovery else max(1, reps // 2),
                workdir=work, progress=progress))
        report = text(results)  # written after each size, so a later failure keeps it
        with open(os.path.join(out, "restore.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(out, "restore.txt"), "w") as f:
            f.write(report + "\n")
    print(report)
    print(f"wrote {out}/restore.txt, {out}/restore.json")
    return 0
