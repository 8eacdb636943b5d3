"""The GCE metadata path: client, watchers, platform detection and the GCE presets.

A real HTTP server on 127.0.0.1 plays the metadata server: long-polls with
``wait_for_change`` and etags, 503 answers, ``instance/preempted``. The preset
tests run a real TensorFlow training subprocess pointed at it through
``GCE_METADATA_HOST``.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import pytest

from asyncckpt.preemption import config as config_lib
from asyncckpt.preemption import platform as platform_lib
from asyncckpt.preemption import watchers as watchers_lib
from asyncckpt.preemption.platform import Platform
from tests.helpers import start_python, subprocess_env, write_script
from tests.metadata_server import FakeMetadataServer, gce_values


@pytest.fixture
def unused_port() -> int:
    """A 127.0.0.1 port nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- client -------------------------------------------------------------------


def test_client_sends_the_header_and_requires_it_on_the_answer():
    with FakeMetadataServer({"instance/hostname": "vm"}) as server:
        client = platform_lib.MetadataClient(server.host)
        resp = client.get("instance/hostname")
        assert resp.value == "vm" and resp.etag == "etag-1"
        assert server.requests[-1][2]  # the request carried Metadata-Flavor: Google
        assert client.get("instance/nothing") is None  # 404
    with FakeMetadataServer({"instance/hostname": "vm"}, google=False) as server:
        client = platform_lib.MetadataClient(server.host)
        with pytest.raises(platform_lib.MetadataError, match="not a GCE metadata server"):
            client.get("instance/hostname")


def test_metadata_host_follows_the_environment(monkeypatch):
    monkeypatch.delenv("GCE_METADATA_HOST", raising=False)
    monkeypatch.delenv("GCE_METADATA_IP", raising=False)
    assert platform_lib.metadata_host() == "metadata.google.internal"
    monkeypatch.setenv("GCE_METADATA_IP", "10.0.0.1")
    assert platform_lib.metadata_host() == "10.0.0.1"
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:8080")
    assert platform_lib.metadata_host() == "127.0.0.1:8080"


# -- detection ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        (gce_values("a3-highgpu-8g"), Platform.GCE_GPU),
        (gce_values("g2-standard-4"), Platform.GCE_GPU),
        (gce_values("n1-standard-8", instance__attributes__accelerator_type="v4-8"),
         Platform.GCE_TPU),
        (gce_values("ct5lp-hightpu-4t"), Platform.GCE_TPU),
        (gce_values("n2-standard-8"), Platform.GCE_CPU),
    ],
)
def test_detect_platform_from_the_metadata_server(monkeypatch, values, expected):
    monkeypatch.delenv(platform_lib.PLATFORM_ENV, raising=False)
    with FakeMetadataServer(values) as server:
        monkeypatch.setenv("GCE_METADATA_HOST", server.host)
        assert platform_lib.detect_platform(framework="none", refresh=True) is expected


def test_detect_platform_offgce_values(monkeypatch, unused_port):
    monkeypatch.delenv(platform_lib.PLATFORM_ENV, raising=False)
    monkeypatch.setenv("GCE_METADATA_HOST", f"127.0.0.1:{unused_port}")  # refused
    assert platform_lib.detect_platform(framework="none", refresh=True) is Platform.OTHER
    with FakeMetadataServer(gce_values("a3-highgpu-8g"), google=False) as server:
        monkeypatch.setenv("GCE_METADATA_HOST", server.host)
        assert platform_lib.detect_platform(framework="none", refresh=True) is Platform.OTHER
    monkeypatch.setenv(platform_lib.PLATFORM_ENV, "gce-tpu")
    assert platform_lib.detect_platform() is Platform.GCE_TPU


def test_presets_fill_what_the_config_leaves_out():
    gpu = config_lib.resolve_termination_config(
        config_lib.TerminationConfig(platform="gce-gpu"))
    assert (gpu.grace_period, gpu.exit_code) == (3600.0, 143)
    assert gpu.grace_for("gce-maintenance") == 3600.0
    assert gpu.grace_for("gce-preempted") == 30.0
    assert gpu.grace_for("sigterm") == 0.0  # on GCE a SIGTERM means shutdown has begun
    cpu = config_lib.resolve_termination_config(config_lib.TerminationConfig(platform="gce-cpu"))
    assert (cpu.grace_period, cpu.exit_code) == (60.0, 143)
    other = config_lib.resolve_termination_config(
        config_lib.TerminationConfig(platform=Platform.OTHER, grace_period=20))
    assert (other.grace_period, other.exit_code) == (20.0, 42)
    assert other.grace_for("sigterm") == 20.0
    assert not other.preset.watch_metadata
    custom = config_lib.resolve_termination_config(
        config_lib.TerminationConfig(platform="gce-tpu", exit_fn=print, grace_period=0))
    assert custom.exit_fn is print and custom.exit_code is None and custom.grace_period == 0
    with pytest.raises(ValueError, match="unknown platform"):
        config_lib.TerminationConfig(platform="aws")
    with pytest.raises(ValueError, match="grace_period"):
        config_lib.TerminationConfig(grace_period=-1)


# -- watchers -------------------------------------------------------------------


def _collect():
    got: list[watchers_lib.Notice] = []
    event = threading.Event()

    def sink(notice):
        got.append(notice)
        event.set()

    return got, event, sink


def test_maintenance_watcher_long_polls_with_etags_and_survives_503s():
    with FakeMetadataServer(gce_values("a3-highgpu-8g")) as server:
        server.fail_next("instance/maintenance-event", 3)
        got, event, sink = _collect()
        watcher = watchers_lib.MetadataWatcher(
            sink, path="instance/maintenance-event", source="gce-maintenance",
            notice_values=("TERMINATE_ON_HOST_MAINTENANCE",),
            logged_values=("MIGRATE_ON_HOST_MAINTENANCE",),
            client=platform_lib.MetadataClient(server.host), backoff_s=0.05,
        )
        watcher.start()
        try:
            server.wait_count("instance/maintenance-event", 1, waiting=True)
            assert watcher.errors == 3  # three 503s, retried with backoff
            server.set("instance/maintenance-event", "MIGRATE_ON_HOST_MAINTENANCE")
            server.wait_count("instance/maintenance-event", 2, waiting=True)
            assert not got  # a live migration is no notice
            server.set("instance/maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
            assert event.wait(30)
        finally:
            watcher.stop()
        assert [n.source for n in got] == ["gce-maintenance"]
        polls = [q for p, q, _ in server.requests
                 if p == "instance/maintenance-event" and "wait_for_change" in q]
        # Each long-poll names the etag of the value seen before it.
        assert [q["last_etag"] for q in polls[:2]] == ["etag-1", "etag-2"]
        assert not watcher.alive


def test_spot_watcher_reports_preemption():
    with FakeMetadataServer(gce_values("n2-standard-8")) as server:
        got, event, sink = _collect()
        watcher = watchers_lib.spot_watcher(sink, platform_lib.MetadataClient(server.host))
        watcher.start()
        try:
            server.wait_count("instance/preempted", 1, waiting=True)
            server.set("instance/preempted", "TRUE")
            assert event.wait(30)
        finally:
            watcher.stop()
        assert got[0].source == "gce-preempted"


def test_watchers_stop_promptly_while_a_long_poll_is_open(unused_port):
    with FakeMetadataServer(gce_values("n2-standard-8")) as server:
        got, _, sink = _collect()
        ws = [watchers_lib.maintenance_watcher(sink, platform_lib.MetadataClient(server.host)),
              watchers_lib.spot_watcher(sink, platform_lib.MetadataClient(server.host)),
              watchers_lib.PollingWatcher(sink, lambda: False, interval_s=30)]
        # A watcher retrying a refused connection stops as well.
        ws.append(watchers_lib.maintenance_watcher(
            sink, platform_lib.MetadataClient(f"127.0.0.1:{unused_port}")))
        for w in ws:
            w.start()
        server.wait_count("instance/preempted", 1, waiting=True)
        server.wait_count("instance/maintenance-event", 1, waiting=True)
        for w in ws:
            w.stop(timeout=10)
        assert not any(w.alive for w in ws)
        assert not got
        names = {t.name for t in threading.enumerate()}
        assert not any(n.startswith("asyncckpt-gce") or n == "asyncckpt-user-watcher"
                       for n in names)


def test_user_watcher_fn_errors_count_as_no_notice():
    calls = []

    def fn():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("flaky")
        return len(calls) >= 4

    got, event, sink = _collect()
    watcher = watchers_lib.PollingWatcher(sink, fn, interval_s=0.01)
    watcher.start()
    assert event.wait(30)
    watcher.stop()
    assert len(calls) == 4 and got[0].source == "user"


def test_watchers_started_again_report_only_a_new_notice():
    """After an exit_fn returned: a notice still pending is the one already handled."""
    with FakeMetadataServer(gce_values("a3-highgpu-8g")) as server:
        server.set("instance/maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
        got, event, sink = _collect()
        watcher = watchers_lib.maintenance_watcher(
            sink, platform_lib.MetadataClient(server.host), armed=False)
        watcher.start()
        try:
            server.wait_count("instance/maintenance-event", 1, waiting=True)
            assert not got  # still the event handled before: no new notice
            server.set("instance/maintenance-event", "NONE")
            server.wait_count("instance/maintenance-event", 2, waiting=True)
            assert not got
            server.set("instance/maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
            assert event.wait(30)  # a new maintenance event
        finally:
            watcher.stop()
        assert [n.source for n in got] == ["gce-maintenance"]
    answers = iter([True, True, True, False, True])
    calls = []

    def fn():
        calls.append(1)
        return next(answers)

    got, event, sink = _collect()
    watcher = watchers_lib.PollingWatcher(sink, fn, interval_s=0.01, armed=False)
    watcher.start()
    assert event.wait(30)
    watcher.stop()
    assert len(calls) == 5 and [n.source for n in got] == ["user"]


def test_sigterm_watcher_chains_the_previous_handler_and_restores_it():
    seen = []

    def previous(signum, frame):
        seen.append(("previous", signum))

    old = signal.signal(signal.SIGTERM, previous)
    try:
        got, event, sink = _collect()
        watcher = watchers_lib.SigtermWatcher(sink)
        watcher.start()
        signal.raise_signal(signal.SIGTERM)
        assert event.wait(10)
        assert got[0].source == "sigterm" and seen == [("previous", signal.SIGTERM)]
        watcher.stop()
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, old)


# -- the GCE presets in a real training process ------------------------------------

TRAINER = """
import json, os, sys, time
import numpy as np
import tensorflow as tf
import asyncckpt.tf as at
from asyncckpt.preemption import PreemptionCheckpointHandler, TerminationConfig

directory, grace = sys.argv[1], sys.argv[2]
v = tf.Variable(np.zeros(1000, np.float32))
mgr = at.CheckpointManager(tf.train.Checkpoint(v=v), directory, max_to_keep=3)
config = TerminationConfig(grace_period=None if grace == "preset" else float(grace))
handler = PreemptionCheckpointHandler(mgr, termination_config=config)
print("platform", handler.config.platform.value, handler.config.grace_period, flush=True)
boundaries = []  # (time, run) at each step boundary
reported = []


def step():
    boundaries.append((time.time(), handler.total_run_calls))
    if handler.saves and not handler.saves[-1].final and not reported:
        reported.append(handler.saves[-1].run)
        print("saved", handler.saves[-1].run, flush=True)  # the notice's checkpoint
    v.assign_add(tf.ones(1000))
    time.sleep(0.05)  # the step's work
    print("step", handler.total_run_calls, flush=True)


try:
    with handler:
        while handler.total_run_calls < 2000:
            handler.run(step)
finally:
    saves = [s.__dict__ for s in handler.saves]
    for s in saves:
        # The run in progress when the notice arrived.
        s["run_at_notice"] = max(r for t, r in boundaries if t <= s["notice_time"])
    print("SAVES " + json.dumps(saves), flush=True)
"""


def _read_until(proc, prefix: str, timeout: float = 120) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"no line {prefix!r} from the child: {proc.stderr.read()[-3000:]}")


@pytest.mark.parametrize(
    ("values", "platform", "grace"),
    [
        (gce_values("a3-highgpu-8g"), "gce-gpu", "preset"),
        (gce_values("ct5lp-hightpu-4t", instance__attributes__accelerator_type="v5litepod-4"),
         "gce-tpu", "2.0"),
    ],
    ids=["gpu", "tpu"],
)
def test_gce_preset_saves_within_one_step_of_a_maintenance_notice(tmp_path, values, platform,
                                                                  grace):
    script = write_script(tmp_path, "trainer.py", TRAINER)
    with FakeMetadataServer(values) as server:
        server.fail_next("instance/maintenance-event", 2)  # busy at first
        env = subprocess_env(GCE_METADATA_HOST=server.host)
        env.pop(platform_lib.PLATFORM_ENV, None)
        proc = start_python(script, str(tmp_path / "ckpt"), grace, env=env)
        try:
            assert _read_until(proc, "platform").split()[1] == platform
            _read_until(proc, "step 5")
            server.wait_count("instance/maintenance-event", 1, waiting=True)
            server.set("instance/maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")
            if grace == "preset":
                # One hour of notice: a checkpoint now, training goes on; the
                # shutdown's SIGTERM then ends it at once.
                saved = int(_read_until(proc, "saved", 60).split()[1])
                _read_until(proc, f"step {saved + 2}", 60)  # trained on after the save
                proc.send_signal(signal.SIGTERM)
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == config_lib.EXIT_CODE_GCE, err[-3000:]
    saves = json.loads(next(line[6:] for line in out.splitlines() if line.startswith("SAVES ")))
    first, final = saves[0], saves[-1]
    assert first["run"] - first["run_at_notice"] <= 1  # saved at the next step boundary
    assert not first["final"] and final["final"] and final["run"] > first["run"]
    assert final["durable_at"] <= final["deadline"] or grace == "preset"
    # Numbered by the save counter, as TensorFlow's handler names them.
    assert (first["checkpoint"], final["checkpoint"]) == (
        str(tmp_path / "ckpt" / "ckpt-1"), str(tmp_path / "ckpt" / "ckpt-2"))
    mgr_state = (tmp_path / "ckpt" / "checkpoint").read_text()
    assert 'model_checkpoint_path: "ckpt-2"' in mgr_state
