"""Every TensorFlow internal asyncckpt relies on, in one place.

TensorFlow has no public API for "give me the tensors a checkpoint would hold"
or "write these host buffers as a checkpoint", so the adapter uses the same
internals ``tf.train.Checkpoint`` uses itself. Keeping them here makes a
TensorFlow upgrade a one-file review, and turns a missing internal into an
actionable error instead of an AttributeError deep in a save.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import types
import weakref
from collections.abc import Callable

try:
    import tensorflow as tf
except ImportError as e:  # pragma: no cover - exercised only without TensorFlow
    raise ImportError(
        "asyncckpt.tf needs TensorFlow; install it with: pip install 'asyncckpt[tf]'"
    ) from e

try:
    from tensorflow.python.checkpoint import checkpoint as tf_checkpoint
    from tensorflow.python.checkpoint import (
        checkpoint_context,
        checkpoint_management,
        save_util,
        saveable_compat,
        tensor_callable,
    )
    from tensorflow.python.checkpoint.sharding import sharding_policies
    from tensorflow.python.data.ops import iterator_ops
    from tensorflow.python.eager import context
    from tensorflow.python.eager import executor as eager_executor
    from tensorflow.python.ops import gen_io_ops, gen_resource_variable_ops, resource_variable_ops
    from tensorflow.python.saved_model import path_helpers, registration
    from tensorflow.python.trackable import base as trackable_base
    from tensorflow.python.trackable import trackable_utils
    from tensorflow.python.training.saving import saveable_object, saveable_object_util
except ImportError as e:  # pragma: no cover - only on an untested TensorFlow
    raise ImportError(
        f"asyncckpt.tf does not support TensorFlow {tf.__version__}: an internal module it "
        f"needs has moved ({e}). Supported: TensorFlow 2.21."
    ) from e

OBJECT_GRAPH_KEY: str = trackable_base.OBJECT_GRAPH_PROTO_KEY
SaveSpec = saveable_object.SaveSpec
# A lazy reader of a variable's value, what variables serialize to.
TensorCallable = tensor_callable.Callable


def saved_object(owner):
    """The object a serialized owner stands for.

    Objects that save through legacy ``SaveableObject``s (lookup tables,
    ShardedVariables) appear in ``serialize_graph`` as a
    ``SaveableCompatibilityConverter`` wrapping them.
    """
    if isinstance(owner, saveable_object_util.SaveableCompatibilityConverter):
        return owner.obj
    return owner


def graph_view_of(checkpoint: tf.train.Checkpoint):
    """The object-graph view ``tf.train.Checkpoint`` itself saves from."""
    try:
        return checkpoint._saver._graph_view
    except AttributeError as e:  # pragma: no cover
        raise RuntimeError(
            f"TensorFlow {tf.__version__} changed tf.train.Checkpoint internals; "
            "asyncckpt.tf supports TensorFlow 2.21"
        ) from e


def save_graph_of(wrapper: tf.train.Checkpoint, checkpoint: tf.train.Checkpoint) -> None:
    """Makes ``wrapper`` save and restore ``checkpoint``'s object graph, exactly.

    As if ``checkpoint`` itself were saved: its own children and its own
    ``save_counter``, with no edge added (``tf.train.Checkpoint(root=...)``
    would attach a ``root`` child, and refuses a root that has one already).
    """
    from tensorflow.python.trackable import data_structures

    checkpoint.save_counter  # noqa: B018 - created now, so the wrapper numbers with it
    wrapper._saver = tf_checkpoint.TrackableSaver(graph_view_of(checkpoint))
    wrapper._save_counter = data_structures.NoDependency(checkpoint._save_counter)


def serialize_graph(checkpoint: tf.train.Checkpoint):
    """Returns ``(serialized_tensors, registered_savers, object_graph_proto)``.

    ``serialized_tensors`` maps each trackable to ``{checkpoint_key: value}`` or
    ``{checkpoint_key: {slice_spec: value}}``, where a value is a tensor or a
    ``SaveSpec`` whose ``tensor`` reads it; exactly what TensorFlow would save.
    """
    tensors, _, registered, proto = save_util.serialize_graph_view(graph_view_of(checkpoint))
    return tensors, registered, proto


def traverse(checkpoint: tf.train.Checkpoint) -> tuple[list, dict]:
    """Every object reachable from the checkpoint, breadth first, and its name path.

    The second item maps each object to its shortest path from the root, a
    list of references with a ``name``.
    """
    return graph_view_of(checkpoint).breadth_first_traversal()


def flat_caller(fn):
    """A cheaper way to call the traced, argument-less ``tf.function`` ``fn``.

    Calling the ``tf.function`` itself matches its arguments against the
    traced signatures on every call (a few hundred microseconds on a busy
    machine, as much as the reads it runs); the concrete function's flat call
    skips that, still honouring gradient tapes. Falls back to the concrete
    function's public call where the internal is missing.
    """
    concrete = fn.get_concrete_function()
    call_flat = getattr(concrete, "_call_flat", None)
    if call_flat is None or not hasattr(concrete, "captured_inputs"):  # pragma: no cover
        return concrete
    return lambda: call_flat([], concrete.captured_inputs)


def _default_reader_code():
    """The code of the lazy reader ``BaseResourceVariable._serialize_to_tensors`` returns."""
    serialize = resource_variable_ops.BaseResourceVariable._serialize_to_tensors
    for const in serialize.__code__.co_consts:
        if isinstance(const, types.CodeType) and const.co_name == "_read_variable_closure":
            return const
    return None  # pragma: no cover - only on an untested TensorFlow


_DEFAULT_READER = _default_reader_code()


def host_numpy(tensor: tf.Tensor):
    """A NumPy view of a CPU tensor's memory, without a copy."""
    return tensor._numpy()


def lookup_dependency(trackable, name: str):
    """The child ``trackable`` tracks under ``name`` (None if it has none)."""
    return trackable._lookup_dependency(name)


def lazy_reader(value: TensorCallable) -> Callable[[], tf.Tensor]:
    """The function a ``TensorCallable`` (a variable's lazy reader) calls to read its value."""
    return value._tensor


def plain_variable(value: object):
    """The variable ``value`` reads, if it is TensorFlow's default lazy variable reader.

    A resource variable (a Keras 3 variable's too) serializes to a
    ``TensorCallable`` around a closure that reads the variable on its own
    device and copies the result to the CPU. For such a value this returns the
    variable, which ``read_variable`` then reads with one eager op; for any
    other value (a ShardedVariable slice, a distributed or mixed-precision
    variable with its own reader, Python state) it returns None.
    """
    fn = getattr(value, "_tensor", None)
    if _DEFAULT_READER is None or getattr(fn, "__code__", None) is not _DEFAULT_READER:
        return None
    for cell in fn.__closure__ or ():
        contents = cell.cell_contents
        if isinstance(contents, resource_variable_ops.BaseResourceVariable):
            return contents
    return None


def read_variable(variable) -> tf.Tensor:
    """The current value of a resource variable, on its device, by one eager op.

    The op the default reader runs, without the Python around it (device
    scopes, initialization check, ``tf.identity``): about 7 us a variable
    instead of 25-30 us, and no traced function call (100-500 us). Raises for
    an uninitialized variable.
    """
    return gen_resource_variable_ops.read_variable_op(variable.handle, variable.dtype)


def save_v2(
    prefix: str, names: list[str], slices: list[str], tensors: list, io_device: str | None = None
) -> None:
    """Writes one TensorFlow tensor bundle (``prefix.index`` + one data file).

    ``io_device`` is ``CheckpointOptions.experimental_io_device`` (the device
    whose host runs the write); None means the local CPU, as in TensorFlow.
    """
    with tf.device(io_device or "CPU:0"):
        gen_io_ops.save_v2(
            prefix=prefix, tensor_names=names, shape_and_slices=slices, tensors=tensors
        )


def sync_executor_scope():
    """A synchronous eager executor for the writer thread.

    With the main thread's executor possibly asynchronous, a background save
    could otherwise return before TensorFlow finished reading the staging
    buffers it was given.
    """
    return context.executor_scope(
        eager_executor.new_executor(enable_async=False, enable_streaming_enqueue=False)
    )


def checkpoint_state_text(
    directory: str,
    latest: str,
    all_paths: list[str],
    all_timestamps: list[float],
    last_preserved_timestamp: float,
) -> str:
    """The text of a ``checkpoint`` state file, as TensorFlow writes it."""
    from google.protobuf import text_format

    proto = checkpoint_management.generate_checkpoint_state_proto(
        directory,
        latest,
        all_model_checkpoint_paths=all_paths,
        all_model_checkpoint_timestamps=all_timestamps,
        last_preserved_timestamp=last_preserved_timestamp,
    )
    return text_format.MessageToString(proto)


def read_checkpoint_state(directory: str):
    """The parsed ``checkpoint`` state file of a directory, or None."""
    return checkpoint_management.get_checkpoint_state(directory)


def parse_checkpoint_state(text: str):
    """A ``checkpoint`` state file's text parsed (TensorFlow's ``CheckpointState``).

    Raises:
        ValueError: the text is not a state file.
    """
    from google.protobuf import text_format
    from tensorflow.python.training.checkpoint_state_pb2 import CheckpointState

    try:
        return text_format.Parse(text, CheckpointState())
    except text_format.ParseError as e:
        raise ValueError(f"not a checkpoint state file: {e}") from e


def iterator_state_reader(owner: object, key: str):
    """For ``key`` of a ``tf.data`` iterator: a function that serializes its state again.

    ``owner`` is what ``serialize_graph`` lists the value under: the
    iterator, or TensorFlow's ``SaveableCompatibilityConverter`` around it
    (iterators keep their legacy checkpoint name, ``ITERATOR_STATE``). The
    function holds the iterator weakly and returns what the iterator's own
    ``_serialize_to_tensors`` (what ``tf.train.Checkpoint`` calls) gives for
    ``key``: its current state. None for any other object, or an iterator
    without weak references.
    """
    obj = owner.obj if isinstance(
        owner, saveable_object_util.SaveableCompatibilityConverter) else owner
    if not isinstance(obj, iterator_ops.OwnedIterator):
        return None
    local = trackable_utils.extract_local_name(key, saveable_compat.get_saveable_name(obj))
    try:
        ref = weakref.ref(obj)
    except TypeError:  # pragma: no cover - TensorFlow 2.21's iterators have weak references
        return None

    def read():
        iterator = ref()
        if iterator is None:  # pragma: no cover - the plan is dropped when its objects die
            raise ReferenceError(f"the tf.data iterator saved under {key!r} is gone")
        for name, value in iterator._serialize_to_tensors().items():
            if trackable_utils.escape_local_name(name) == local:
                return value
        raise KeyError(f"the tf.data iterator no longer serializes {key!r}")

    return read


def run_registered_saver(name: str, trackables: dict) -> bool:
    """Calls a registered TensorFlow saver's save function, as ``tf.train.Checkpoint`` does.

    TensorFlow calls it with the objects it covers (object name -> object)
    and a file prefix of its own, before it reads any value; it returns the
    prefixes of files to merge into the checkpoint. Here the prefix lies in a
    scratch directory, removed afterwards.

    Returns:
        Whether the saver wrote nothing (returned no prefix, left no file):
        one that only prepares values, as the TPU embedding saver
        (``tf.TPUEmbeddingCallback``) pulls tables into host variables.
    """
    save_fn = registration.get_save_function(name)
    scratch = tempfile.mkdtemp(prefix="asyncckpt-saver-")
    try:
        prefix = tf.constant(os.path.join(scratch, "ckpt"))
        out = save_fn(trackables=trackables, file_prefix=prefix)
        return (out is None or not tf.nest.flatten(out)) and not os.listdir(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def executing_eagerly() -> bool:
    """False inside a ``tf.function`` or in TF1 graph mode (no host copy possible)."""
    return context.executing_eagerly()


def in_preemption_save_context() -> bool:
    """Whether TensorFlow's PreemptionCheckpointHandler is making its final save."""
    return checkpoint_context.in_preemption_save_context()


def is_default_sharding(callback: object) -> bool:
    """Whether a sharding callback is TensorFlow's default (one data file per task)."""
    return callback is None or isinstance(callback, sharding_policies.ShardByTaskPolicy)


def saved_model_variables_path(path: str) -> str | None:
    """The variables prefix inside a SavedModel directory, or None if ``path`` is not one."""
    if not os.path.isdir(path):
        return None
    if os.path.exists(path_helpers.get_saved_model_pb_path(path)) or os.path.exists(
        path_helpers.get_saved_model_pbtxt_path(path)
    ):
        return path_helpers.get_variables_path(path)
    return None


def is_name_based_status(status: object) -> bool:
    """Whether a load status comes from a TF1 name-based checkpoint."""
    return isinstance(status, tf_checkpoint.NameBasedSaverStatus)


def restore_coordinator(status: object):
    """The restore coordinator behind a ``CheckpointLoadStatus``, or None."""
    if isinstance(status, tf_checkpoint.CheckpointLoadStatus):
        return status._checkpoint
    return None


def objects_with_values(objects: list) -> list:
    """The objects that hold checkpoint values themselves (variables and the like)."""
    return tf_checkpoint._objects_with_attributes(objects)


# The closures ``tf.train.CheckpointManager.save`` builds; one of them, its
# bookkeeping (``_record_and_sweep_state``), is the write callback it adds to
# the options it hands to ``Checkpoint._write``.
_MANAGER_SAVE_CODES = frozenset(
    c for c in checkpoint_management.CheckpointManager.save.__code__.co_consts
    if isinstance(c, types.CodeType))


def manager_of_write_callback(callback: object) -> tf.train.CheckpointManager | None:
    """The ``tf.train.CheckpointManager`` whose ``save()`` made ``callback``, or None.

    That callback is TensorFlow's manager's bookkeeping: it records the path
    as ``latest_checkpoint`` and in ``checkpoints``, writes the ``checkpoint``
    state file and deletes what falls out of ``max_to_keep``. Any other
    callable (the user's own write callbacks) gives None.
    """
    code = getattr(callback, "__code__", None)
    closure = getattr(callback, "__closure__", None)
    if code not in _MANAGER_SAVE_CODES or not closure:
        return None
    cells = dict(zip(code.co_freevars, closure, strict=True))
    cell = cells.get("self")
    manager = None if cell is None else cell.cell_contents
    return manager if isinstance(manager, tf.train.CheckpointManager) else None


def dropped_by_save(manager: tf.train.CheckpointManager, path: str) -> list[str]:
    """The checkpoints ``manager``'s bookkeeping of a save of ``path`` takes off its list.

    Its ``_sweep`` deletes them (or keeps one for ``keep_checkpoint_every_n_hours``):
    the oldest of ``checkpoints`` beyond ``max_to_keep`` once ``path`` is
    the newest (a path already listed moves to the end, as TensorFlow's
    manager moves it).
    """
    keep = manager._max_to_keep
    if not keep:
        return []
    listed = [p for p in manager._maybe_delete if p != path] + [path]
    return listed[:max(0, len(listed) - keep)]
