"""A small run of the scale benchmark (``python -m benchmarks --scale``, benchmarks/suite/scale.py).

One and two real ``jax.distributed`` processes, 20 leaves, local disk, one timed save per
case, every engine and format this asyncckpt writes plus orbax's two. Speed is not checked
(see benchmarks/); the JSON must carry every field, the counts must be the ones the layouts
imply, and every restore must be exact. The full grid is not part of the test suite.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT, subprocess_env

pytest.importorskip("jax")
pytest.importorskip("orbax.checkpoint")

LEAVES, DEVICES = 20, 2

RUN_FIELDS = {
    "processes", "target", "engine", "format", "leaves", "leaf_bytes", "devices_per_process",
    "saves", "blocking_ms_p0", "blocking_ms_max", "blocking_ms_p0_each", "durable_ms_p0",
    "durable_ms_p0_each", "kv_calls_per_save", "kv_bytes_per_save", "kv_calls_per_save_p0",
    "kv_bytes_per_save_p0", "kv_bytes_per_save_max_other", "kv_calls_per_save_by_method",
    "collective_barriers_per_save_p0", "fsyncs_per_save", "fsyncs_per_save_p0",
    "syscalls_per_save", "files_per_checkpoint", "bytes_per_checkpoint", "restore_s_p0",
    "restore_s_max", "restore_kv_calls", "restore_kv_bytes", "restore_kv_calls_p0",
    "restore_kv_bytes_p0", "restore_kv_bytes_max_other", "restore_collective_barriers_p0",
    "restored_exactly",
}
# Only meaningful with another process.
OTHER_PROCESS_FIELDS = {"kv_bytes_per_save_max_other", "restore_kv_bytes_max_other"}


@pytest.mark.slow
def test_scale_benchmark_small_run_reports_every_figure(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quiet", "--out", str(out), "--scale",
         "--processes", "1,2", "--leaves", str(LEAVES), "--saves", "1", "--targets", "local",
         "--devices", str(DEVICES), "--scratch", str(tmp_path / "scratch")],
        cwd=REPO_ROOT, env=subprocess_env(TMPDIR=str(tmp_path)), capture_output=True,
        text=True, timeout=600)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text[-6000:]
    assert "== targets (issue 25)" in text and "asyncckpt zarr" in text, text[-4000:]
    results = json.loads((out / "scale.json").read_text())
    assert (out / "scale.txt").read_text().strip() in proc.stdout
    assert results["config"]["processes"] == [1, 2] and results["versions"]["orbax"]
    pairs = {(r["engine"], r["format"]) for r in results["runs"]}
    assert {("asyncckpt", "zarr"), ("orbax", "zarr"), ("orbax", "ocdbt")} <= pairs
    assert len(results["runs"]) == 2 * len(pairs)
    strace = results["fsync_method"].startswith("strace")
    by = {(r["processes"], r["engine"], r["format"]): r for r in results["runs"]}
    for (n, engine, fmt), r in by.items():
        what = (n, engine, fmt)
        assert set(r) == RUN_FIELDS, (what, set(r) ^ RUN_FIELDS)
        for field in RUN_FIELDS - OTHER_PROCESS_FIELDS:
            assert r[field] is not None, (what, field)
        assert all((r[f] is None) == (n == 1) for f in OTHER_PROCESS_FIELDS), what
        assert r["restored_exactly"], what
        assert r["leaves"] == LEAVES and r["devices_per_process"] == DEVICES
        assert 0 < r["blocking_ms_p0"] <= r["blocking_ms_max"]
        assert r["blocking_ms_p0"] < r["durable_ms_p0"], what
        assert r["restore_s_max"] > 0
        # Every leaf's bytes are in the step (orbax's zstd saves about 30% on random normals).
        assert r["bytes_per_checkpoint"] >= (1.0 if engine == "asyncckpt" else 0.5) * (
            LEAVES * r["leaf_bytes"]), what
        # zarr: a file per array shard and a metadata file per array, at least; OCDBT: a few
        # data files per process, fewer than that.
        zarr_least = LEAVES * n * DEVICES + LEAVES
        if fmt == "zarr":
            assert r["files_per_checkpoint"] >= zarr_least, what
        else:
            assert r["files_per_checkpoint"] < zarr_least, what
        if engine == "asyncckpt" or strace:  # wrapped os.fsync misses TensorStore's own
            assert r["fsyncs_per_save"] >= 1 and r["fsyncs_per_save_p0"] >= 1, what
        assert r["kv_calls_per_save"] == sum(r["kv_calls_per_save_by_method"].values())
    for fmt in {f for e, f in pairs if e == "asyncckpt"}:
        one, two = by[(1, "asyncckpt", fmt)], by[(2, "asyncckpt", fmt)]
        # One process: no coordination at all. Two: every process answers every save, and
        # a restore agrees on its verdict through the store.
        assert one["kv_calls_per_save"] == 0 and one["restore_kv_calls"] == 0
        assert two["kv_calls_per_save_p0"] > 0 and two["kv_bytes_per_save_max_other"] > 0
        assert two["restore_kv_calls"] > 0
        assert two["collective_barriers_per_save_p0"] == 0
    # orbax's barriers outside its writer thread are collectives, counted apart.
    assert by[(2, "orbax", "ocdbt")]["collective_barriers_per_save_p0"] > 0
    assert by[(2, "orbax", "ocdbt")]["kv_calls_per_save_by_method"].get("wait_at_barrier")
    assert results["targets"] and all(set(t) == {"what", "value", "met"}
                                      for t in results["targets"])


def test_scale_benchmark_refuses_what_it_cannot_run(capsys):
    from benchmarks.suite import scale as bench
    from benchmarks.suite.cli import main

    # Options of the other modes are not silently dropped.
    assert main(["--sizes", "4", "--scale", "--processes", "1"]) == 2
    assert "--sizes" in capsys.readouterr().err
    with pytest.raises(ValueError, match="does not split evenly"):
        bench.make_plan(["--processes", "3", "--leaf-kib", "1"])
    # asyncckpt's OCDBT is asked for: planned where asyncckpt writes it, refused by name where not.
    import asyncckpt.jax as aj

    argv = ["--engines", "asyncckpt,orbax", "--format", "ocdbt", "--targets", "local"]
    if hasattr(aj, "FormatOptions"):
        ids = [c["id"] for c in bench.make_plan(argv)["cases"]]
        assert ids == ["local-asyncckpt-ocdbt-500", "local-orbax-ocdbt-500"]
    else:
        with pytest.raises(ValueError, match="no OCDBT writer"):
            bench.make_plan(argv)
        plan = bench.make_plan(["--engines", "orbax", "--format", "ocdbt", "--targets", "local"])
        assert [c["id"] for c in plan["cases"]] == ["local-orbax-ocdbt-500"]
