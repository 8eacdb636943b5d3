"""Snapshot of TensorFlow state into host staging buffers.

Staging asks TensorFlow for exactly what ``tf.train.Checkpoint`` would save
(every variable, ShardedVariable slice, optimizer slot, Python state,
``tf.data`` iterator state, in the same object graph and under the same
keys), and copies each value into a reused host buffer of the slot (a
variant tensor, an iterator's state, is held as captured: ``_variant``).
The staged state is written by ``_job.write_bundle``.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from asyncckpt._engine._copy import copy_arrays
from asyncckpt._engine.slots import Slot
from asyncckpt.errors import UnsupportedObjectError
from asyncckpt.tf import _compat
from asyncckpt.tf._compat import tf
from asyncckpt.tf._copy import DeferredCopy
from asyncckpt.tf._variant import CapturedVariant

logger = logging.getLogger(__name__)

_UNSUPPORTED_DTYPES = (tf.resource,)


@dataclass(frozen=True)
class StagedTensor:
    """One tensor of the checkpoint, held in host memory.

    Attributes:
        key: Checkpoint key (``path/.ATTRIBUTES/VARIABLE_VALUE``).
        slice_spec: TensorFlow slice spec for a ShardedVariable part, else "".
        dtype: TensorFlow dtype.
        host: The host copy: a slot buffer, a private array for strings, or
            for a variant (iterator state) the tensor captured at the call.
    """

    key: str
    slice_spec: str
    dtype: tf.DType
    host: np.ndarray | CapturedVariant

    @property
    def nbytes(self) -> int:
        """Bytes of the value (of a variant: 0 until the writer has encoded it)."""
        if isinstance(self.host, CapturedVariant):
            return self.host.nbytes
        if self.dtype == tf.string:
            return int(sum(len(b) for b in self.host.reshape(-1)))
        return int(self.host.nbytes)


@dataclass(frozen=True)
class StagedState:
    """Everything one TensorFlow checkpoint file holds, in host memory.

    ``copy``, when set, copies values of host tensors into the slot in the
    background (see ``_copy``): start it once the save is queued, and
    wait for it before reading the buffers.
    """

    tensors: tuple[StagedTensor, ...]
    object_graph: bytes
    io_device: str | None = None  # CheckpointOptions.experimental_io_device
    copy: DeferredCopy | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors) + len(self.object_graph)


def _describe(trackable: object) -> str:
    return f"{type(trackable).__module__}.{type(trackable).__qualname__}"


def _to_host(value: object, key: str, owner: str) -> tf.Tensor | None:
    """Evaluates one serialized value to a tensor readable from the host."""
    if isinstance(value, _compat.SaveSpec):
        value = value.tensor
    if value is None:  # an uninitialized variable: TensorFlow skips it too.
        return None
    if isinstance(value, tf.Variable):
        value = value.read_value()
    if not tf.is_tensor(value):
        try:
            value = tf.convert_to_tensor(value)
        except (TypeError, ValueError) as e:
            raise UnsupportedObjectError(
                f"asyncckpt cannot stage checkpoint value {key!r} of {owner}: "
                f"{type(value).__name__} is not a tensor"
            ) from e
    _check_dtype(value.dtype, key, owner)
    return value


def _check_dtype(dtype: tf.DType, key: str, owner: str) -> None:
    if dtype in _UNSUPPORTED_DTYPES:
        raise UnsupportedObjectError(
            f"asyncckpt cannot stage checkpoint value {key!r} of {owner}: "
            f"its dtype is {dtype.name}, an opaque handle that has no host copy. Leave "
            "this object out of the asyncckpt checkpoint and save it with tf.train.Checkpoint."
        )


@dataclass
class _Entry:
    key: str
    slice_spec: str
    owner: str  # the owning object's type, for error messages (no reference to it)
    value: object  # a tensor, or a SaveSpec/Callable that reads one
    # For a value serialized when the plan was built (a tf.data iterator's state):
    # serializes it again for the later saves of a reused plan.
    reread: Callable[[], object] | None = None
    # Whether the value read is a snapshot that later writes never touch (copy-on-write),
    # so its copy may run in the background; see _shares_memory_it_updates.
    snapshot: bool = True


def _shares_memory_it_updates(owner) -> bool:
    """Whether the tensors ``owner`` serializes to may alias memory it updates in place.

    A variable's read is protected by copy-on-write (``_copy``). A
    resource that is not a variable gives no such promise: a
    ``DenseHashTable`` exports its bucket arrays themselves, and the next
    ``insert`` overwrites them in place. Such values are copied at the save
    call, never in the background.
    """
    return (isinstance(owner, tf.saved_model.experimental.TrackableResource)
            and not isinstance(owner, tf.Variable))


def _weak_refs(objects: list, on_death) -> list[weakref.ref] | None:
    try:
        return [weakref.ref(o, on_death) for o in objects]
    except TypeError:  # an object without weak reference support: never reuse
        return None


class Plan:
    """What one save reads: checkpoint keys, their readers, the object graph.

    Building it (TensorFlow's own serialization of the object graph) costs
    milliseconds per hundred variables, so a plan is reused while the object
    graph is unchanged (the same objects under the same names) and every value
    is a lazy variable reader or a ``tf.data`` iterator's state (serialized
    again at each save: ``_Entry.reread``). Objects with optimizer slot
    machinery (``get_slot_names``: compat.v1 and legacy Keras optimizers) can
    grow slots without a visible graph change, so their plans are never
    reused. All lazy reads of a reused plan run in one ``tf.function`` call
    instead of a few eager ops per variable.

    Objects with a registered TensorFlow saver (``registration``) get its save
    function called at each save before any value is read, as TensorFlow's
    save calls it: TPU embeddings pull their tables from device memory into
    their host variables there. A saver that writes files of its own is
    refused (asyncckpt writes the one bundle itself).

    A kept plan refers to the graph's objects only weakly, so it never keeps
    alive what the checkpoint itself holds weakly (``root=weakref.ref(obj)``);
    the variable readers it keeps are dropped with it as soon as one of those
    objects dies.
    """

    def __init__(
        self,
        checkpoint: tf.train.Checkpoint,
        objects: list,
        names: tuple,
        on_death=None,
        *,
        direct_max: int = 0,
    ):
        serialized, registered, proto = _compat.serialize_graph(checkpoint)
        self.names = names
        self.object_graph = proto.SerializeToString()
        self.entries: list[_Entry] = []
        for owner, tensor_dict in serialized.items():
            described = _describe(owner)
            snapshot = not _shares_memory_it_updates(_compat.saved_object(owner))
            for key, value in tensor_dict.items():
                parts = value.items() if isinstance(value, dict) else (("", value),)
                for slice_spec, part in parts:
                    reread = None
                    if tf.is_tensor(part) and part.dtype == tf.variant:
                        reread = _compat.iterator_state_reader(owner, key)
                    self.entries.append(_Entry(key, slice_spec, described, part, reread,
                                               snapshot))
        self.refs = _weak_refs(objects, on_death)
        self.savers = _Savers(registered, self.refs is not None)
        self.reusable = (
            self.refs is not None
            and all(isinstance(e.value, _compat.TensorCallable) or e.reread is not None
                    for e in self.entries)
            and not any("get_slot_names" in dir(o) for o in objects)
        )
        self._fresh = True  # values serialized by this build not read yet
        # Lazy readers (variables) and values serialized by TensorFlow (the rest).
        self._lazy = [i for i, e in enumerate(self.entries) if e.reread is None]
        self._states = [i for i, e in enumerate(self.entries) if e.reread is not None]
        # Few plain variables: each read by one eager op (see _DIRECT_MAX), no tracing.
        self.variables: list | None = None
        if self.reusable and len(self._lazy) <= direct_max:
            found = [_compat.plain_variable(self.entries[i].value) for i in self._lazy]
            if all(v is not None for v in found):
                self.variables = found
        self._batched = None  # tf.function reading every value, traced after the first read
        self._call = None  # calls the traced _batched without its argument matching
        self._batched_failed = False
        self.traced = threading.Event()  # set once tracing ended (well or not)
        self.uses = 0
        self.nbytes: int | None = None  # staged bytes of a save, known after the first read

    def matches(self, objects: list, names: tuple) -> bool:
        refs = self.refs
        return (
            refs is not None
            and len(objects) == len(refs)
            and all(r() is o for r, o in zip(refs, objects, strict=True))
            and names == self.names
        )

    def read(self, *, sizes_only: bool = False) -> list[tf.Tensor | None]:
        """Current values of every entry (None for an uninitialized variable).

        Registered savers run first (``_Savers``), then iterator states are
        serialized, then the variables are read. ``sizes_only`` (``prepare``,
        which only needs the variables' buffer sizes) runs no saver and
        serializes no iterator (None for those entries).
        """
        self.uses += 1
        if not sizes_only:
            self.savers.run()
        fresh, self._fresh = self._fresh, False
        values: list = [None] * len(self.entries)
        for i in self._states:
            e = self.entries[i]
            value = None if sizes_only else e.value if fresh else e.reread()
            if self.reusable:
                e.value = None  # a kept plan holds no iterator state
            values[i] = None if value is None else _to_host(value, e.key, e.owner)
        for i, v in zip(self._lazy, self._read_lazy(), strict=True):
            values[i] = v
        return values

    def _read_lazy(self) -> list[tf.Tensor | None]:
        lazy = [self.entries[i] for i in self._lazy]
        if self.variables is not None:
            values = self._checked(
                lazy, lambda: [_compat.read_variable(v) for v in self.variables], "direct")
            if values is not None:
                return values
        else:
            if self.uses == 1 and self.reusable:
                self._start_tracing(lazy)
            if self._batched is not None and not self._batched_failed:
                values = self._checked(lazy, self._call, "batched")
                if values is not None:
                    return values
                self._batched_failed = True
        return [_to_host(e.value, e.key, e.owner) for e in lazy]

    @property
    def batched_reader(self) -> Callable[[], list] | None:
        """The traced read of every variable value, called without argument matching.

        None until the first ``read`` has traced it, and once a batched read failed.
        """
        return self._call if self._batched is not None and not self._batched_failed else None

    def batched_read_failed(self) -> None:
        """A batched read failed (e.g. an uninitialized variable): read value by value now."""
        self._batched_failed = True

    def _checked(self, entries: list[_Entry], read: Callable[[], list],
                 how: str) -> list | None:
        """``read()``'s values if it works and their dtypes match; else None (read eagerly)."""
        try:
            values = read()
            for e, v in zip(entries, values, strict=True):
                _check_dtype(v.dtype, e.key, e.owner)
            return values
        except UnsupportedObjectError:
            raise
        except Exception as e:  # e.g. an uninitialized variable
            logger.debug("%s read failed (%r); reading variables one by one", how, e)
            return None

    def _start_tracing(self, lazy: list[_Entry]) -> None:
        """Traces the batched reader, on the first save's thread (issue 13.3).

        Tracing takes tens of ms of Python. Done on a background thread after
        the first save, it was often not finished when the second save came
        (a step or two later, or later still on a loaded machine): that save
        then read the variables one by one while the tracer competed with it
        for the GIL, and blocked 10-16x a memcpy. The first save already
        builds the plan and allocates the staging memory; it traces too, so
        that every later save finds the reader ready.
        """
        readers = [_compat.lazy_reader(e.value) for e in lazy]
        try:
            fn = tf.function(lambda: [r() for r in readers])
            self._call = _compat.flat_caller(fn)  # traces; the cheap way to call fn
            self._batched = fn
        except Exception as e:
            logger.debug("tracing the batched read failed (%r); reading one by one", e)
            self._batched_failed = True
        finally:
            self.traced.set()


class _Savers:
    """The registered TensorFlow savers of a plan's objects, run before each read.

    Holds the objects weakly when the plan is kept (``weak``), like the plan.
    """

    def __init__(self, registered: dict, weak: bool):
        self._savers = []
        for name, trackables in registered.items():
            if trackables:
                held = {n: (weakref.ref(t) if weak else (lambda t=t: t))
                        for n, t in trackables.items()}
                self._savers.append((name, held))

    def run(self) -> None:
        """Calls each saver's save function on this thread.

        Raises:
            UnsupportedObjectError: A saver wrote files of its own.
        """
        for name, held in self._savers:
            trackables = {n: get() for n, get in held.items()}
            if not _compat.run_registered_saver(name, trackables):
                raise UnsupportedObjectError(
                    f"asyncckpt cannot stage objects whose registered TensorFlow saver "
                    f"{name!r} writes files of its own ({sorted(trackables)}); save them "
                    "with tf.train.Checkpoint"
                )


# Up to this many values, all plain variables, a save reads each by one eager
# op (~7 us) instead of calling a traced function (100-500 us a call, 60-90 ms
# to trace): the fixed cost of a small state's save (issue 13.4). Above it the
# one traced call is cheaper than the eager ops.
_DIRECT_MAX = 32


def graph_signature(checkpoint: tf.train.Checkpoint) -> tuple[list, tuple]:
    """The objects of the checkpoint's graph and the name path of each."""
    objects, paths = _compat.traverse(checkpoint)
    names = tuple(tuple(ref.name for ref in paths[o]) for o in objects)
    return objects, names


def _plan_dropper(stager_ref: weakref.ref):
    """A weakref callback that drops the stager's plan once one of its objects died.

    It holds the stager weakly, so a plan's weak references form no cycle.
    """

    def on_death(_dead: weakref.ref) -> None:
        stager = stager_ref()
        plan = stager._plan if stager is not None else None
        if plan is not None and plan.refs and any(r() is None for r in plan.refs):
            stager._plan = None

    return on_death


class Stager:
    """Stages a ``tf.train.Checkpoint``'s state; keeps its plan between saves.

    It holds no reference to the checkpoint (the checkpoint holds the stager),
    and only weak ones to the objects of the last plan.
    """

    def __init__(self):
        self._plan: Plan | None = None
        self._on_death = _plan_dropper(weakref.ref(self))

    def clear(self) -> None:
        """Forgets the kept plan (and with it the variable readers it holds)."""
        self._plan = None

    def _plan_for(self, checkpoint: tf.train.Checkpoint) -> Plan:
        """The plan of the checkpoint's current object graph (the kept one if it still fits)."""
        objects, names = graph_signature(checkpoint)
        plan = self._plan
        if plan is None or not plan.matches(objects, names):
            plan = Plan(checkpoint, objects, names, self._on_death, direct_max=_DIRECT_MAX)
        self._plan = plan if plan.reusable else None
        return plan

    def staging_layout(self, checkpoint: tf.train.Checkpoint) -> dict[str, int]:
        """Byte size of each staging buffer a save of the checkpoint now takes, by key."""
        plan = self._plan_for(checkpoint)
        return {_buffer_key(e.key, e.slice_spec): t.shape.num_elements() * t.dtype.size
                for e, t in zip(plan.entries, plan.read(sizes_only=True), strict=True)
                if t is not None and t.dtype != tf.string}

    def stage(
        self,
        checkpoint: tf.train.Checkpoint,
        slot: Slot,
        *,
        io_device: str | None = None,
        background_copy: bool = False,
    ) -> StagedState:
        """Copies the checkpoint's current values into ``slot``.

        Runs on the training thread; returns once the values are held as the
        save will write them, so the caller may mutate the state again. With
        ``background_copy``, values in host memory are only read here: their
        copies into the slot run in the background (the returned state's
        ``copy``), which is exact because TensorFlow never writes into a
        buffer a read still shares (see ``_copy``). Values of resources
        that are not variables (lookup tables), which carry no such
        promise, are copied here all the same.

        Raises:
            UnsupportedObjectError: The object graph holds something that
                cannot be copied to host memory.
        """
        plan = self._plan_for(checkpoint)
        values = plan.read()
        if plan.nbytes is None:  # sizes are fixed with the plan's variables
            plan.nbytes = sum(t.shape.num_elements() * t.dtype.size for t in values
                              if t is not None and t.dtype != tf.string)
        slot.reserve(plan.nbytes)  # over the host memory budget: raises, nothing allocated
        staged = []
        copies: list[tuple[np.ndarray, np.ndarray]] = []
        deferred: list[tuple[np.ndarray, np.ndarray]] | None = [] if background_copy else None
        for entry, tensor in zip(plan.entries, values, strict=True):
            if tensor is not None:
                staged.append(_plan_copy(slot, entry.key, entry.slice_spec, tensor, copies,
                                         deferred if entry.snapshot else None))
        # The views in `copies` alias TensorFlow tensors, which they keep alive.
        copy_arrays(copies)
        # Started by the save once it has queued the job (TFSaveJob.start_background):
        # copying now would compete for the cores with the rest of the save call.
        copy = DeferredCopy(deferred) if deferred else None
        del deferred
        return StagedState(tuple(staged), plan.object_graph, io_device, copy)


def _buffer_key(key: str, slice_spec: str) -> str:
    return f"{key}|{slice_spec}"


def _plan_copy(
    slot: Slot,
    key: str,
    slice_spec: str,
    tensor: tf.Tensor,
    copies: list[tuple[np.ndarray, np.ndarray]],
    deferred: list[tuple[np.ndarray, np.ndarray]] | None = None,
) -> StagedTensor:
    """Plans the copy of one value into the slot.

    The copy goes to ``deferred`` (the background) for a tensor in host
    memory when that list is given, else to ``copies`` (this thread).
    """
    if tensor.dtype == tf.string:
        # Strings (Python state) are small; keep a private copy by value.
        return StagedTensor(key, slice_spec, tensor.dtype, np.array(tensor.numpy(), dtype=object))
    if tensor.dtype == tf.variant:
        # An iterator's serialized state: immutable, encoded by the writer (_variant).
        return StagedTensor(key, slice_spec, tensor.dtype, CapturedVariant(tensor))
    on_host = "CPU" in tensor.device.upper()
    if not on_host:
        # Device-to-host copy; TensorFlow picks the DMA path for the device.
        with tf.device("CPU:0"):
            tensor = tf.identity(tensor)
    host_view = _compat.host_numpy(tensor)  # a view of the CPU tensor's memory, no copy
    buf = slot.buffer(_buffer_key(key, slice_spec), host_view.shape, host_view.dtype)
    if on_host and deferred is not None:
        deferred.append((buf, host_view))
    else:
        copies.append((buf, host_view))
    return StagedTensor(key, slice_spec, tensor.dtype, buf)
