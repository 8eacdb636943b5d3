"""The test servers start reliably: explicit ports, retried starts, logs in errors."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from tests import servers


def _hold(port: int) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def _server(factory, path):
    try:
        return factory(str(path))
    except servers.ServerUnavailableError as e:
        pytest.skip(str(e))


def test_seaweed_gets_every_port_explicitly_and_retries_on_new_ports(tmp_path):
    server = _server(servers.SeaweedS3, tmp_path / "weed")
    # SeaweedFS would derive each gRPC port as HTTP port + 10000: all are given instead.
    assert len(set(server._ports.values())) == 8
    first = dict(server._ports)
    held = _hold(first["filer_grpc"])  # taken between being picked and being bound
    try:
        server.start()
        try:
            assert server._ports["filer_grpc"] != first["filer_grpc"]
            assert server.env()["AWS_ENDPOINT_URL"] == f"http://127.0.0.1:{server.port}"
            server.make_bucket("retried")
            req = urllib.request.Request(f"{server.endpoint}/retried/x", data=b"x", method="PUT")
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.status == 200
        finally:
            server.kill()
    finally:
        held.close()


def test_fake_gcs_retries_on_a_new_port(tmp_path):
    server = _server(servers.FakeGCS, tmp_path / "gcs")
    taken = server.port
    held = _hold(taken)
    try:
        server.start()
        try:
            assert server.port != taken
            assert server.env() == {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{server.port}"}
            server.make_bucket("retried")
        finally:
            server.kill()
    finally:
        held.close()


def test_a_restart_keeps_the_ports_clients_were_given(tmp_path):
    server = _server(servers.FakeGCS, tmp_path / "gcs")
    env = server.env()  # clients now point at this port
    held = _hold(server.port)
    try:
        with pytest.raises(RuntimeError, match="did not start in 3 attempts"):
            server.start(timeout_s=10)
        assert server.env() == env  # never moved to a port nobody was told about
    finally:
        held.close()
    server.start()
    try:
        assert server.env() == env
    finally:
        server.kill()


class _AlwaysTaken(servers.FakeGCS):
    """fake-gcs-server whose every port pick is already taken (the real server, real binds)."""

    held: list[socket.socket]

    def _pick_ports(self) -> None:
        super()._pick_ports()
        if not hasattr(self, "held"):
            self.held = []
        self.held.append(_hold(self.port))


def test_a_server_that_never_starts_raises_with_its_log(tmp_path):
    server = _server(_AlwaysTaken, tmp_path / "gcs")
    try:
        with pytest.raises(RuntimeError) as info:
            server.start(timeout_s=10)
    finally:
        for s in server.held:
            s.close()
    message = str(info.value)
    assert "did not start in 3 attempts" in message
    assert "attempt 3" in message
    assert "address already in use" in message  # the server's own log, not just an exit code
