"""Scale benchmark: N real ``jax.distributed`` processes saving and restoring many arrays.

Usage: python -m benchmarks --scale [--processes 1,2,4,8] [--leaves 500] [--leaf-kib 64]
       [--devices 2] [--targets local,s3] [--engines asyncckpt,orbax] [--format zarr,ocdbt]
       [--saves 3] [--out DIR] [--quick]
(or ``python -m benchmarks.suite.scale [the same arguments]``)

For each process count N, N worker processes start on 127.0.0.1 (CPU, ``--devices`` XLA
host devices each) and join one ``jax.distributed`` run. The state is ``--leaves`` float32
arrays of ``--leaf-kib`` KiB, each split over every device of the run. In the same processes,
one case after another, each (target, engine, format) saves it twice untimed (first-save
allocations, plans, the run token; then ``max_to_keep`` steps exist, so each timed save also
drops the oldest, as in a training run), then ``--saves`` times timed, then restores the last
step onto the same shardings and checks every value:

* **engines**: asyncckpt's ``asyncckpt.jax.CheckpointManager`` and orbax's own
  ``orbax.checkpoint.CheckpointManager`` (async, ``StandardSave``), both ``max_to_keep=2``;
* **formats**: ``ocdbt`` (orbax's default: a few TensorStore data files per process) and
  ``zarr`` (orbax's non-OCDBT layout: a file per array shard; asyncckpt's only layout before
  its OCDBT writer). Default: every format each engine writes. Asking asyncckpt for ``ocdbt``
  where it has no OCDBT writer (no ``asyncckpt.jax.FormatOptions``) is refused;
* **targets**: a local directory (the disk of ``--scratch``), and ``s3://`` on a SeaweedFS
  server this benchmark starts on 127.0.0.1 (orbax there only where its paths can reach S3:
  etils needs ``s3fs``; otherwise the case is listed as skipped, with the reason).

Measured, per save (medians over the timed saves) and per restore:

* blocking: time in ``save()``, process 0 and the slowest process;
* durable: process 0's ``save()`` call to its ``wait_until_finished()`` returning (the step
  committed, and retention's deletion of the dropped step where the engine does it there);
* coordination service: calls and bytes (keys and values) through JAX's real distributed
  client, counted by a proxy that replaces ``jax._src.distributed.global_state.client`` in
  each process (after JAX's backends are up) and passes every call on unchanged. A value one
  process sets and another gets counts twice, once each way (both cross the network). Totals
  over all processes, process 0 and the busiest other process, calls by method. Barriers orbax
  runs as collectives (``multihost_utils.sync_global_devices``, its default outside the
  writer thread) are not KV traffic: they are counted apart, per process;
* fsyncs (``fsync``, ``fdatasync``, ``sync_file_range``): with ``strace`` (each worker runs
  under ``strace -f --seccomp-bpf``, which stops only at the traced calls, and the calls are
  binned by timestamp into each save's window), so TensorStore's own fsyncs (C++) count too;
  without it, Python's ``os.fsync``/``os.fdatasync`` are wrapped instead (which misses
  TensorStore's): the JSON says which. ``--trace-files`` adds opens, unlinks and renames;
* files (objects on S3) of one committed step, listed by asyncckpt's store;
* restore: wall time (process 0 and the slowest), KV calls and bytes; page cache warm on disk.

A save's window runs from just before its ``save()`` to just before the next one, so
background work that outlives ``wait_until_finished()`` (orbax's and asyncckpt's retention)
counts with the save that caused it. Writes ``scale.json`` and ``scale.txt`` to ``--out``
(default ``benchmarks/results/scale-<date-time>/``) and prints the tables and the issue's
targets at the largest N and leaf count run. Speed numbers are noisy on a shared machine;
counts are not.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.suite import ROOT

ENGINES = ("asyncckpt", "orbax")
FORMATS = ("zarr", "ocdbt")
TARGETS = ("local", "s3")
BUCKET = "asyncckpt-scale"
ORBAX_DEFAULT_FORMAT = "ocdbt"  # what orbax's CheckpointManager writes unless told otherwise
FSYNC_CALLS = ("fsync", "fdatasync", "sync_file_range")
FILE_CALLS = ("open", "openat", "creat", "unlink", "unlinkat", "rename", "renameat", "renameat2")
RESULT = "SCALE-RESULT "
MAX_TO_KEEP = 2  # both managers; the timed saves each drop the oldest step

# Targets of issue 25 at 8 processes and 500 leaves.
MAX_FILES_RATIO = 2.0
MAX_KV_BYTES_RATIO = 2.0
MIN_BLOCKING_RATIO = 5.0
MAX_RESTORE_PER_PROCESS_GROWTH = 1.5  # "linear in N": per-process restore KV bytes, N max / N min


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--processes", default=None, help="process counts (default 1,2,4,8)")
    p.add_argument("--leaves", default=None, help="numbers of arrays in the state (default 500)")
    p.add_argument("--leaf-kib", type=int, default=64, help="size of each array (default 64)")
    p.add_argument("--devices", type=int, default=2,
                   help="CPU devices per process (XLA host platform; default 2)")
    p.add_argument("--targets", default=None, help="local, s3 or both (default local,s3)")
    p.add_argument("--engines", default="asyncckpt,orbax",
                   help="asyncckpt, orbax or both (default both)")
    p.add_argument("--format", default=None,
                   help="zarr, ocdbt or both (default: every format each engine writes)")
    p.add_argument("--saves", type=int, default=None,
                   help="timed saves per case, after one untimed save (default 3)")
    p.add_argument("--trace-files", action="store_true",
                   help="with strace: count opens, unlinks and renames too")
    p.add_argument("--no-strace", action="store_true",
                   help="count fsyncs by wrapping os.fsync/os.fdatasync even where strace "
                        "runs (misses TensorStore's own fsyncs)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds for the workers of one process count (and their barriers)")
    p.add_argument("--scratch", default=None,
                   help="where checkpoints and the S3 server's data go (default: a temporary "
                        "directory beside --out, on the same disk)")
    p.add_argument("--out", default=None,
                   help="output folder (default benchmarks/results/scale-<date-time>)")
    p.add_argument("--quick", action="store_true",
                   help="a small run: processes 1,2, 100 leaves, 2 saves, local disk only")
    p.add_argument("--quiet", action="store_true", help="no progress lines")


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--worker"]:
        return _worker_main(argv[1:])
    try:
        plan = make_plan(argv)
    except ValueError as e:
        print(f"python -m benchmarks --scale: {e}", file=sys.stderr)
        return 2
    results = run(plan)
    text = report(results)
    out = plan["out"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "scale.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out, "scale.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"\nwrote {os.path.join(out, 'scale.json')}, {os.path.join(out, 'scale.txt')}")
    return 0


# -- the plan (parent) -----------------------------------------------------------------------


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{what} must be positive integers, got {text!r}")
    return values


def _names(text: str, known: tuple[str, ...], what: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in values if x not in known]
    if unknown or not values:
        raise ValueError(f"{what}: unknown {unknown or text!r}; known: {', '.join(known)}")
    return values


def asyncckpt_formats() -> tuple[str, ...]:
    """The formats this asyncckpt's JAX manager writes (OCDBT only with ``FormatOptions``)."""
    import asyncckpt.jax as aj

    return FORMATS if hasattr(aj, "FormatOptions") else ("zarr",)


def make_plan(argv: list[str]) -> dict:
    """The cases to run, from the command line; ValueError for arguments that cannot run."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks --scale",
                                     description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    processes = _ints(args.processes or ("1,2" if args.quick else "1,2,4,8"), "--processes")
    leaves = _ints(args.leaves or ("100" if args.quick else "500"), "--leaves")
    saves = args.saves if args.saves is not None else (2 if args.quick else 3)
    if saves < 1:
        raise ValueError("--saves must be at least 1")
    targets = _names(args.targets or ("local" if args.quick else "local,s3"), TARGETS,
                     "--targets")
    engines = _names(args.engines, ENGINES, "--engines")
    wanted = _names(args.format, FORMATS, "--format") if args.format else None
    if args.devices < 1 or args.leaf_kib < 1:
        raise ValueError("--devices and --leaf-kib must be positive")
    elements = args.leaf_kib * 1024 // 4
    for n in processes:
        if elements % (n * args.devices):
            raise ValueError(f"a leaf of {args.leaf_kib} KiB ({elements} float32) does not split "
                             f"evenly over {n} x {args.devices} devices")
    ours = asyncckpt_formats() if "asyncckpt" in engines else ()
    if wanted and "asyncckpt" in engines and not set(wanted) <= set(ours):
        raise ValueError(
            "--format ocdbt: this asyncckpt writes only orbax's zarr layout (a file per array "
            "shard): it has no OCDBT writer (asyncckpt.jax.FormatOptions, issue 25 item 1). "
            "Use --format zarr, or --engines orbax --format ocdbt for orbax's own OCDBT.")
    pairs = []
    for engine in engines:
        for fmt in wanted or (ours if engine == "asyncckpt" else FORMATS):
            pairs.append((engine, fmt))
    cases, skipped = [], []
    orbax_s3 = importlib.util.find_spec("s3fs") is not None
    for target in targets:
        for n_leaves in leaves:
            for engine, fmt in pairs:
                case = {"id": f"{target}-{engine}-{fmt}-{n_leaves}", "target": target,
                        "engine": engine, "format": fmt, "leaves": n_leaves}
                if target == "s3" and engine == "orbax" and not orbax_s3:
                    skipped.append({**case, "reason": (
                        "orbax's paths (etils.epath) reach s3:// through TensorFlow's gfile "
                        "where TensorFlow is installed (it has no S3 filesystem), else through "
                        "fsspec's s3fs, which is not installed")})
                    continue
                cases.append(case)
    strace = None if args.no_strace else shutil.which("strace")
    if strace and not _strace_works(strace):
        strace = None
    out = args.out or os.path.join(ROOT, "benchmarks", "results",
                                   time.strftime("scale-%Y%m%d-%H%M%S"))
    return {
        "processes": processes, "leaves": leaves, "leaf_bytes": args.leaf_kib * 1024,
        "devices": args.devices, "saves": saves, "cases": cases, "skipped": skipped,
        "strace": strace, "trace_files": bool(args.trace_files and strace),
        "timeout_s": args.timeout, "scratch": args.scratch, "out": out, "quiet": args.quiet,
        "command": "python -m benchmarks --scale " + " ".join(shlex.quote(a) for a in argv),
    }


def _strace_works(strace: str) -> bool:
    try:
        return subprocess.run([strace, "-f", "-qq", "--seccomp-bpf", "-e", "trace=fsync",
                               "-o", os.devnull, "true"], capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


# -- running (parent) ------------------------------------------------------------------------


def run(plan: dict) -> dict:
    """Runs every process count of ``plan`` (``make_plan``); returns the results."""
    import asyncckpt
    from benchmarks.suite.report import machine

    def progress(msg: str) -> None:
        if not plan["quiet"]:
            print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    results = {
        "machine": machine(), "command": plan["command"],
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "config": {k: plan[k] for k in ("processes", "leaves", "leaf_bytes", "devices", "saves")},
        "fsync_method": ("strace -f (every fsync/fdatasync/sync_file_range, C++ included)"
                         if plan["strace"] else
                         "os.fsync/os.fdatasync wrapped in Python (TensorStore's are missed)"),
        "skipped": plan["skipped"], "runs": [], "versions": {},
    }
    for s in plan["skipped"]:
        progress(f"skipped {s['id']}: {s['reason']}")
    package_root = str(Path(asyncckpt.__file__).resolve().parent.parent)
    scratch_parent = plan["scratch"] or os.path.abspath(plan["out"])
    os.makedirs(scratch_parent, exist_ok=True)
    server = None
    with tempfile.TemporaryDirectory(prefix="scale-scratch-", dir=scratch_parent) as work:
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", TMPDIR=work,
                   TF_CPP_MIN_LOG_LEVEL="2",
                   XLA_FLAGS=f"--xla_force_host_platform_device_count={plan['devices']}")
        # The asyncckpt measured first (whatever checkout ``run`` imported), then the
        # checkout of these benchmarks, whose worker module the processes run.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, str(ROOT),
                                                          env.get("PYTHONPATH")]))
        try:
            if any(c["target"] == "s3" for c in plan["cases"]):
                from tests.servers import SeaweedS3

                progress("starting SeaweedFS (S3) on 127.0.0.1 ...")
                server = SeaweedS3(os.path.join(work, "seaweed"))
                server.start(timeout_s=180)
                server.make_bucket(BUCKET)
                env.update(server.env())
                if any(c["target"] == "s3" and c["engine"] == "orbax" for c in plan["cases"]):
                    env["EPATH_USE_TF"] = "false"  # etils: fsspec (s3fs), not TF's gfile
            for n in plan["processes"]:
                progress(f"{n} process(es): {len(plan['cases'])} case(s) ...")
                runs, versions = _run_processes(n, plan, env, os.path.join(work, f"n{n}"),
                                                progress)
                results["runs"].extend(runs)
                results["versions"] = versions
        finally:
            if server is not None:
                server.kill()  # throwaway data
    results["targets"] = evaluate_targets(results)
    return results


def _run_processes(n: int, plan: dict, env: dict, root: str, progress) -> tuple[list, dict]:
    from tests.servers import free_port

    os.makedirs(root, exist_ok=True)
    config = {
        "cases": plan["cases"], "leaf_bytes": plan["leaf_bytes"], "devices": plan["devices"],
        "saves": plan["saves"], "timeout_s": plan["timeout_s"], "root": root,
        "s3_prefix": f"s3://{BUCKET}/{uuid.uuid4().hex[:10]}/n{n}",
        "python_fsync": not plan["strace"],
    }
    config_path = os.path.join(root, "config.json")
    with open(config_path, "w") as f:
        json.dump(config, f)
    port = str(free_port())
    traced = FSYNC_CALLS + (FILE_CALLS if plan["trace_files"] else ())
    procs, logs, traces = [], [], []
    try:
        for i in range(n):
            cmd = [sys.executable, "-m", "benchmarks.suite.scale", "--worker", str(i), str(n),
                   port, config_path]
            trace = os.path.join(root, f"strace.{i}")
            if plan["strace"]:
                cmd = [plan["strace"], "-f", "-qq", "-ttt", "--seccomp-bpf",
                       "-e", "trace=" + ",".join(traced), "-o", trace, *cmd]
            log = open(os.path.join(root, f"worker.{i}.log"), "w+")  # noqa: SIM115
            logs.append(log)
            traces.append(trace)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          stdin=subprocess.DEVNULL))
        deadline = time.monotonic() + plan["timeout_s"] + 120
        while any(p.poll() is None for p in procs):
            failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        texts = []
        for log in logs:
            log.seek(0)
            texts.append(log.read())
            log.close()
    if any(p.returncode != 0 for p in procs):
        detail = "\n".join(f"--- process {i} (exit {p.returncode}):\n{t[-3000:]}"
                           for i, (p, t) in enumerate(zip(procs, texts, strict=True)))
        raise RuntimeError(f"the workers of {n} process(es) failed:\n{detail}")
    per_process = []
    for t in texts:
        lines = [x for x in t.splitlines() if x.startswith(RESULT)]
        per_process.append(json.loads(lines[-1][len(RESULT):]))
    calls = [_read_trace(t, traced) if plan["strace"] else None for t in traces]
    runs = []
    for k, case in enumerate(plan["cases"]):
        rows = [p["cases"][k] for p in per_process]
        runs.append(_summarize(n, case, rows, calls, plan))
        progress("  " + _progress_line(runs[-1]))
    return runs, per_process[0]["versions"]


_TRACE_LINE = re.compile(r"^\d+\s+(\d+\.\d+)\s+([a-z_0-9]+)\(")


def _read_trace(path: str, traced: tuple[str, ...]) -> list[tuple[float, str]]:
    """(time, syscall) of each traced call that was entered (a call split by another
    thread's is one ``name(... <unfinished ...>`` line and one ``<... name resumed>``)."""
    out = []
    with open(path) as f:
        for line in f:
            m = _TRACE_LINE.match(line)
            if m and m.group(2) in traced:
                out.append((float(m.group(1)), m.group(2)))
    return out


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _kv_delta(a: dict, b: dict) -> dict:
    calls = {k: b["calls"].get(k, 0) - a["calls"].get(k, 0) for k in b["calls"]}
    calls = {k: v for k, v in calls.items() if v}
    return {"calls": calls, "n": sum(calls.values()), "bytes": b["bytes"] - a["bytes"],
            "collective_barriers": b["collective_barriers"] - a["collective_barriers"],
            "python_fsyncs": b["python_fsyncs"] - a["python_fsyncs"]}


def _syscalls(calls: list[tuple[float, str]] | None, t0: float, t1: float) -> dict:
    counts: dict[str, int] = {}
    for t, name in calls or ():
        if t0 <= t < t1:
            counts[name] = counts.get(name, 0) + 1
    return counts


def _summarize(n: int, case: dict, rows: list[dict], calls: list, plan: dict) -> dict:
    """One case at N processes, from every process's marks and timings."""
    saves = plan["saves"]
    # windows: save i is marks[i] .. marks[i + 1]; the restore is marks[saves] .. marks[-1]
    per_save = []  # per save: per process: {kv..., fsyncs, syscalls}
    for i in range(saves + 1):
        procs = []
        for p, row in enumerate(rows):
            a, b = row["marks"][i], row["marks"][i + 1]
            d = _kv_delta(a, b)
            sys_counts = _syscalls(calls[p], a["t"], b["t"])
            d["syscalls"] = sys_counts
            d["fsyncs"] = (sum(sys_counts.get(c, 0) for c in FSYNC_CALLS) if calls[p] is not None
                           else d["python_fsyncs"])
            procs.append(d)
        per_save.append(procs)
    saves_w, restore_w = per_save[:saves], per_save[saves]

    def total(windows, key):
        return _median([sum(p[key] for p in w) for w in windows])

    def p0(windows, key):
        return _median([w[0][key] for w in windows])

    def others(windows, key):
        return _median([max(p[key] for p in w[1:]) for w in windows]) if n > 1 else None

    by_method: dict[str, float] = {}
    for w in saves_w:
        for p in w:
            for k, v in p["calls"].items():
                by_method[k] = by_method.get(k, 0) + v / saves
    syscalls: dict[str, float] = {}
    for w in saves_w:
        for p in w:
            for k, v in p["syscalls"].items():
                syscalls[k] = syscalls.get(k, 0) + v / saves
    blocking = [_median(r["blocking_s"]) for r in rows]
    restore_s = [r["restore_s"] for r in rows]
    return {
        "processes": n, "target": case["target"], "engine": case["engine"],
        "format": case["format"], "leaves": case["leaves"], "leaf_bytes": plan["leaf_bytes"],
        "devices_per_process": plan["devices"], "saves": saves,
        "blocking_ms_p0": blocking[0] * 1e3, "blocking_ms_max": max(blocking) * 1e3,
        "blocking_ms_p0_each": [x * 1e3 for x in rows[0]["blocking_s"]],
        "durable_ms_p0": _median(rows[0]["durable_s"]) * 1e3,
        "durable_ms_p0_each": [x * 1e3 for x in rows[0]["durable_s"]],
        "kv_calls_per_save": total(saves_w, "n"),
        "kv_bytes_per_save": total(saves_w, "bytes"),
        "kv_calls_per_save_p0": p0(saves_w, "n"),
        "kv_bytes_per_save_p0": p0(saves_w, "bytes"),
        "kv_bytes_per_save_max_other": others(saves_w, "bytes"),
        "kv_calls_per_save_by_method": {k: round(v, 2) for k, v in sorted(by_method.items())},
        "collective_barriers_per_save_p0": p0(saves_w, "collective_barriers"),
        "fsyncs_per_save": total(saves_w, "fsyncs"),
        "fsyncs_per_save_p0": p0(saves_w, "fsyncs"),
        "syscalls_per_save": {k: round(v, 2) for k, v in sorted(syscalls.items())},
        "files_per_checkpoint": rows[0]["files"],
        "bytes_per_checkpoint": rows[0]["file_bytes"],
        "restore_s_p0": restore_s[0], "restore_s_max": max(restore_s),
        "restore_kv_calls": sum(p["n"] for p in restore_w),
        "restore_kv_bytes": sum(p["bytes"] for p in restore_w),
        "restore_kv_calls_p0": restore_w[0]["n"],
        "restore_kv_bytes_p0": restore_w[0]["bytes"],
        "restore_kv_bytes_max_other": max(p["bytes"] for p in restore_w[1:]) if n > 1 else None,
        "restore_collective_barriers_p0": restore_w[0]["collective_barriers"],
        "restored_exactly": all(r["restored_ok"] for r in rows),
    }


def _progress_line(r: dict) -> str:
    return (f"{r['target']:<5} {r['engine']:<9} {r['format']:<5} {r['leaves']:>5} leaves: "
            f"blocking {r['blocking_ms_p0']:.0f} ms, durable {r['durable_ms_p0']:.0f} ms, "
            f"{r['files_per_checkpoint']} files, KV {r['kv_bytes_per_save']:.0f} B/save, "
            f"{r['fsyncs_per_save']:.0f} fsyncs/save, restore {r['restore_s_max']:.2f} s")


# -- targets and the report ------------------------------------------------------------------


def evaluate_targets(results: dict) -> list[dict]:
    """Issue 25's targets, at the largest process count and leaf count of the run."""
    runs = results["runs"]
    if not runs:
        return []
    n_max = max(r["processes"] for r in runs)
    leaves = max(r["leaves"] for r in runs)
    out = []

    def find(target, engine, fmt, n):
        return next((r for r in runs if (r["target"], r["engine"], r["format"], r["leaves"],
                                         r["processes"]) == (target, engine, fmt, leaves, n)),
                    None)

    for target in TARGETS:
        orbax = find(target, "orbax", ORBAX_DEFAULT_FORMAT, n_max)
        for fmt in FORMATS:
            ours = find(target, "asyncckpt", fmt, n_max)
            if ours is None:
                continue
            where = f"{target}, asyncckpt {fmt}, N={n_max}, {leaves} leaves"
            if orbax is not None:
                ratio = ours["files_per_checkpoint"] / max(1, orbax["files_per_checkpoint"])
                out.append({"what": f"files per step <= {MAX_FILES_RATIO:g}x orbax's "
                                    f"({where})", "value": ratio,
                            "met": ratio <= MAX_FILES_RATIO})
                ratio = ours["kv_bytes_per_save"] / max(1, orbax["kv_bytes_per_save"])
                out.append({"what": f"KV bytes per save <= {MAX_KV_BYTES_RATIO:g}x orbax's "
                                    f"({where})", "value": ratio,
                            "met": ratio <= MAX_KV_BYTES_RATIO})
                ratio = orbax["blocking_ms_p0"] / max(1e-9, ours["blocking_ms_p0"])
                out.append({"what": f"orbax's blocking / ours >= {MIN_BLOCKING_RATIO:g} "
                                    f"({where})", "value": ratio,
                            "met": ratio >= MIN_BLOCKING_RATIO})
            multi = sorted(r["processes"] for r in runs
                           if (r["target"], r["engine"], r["format"], r["leaves"])
                           == (target, "asyncckpt", fmt, leaves) and r["processes"] >= 2)
            if len(multi) >= 2:
                lo, hi = find(target, "asyncckpt", fmt, multi[0]), ours
                growth = ((hi["restore_kv_bytes"] / hi["processes"])
                          / max(1, lo["restore_kv_bytes"] / lo["processes"]))
                out.append({"what": f"restore KV bytes linear in N: per process at N={n_max} "
                                    f"<= {MAX_RESTORE_PER_PROCESS_GROWTH:g}x at N={multi[0]} "
                                    f"({target}, asyncckpt {fmt}, {leaves} leaves)",
                            "value": growth, "met": growth <= MAX_RESTORE_PER_PROCESS_GROWTH})
    return out


def _fmt(v, spec="{:.0f}") -> str:
    return "-" if v is None else spec.format(v)


def report(results: dict) -> str:
    """The results as text: one table per (target, leaves), then the targets."""
    cfg = results["config"]
    lines = [f"== scale: {results['machine']}",
             f"   {cfg['devices']} CPU devices per process, leaves of {cfg['leaf_bytes'] // 1024} "
             f"KiB split over every device, {cfg['saves']} timed saves per case (medians)",
             f"   fsyncs counted by {results['fsync_method']}",
             f"   versions: {results['versions']}"]
    for s in results["skipped"]:
        lines.append(f"   skipped {s['id']}: {s['reason']}")
    header = (f"{'N':>2} {'engine':<16} {'block p0':>8} {'blk max':>8} {'durable':>8} "
              f"{'KV calls':>8} {'KV B':>9} {'KV B p0':>9} {'coll':>4} {'files':>6} "
              f"{'fsync':>6} {'fs p0':>6} {'restore':>7} {'rKV call':>8} {'rKV B':>9} ok")
    groups: dict[tuple, list] = {}
    for r in results["runs"]:
        groups.setdefault((r["target"], r["leaves"]), []).append(r)
    for (target, leaves), rows in groups.items():
        lines += ["", f"== {target}, {leaves} leaves (ms; KV and fsyncs per save, all "
                      f"processes; coll: collective barriers per save per process; restore: "
                      f"slowest process, s)", header]
        for r in sorted(rows, key=lambda r: (r["processes"], r["engine"], r["format"])):
            lines.append(
                f"{r['processes']:>2} {r['engine'] + ' ' + r['format']:<16} "
                f"{r['blocking_ms_p0']:>8.1f} {r['blocking_ms_max']:>8.1f} "
                f"{r['durable_ms_p0']:>8.0f} {_fmt(r['kv_calls_per_save'], '{:.1f}'):>8} "
                f"{_fmt(r['kv_bytes_per_save']):>9} {_fmt(r['kv_bytes_per_save_p0']):>9} "
                f"{_fmt(r['collective_barriers_per_save_p0']):>4} "
                f"{r['files_per_checkpoint']:>6} {_fmt(r['fsyncs_per_save']):>6} "
                f"{_fmt(r['fsyncs_per_save_p0']):>6} {r['restore_s_max']:>7.2f} "
                f"{r['restore_kv_calls']:>8} {r['restore_kv_bytes']:>9} "
                f"{'yes' if r['restored_exactly'] else 'NO'}")
    if results.get("targets"):
        lines += ["", "== targets (issue 25)"]
        for t in results["targets"]:
            lines.append(f"{'met ' if t['met'] else 'MISS'} {t['what']}: {t['value']:.2f}")
    return "\n".join(lines)


# -- the worker (one process of a jax.distributed run) ---------------------------------------


class CountingClient:
    """JAX's real distributed client, counting each call and the bytes of its keys and values.

    Every call is passed on unchanged, its exceptions included; a value a get returns counts
    as bytes received.
    """

    def __init__(self, inner) -> None:
        self._inner = inner
        self.calls: dict[str, int] = {}
        self.bytes = 0

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if not callable(attr) or name in ("connect", "shutdown", "get_live_nodes"):
            return attr

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            self.bytes += _payload(args)
            result = attr(*args, **kwargs)
            self.bytes += _payload(result)
            return result

        return counted


def _payload(value) -> int:
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, bytes | bytearray | memoryview):
        return len(value)
    if isinstance(value, list | tuple):
        return sum(_payload(v) for v in value)
    return 0  # timeouts, flags, process ids: not payload


def _worker_main(argv: list[str]) -> int:
    pid, nproc, port, config_path = int(argv[0]), int(argv[1]), argv[2], argv[3]
    with open(config_path) as f:
        cfg = json.load(f)
    counters = {"collective_barriers": 0, "python_fsyncs": 0}
    if cfg["python_fsync"]:
        for name in ("fsync", "fdatasync"):
            real = getattr(os, name)

            def counted(fd, _real=real):
                counters["python_fsyncs"] += 1
                return _real(fd)

            setattr(os, name, counted)
    import jax

    timeout_ms = int(cfg["timeout_s"] * 1000)
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                               initialization_timeout=int(cfg["timeout_s"]))
    assert jax.local_device_count() == cfg["devices"], jax.local_devices()
    from jax._src import distributed
    from jax.experimental import multihost_utils

    raw = distributed.global_state.client  # the backends above already hold the real one
    kv = CountingClient(raw)
    distributed.global_state.client = kv
    real_sync = multihost_utils.sync_global_devices

    def counted_sync(name, *args, **kwargs):
        counters["collective_barriers"] += 1
        return real_sync(name, *args, **kwargs)

    multihost_utils.sync_global_devices = counted_sync
    seq = [0]

    def barrier(name: str) -> None:
        seq[0] += 1
        raw.wait_at_barrier(f"scale-{seq[0]}-{name}", timeout_ms)

    def mark() -> dict:
        return {"t": time.time(), "calls": dict(kv.calls), "bytes": kv.bytes, **counters}

    import orbax.checkpoint as ocp

    import asyncckpt

    out = {"cases": [], "versions": {"jax": jax.__version__, "orbax": ocp.__version__,
                                     "asyncckpt": asyncckpt.__version__}}
    try:
        for case in cfg["cases"]:
            barrier(case["id"])
            out["cases"].append(_run_case(case, cfg, pid, barrier, mark))
        print(RESULT + json.dumps(out), flush=True)
        barrier("end")
    finally:
        distributed.global_state.client = raw
        multihost_utils.sync_global_devices = real_sync
    jax.distributed.shutdown()
    return 0


def _run_case(case: dict, cfg: dict, pid: int, barrier, mark) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from asyncckpt.storage.stores import open_store

    mesh = Mesh(np.array(jax.devices()), ("d",))
    sharding = NamedSharding(mesh, P("d"))
    n = cfg["leaf_bytes"] // 4
    # Random floats, as trained weights are: orbax's zstd finds little to compress in them.
    base = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    names = [f"p{i:05d}" for i in range(case["leaves"])]

    def state(step: int) -> dict:
        return {name: jax.make_array_from_callback(
            (n,), sharding, lambda idx, i=i: base[idx] + float(step * 1000 + i))
            for i, name in enumerate(names)}

    if case["target"] == "s3":
        directory = f"{cfg['s3_prefix']}/{case['id']}"
    else:
        directory = os.path.join(cfg["root"], case["id"])
    save, restore, mgr = _manager(case, directory, cfg)
    # Untimed saves until retention keeps MAX_TO_KEEP steps: from then on, as in a training
    # run, every save also drops the oldest step (first-save allocations and plans are done).
    for step in range(MAX_TO_KEEP):
        save(step, state(step))
        mgr.wait_until_finished()
    blocking, durable, marks = [], [], []
    last = MAX_TO_KEEP + cfg["saves"] - 1
    for step in range(MAX_TO_KEEP, last + 1):
        tree = state(step)
        barrier(f"{case['id']}-save{step}")
        marks.append(mark())
        t0 = time.perf_counter()
        save(step, tree)
        t1 = time.perf_counter()
        mgr.wait_until_finished()
        t2 = time.perf_counter()
        blocking.append(t1 - t0)
        durable.append(t2 - t0)
        del tree
    barrier(f"{case['id']}-saved")
    files = file_bytes = None
    if pid == 0:
        store = open_store(directory)
        objects = store.list(f"{last}/")
        files, file_bytes = len(objects), sum(o.size for o in objects)
        store.close()
    target = {name: jax.ShapeDtypeStruct((n,), jnp.float32, sharding=sharding) for name in names}
    barrier(f"{case['id']}-restore")
    marks.append(mark())
    t0 = time.perf_counter()
    got = restore(last, target)
    jax.block_until_ready(got)
    restore_s = time.perf_counter() - t0
    ok = sorted(got) == names and all(
        np.array_equal(np.asarray(s.data), base[s.index] + float(last * 1000 + i))
        for i, name in enumerate(names) for s in got[name].addressable_shards)
    del got
    barrier(f"{case['id']}-restored")
    marks.append(mark())
    mgr.close()
    return {"id": case["id"], "blocking_s": blocking, "durable_s": durable, "marks": marks,
            "restore_s": restore_s, "restored_ok": bool(ok), "files": files,
            "file_bytes": file_bytes}


def _manager(case: dict, directory: str, cfg: dict):
    """(save(step, tree), restore(step, target), manager) of the case's engine and format."""
    use_ocdbt = case["format"] == "ocdbt"
    if case["engine"] == "asyncckpt":
        import asyncckpt.jax as aj

        kwargs = {}
        if hasattr(aj, "FormatOptions"):
            kwargs["format_options"] = aj.FormatOptions(use_ocdbt=use_ocdbt)
        elif use_ocdbt:
            raise ValueError("this asyncckpt has no OCDBT writer")  # refused by _plan first
        mgr = aj.CheckpointManager(directory, max_to_keep=MAX_TO_KEEP,
                                   coordination_timeout_s=cfg["timeout_s"], **kwargs)
        return (lambda step, tree: mgr.save(step, tree),
                lambda step, target: mgr.restore(step, target=target), mgr)
    import orbax.checkpoint as ocp

    mgr = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=MAX_TO_KEEP,
                                             enable_async_checkpointing=True),
        item_handlers=ocp.StandardCheckpointHandler(use_ocdbt=use_ocdbt))
    return (lambda step, tree: mgr.save(step, args=ocp.args.StandardSave(tree)),
            lambda step, target: mgr.restore(step, args=ocp.args.StandardRestore(target)), mgr)


if __name__ == "__main__":
    sys.exit(main())
