"""The cluster-wide key-value store every multi-worker part of asyncckpt uses.

One interface, one error hierarchy, for both users of a coordination service:
the preemption handler (workers agree on the step to save at) and the JAX
manager's multi-process commit (``asyncckpt.jax._distributed``: processes
report their files, the primary publishes). Both need the same primitives:
an atomic *claim* (create a key; fails if it exists, so the first claimant
wins), a *get* that waits for a key with a timeout, a *try_get*, a *delete*
and a *barrier*. Three implementations:

* ``TFCoordinator``: TensorFlow's coordination service, which
  ``MultiWorkerMirroredStrategy`` starts (``context.set_config_key_value``
  raises ``AlreadyExistsError`` for an existing key).
* ``JaxCoordinator``: the key-value store of ``jax.distributed`` (a key set
  without ``allow_overwrite`` fails with ``ALREADY_EXISTS``).
* ``InProcessCoordinator``: a dictionary and a condition variable, for a
  single worker (``InProcessCoordinator.group(n)`` gives n threads a shared
  store, for tests of the protocol itself).

None of them runs a collective: every call is an RPC to the coordination
service (or a local lock), safe from any thread while the training thread is
inside a collective. Errors: a service failure is a ``CoordinationError``, a
wait that runs out a ``CoordinationTimeoutError``, a peer's reported failure a
``PeerFailedError`` (both subclass ``CoordinationError``). A get that finds
nothing in time returns None; callers that must have the value turn that into
a ``CoordinationTimeoutError`` themselves (they know what they waited for).

This module imports neither TensorFlow nor JAX at import time.
"""

from __future__ import annotations

import abc
import json
import logging
import os
import sys
import threading

from asyncckpt.errors import CoordinationError, CoordinationTimeoutError, PeerFailedError

logger = logging.getLogger(__name__)


class Coordinator(abc.ABC):
    """A cluster-wide key-value store with first-claim-wins semantics.

    Attributes:
        worker_id: This worker, ``0 <= worker_id < num_workers``.
        num_workers: Workers taking part.
        kind: Short name for logs.
    """

    worker_id: int = 0
    num_workers: int = 1
    kind: str = "coordinator"

    @abc.abstractmethod
    def claim(self, key: str, value: str) -> bool:
        """Creates ``key`` with ``value``; False if it already exists."""

    @abc.abstractmethod
    def get(self, key: str, timeout_s: float) -> str | None:
        """The value of ``key``, waiting up to ``timeout_s``; None if unset."""

    @abc.abstractmethod
    def try_get(self, key: str) -> str | None:
        """The value of ``key`` if it is set, else None, without waiting."""

    @abc.abstractmethod
    def barrier(self, name: str, timeout_s: float) -> None:
        """Waits until every worker reached the barrier ``name``.

        Raises:
            CoordinationTimeoutError: Not all workers arrived in time.
        """

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Removes ``key`` (and keys below ``key/``); no error if absent."""

    def peer_failed(self, worker: int, error: str, code: int | None) -> PeerFailedError:
        """The error to raise for another worker's failure (``code``: its framework's code).

        Default: a ``PeerFailedError``. TensorFlow's coordinator makes it an
        instance of the peer's own ``tf.errors.OpError`` class as well.
        """
        del code
        return PeerFailedError(worker, error)

    def report_error(self, exc: BaseException) -> None:
        """Makes ``exc`` visible to the framework's own failure handling.

        The handler also publishes the error under a key every worker's
        watcher reads; this hook adds what the framework offers on top (TF:
        aborting the collectives peers are blocked in). Default: nothing more.
        """
        del exc

    def claim_json(self, key: str, value: dict) -> bool:
        return self.claim(key, json.dumps(value, sort_keys=True))

    def set(self, key: str, value: str) -> None:
        """Creates ``key``, which must not exist yet.

        Raises:
            CoordinationError: The key exists (two writers for one key).
        """
        if not self.claim(key, value):
            raise CoordinationError(f"[worker {self.worker_id}] key {key!r} is already set")

    def wait(self, key: str, timeout_s: float, what: str) -> str:
        """The value of ``key``, waiting up to ``timeout_s``.

        Raises:
            CoordinationTimeoutError: Not set in time; ``what`` names what was
                waited for.
        """
        value = self.get(key, timeout_s)
        if value is None:
            raise CoordinationTimeoutError(
                f"[worker {self.worker_id}] no answer for {what} within {timeout_s:.0f} s "
                f"(key {key!r})"
            )
        return value

    def __repr__(self) -> str:
        return f"{type(self).__name__}(worker {self.worker_id} of {self.num_workers})"


class _SharedValues:
    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self.values: dict[str, str] = {}
        self.cond = threading.Condition()
        self.barriers: dict[str, set[int]] = {}


class InProcessCoordinator(Coordinator):
    """Coordination between threads of one process (one worker by default)."""

    kind = "in-process"

    def __init__(self, *, _store: _SharedValues | None = None, _worker_id: int = 0):
        self._store = _store or _SharedValues(1)
        self.worker_id = _worker_id
        self.num_workers = self._store.num_workers

    @classmethod
    def group(cls, num_workers: int) -> list[InProcessCoordinator]:
        """``num_workers`` coordinators sharing one store (one per thread)."""
        store = _SharedValues(num_workers)
        return [cls(_store=store, _worker_id=i) for i in range(num_workers)]

    def claim(self, key: str, value: str) -> bool:
        with self._store.cond:
            if key in self._store.values:
                return False
            self._store.values[key] = value
            self._store.cond.notify_all()
            return True

    def get(self, key: str, timeout_s: float) -> str | None:
        with self._store.cond:
            self._store.cond.wait_for(lambda: key in self._store.values, timeout=timeout_s)
            return self._store.values.get(key)

    def try_get(self, key: str) -> str | None:
        with self._store.cond:
            return self._store.values.get(key)

    def delete(self, key: str) -> None:
        with self._store.cond:
            values = self._store.values
            for k in [k for k in values if k == key or k.startswith(key + "/")]:
                del values[k]

    def barrier(self, name: str, timeout_s: float) -> None:
        s = self._store
        with s.cond:
            arrived = s.barriers.setdefault(name, set())
            arrived.add(self.worker_id)
            s.cond.notify_all()
            if not s.cond.wait_for(lambda: len(arrived) >= s.num_workers, timeout=timeout_s):
                raise CoordinationTimeoutError(
                    f"barrier {name!r}: {s.num_workers - len(arrived)} worker(s) missing "
                    f"after {timeout_s:.0f} s"
                )


def _ms(timeout_s: float) -> int:
    # Both services treat 0 as "forever": never pass it.
    return max(1, int(timeout_s * 1000))


def _worker_layout(cluster: dict, task_type: str | None,
                   task_id: int) -> tuple[int, int] | None:
    """``(worker_id, num_workers)`` of a task among a cluster's chief and worker tasks.

    The chief comes first, then the workers in order (TensorFlow's
    ``id_in_cluster``). None when the cluster has fewer than two such tasks
    or the task is not one of them.

    Raises:
        NotImplementedError: The cluster has parameter servers.
    """
    if cluster.get("ps"):
        raise NotImplementedError(
            "the preemption handler does not support ParameterServerStrategy"
        )
    tasks = [("chief", i) for i in range(len(cluster.get("chief", [])))]
    tasks += [("worker", i) for i in range(len(cluster.get("worker", [])))]
    me = (task_type, task_id)
    if len(tasks) < 2 or me not in tasks:
        return None
    return tasks.index(me), len(tasks)


class TFCoordinator(Coordinator):
    """TensorFlow's coordination service (multi-worker TensorFlow).

    Args:
        worker_id: This task's index among all chief and worker tasks
            (the chief first).
        num_workers: Number of chief and worker tasks.
    """

    kind = "tensorflow"

    def __init__(self, *, worker_id: int, num_workers: int):
        from tensorflow.python.eager import context
        from tensorflow.python.framework import errors

        self._context = context.context()
        self._errors = errors
        self.worker_id = worker_id
        self.num_workers = num_workers

    @classmethod
    def from_environment(cls) -> TFCoordinator | None:
        """The coordinator of a multi-worker TensorFlow run, or None.

        A run is multi-worker when ``TF_CONFIG`` names more than one chief or
        worker task and the coordination service is configured (as
        ``MultiWorkerMirroredStrategy`` does).
        """
        if "tensorflow" not in sys.modules or not os.environ.get("TF_CONFIG"):
            return None
        from tensorflow.python.eager import context

        if context.context().coordination_service is None:
            return None
        tf_config = json.loads(os.environ["TF_CONFIG"])
        task = tf_config.get("task", {})
        layout = _worker_layout(tf_config.get("cluster", {}), task.get("type"),
                                int(task.get("index", 0)))
        return None if layout is None else cls(worker_id=layout[0], num_workers=layout[1])

    @classmethod
    def from_cluster_resolver(cls, resolver) -> TFCoordinator | None:
        """The coordinator of the cluster a ``tf.distribute`` cluster resolver describes.

        Its cluster spec, task type and task id say which worker this is
        (the chief first, then the workers, as TensorFlow counts them); None
        when the spec names fewer than two chief or worker tasks (local
        training: ``MirroredStrategy``, ``OneDeviceStrategy``, a
        ``MultiWorkerMirroredStrategy`` without a cluster).

        Raises:
            NotImplementedError: The cluster has parameter servers.
            ValueError: The task is not one of the cluster's chief or worker
                tasks (an evaluator takes no part in preemption saves).
            CoordinationError: Several workers, but TensorFlow's coordination
                service is not running (the strategy is created after the
                handler, or without the cluster).
        """
        cluster = resolver.cluster_spec().as_dict()
        if not cluster:
            return None
        task_type = resolver.task_type
        task_id = int(resolver.task_id or 0)
        layout = _worker_layout(cluster, task_type, task_id)
        if layout is None:
            tasks = len(cluster.get("chief", [])) + len(cluster.get("worker", []))
            if tasks < 2:
                return None
            raise ValueError(
                f"task {task_type}:{task_id} is not a chief or worker task of the cluster "
                f"{sorted(cluster)}; only those take part in preemption saves"
            )
        from tensorflow.python.eager import context

        if context.context().coordination_service is None:
            raise CoordinationError(
                f"the cluster resolver names {layout[1]} workers but TensorFlow's coordination "
                "service is not running: create the MultiWorkerMirroredStrategy (which "
                "starts it) before the preemption handler"
            )
        return cls(worker_id=layout[0], num_workers=layout[1])

    def claim(self, key: str, value: str) -> bool:
        try:
            self._context.set_config_key_value(key, value)
            return True
        except self._errors.AlreadyExistsError:
            return False
        except self._errors.OpError as e:
            raise CoordinationError(f"claim {key!r}: {e}") from e

    def get(self, key: str, timeout_s: float) -> str | None:
        try:
            return self._context.get_config_key_value(key, _ms(timeout_s))
        except self._errors.DeadlineExceededError:
            return None
        except self._errors.OpError as e:
            raise CoordinationError(f"get {key!r}: {e}") from e

    def delete(self, key: str) -> None:
        try:
            self._context.delete_config_key_value(key)
        except self._errors.NotFoundError:
            pass
        except self._errors.OpError as e:
            raise CoordinationError(f"delete {key!r}: {e}") from e

    def try_get(self, key: str) -> str | None:
        return self.get(key, 0.001)

    def barrier(self, name: str, timeout_s: float) -> None:
        try:
            self._context.wait_at_barrier(name, _ms(timeout_s))
        except self._errors.DeadlineExceededError as e:
            raise CoordinationTimeoutError(f"barrier {name!r}: {e}") from e
        except self._errors.OpError as e:
            raise CoordinationError(f"barrier {name!r}: {e}") from e

    def peer_failed(self, worker: int, error: str, code: int | None) -> PeerFailedError:
        """A ``PeerFailedError`` that is also the peer's ``tf.errors.OpError`` class.

        TensorFlow's handler lets every worker raise the error the failing one
        raised (``except tf.errors.ResourceExhaustedError`` catches it on every
        worker); a worker told of it at a step boundary does the same.
        """
        if code is None:
            return PeerFailedError(worker, error)
        try:
            op_error = self._errors.exception_type_from_error_code(int(code))
        except (KeyError, TypeError, ValueError):
            return PeerFailedError(worker, error)
        return _tf_peer_failed_class(op_error)(worker, error)

    def report_error(self, exc: BaseException) -> None:
        code = getattr(exc, "error_code", None) or self._errors.UNKNOWN
        try:
            self._context.report_error_to_cluster(code, f"{type(exc).__name__}: {exc}")
        except Exception as e:
            logger.info("could not report the error to the TensorFlow cluster: %r", e)


_TF_PEER_FAILED: dict[type, type] = {}


def _tf_peer_failed_class(op_error: type) -> type:
    """``PeerFailedError`` combined with one ``tf.errors.OpError`` class (cached)."""
    cls = _TF_PEER_FAILED.get(op_error)
    if cls is None:

        def __init__(self, worker: int, error: str) -> None:
            op_error.__init__(self, None, None, f"worker {worker} failed: {error}")
            self.worker = worker
            self.error = error

        def __reduce__(self):
            return (_tf_peer_failed, (op_error, self.worker, self.error))

        cls = type(f"PeerFailedError_{op_error.__name__}", (PeerFailedError, op_error),
                   {"__init__": __init__, "__reduce__": __reduce__,
                    "__module__": __name__, "__doc__": PeerFailedError.__doc__})
        _TF_PEER_FAILED[op_error] = cls
    return cls


def _tf_peer_failed(op_error: type, worker: int, error: str) -> PeerFailedError:
    """Unpickles a ``PeerFailedError`` of a ``tf.errors.OpError`` class."""
    return _tf_peer_failed_class(op_error)(worker, error)


def _jax_status(e: BaseException, status: str) -> bool:
    return str(e).lstrip().startswith(status)


class JaxCoordinator(Coordinator):
    """The key-value store of ``jax.distributed`` (multi-process JAX)."""

    kind = "jax"

    def __init__(self, client, *, worker_id: int, num_workers: int):
        self._client = client
        self.worker_id = worker_id
        self.num_workers = num_workers

    @classmethod
    def from_environment(cls) -> JaxCoordinator | None:
        """The coordinator of a ``jax.distributed`` run of 2+ processes, or None."""
        if "jax" not in sys.modules:
            return None
        from jax._src import distributed

        state = distributed.global_state
        if state.client is None or (state.num_processes or 1) < 2:
            return None
        return cls(state.client, worker_id=state.process_id, num_workers=state.num_processes)

    @classmethod
    def for_processes(cls) -> JaxCoordinator | None:
        """The coordinator of this JAX run when it has several processes, else None.

        Unlike ``from_environment`` it asks JAX for the process layout (so JAX
        must be imported) and insists on the key-value store.

        Raises:
            CoordinationError: Several processes but ``jax.distributed`` is
                not initialized.
        """
        import jax
        from jax._src import distributed

        index, count = jax.process_index(), jax.process_count()
        if count == 1:
            return None
        client = distributed.global_state.client
        if client is None:
            raise CoordinationError(
                f"JAX runs {count} processes but jax.distributed is not initialized; "
                "asyncckpt coordinates multi-process saves through its key-value store: "
                "call jax.distributed.initialize() first"
            )
        return cls(client, worker_id=index, num_workers=count)

    def claim(self, key: str, value: str) -> bool:
        try:
            self._client.key_value_set(key, value)
            return True
        except Exception as e:
            if _jax_status(e, "ALREADY_EXISTS"):
                return False
            raise CoordinationError(f"claim {key!r}: {e}") from e

    def get(self, key: str, timeout_s: float) -> str | None:
        try:
            return self._client.blocking_key_value_get(key, _ms(timeout_s))
        except Exception as e:
            if _jax_status(e, "DEADLINE_EXCEEDED"):
                return None
            raise CoordinationError(f"get {key!r}: {e}") from e

    def try_get(self, key: str) -> str | None:
        try:
            return self._client.key_value_try_get(key)
        except Exception as e:
            if _jax_status(e, "NOT_FOUND"):
                return None
            raise CoordinationError(f"try_get {key!r}: {e}") from e

    def delete(self, key: str) -> None:
        try:
            self._client.key_value_delete(key)
        except Exception as e:
            if not _jax_status(e, "NOT_FOUND"):
                raise CoordinationError(f"delete {key!r}: {e}") from e

    def barrier(self, name: str, timeout_s: float) -> None:
        try:
            self._client.wait_at_barrier(name, _ms(timeout_s))
        except Exception as e:
            if _jax_status(e, "DEADLINE_EXCEEDED"):
                raise CoordinationTimeoutError(f"barrier {name!r}: {e}") from e
            raise CoordinationError(f"barrier {name!r}: {e}") from e


def auto_coordinator(framework: str | None) -> Coordinator:
    """The coordinator for the run this process is part of.

    TensorFlow's coordination service under ``MultiWorkerMirroredStrategy``,
    the ``jax.distributed`` key-value store when it has 2+ processes, else an
    in-process one. ``framework`` (the checkpoint's) is tried first; the other
    framework is consulted only if it is already imported.
    """
    order = ["tensorflow", "jax"]
    if framework == "jax":
        order.reverse()
    for name in order:
        coordinator = (
            TFCoordinator.from_environment() if name == "tensorflow"
            else JaxCoordinator.from_environment()
        )
        if coordinator is not None:
            logger.info("preemption: coordinating through %s as worker %d of %d",
                        coordinator.kind, coordinator.worker_id, coordinator.num_workers)
            return coordinator
    return InProcessCoordinator()
