"""A GCE metadata server on 127.0.0.1 for tests: scripted values, long-polls, failures.

Used by the preemption tests in the pytest process and, imported by path, in
training subprocesses (each worker of a multi-worker test can run its own, as
each VM has its own metadata server).
"""

from __future__ import annotations

import http.server
import threading
import time
import urllib.parse

ROOT = "/computeMetadata/v1/"


class FakeMetadataServer:
    """A GCE metadata server on 127.0.0.1 with scripted values and failures.

    Args:
        values: Initial ``path -> value`` (paths below ``computeMetadata/v1/``).
        google: Answer with ``Metadata-Flavor: Google`` (False plays an
            unrelated web server).
    """

    def __init__(self, values: dict[str, str] | None = None, *, google: bool = True):
        self.values = dict(values or {})
        self.etags = dict.fromkeys(self.values, 1)
        self.google = google
        self.fail = {}  # path -> number of 503 answers still to give
        self.requests: list[tuple[str, dict, bool]] = []  # (path, query, had header)
        self.cond = threading.Condition()
        self.closing = False
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                server._answer(self)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> FakeMetadataServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self.cond:
            self.closing = True
            self.cond.notify_all()
        self.httpd.shutdown()
        self.httpd.server_close()

    def set(self, path: str, value: str) -> None:
        with self.cond:
            self.values[path] = value
            self.etags[path] = self.etags.get(path, 0) + 1
            self.cond.notify_all()

    def fail_next(self, path: str, count: int) -> None:
        with self.cond:
            self.fail[path] = count

    def count(self, path: str, *, waiting: bool | None = None) -> int:
        with self.cond:
            return sum(1 for p, q, _ in self.requests if p == path
                       and (waiting is None or ("wait_for_change" in q) == waiting))

    def wait_count(self, path: str, n: int, *, waiting: bool | None = None,
                   timeout: float = 60) -> None:
        """Waits until the server has received ``n`` such requests (long-polls with
        ``waiting=True``), or fails after ``timeout`` seconds."""
        with self.cond:
            ok = self.cond.wait_for(
                lambda: sum(1 for p, q, _ in self.requests if p == path
                            and (waiting is None or ("wait_for_change" in q) == waiting)) >= n,
                timeout=timeout)
        assert ok, f"fewer than {n} requests for {path} within {timeout} s"

    def _send(self, h, status: int, body: str = "", etag: int | None = None) -> None:
        data = body.encode()
        h.send_response(status)
        if self.google:
            h.send_header("Metadata-Flavor", "Google")
        if etag is not None:
            h.send_header("ETag", f"etag-{etag}")
        h.send_header("Content-Type", "application/text")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _answer(self, h) -> None:
        url = urllib.parse.urlsplit(h.path)
        query = dict(urllib.parse.parse_qsl(url.query))
        path = url.path[len(ROOT):] if url.path.startswith(ROOT) else url.path
        had_header = h.headers.get("Metadata-Flavor") == "Google"
        with self.cond:
            self.requests.append((path, query, had_header))
            self.cond.notify_all()  # wakes tests waiting in wait_count
            if not had_header:
                status = 403
            elif self.fail.get(path, 0) > 0:
                self.fail[path] -= 1
                status = 503
            elif path not in self.values:
                status = 404
            else:
                status = 200
                if query.get("wait_for_change") == "true":
                    last = query.get("last_etag")
                    limit = time.monotonic() + float(query.get("timeout_sec", 30))
                    while (not self.closing and f"etag-{self.etags[path]}" == last
                           and time.monotonic() < limit):
                        self.cond.wait(limit - time.monotonic())
                value, etag = self.values[path], self.etags[path]
        if status == 200:
            self._send(h, 200, value, etag)
        else:
            self._send(h, status, "error")


def gce_values(machine_type: str, **extra: str) -> dict[str, str]:
    """A GCE VM's metadata with no notice (``extra``: more values, ``a__b_c`` is ``a/b-c``)."""
    values = {
        "instance/machine-type": f"projects/123/machineTypes/{machine_type}",
        "instance/maintenance-event": "NONE",
        "instance/preempted": "FALSE",
    }
    values.update({k.replace("__", "/").replace("_", "-"): v for k, v in extra.items()})
    return values
