"""Every TensorFlow internal asyncckpt relies on, in one place.

TensorFlow has no public API for "give me the tensors a checkpoint would hold"
or "write these host buffers as a checkpoint", so the adapter uses the same
internals ``tf.train.Checkpoint`` uses itself. Keeping them here makes a
TensorFlow upgrade a one-file review, and turns a missing internal into an
actionable error instead of an AttributeError deep in a save.
"""

from __future__ import annotations

try:
    import tensorflow as tf
except ImportError as e:  # pragma: no cover - exercised only without TensorFlow
    raise ImportError(
        "asyncckpt.tf needs TensorFlow; install it with: pip install 'asyncckpt[tf]'"
    ) from e

try:
    from tensorflow.python.checkpoint import checkpoint_management, save_util, tensor_callable
    from tensorflow.python.eager import context
    from tensorflow.python.eager import executor as eager_executor
    from tensorflow.python.ops import gen_io_ops
    from tensorflow.python.trackable import base as trackable_base
    from tensorflow.python.training.saving import saveable_object
except ImportError as e:  # pragma: no cover - only on an untested TensorFlow
    raise ImportError(
        f"asyncckpt.tf does not support TensorFlow {tf.__version__}: an internal module it "
        f"needs has moved ({e}). Supported: TensorFlow 2.21."
    ) from e

OBJECT_GRAPH_KEY: str = trackable_base.OBJECT_GRAPH_PROTO_KEY
SaveSpec = saveable_object.SaveSpec
# A lazy reader of a variable's value, what variables serialize to.
TensorCallable = tensor_callable.Callable


def graph_view_of(checkpoint: tf.train.Checkpoint):
    """The object-graph view ``tf.train.Checkpoint`` itself saves from."""
    try:
        return checkpoint._saver._graph_view
    except AttributeError as e:  # pragma: no cover
        raise RuntimeError(
            f"TensorFlow {tf.__version__} changed tf.train.Checkpoint internals; "
            "asyncckpt.tf supports TensorFlow 2.21"
        ) from e


def serialize_graph(checkpoint: tf.train.Checkpoint):
    """Returns ``(serialized_tensors, registered_savers, object_graph_proto)``.

    ``serialized_tensors`` maps each trackable to ``{checkpoint_key: value}`` or
    ``{checkpoint_key: {slice_spec: value}}``, where a value is a tensor or a
    ``SaveSpec`` whose ``tensor`` reads it; exactly what TensorFlow would save.
    """
    tensors, _, registered, proto = save_util.serialize_graph_view(graph_view_of(checkpoint))
    return tensors, registered, proto


def list_trackables(checkpoint: tf.train.Checkpoint) -> list:
    """Every object reachable from the checkpoint, breadth first."""
    objects, _ = graph_view_of(checkpoint).breadth_first_traversal()
    return objects


def save_v2(prefix: str, names: list[str], slices: list[str], tensors: list) -> None:
    """Writes one TensorFlow tensor bundle (``prefix.index`` + one data file)."""
    with tf.device("CPU:0"):
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


def is_tpu_embedding(obj: object) -> bool:
    """Whether ``obj`` is a TPU embedding whose tables live in device memory."""
    for module, name in (
        ("tensorflow.python.tpu.tpu_embedding_v2", "TPUEmbedding"),
        ("tensorflow.python.tpu.tpu_embedding_v3", "TPUEmbeddingV2"),
    ):
        import sys

        mod = sys.modules.get(module)
        cls = getattr(mod, name, None) if mod is not None else None
        if cls is not None and isinstance(obj, cls):
            return True
    return False
