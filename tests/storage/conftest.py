"""Real S3 (SeaweedFS) and GCS (fake-gcs-server) servers on 127.0.0.1 for the storage tests.

Each server starts once per session on free ports, with its data in a
temporary directory; the standard environment variables that point clients at
it are set for the session. A test that needs a server the machine lacks is
skipped with the reason (only a missing binary skips; a server that fails to
start is an error).
"""

from __future__ import annotations

import os
import uuid

import pytest

from tests.servers import FakeGCS, SeaweedS3, ServerUnavailableError

BUCKET = "asyncckpt-test"


def _start(factory, tmp_path_factory, name):
    try:
        server = factory(str(tmp_path_factory.mktemp(name)))
    except ServerUnavailableError as e:
        pytest.skip(str(e))
    server.start()
    server.make_bucket(BUCKET)
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    return server, saved


def _restore_env(saved):
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A running SeaweedFS S3 server (bucket ``asyncckpt-test``); AWS_* variables set."""
    server, saved = _start(SeaweedS3, tmp_path_factory, "seaweed")
    yield server
    server.kill()  # throwaway data: a graceful stop takes SeaweedFS ~10 s
    _restore_env(saved)


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """A running fake-gcs-server (bucket ``asyncckpt-test``); STORAGE_EMULATOR_HOST set."""
    server, saved = _start(FakeGCS, tmp_path_factory, "fakegcs")
    yield server
    server.kill()  # throwaway data: a graceful stop takes SeaweedFS ~10 s
    _restore_env(saved)


@pytest.fixture(params=["local", "s3", "gcs"])
def location(request, tmp_path):
    """A fresh, empty checkpoint location of each kind: a local dir, s3:// and gs:// URLs."""
    run = f"run-{uuid.uuid4().hex[:10]}"
    if request.param == "local":
        return str(tmp_path / run)
    if request.param == "s3":
        request.getfixturevalue("s3_server")
        return f"s3://{BUCKET}/{run}"
    request.getfixturevalue("gcs_server")
    return f"gs://{BUCKET}/{run}"


@pytest.fixture(params=["s3", "gcs"])
def remote_url(request):
    """A fresh, empty s3:// and gs:// location."""
    run = f"run-{uuid.uuid4().hex[:10]}"
    request.getfixturevalue(f"{request.param}_server")
    scheme = "s3" if request.param == "s3" else "gs"
    return f"{scheme}://{BUCKET}/{run}"


def own_server(kind: str, directory: str, monkeypatch) -> SeaweedS3 | FakeGCS:
    """A started server of one test alone (it may stop and restart it), with bucket ``outage``."""
    try:
        server = (SeaweedS3 if kind == "s3" else FakeGCS)(directory)
    except ServerUnavailableError as e:
        pytest.skip(str(e))
    server.start()
    server.make_bucket("outage")
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    return server


@pytest.fixture
def own_s3(tmp_path, monkeypatch):
    """A SeaweedFS server of this test alone (it gets stopped and restarted)."""
    server = own_server("s3", str(tmp_path / "weed"), monkeypatch)
    yield server
    server.kill()
