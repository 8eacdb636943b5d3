"""pytest-benchmark suite over the same engines as ``asyncckpt bench``, at small sizes.

Not part of the README's test command. Run with:
    .venv/bin/python -m pytest benchmarks/ --benchmark-only
Sizes come from ASYNCCKPT_BENCH_MIB (default 16).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest

from benchmarks.suite import engines as eng

MIB = int(os.environ.get("ASYNCCKPT_BENCH_MIB", "16"))


@pytest.fixture(scope="session")
def nbytes() -> int:
    return MIB << 20


@pytest.fixture(scope="session")
def tf_state(nbytes):
    pytest.importorskip("tensorflow")
    return eng.TFState(nbytes, eng.tensors_for(nbytes))


@pytest.fixture(scope="session")
def jax_state(nbytes):
    pytest.importorskip("jax")
    return eng.JAXState(nbytes, eng.tensors_for(nbytes))
