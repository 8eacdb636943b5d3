"""The benchmark scripts that reach into asyncckpt's internals still run, and so does
``asyncckpt bench`` itself.

These scripts swap or wrap private functions (a writer, a copy, a save
job) to measure one part at a time, so a change of those internals can
break them without any other test noticing: ``bench_tf_write.py`` raised
``TypeError`` for several sessions after the bundle writer gained a
keyword. Each runs here once at a tiny size, in a subprocess, and must
finish and print its result line. Speed is not checked (see benchmarks/).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (script, arguments, a fragment of the result it must print)
CASES = [
    ("bench_tf_write.py", ["--sizes", "4", "--reps", "1"],
     "asyncckpt tf (SaveV2): durable throughput / raw write+fsync"),
    ("bench_tf_background_copy.py", ["--sizes", "4", "--reps", "1", "--skip-training"],
     "asyncckpt copy / memcpy"),
    ("bench_tf_train_overhead.py", ["--sizes", "4", "--rounds", "1", "--saves", "2"],
     "asyncckpt tf (page cache)    overhead"),
    ("bench_restore_phases.py", ["--mib", "4", "--reps", "1"], " wall "),
    ("bench_slots.py", ["--sizes", "4", "--saves", "2", "--steady", "2"],
     "jax-arrays floor"),
    ("bench_jax_blocking.py", ["--mib", "4", "--tensors", "4", "--reps", "2", "--phases"],
     "phases: copy into the slot"),
    ("bench_jax_ocdbt_gil.py", ["--mib", "4", "--values", "4", "--reps", "1"],
     "KvStore.write(bytes), commit"),
    ("bench_jax_layouts.py", ["--states", "4x256K", "--reps", "1"], "zarr files"),
    ("bench_preemption_deadline.py",
     ["--trials", "1", "--grace", "2", "--step", "0.05", "--write", "0.25", "--noise", "none",
      "--warmup", "2", "--warmup-preemptions", "1"],
     "all cells: asyncckpt 1/1 in time"),
]


def _run(tmp_path, args: list[str]) -> str:
    env = dict(os.environ, TMPDIR=str(tmp_path), ASYNCCKPT_BENCH_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("script", "args", "expect"), CASES, ids=[c[0] for c in CASES])
def test_benchmark_script_runs(tmp_path, script, args, expect):
    out = _run(tmp_path, [str(ROOT / "benchmarks" / script), *args])
    assert expect in out, out[-4000:]


@pytest.mark.slow
def test_asyncckpt_bench_runs_every_case_and_reports_the_targets(tmp_path):
    out = _run(tmp_path, ["-m", "asyncckpt", "bench", "--sizes", "4", "--reps", "1",
                          "--train-size", "0", "--keras-size", "0", "--quiet",
                          "--out", str(tmp_path / "out")])
    for line in ("memcpy jax arrays", "asyncckpt tf ", "asyncckpt jax ", "orbax async",
                 "asyncckpt jax blocking / memcpy jax arrays:", "== targets"):
        assert line in out, (line, out[-4000:])
    assert (tmp_path / "out" / "results.json").is_file()


def _checkpoints_on_disk(directory: Path) -> set[int]:
    found = set()
    for name in os.listdir(directory):
        if name.isdigit():  # a JAX step directory (orbax's and ours)
            found.add(int(name))
        elif name.startswith("ckpt-") and "." in name:  # a TensorFlow prefix's files
            found.add(int(name[len("ckpt-"):name.index(".")]))
    return found


def test_bench_engines_keep_the_newest_checkpoints_only_and_restore_the_last(tmp_path):
    """At 1 GiB the full bench wrote 13 checkpoints per engine: 65 GB of scratch."""
    from benchmarks.suite import engines as eng

    states = {"tf": eng.TFState(1 << 20, 2), "jax": eng.JAXState(1 << 20, 2)}
    for cls in eng.ENGINES.values():
        directory = tmp_path / cls.name.replace(" ", "_")
        e = cls(states[cls.framework], str(directory))
        try:
            for _ in range(4):
                e.save()
                e.wait()
                e.prune()
            assert _checkpoints_on_disk(directory) == {3, 4}, (cls.name, os.listdir(directory))
            e.restore()
        finally:
            e.close()
