"""The GCE metadata server client, and detection of the platform a job runs on.

Only the configured metadata host is ever contacted: ``GCE_METADATA_HOST``
(``host[:port]``, what google-auth honours), else ``GCE_METADATA_IP``, else
``metadata.google.internal``. An answer counts only if it carries the header
``Metadata-Flavor: Google``, so an unrelated HTTP server (or a captive proxy)
is never mistaken for GCE. Every request has a short timeout, and detection as
a whole is bounded even where name resolution hangs (off GCE,
``metadata.google.internal`` may not resolve quickly).
"""

from __future__ import annotations

import contextlib
import enum
import http.client
import logging
import os
import socket
import sys
import threading
import urllib.parse
from dataclasses import dataclass

from asyncckpt.errors import AsyncCkptError

logger = logging.getLogger(__name__)

METADATA_FLAVOR = ("Metadata-Flavor", "Google")
METADATA_ROOT = "/computeMetadata/v1/"
DEFAULT_METADATA_HOST = "metadata.google.internal"
PLATFORM_ENV = "ASYNCCKPT_PLATFORM"

# GCE machine families whose machine types come with GPUs attached.
_GPU_FAMILIES = ("a2-", "a3-", "a4-", "a4x-", "g2-", "g4-")
# Cloud TPU VM machine types (v5e, v5p, v6e...): "ct5lp-hightpu-4t".
_TPU_FAMILIES = ("ct",)


class Platform(enum.Enum):
    """Where the job runs, as far as termination notices are concerned."""

    GCE_GPU = "gce-gpu"
    GCE_TPU = "gce-tpu"
    GCE_CPU = "gce-cpu"
    OTHER = "other"

    @property
    def on_gce(self) -> bool:
        return self is not Platform.OTHER

    @classmethod
    def parse(cls, value: Platform | str) -> Platform:
        if isinstance(value, Platform):
            return value
        try:
            return cls(str(value).strip().lower().replace("_", "-"))
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown platform {value!r}; expected one of {names}") from None



def metadata_host() -> str:
    """The metadata server's ``host[:port]``, from the environment."""
    for name in ("GCE_METADATA_HOST", "GCE_METADATA_IP"):
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return DEFAULT_METADATA_HOST


class MetadataError(AsyncCkptError):
    """The metadata server answered with an error, or something else answered."""

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message)
        self.status = status

    @property
    def retriable(self) -> bool:
        """503 (the server is busy, e.g. during maintenance) and 5xx in general."""
        return self.status is not None and self.status >= 500


@dataclass(frozen=True)
class MetadataResponse:
    """One answer of the metadata server: the value and its ``ETag``."""

    value: str
    etag: str | None


class MetadataClient:
    """Minimal GCE metadata client with abortable long-polls.

    Args:
        host: ``host[:port]``; default ``metadata_host()``.
        timeout_s: Socket timeout of a plain request (long-polls add their
            ``timeout_sec`` to it).
    """

    def __init__(self, host: str | None = None, *, timeout_s: float = 2.0):
        self.host = host or metadata_host()
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._active: http.client.HTTPConnection | None = None
        self._aborted = False

    def get(
        self,
        path: str,
        *,
        wait_for_change: bool = False,
        last_etag: str | None = None,
        timeout_sec: int | None = None,
    ) -> MetadataResponse | None:
        """GETs ``computeMetadata/v1/<path>``.

        Args:
            path: Path below ``computeMetadata/v1/``, e.g. ``instance/preempted``.
            wait_for_change: Long-poll: the server answers when the value
                changes from the one whose etag is ``last_etag`` (or after
                ``timeout_sec``).
            last_etag: Etag of the value already seen.
            timeout_sec: Longest wait of a long-poll, in seconds.

        Returns:
            The answer, or None if the key does not exist (404).

        Raises:
            MetadataError: Another status, or an answer without
                ``Metadata-Flavor: Google``.
            OSError: Connection refused, reset, timed out, or aborted.
        """
        query = {}
        if wait_for_change:
            query["wait_for_change"] = "true"
            if last_etag:
                query["last_etag"] = last_etag
            if timeout_sec is not None:
                query["timeout_sec"] = str(int(timeout_sec))
        url = METADATA_ROOT + path.lstrip("/")
        if query:
            url += "?" + urllib.parse.urlencode(query)
        timeout = self.timeout_s + ((timeout_sec or 0) if wait_for_change else 0)
        conn = http.client.HTTPConnection(self.host, timeout=timeout)
        with self._lock:
            if self._aborted:
                raise ConnectionAbortedError("metadata client was closed")
            self._active = conn
        try:
            conn.request("GET", url, headers=dict([METADATA_FLAVOR]))
            resp = conn.getresponse()
            body = resp.read().decode("utf-8", errors="replace")
            if resp.getheader(METADATA_FLAVOR[0], "") != METADATA_FLAVOR[1]:
                raise MetadataError(
                    f"{self.host} answered without '{METADATA_FLAVOR[0]}: {METADATA_FLAVOR[1]}'; "
                    "not a GCE metadata server",
                    status=None,
                )
            if resp.status == 404:
                return None
            if resp.status != 200:
                raise MetadataError(
                    f"metadata server: {resp.status} {resp.reason} for {path}", status=resp.status
                )
            return MetadataResponse(body, resp.getheader("ETag"))
        except http.client.HTTPException as e:
            raise ConnectionError(f"metadata server: {e!r}") from e
        finally:
            with self._lock:
                self._active = None
            conn.close()

    def abort(self) -> None:
        """Makes a request in progress (on another thread) fail at once."""
        with self._lock:
            self._aborted = True
            conn = self._active
        sock = getattr(conn, "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def _device_kind(framework: str | None) -> str | None:
    """``"gpu"``/``"tpu"``/``"cpu"`` from a framework already in use, else None.

    Never imports a framework: only one found in ``sys.modules`` is asked, and
    JAX only once its backends exist (asking earlier would create them, which
    must not happen before ``jax.distributed.initialize``).
    """
    order = [framework] if framework else ["tensorflow", "jax"]
    for name in order:
        if name == "tensorflow" and "tensorflow" in sys.modules:
            tf = sys.modules["tensorflow"]
            try:
                if tf.config.list_physical_devices("TPU"):
                    return "tpu"
                if tf.config.list_physical_devices("GPU"):
                    return "gpu"
                return "cpu"
            except Exception as e:
                logger.debug("could not list TensorFlow devices: %r", e)
        if name == "jax" and "jax" in sys.modules:
            try:
                from jax._src import xla_bridge

                if not xla_bridge.backends_are_initialized():
                    continue
                import jax

                return str(jax.devices()[0].platform).lower()
            except Exception as e:
                logger.debug("could not list JAX devices: %r", e)
    return None


def _classify(machine_type: str, accelerator_type: str | None, framework: str | None) -> Platform:
    family = machine_type.rsplit("/", 1)[-1].lower()
    if accelerator_type or family.startswith(_TPU_FAMILIES):
        return Platform.GCE_TPU
    if family.startswith(_GPU_FAMILIES):
        return Platform.GCE_GPU
    kind = _device_kind(framework)
    if kind == "tpu":
        return Platform.GCE_TPU
    if kind in ("gpu", "cuda", "rocm"):
        return Platform.GCE_GPU
    return Platform.GCE_CPU


def _ask_metadata(client: MetadataClient) -> tuple[str, str | None]:
    machine = client.get("instance/machine-type")
    if machine is None:
        raise MetadataError("metadata server has no instance/machine-type", status=404)
    # Cloud TPU VMs carry their TPU type as an instance attribute ("v4-8").
    accel = client.get("instance/attributes/accelerator-type")
    return machine.value.strip(), (accel.value.strip() if accel else None)


_cache: dict[tuple[str, str | None], Platform] = {}
_cache_lock = threading.Lock()


def detect_platform(
    *, framework: str | None = None, timeout_s: float = 2.0, refresh: bool = False
) -> Platform:
    """Which preset applies here.

    ``ASYNCCKPT_PLATFORM`` (``gce-gpu``, ``gce-tpu``, ``gce-cpu``, ``other``)
    overrides detection. Otherwise: not GCE (no metadata server answers) is
    ``OTHER``; on GCE a TPU VM is told by its ``accelerator-type`` attribute
    or TPU machine type, a GPU VM by a GPU machine family (A2, A3, A4, G2, G4),
    else by the devices of the framework in use (an N1 VM with attached GPUs);
    anything else is a CPU VM. The result is cached per process.

    Args:
        framework: ``"tensorflow"`` or ``"jax"``: the framework to ask for the
            device kind. None asks whichever is imported.
        timeout_s: Bound on the whole metadata exchange.
        refresh: Ignore the cached result.
    """
    override = os.environ.get(PLATFORM_ENV, "").strip()
    if override:
        return Platform.parse(override)
    host = metadata_host()
    key = (host, framework)
    with _cache_lock:
        if not refresh and key in _cache:
            return _cache[key]
    client = MetadataClient(host, timeout_s=timeout_s)
    answer: list = []

    def ask() -> None:
        try:
            answer.append(_ask_metadata(client))
        except (OSError, MetadataError) as e:
            answer.append(e)

    # A thread bounds the exchange where DNS resolution of the default host
    # blocks longer than any socket timeout.
    thread = threading.Thread(target=ask, name="asyncckpt-gce-detect", daemon=True)
    thread.start()
    thread.join(timeout_s * 2)
    if not answer:
        client.abort()
        logger.info("no answer from metadata server %s within %.1f s: not on GCE", host, timeout_s)
        platform = Platform.OTHER
    elif isinstance(answer[0], Exception):
        logger.info("metadata server %s not usable (%s): not on GCE", host, answer[0])
        platform = Platform.OTHER
    else:
        machine_type, accelerator = answer[0]
        platform = _classify(machine_type, accelerator, framework)
        logger.info(
            "GCE VM: machine type %s%s -> %s",
            machine_type.rsplit("/", 1)[-1],
            f", accelerator {accelerator}" if accelerator else "",
            platform.value,
        )
    with _cache_lock:
        _cache[key] = platform
    return platform
