"""The ``frontend`` fixture: each scenario of the behaviour suite on each front end.

A test names the front ends a rule applies to with ``frontends.on(...)``
(indirect parametrization); ``frontend`` is then that front end over a fresh directory.
"""

from __future__ import annotations

import pytest

from tests.behaviour.frontends import FRONTENDS, Frontend


@pytest.fixture
def frontend(request, ckpt_dir) -> Frontend:
    name = request.param
    if name.startswith("tf"):
        pytest.importorskip("tensorflow")
    elif name.startswith("jax"):
        pytest.importorskip("jax")
        pytest.importorskip("orbax.checkpoint")
    return FRONTENDS[name](ckpt_dir)
