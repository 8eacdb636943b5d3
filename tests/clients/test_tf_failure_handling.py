"""TensorFlow's own failure-handling test cases against asyncckpt's preemption handler.

Each test is named after the case of TensorFlow's
``tensorflow/python/distribute/failure_handling/failure_handler_test.py``
(``PreemptionCheckpointTest``) or ``gce_failure_handler_test.py``
(``GceFailureHandlingTest``) it reproduces, with its parameters as ids.
The code is asyncckpt's own (``tf_failure_handling_worker.py`` plays their
``worker_fn``); the scenarios and assertions are theirs: a
``MultiWorkerMirroredStrategy`` cluster on 127.0.0.1 (or a local
``MirroredStrategy``/``OneDeviceStrategy``/``MultiWorkerMirroredStrategy``),
the handler built with TensorFlow's call, a real SIGTERM or a GCE
maintenance event from a local metadata server at the end of a random epoch,
every worker exiting with the platform's code (42, or 143 on GCE), a restart
that finds ``ckpt-1`` (``ckpt-2`` after a grace period) or, saving with
``checkpoint_number=total_run_calls``, the restored run count as the newest
index, and a variable that counts the steps applied ending at exactly
``replicas * epochs * steps`` (no step skipped or repeated). An application
error on one worker is raised as the same ``tf.errors`` class on every worker.

Cost (these start TensorFlow clusters): the cases share processes, as
TensorFlow's local-mode cases share theirs. Local cases run in a few
processes, each case restarted in-process as TensorFlow does; the
multi-worker cases run one after another in one cluster (each case ends with
every worker's ``exit_fn``, whose ``SystemExit`` the worker catches and moves
to the next case), and a second, fresh cluster resumes every one of them
from its files. Differences from TensorFlow's runs, all in the harness:
``ASYNCCKPT_TF_WORKERS`` workers (default 2; TensorFlow's tests use 4); the
notice at an epoch chosen from the test seed rather than at random times;
short sleeps in the steps of grace-period cases so training outlasts the
grace period (TensorFlow's steps are often too fast for its grace-period
cases to exercise it, see their comments); of the parameter combinations of
a grace-period case, those listed below (each parameter value is covered).
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("tensorflow")

from tests.helpers import subprocess_env, test_seed

pytestmark = pytest.mark.slow

WORKERS = int(os.environ.get("ASYNCCKPT_TF_WORKERS", "2"))
WORKER_SCRIPT = os.path.join(os.path.dirname(__file__), "tf_failure_handling_worker.py")
# failure_handler_test.py and gce_failure_handler_test.py train this long.
FH_EPOCHS, FH_STEPS = 8, 15
GCE_EPOCHS, GCE_STEPS = 5, 6
EXIT_OTHER, EXIT_GCE = 42, 143
# Grace periods: TensorFlow's 1 s for local failure_handler_test cases; 3 s for
# the others (theirs: 5 s and 7 s), to keep the suite short. The handler's
# rule does not depend on the length (the margin is measured).
FH_GRACE_LOCAL, GRACE = 1, 3
# Of these cases' parameter combinations, these run (each value of each
# parameter is covered; the other combinations differ only in combining them).
MULTI_CONSECUTIVE = [(0, "checkpoint", True), (0, "manager", False),
                     (GRACE, "checkpoint", False), (GRACE, "manager", True)]
GCE_GRACE_LOCAL = [("checkpoint", "MS", True), ("manager", "OneDevice", False),
                   ("manager", "MWMS_local", True), ("checkpoint", "MWMS_multi_worker", False)]


def _case(case_id: str, **fields) -> dict:
    case = {
        "id": case_id, "notice": "sigterm", "input_arg": "checkpoint",
        "api_wrapping_train": True, "number_by_run": False, "grace_period": None,
        "save_fn": False, "config": "asyncckpt", "strategy": "MWMS_multi_worker",
        "epochs": FH_EPOCHS, "steps_per_epoch": FH_STEPS, "trigger_epoch": 0,
        "trigger_worker": 0, "step_sleep": 0.0, "dir_suffix": "", "restart": True,
    }
    case.update(fields)
    return case


def _fh(case_id: str, rng: random.Random, *, multi_worker: bool, **fields) -> dict:
    """A ``failure_handler_test.py`` case: SIGTERM, TensorFlow's own TerminationConfig."""
    return _case(f"fh.{case_id}", config="tf", trigger_epoch=rng.randrange(0, 3),
                 trigger_worker=rng.randrange(WORKERS) if multi_worker else 0,
                 strategy="MWMS_multi_worker" if multi_worker else "MWMS_local", **fields)


def _gce(case_id: str, rng: random.Random, *, strategy: str, **fields) -> dict:
    """A ``gce_failure_handler_test.py`` case: GCE maintenance events, exit code 143."""
    multi = strategy == "MWMS_multi_worker"
    fields.setdefault("grace_period", 0)
    fields.setdefault("notice", "maintenance")
    fields.setdefault("trigger_epoch", rng.randrange(0, 2))
    return _case(f"gce.{case_id}", epochs=GCE_EPOCHS, steps_per_epoch=GCE_STEPS,
                 dir_suffix="/", number_by_run=not fields.get("api_wrapping_train", True),
                 trigger_worker=rng.randrange(WORKERS) if multi else 0,
                 strategy=strategy, **fields)


def _cases(seed: int) -> dict[str, list[dict]]:
    """The cases of each process group: ``local*`` (one process each) and ``multi``."""
    rng = random.Random(seed)
    local, multi, grace_local = [], [], []
    for input_arg in ("checkpoint", "manager"):
        for api in (True, False):
            local.append(_fh(f"test_preemption_checkpointing[{input_arg}-local-{api}]", rng,
                             multi_worker=False, input_arg=input_arg, api_wrapping_train=api))
            multi.append(_fh(f"test_preemption_checkpointing[{input_arg}-multi_worker-{api}]",
                             rng, multi_worker=True, input_arg=input_arg,
                             api_wrapping_train=api))
        local.append(_fh(f"test_grace_period_continue_training[{input_arg}-local]", rng,
                         multi_worker=False, input_arg=input_arg, grace_period=FH_GRACE_LOCAL,
                         step_sleep=0.03))
        multi.append(_fh(f"test_grace_period_continue_training[{input_arg}-multi_worker]", rng,
                         multi_worker=True, input_arg=input_arg, grace_period=GRACE,
                         step_sleep=0.05))
    multi.append(_fh("test_passed_in_save_fn", rng, multi_worker=True, save_fn=True,
                     restart=False))
    for input_arg in ("checkpoint", "manager"):
        for strategy in ("MS", "OneDevice", "MWMS_local", "MWMS_multi_worker"):
            group = multi if strategy == "MWMS_multi_worker" else local
            group.append(_gce(f"test_basic_run[{input_arg}-{strategy}]", rng,
                              strategy=strategy, input_arg=input_arg))
    # All workers noticed at once. Locally TensorFlow does not restart (its
    # frequent notices would stop the restarted job too): it checks the exit.
    for grace in (0, 7):  # 7 s: the 30 steps end first, as in TensorFlow's runs
        for input_arg in ("checkpoint", "manager"):
            for strategy in ("MS", "OneDevice", "MWMS_local"):
                for api in (True, False):
                    local.append(_gce(
                        "test_multiple_workers_preempted_consecutively"
                        f"[{grace}-{input_arg}-{strategy}-{api}]", rng, strategy=strategy,
                        notice="maintenance-all", grace_period=grace, input_arg=input_arg,
                        api_wrapping_train=api, restart=False))
    for grace, input_arg, api in MULTI_CONSECUTIVE:
        multi.append(_gce(
            "test_multiple_workers_preempted_consecutively"
            f"[{grace}-{input_arg}-MWMS_multi_worker-{api}]", rng,
            strategy="MWMS_multi_worker", notice="maintenance-all",
            grace_period=grace, input_arg=input_arg, api_wrapping_train=api,
            step_sleep=0.15 if grace else 0.0))
    for input_arg, strategy, api in GCE_GRACE_LOCAL:
        grace_local.append(_gce(
            f"test_grace_period_continue_training[{input_arg}-{strategy}-{api}]", rng,
            # TensorFlow's MWMS_multi_worker combination of this case runs locally.
            strategy="MWMS_local" if strategy == "MWMS_multi_worker" else strategy,
            grace_period=GRACE, input_arg=input_arg, api_wrapping_train=api, trigger_epoch=0,
            step_sleep=0.25))
    error = _fh("test_error_propagation", rng, multi_worker=True, fresh=True,
                error_worker=rng.randrange(WORKERS))
    return {"local": local, "local_grace": grace_local, "multi": multi,
            "multi_resume": [c for c in multi if c["restart"]] + [error]}


def _ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _start(root, name: str, spec: dict) -> tuple[str, subprocess.Popen, Path]:
    """Starts a worker process; its output goes to files (TensorFlow logs a lot)."""
    spec = {**spec, "root": str(root), "off_gce_host": f"127.0.0.1:{_ports(1)[0]}"}
    path = root / f"{name}.json"
    path.write_text(json.dumps(spec))
    env = subprocess_env()
    env.pop("TF_CONFIG", None)
    env.pop("ASYNCCKPT_PLATFORM", None)
    out = root / f"{name}.out"
    with open(out, "w") as stdout, open(root / f"{name}.err", "w") as stderr:
        proc = subprocess.Popen([sys.executable, WORKER_SCRIPT, str(path)], env=env,
                                stdout=stdout, stderr=stderr, text=True)
    return name, proc, out


def _wait_ready(started, timeout: float) -> None:
    """Waits until every process has imported TensorFlow (or ended)."""
    deadline = time.monotonic() + timeout
    for _, proc, out in started:
        while "READY" not in out.read_text() and proc.poll() is None:
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)


def _finish(started, timeout: float) -> dict[str, tuple[int, str, str]]:
    results = {}
    deadline = time.monotonic() + timeout
    for name, proc, out in started:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        results[name] = (proc.returncode, out.read_text(),
                         out.with_suffix(".err").read_text())
    return results


class Outcomes:
    """Facts each worker reported per case, and the processes' output for failures."""

    def __init__(self, runs: dict[str, tuple[int, str, str]]):
        self.facts: dict[str, list[dict]] = {}
        self.output = []
        for name, (rc, stdout, stderr) in runs.items():
            self.output.append(f"--- {name} (exit {rc}):\n{stdout[-3000:]}\n{stderr[-5000:]}")
            for line in stdout.splitlines():
                if line.startswith("CASE "):
                    facts = json.loads(line[5:])
                    self.facts.setdefault(facts["id"], []).append(facts)

    def of(self, case_id: str, count: int) -> list[dict]:
        got = self.facts.get(case_id, [])
        assert len(got) == count, (f"{case_id}: {len(got)} of {count} reports\n"
                                   + "\n".join(self.output))
        return got


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> Outcomes:
    """Runs every case once: the cluster's two lifetimes, the local processes beside them."""
    root = tmp_path_factory.mktemp("tf_failure_handling")
    groups = _cases(test_seed("TensorFlow failure-handling cases"))
    print(f"{WORKERS} workers; set ASYNCCKPT_TF_WORKERS=4 for TensorFlow's cluster size")
    ports = _ports(WORKERS)
    preempt = [_start(root, f"worker{i}-preempt", {"phase": "preempt", "worker": i,
                                                   "ports": ports, "cases": groups["multi"]})
               for i in range(WORKERS)]
    # The local processes start once the cluster has imported TensorFlow: the
    # imports are what the two cores are short of; the cluster's cases sleep.
    _wait_ready(preempt, timeout=300)
    local = [_start(root, name, {"phase": "local", "worker": None, "ports": None,
                                 "cases": groups[name]}) for name in ("local", "local_grace")]
    runs = _finish(preempt, timeout=600)
    ports = _ports(WORKERS)  # a fresh cluster, as after a restart of every VM
    resume = [_start(root, f"worker{i}-resume", {"phase": "resume", "worker": i, "ports": ports,
                                                 "cases": groups["multi_resume"]})
              for i in range(WORKERS)]
    runs.update(_finish(resume, timeout=600))
    runs.update(_finish(local, timeout=600))
    return Outcomes(runs)


def _lives(outcomes: Outcomes, case_id: str, *, multi: bool) -> list[tuple[dict, dict]]:
    """``(first lifetime, restarted lifetime)`` facts per worker."""
    if not multi:
        (facts,) = outcomes.of(case_id, 1)
        return [(facts.get("first", {}), facts.get("restarted", {}))]
    reports = outcomes.of(case_id, 2 * WORKERS)
    by_worker: dict[int, list[dict]] = {}
    for r in reports:
        by_worker.setdefault(r["worker"], []).append(r)
    out = []
    for w in range(WORKERS):
        first = next(r for r in by_worker[w] if r["phase"] == "preempt")["first"]
        restarted = next(r for r in by_worker[w] if r["phase"] == "resume")["restarted"]
        out.append((first, restarted))
    return out


def _check_clean(life: dict, context: str) -> None:
    assert "error" not in life and "op_error" not in life, f"{context}: {life}"
    assert life.get("threads_after_close") == [], f"{context}: watcher threads left: {life}"


def _check_preempted(life: dict, code: int, context: str) -> dict:
    """The first lifetime exited with ``code`` after a durable final save; returns it."""
    assert life.get("exit") == code, f"{context}: {life}"
    _check_clean(life, context)
    final = life["saves"][-1]
    assert final["final"], f"{context}: {life}"
    return final


def _check_resumed(first: dict, restarted: dict, context: str, *, index: int | None) -> None:
    """TensorFlow's restart checks, and the restored count is the saved one."""
    _check_clean(restarted, context)
    final = first["saves"][-1]
    # The restored run count is the one the final save recorded ...
    assert restarted["start_run"] == final["run"], f"{context}: {first} {restarted}"
    # ... the newest checkpoint is ckpt-<index> (ckpt-<restored count> when saved with
    # checkpoint_number=total_run_calls) ...
    expected = restarted["start_run"] if index is None else index
    assert restarted["indices"] and max(restarted["indices"]) == expected, (
        f"{context}: {first} {restarted}")
    # ... and training ends with every step applied exactly once.
    assert restarted.get("finished"), f"{context}: {restarted}"
    assert restarted["v"] == restarted["expected_v"], f"{context}: {first} {restarted}"


def _same_step_everywhere(lives: list[tuple[dict, dict]], context: str) -> None:
    runs = {tuple(s["run"] for s in first["saves"]) for first, _ in lives}
    assert len(runs) == 1, f"{context}: workers saved at different steps: {lives}"


class TestPreemptionCheckpointTest:
    """``failure_handler_test.py``: SIGTERM, exit code 42 (not on GCE)."""

    @pytest.mark.parametrize("api_wrapping_train", [True, False])
    @pytest.mark.parametrize("mwms_mode", ["local", "multi_worker"])
    @pytest.mark.parametrize("input_arg", ["checkpoint", "manager"])
    def test_preemption_checkpointing(self, outcomes, input_arg, mwms_mode, api_wrapping_train):
        case_id = (f"fh.test_preemption_checkpointing[{input_arg}-{mwms_mode}-"
                   f"{api_wrapping_train}]")
        lives = _lives(outcomes, case_id, multi=mwms_mode == "multi_worker")
        for first, restarted in lives:
            final = _check_preempted(first, EXIT_OTHER, case_id)
            assert final["checkpoint"].endswith("ckpt-1"), case_id  # the save counter's name
            _check_resumed(first, restarted, case_id, index=1)
        _same_step_everywhere(lives, case_id)

    @pytest.mark.parametrize("mwms_mode", ["local", "multi_worker"])
    @pytest.mark.parametrize("input_arg", ["checkpoint", "manager"])
    def test_grace_period_continue_training(self, outcomes, input_arg, mwms_mode):
        case_id = f"fh.test_grace_period_continue_training[{input_arg}-{mwms_mode}]"
        grace = GRACE if mwms_mode == "multi_worker" else FH_GRACE_LOCAL
        lives = _lives(outcomes, case_id, multi=mwms_mode == "multi_worker")
        for first, restarted in lives:
            final = _check_preempted(first, EXIT_OTHER, case_id)
            # A checkpoint at the notice, training on, the final one in the grace period.
            assert [s["final"] for s in first["saves"]] == [False, True], case_id
            assert final["notice_to_durable_s"] <= grace + 15, case_id
            _check_resumed(first, restarted, case_id, index=2)
        _same_step_everywhere(lives, case_id)

    def test_passed_in_save_fn(self, outcomes):
        case_id = "fh.test_passed_in_save_fn"
        for facts in outcomes.of(case_id, WORKERS):
            first = facts["first"]
            _check_preempted(first, EXIT_OTHER, case_id)
            # The save_fn saved nothing, and nothing else did.
            assert first["indices_after"] == [], f"{case_id}: {first}"
            assert [s["checkpoint"] for s in first["saves"]] == [None], case_id

    def test_error_propagation(self, outcomes):
        case_id = "fh.test_error_propagation"
        for facts in outcomes.of(case_id, WORKERS):
            error = facts["first"].get("op_error")
            assert error is not None and error[0] == "ResourceExhaustedError", (
                f"{case_id}: {facts}")
            assert "Running out of resources" in error[1], f"{case_id}: {facts}"


class TestGceFailureHandlingTest:
    """``gce_failure_handler_test.py``: maintenance events, exit code 143."""

    @pytest.mark.parametrize("strategy_option", ["MS", "OneDevice", "MWMS_local",
                                                 "MWMS_multi_worker"])
    @pytest.mark.parametrize("input_arg", ["checkpoint", "manager"])
    def test_basic_run(self, outcomes, input_arg, strategy_option):
        case_id = f"gce.test_basic_run[{input_arg}-{strategy_option}]"
        lives = _lives(outcomes, case_id, multi=strategy_option == "MWMS_multi_worker")
        for first, restarted in lives:
            _check_preempted(first, EXIT_GCE, case_id)
            _check_resumed(first, restarted, case_id, index=1)
        _same_step_everywhere(lives, case_id)

    @pytest.mark.parametrize(
        ("grace_period", "input_arg", "strategy_option", "api_wrapping_train"),
        [(g, i, s, a) for g in (0, 7) for i in ("checkpoint", "manager")
         for s in ("MS", "OneDevice", "MWMS_local") for a in (True, False)]
        + [(g, i, "MWMS_multi_worker", a) for g, i, a in MULTI_CONSECUTIVE])
    def test_multiple_workers_preempted_consecutively(self, outcomes, grace_period, input_arg,
                                                      strategy_option, api_wrapping_train):
        case_id = (f"gce.test_multiple_workers_preempted_consecutively[{grace_period}-"
                   f"{input_arg}-{strategy_option}-{api_wrapping_train}]")
        if strategy_option != "MWMS_multi_worker":
            ((first, _),) = _lives(outcomes, case_id, multi=False)
            # Noticed from the start: with no grace period it exits at once; with 7 s
            # the job may finish first (TensorFlow accepts either, and restarts neither).
            if grace_period == 0 or not first.get("finished"):
                _check_preempted(first, EXIT_GCE, case_id)
            else:
                _check_clean(first, case_id)
                assert first["v"] == first["expected_v"], f"{case_id}: {first}"
            return
        lives = _lives(outcomes, case_id, multi=True)
        for first, restarted in lives:
            _check_preempted(first, EXIT_GCE, case_id)
            index = (2 if grace_period else 1) if api_wrapping_train else None
            _check_resumed(first, restarted, case_id, index=index)
        _same_step_everywhere(lives, case_id)

    @pytest.mark.parametrize(("input_arg", "strategy_option", "api_wrapping_train"),
                             GCE_GRACE_LOCAL)
    def test_grace_period_continue_training(self, outcomes, input_arg, strategy_option,
                                            api_wrapping_train):
        case_id = (f"gce.test_grace_period_continue_training[{input_arg}-{strategy_option}-"
                   f"{api_wrapping_train}]")
        ((first, restarted),) = _lives(outcomes, case_id, multi=False)
        final = _check_preempted(first, EXIT_GCE, case_id)
        assert [s["final"] for s in first["saves"]] == [False, True], case_id
        assert final["notice_to_durable_s"] <= GRACE + 15, case_id
        _check_resumed(first, restarted, case_id, index=2 if api_wrapping_train else None)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
