"""Blocking time of one save per engine, and the memcpy / raw-write floors."""

from __future__ import annotations

import pytest

from benchmarks.suite import engines as eng

TF_ENGINES = [n for n, c in eng.ENGINES.items() if c.framework == "tf"]
JAX_ENGINES = [n for n, c in eng.ENGINES.items() if c.framework == "jax"]


def _bench_engine(benchmark, engine: eng.Engine) -> None:
    engine.save()  # warm-up: first-save allocations and tracing
    engine.save()
    engine.wait()
    try:
        # Each round: wait for the previous write (not timed), then one timed save.
        benchmark.pedantic(engine.save, setup=engine.wait, rounds=5, iterations=1)
    finally:
        engine.close()


@pytest.mark.parametrize("name", TF_ENGINES)
def test_tf_save_blocking(benchmark, tf_state, tmp_path, name):
    benchmark.group = "tf save blocking"
    _bench_engine(benchmark, eng.ENGINES[name](tf_state, str(tmp_path)))


@pytest.mark.parametrize("name", JAX_ENGINES)
def test_jax_save_blocking(benchmark, jax_state, tmp_path, name):
    benchmark.group = "jax save blocking"
    pytest.importorskip("orbax.checkpoint")
    if name == "asyncckpt jax":
        pytest.importorskip("asyncckpt.jax")
    _bench_engine(benchmark, eng.ENGINES[name](jax_state, str(tmp_path)))


@pytest.mark.parametrize("floor", ["memcpy", "memcpy_per_tensor", "raw_write"])
def test_floor(benchmark, nbytes, tmp_path, floor):
    benchmark.group = "floors"
    floors = eng.Floors(nbytes, eng.tensors_for(nbytes), str(tmp_path))
    benchmark.pedantic(getattr(floors, floor), rounds=5, iterations=1, warmup_rounds=1)


@pytest.mark.parametrize("name", TF_ENGINES)
def test_tf_save_until_durable(benchmark, tf_state, tmp_path, name):
    benchmark.group = "tf save until durable"
    engine = eng.ENGINES[name](tf_state, str(tmp_path))
    engine.save()
    engine.wait()
    try:
        benchmark.pedantic(lambda: (engine.save(), engine.wait()), rounds=3, iterations=1)
    finally:
        engine.close()
