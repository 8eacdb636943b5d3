"""``python -m benchmarks``: asyncckpt side by side with TensorFlow, orbax and the floors.

The default run saves, restores and trains with every engine of ``--frameworks``;
``--restore``, ``--storage``, ``--scale`` and ``--preemption`` run another benchmark
instead (the last two take their own options, everything after the flag).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time

from benchmarks.suite.report import PROG

DEFAULT_SIZES = "64,256,1024"
QUICK_SIZES = "16,64"
# The benchmarks that take every argument after their flag, and the options of this parser
# each is also given (any other option set beside one of them is refused).
HANDED_OVER = {"scale": ("out", "quick", "quiet"), "preemption": ()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default=None,
                   help=f"state sizes in MiB, comma-separated (default {DEFAULT_SIZES})")
    p.add_argument("--quick", action="store_true",
                   help=f"a small run: sizes {QUICK_SIZES}, 7 repetitions (saves of milliseconds: "
                        "3 left a median to one outlier), short training loop")
    p.add_argument("--states", default=None,
                   help="instead of --sizes: states as <arrays>x<size of one array>, "
                        "comma-separated, sizes in K, M or G (e.g. 4x16M,500x64K: 64 MiB in 4 "
                        "arrays, 500 arrays of 64 KiB); with --sizes each state has "
                        "4-64 arrays of about 16 MiB")
    p.add_argument("--reps", type=int, default=None,
                   help="repetitions per case (default 5, 7 with --quick)")
    p.add_argument("--frameworks", default="tf,jax", help="tf, jax or both (default tf,jax)")
    p.add_argument("--engines", default=None,
                   help="comma-separated engine names (default: all of the frameworks')")
    p.add_argument("--train-size", type=int, default=None,
                   help="state size in MiB for the training-loop overhead (default: the middle "
                        "size; 0 skips it)")
    p.add_argument("--train-saves", type=int, default=2, help="saves per training run")
    p.add_argument("--train-reps", type=int, default=None,
                   help="interleaved rounds of the training loop, medians reported "
                        "(default 5, 3 with --quick)")
    p.add_argument("--scratch", default=None,
                   help="directory to write checkpoints in (default: a temporary directory "
                        "beside --out, i.e. on the same disk)")
    p.add_argument("--out", default=None,
                   help="output folder (default: bench-results/<date-time>)")
    p.add_argument("--keras-size", type=int, default=32,
                   help="Keras model weights in MiB for the BackupAndRestore row, each Keras "
                        "backend of --frameworks in a child process (default 32; 0 skips it)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--storage", choices=["s3", "gcs"], default=None,
                   help="instead: the remote tier against a local S3 (SeaweedFS) or GCS "
                        "(fake-gcs-server) server: upload throughput vs a raw put, blocking "
                        "time with the tier on vs off, restore time (size: first of --sizes, "
                        "default 256, 64 with --quick)")
    p.add_argument("--restore", action="store_true",
                   help="instead: restore from a cold page cache against a raw read, "
                        "tf.train.Checkpoint.restore and orbax, and recovery time (process "
                        "start to the first training step after a restore) in fresh processes "
                        "(sizes default 256,1024; 64 with --quick)")
    p.add_argument("--no-recovery", action="store_true",
                   help="with --restore: skip the recovery-time processes")
    p.add_argument("--scale", nargs=argparse.REMAINDER, default=None, metavar="ARG",
                   help="instead: the multi-process scale benchmark (suite/scale.py): "
                        "N jax.distributed processes on 127.0.0.1, "
                        "asyncckpt and orbax, local disk and S3; blocking, durable time, "
                        "coordination calls and bytes, files, fsyncs, restore. Every argument "
                        "after --scale is the benchmark's own (--scale --help lists them); "
                        "--out, --quick and --quiet before it are passed on")
    p.add_argument("--preemption", nargs=argparse.REMAINDER, default=None, metavar="ARG",
                   help="instead: the preemption deadline benchmark (suite/preemption.py): "
                        "a training loop under PreemptionCheckpointHandler with a slowed disk "
                        "gets a real SIGTERM; final checkpoint in time, share of the grace "
                        "period trained, against TensorFlow's rule on the same runs. Every "
                        "argument after --preemption is its own (--preemption --help)")


def parse_states(text: str) -> list[tuple[int, int]]:
    """``--states``: ``"4x16M,500x64K"`` -> ``[(bytes, arrays), ...]``."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    out = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        count, sep, size = item.partition("x")
        unit = units.get(size[-1:].upper()) if size else None
        if not sep or unit is None or not count.isdigit() or not size[:-1].isdigit():
            raise ValueError(f"--states: {item!r} is not <arrays>x<size>[K|M|G] (4x16M)")
        out.append((int(count) * int(size[:-1]) * unit, int(count)))
    return out


def hand_over(args: argparse.Namespace, name: str) -> int:
    """``--scale`` / ``--preemption``: that benchmark's ``main`` with the arguments after it."""
    shared = HANDED_OVER[name]
    defaults = argparse.ArgumentParser()
    add_arguments(defaults)
    unused = [f"--{key.replace('_', '-')}" for key, default in vars(defaults.parse_args([]))
              .items() if key not in (*shared, name) and getattr(args, key) != default]
    if unused:
        print(f"{PROG} --{name}: not options of the {name} benchmark: {', '.join(unused)}; "
              f"give its own after --{name} (--{name} --help lists them)", file=sys.stderr)
        return 2
    argv = list(getattr(args, name))
    if "out" in shared and args.out is not None and "--out" not in argv:
        argv += ["--out", args.out]
    argv += [f"--{flag}" for flag in ("quick", "quiet") if flag in shared
             and getattr(args, flag) and f"--{flag}" not in argv]
    if name == "scale":
        from benchmarks.suite import scale as module
    else:
        from benchmarks.suite import preemption as module
    return module.main(argv)


def run_from_args(args: argparse.Namespace) -> int:
    for name in HANDED_OVER:
        if getattr(args, name, None) is not None:
            return hand_over(args, name)
    if getattr(args, "restore", False):
        from benchmarks.suite.restore import run as run_restore

        return run_restore(args)
    if getattr(args, "storage", None):
        from benchmarks.suite.storage import run

        return run(args)
    frameworks = [f for f in args.frameworks.split(",") if f]
    for fw, module in (("tf", "tensorflow"), ("jax", "jax")):
        if fw in frameworks and importlib.util.find_spec(module) is None:
            print(f"{PROG}: {module} is not installed; skipping {fw}", file=sys.stderr)
            frameworks.remove(fw)
    if "jax" in frameworks and "jax" not in sys.modules:
        # Several CPU devices, so JAX arrays are really sharded (no effect on GPUs/TPUs).
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    from benchmarks.suite import engines as eng
    from benchmarks.suite import report, runner

    sizes_mib = [int(s) for s in (args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES))
                 .split(",") if s]
    try:
        states = (parse_states(args.states) if args.states
                  else [(mib << 20, None) for mib in sizes_mib])
    except ValueError as e:
        print(f"asyncckpt bench: {e}", file=sys.stderr)
        return 2
    reps = args.reps or (7 if args.quick else 5)
    names = [n for n, cls in eng.ENGINES.items() if cls.framework in frameworks]
    if args.engines:
        wanted = [n.strip() for n in args.engines.split(",")]
        unknown = [n for n in wanted if n not in eng.ENGINES]
        if unknown:
            print(f"unknown engine(s) {unknown}; known: {list(eng.ENGINES)}", file=sys.stderr)
            return 2
        names = [n for n in wanted if n in names]
    out = args.out or os.path.join("bench-results", time.strftime("%Y%m%d-%H%M%S"))
    os.makedirs(out, exist_ok=True)
    scratch_parent = args.scratch or os.path.abspath(out)
    os.makedirs(scratch_parent, exist_ok=True)
    progress = runner.Progress(quiet=args.quiet)
    results: dict = {
        "machine": report.machine(),
        "command": report.command_line(args),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "versions": {},
        "sizes": [],
    }
    for mod in ("tensorflow", "jax", "orbax.checkpoint", "numpy"):
        if importlib.util.find_spec(mod.split(".")[0]) is not None:
            try:
                results["versions"][mod] = getattr(__import__(mod, fromlist=["_"]),
                                                   "__version__", "?")
            except Exception:  # a framework that fails to import is reported, not fatal
                results["versions"][mod] = "import failed"
    with tempfile.TemporaryDirectory(prefix="bench-scratch-", dir=scratch_parent) as work:
        for i, (nbytes, arrays) in enumerate(states):
            progress(f"state of {nbytes / 2**20:.0f} MiB" + (f" in {arrays} arrays" if arrays
                                                              else "") + " ...")
            results["sizes"].append(runner.measure_size(
                nbytes, frameworks=frameworks, engine_names=names, reps=reps,
                workdir=os.path.join(work, f"{i}"), progress=progress, tensors=arrays))
        train_mib = args.train_size
        if train_mib is None:
            train_mib = max(1, states[len(states) // 2][0] >> 20)
        if train_mib:
            progress(f"training loop with a {train_mib} MiB state ...")
            results["training"] = runner.measure_training(
                train_mib << 20, frameworks=frameworks, engine_names=names,
                workdir=os.path.join(work, "train"), saves=args.train_saves,
                reps=args.train_reps or (3 if args.quick else 5), progress=progress)
        if "tf" in frameworks:
            results["unbuilt_optimizer"] = runner.unbuilt_optimizer_case(work, names)
        if args.keras_size and importlib.util.find_spec("keras") is not None:
            from benchmarks.suite import keras_case

            progress(f"Keras BackupAndRestore with {args.keras_size} MiB of weights ...")
            results["keras"] = keras_case.measure_all(
                args.keras_size << 20, reps=args.reps or (5 if args.quick else 10),
                backends=[{"tf": "tensorflow"}.get(f, f) for f in frameworks])
    paths = report.write(results, out)
    print(report.text(results))
    if results.get("keras"):
        with open(paths["text"], "a") as f:
            f.write("\n" + keras_case.text(results["keras"]) + "\n")
        print("\n" + keras_case.text(results["keras"]))
    print("\nwrote " + ", ".join(paths.values()))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = p.parse_args(argv)
    args.argv = argv
    return run_from_args(args)
