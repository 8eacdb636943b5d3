"""Preemption with a remote tier: a real SIGTERM, real S3/GCS servers.

The final save of a grace period goes to the tier the time left allows: the
remote one when the measured upload fits, else the local one; a remote tier
that cannot be reached leaves the final checkpoint committed locally, and
the handler says which tier it reached.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import numpy as np
import pytest

pytest.importorskip("jax")

import asyncckpt.jax as aj
from asyncckpt.preemption import GraceOptions, PreemptionCheckpointHandler, TerminationConfig
from asyncckpt.storage import RetryPolicy, StorageError
from asyncckpt.storage.protocol import list_committed
from asyncckpt.storage.stores import open_store
from asyncckpt.storage.tier import RemoteOptions

N = 64 * 1024


def _state(run: int) -> dict:
    return {"w": np.full(N, float(run), np.float32), "run": np.asarray(run, np.int64)}


def _step(state):
    time.sleep(0.01)
    return {"w": state["w"] + 1.0, "run": state["run"] + 1}


def _measure(manager, saves: int = 4) -> float:
    """Saves ``saves`` steps, each committed locally and uploaded; the slowest upload's seconds."""
    for step in range(1, saves + 1):
        manager.save(step, _state(step))
        manager.wait_until_finished()
    tiers = manager._tiers._dir  # the measured upload times the handler reads
    return max([e["total_seconds"] for e in tiers.remote.stats] or [0.0])


def _train(manager, *, grace: float, after_notice=None, slack_s: float | None = None):
    """Trains under a handler; a real SIGTERM two steps in. ``(handler, final, state)``.

    ``after_notice`` runs once, at the first step after the notice was
    handled (the final save's tier is planned then).
    """
    config = TerminationConfig(grace_period=grace, exit_fn=lambda: None, platform="other")
    saved = {}
    with PreemptionCheckpointHandler(manager, termination_config=config,
                                     grace_options=GraceOptions(slack_s=slack_s)) as handler:
        state = _state(handler.total_run_calls)
        start = handler.total_run_calls
        while not handler.preempted:
            saved[handler.total_run_calls] = state
            if handler.total_run_calls == start + 2 and not handler.noticed:
                os.kill(os.getpid(), signal.SIGTERM)  # a real signal, to this process
            elif handler.noticed and after_notice is not None:
                after_notice()
                after_notice = None
            state = handler.run(_step, state)
    final = handler.saves[-1]
    assert final.final
    return handler, final, saved[final.run]


def _restore_remote_only(url: str, step: int):
    """Reads ``step`` back through a fresh manager on the remote URL alone."""
    with aj.CheckpointManager(url) as mgr:
        assert step in mgr.all_steps()
        return mgr.restore(step, target=_state(0))


def test_final_save_reaches_the_remote_tier_when_the_upload_fits(remote_url, tmp_path,
                                                                 caplog):
    local = str(tmp_path / "local")
    caplog.set_level(logging.WARNING, logger="asyncckpt.preemption")
    with aj.CheckpointManager(local, remote=remote_url, max_to_keep=3) as mgr:
        remote = mgr._tiers._dir.remote
        real = remote.store
        # Uploads measured 0.5 s slower than the final one will be: on this
        # shared machine any one upload can run past the bound of the measured
        # ones, and this test is about the plan, not about that risk.
        remote.store = _SlowMarkerStore(real, 0.5)
        slowest = _measure(mgr)
        remote.store = real
        # The slack covers a stall of the test process of up to 2 s.
        handler, final, state = _train(mgr, grace=3 * slowest + 4.0, slack_s=2.0)
        assert handler.final_tier == "remote"
        assert final.remote_error is None
        assert final.location == f"{remote_url}/{final.run}"
    committed = [c.name for c in list_committed(open_store(remote_url))]
    assert str(final.run) in committed
    got = _restore_remote_only(remote_url, final.run)
    np.testing.assert_array_equal(got["w"], state["w"])
    assert int(got["run"]) == final.run
    assert "final save planned for the remote tier" in caplog.text
    assert f"durable on the remote tier, {remote_url}/{final.run}" in caplog.text


class _SlowMarkerStore:
    """The real store, with every create-only put (a commit marker) slowed by ``delay_s``."""

    def __init__(self, store, delay_s: float):
        self._store, self._delay = store, delay_s

    def put(self, key, data, *, create_only=False):
        if create_only:
            time.sleep(self._delay)
        return self._store.put(key, data, create_only=create_only)

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_final_save_commits_locally_when_the_upload_does_not_fit(s3_server, tmp_path,
                                                                 caplog):
    url = f"s3://asyncckpt-test/short-{os.getpid()}-{time.monotonic_ns()}"
    local = str(tmp_path / "local")
    caplog.set_level(logging.WARNING, logger="asyncckpt.preemption")
    with aj.CheckpointManager(local, remote=url, max_to_keep=3) as mgr:
        remote = mgr._tiers._dir.remote
        remote.store = _SlowMarkerStore(remote.store, 0.6)  # uploads of >= 0.6 s measured
        assert _measure(mgr, saves=2) >= 0.6
        handler, final, state = _train(mgr, grace=0.6)
        assert handler.final_tier == "local"
        assert "too short" in final.remote_error
        assert final.location == os.path.join(local, str(final.run))
        # Committed locally (not waiting for any upload), and restorable there.
        assert final.run in mgr.all_steps()
        got = mgr.restore(final.run, target=_state(0))
        np.testing.assert_array_equal(got["w"], state["w"])
    assert "final save planned for the local tier" in caplog.text


def test_final_save_commits_locally_when_the_remote_tier_is_unreachable(own_s3, tmp_path,
                                                                       caplog):
    local = str(tmp_path / "local")
    opts = RemoteOptions(retry=RetryPolicy(deadline_s=3.0, initial_backoff_s=0.1))
    caplog.set_level(logging.WARNING, logger="asyncckpt.preemption")
    stopped = threading.Event()

    def outage():
        own_s3.kill()  # the remote tier goes away after the notice
        stopped.set()

    mgr = aj.CheckpointManager(local, remote="s3://outage/run", remote_options=opts)
    try:
        slowest = _measure(mgr)
        handler, final, state = _train(mgr, grace=6 * slowest + 1.0, after_notice=outage)
        assert stopped.is_set()
        assert handler.final_tier == "local"  # planned remote, reached local
        assert final.remote_error and "s3://outage/run" in final.remote_error
        assert final.run in mgr.all_steps()
        with pytest.raises(StorageError):  # the failed upload surfaces in the manager too
            mgr.wait_until_finished()
        got = mgr.restore(final.run, target=_state(0))
        np.testing.assert_array_equal(got["w"], state["w"])
    finally:
        mgr.close()
    assert "final save planned for the remote tier" in caplog.text
    assert "committed locally only" in caplog.text


def test_url_directory_final_save_is_remote(s3_server, tmp_path):
    url = f"s3://asyncckpt-test/url-{os.getpid()}-{time.monotonic_ns()}"
    with aj.CheckpointManager(url) as mgr:
        for step in range(1, 5):
            mgr.save(step, _state(step))
        mgr.wait_until_finished()
        handler, final, state = _train(mgr, grace=3.0)
        assert handler.final_tier == "remote" and final.location == url
    got = _restore_remote_only(url, final.run)
    np.testing.assert_array_equal(got["w"], state["w"])
