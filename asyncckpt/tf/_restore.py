"""Fast restore of TensorFlow-native checkpoints that carry an asyncckpt manifest.

TensorFlow's own restore, after asyncckpt has verified the files, reads
every byte twice: once for the manifest's CRC32 check and once in
TensorFlow's ``RestoreV2`` (one thread per device, with its own CRC32C of
every tensor). Here the bytes are read once, and only the ones restored:

1. the ``.index`` file is read, checked against the manifest and parsed
   (``_bundleread.open_bundle``): each tensor's dtype, shape, data file,
   offset and TensorFlow CRC32C; every file's size is checked;
2. the tensors this restore will ask for are predicted from the live
   objects (``_bundleread.predict``: TensorFlow's own matching of the
   checkpoint's object graph to them). If that is every tensor (a full
   restore), every tensor is read as before: in parallel, straight into
   NumPy arrays (``engine.reads``), each piece CRC'd by the thread that
   read it, the pieces' CRCs combined into each tensor's CRC32C (checked
   against the index) and each data file's checksum (checked against the
   manifest), which also covers bytes no tensor holds. Otherwise (a
   partial restore: a model without its optimizer) only the predicted
   tensors and the object graph are read, each checked against its
   CRC32C from the index; the rest of the files is not read, so damage
   there goes unnoticed, as in TensorFlow's own restore. All of this is
   checked before anything is assigned;
3. TensorFlow's own restore then runs unchanged (object matching, slot
   variables, deferred restorations, ``assert_consumed``), except that its
   ``RestoreV2`` calls for this checkpoint on this thread get those arrays
   instead of reading the files again. A tensor it asks for that was not
   read (a wrong prediction) is read in that ``RestoreV2`` call and checked
   before the call returns, so nothing is ever assigned unverified bytes;
   tensors of one call are all checked before any of them is returned.
4. After ``restore`` returns, restorations TensorFlow defers until objects
   are created (an optimizer's slots at its first step) are read and
   checked the same way, on any thread, for as long as TensorFlow keeps
   that restore (``Serving.keep``) and the ``.index`` is still the file
   checked.

Partial reads need the hardware CRC32C (``reads.has_fast_crc32c``);
without it every restore reads every tensor, checked by the manifest's
whole-file checksum, and TensorFlow reads what was not prefetched itself.

Partitioned variables (``ShardedVariable``) are read here too: their
slices are pieces of the bundle like any tensor, and a ``RestoreV2`` of a
slice (a shard, in whatever number of shards the restore has) or of the
whole tensor is built from the stored slices it overlaps
(``_bundleread.plan``/``assemble``): handed over without a copy when one
stored slice is exactly the one asked for, copied out of the slices
otherwise.

Falls back to the old path (verify the files, then TensorFlow reads them)
for: checkpoints without an asyncckpt manifest (another tool's, verified by
TensorFlow's own CRC32C), graph mode, a ``CheckpointOptions`` with an
``experimental_io_device``, an index this reader does not vouch for (not an
uncompressed bundle, keys or slices other than TensorFlow writes them), and
a manifest that does not list the bundle's files; that is decided before
anything is read from the data files or assigned. Within a restore,
TensorFlow still reads itself: string/variant tensors and the dtypes
``_bundleread.PLAIN`` leaves out (float8, int4, ...; the object graph's
CRC32C is checked here too), a ``RestoreV2`` asking for another dtype than
saved, and a slice the stored slices do not cover (TensorFlow raises).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np

from asyncckpt._engine import fastcrc, reads
from asyncckpt._engine.manifest import Manifest, is_owned, load_manifest, verify_files
from asyncckpt.tf import _bundle, _bundleread
from asyncckpt.tf._bundleread import Bundle, fail, masked
from asyncckpt.tf._compat import tf
from asyncckpt.tf._job import manifest_path

logger = logging.getLogger(__name__)

_masked = masked  # the name tests and older callers use


@dataclass(eq=False)
class Prefetched:
    """The tensors of one checkpoint, read and verified, waiting for ``RestoreV2``.

    Attributes:
        prefix: The checkpoint's prefix (absolute).
        arrays: Checkpoint key -> (dtype, array); entries are handed out once.
        bundle: The verified bundle, which tensors not prefetched are read
            from when TensorFlow asks for them (None: TensorFlow reads them).
        partial: Whether only the predicted tensors were read.
    """

    prefix: str
    arrays: dict[str, tuple[tf.DType, np.ndarray]] = field(default_factory=dict)
    bundle: Bundle | None = None
    partial: bool = False


def _to_tensor(dtype: tf.DType, array: np.ndarray) -> tf.Tensor:
    """A CPU tensor over ``array``'s memory, without a copy where TensorFlow allows it.

    Through DLPack (the array is 64-byte aligned, which TensorFlow requires);
    dtypes NumPy cannot export (bfloat16) go as unsigned integers of the same
    width and are bitcast, which does not copy either. A variable assigned
    such a tensor keeps its buffer, so the bytes read from the file are the
    variable's. Anything DLPack refuses is copied by ``convert_to_tensor``.
    """
    from tensorflow.experimental import dlpack

    try:
        return dlpack.from_dlpack(array.__dlpack__())
    except Exception:  # a dtype NumPy's or TensorFlow's DLPack does not take
        pass
    try:
        bits = array.view(f"u{array.dtype.itemsize}")
        return tf.bitcast(dlpack.from_dlpack(bits.__dlpack__()), dtype)
    except Exception:
        return tf.convert_to_tensor(array, dtype=dtype)


def prefetch(prefix: str, manifest: Manifest, *, checksums: bool,
             root=None) -> Prefetched | None:
    """Verifies the checkpoint against its manifest while reading its tensors.

    With ``root`` (the ``tf.train.Checkpoint`` restored into) and a hardware
    CRC32C, when the restore is predicted to ask for only some of the
    tensors (``_bundleread.predict``), only those (and the object graph) are
    read, each checked by TensorFlow's CRC32C from the index (which was
    checked against the manifest first). Otherwise every tensor is read,
    and checked as described in the module docstring: a full restore reads
    every byte anyway, and this also checks the bytes no tensor covers and
    the manifest's whole-file checksums.

    Returns:
        The tensors, or None when this checkpoint is not one the fast path
        reads (the caller then verifies and lets TensorFlow read).

    Raises:
        CorruptCheckpointError: A file is missing, truncated or corrupt.
    """
    bundle = _bundleread.open_bundle(prefix, manifest, checksums=checksums)
    if bundle is None:
        return None
    wanted = None
    if root is not None and (not checksums or reads.has_fast_crc32c()):
        wanted = _bundleread.predict(root, bundle)
    rest = [r for r in manifest.files
            if r.name not in bundle.data_names and r.name != bundle.index_name]
    if wanted is None or bundle.plain_keys() <= wanted:
        out = Prefetched(bundle.prefix, _read_whole(bundle), bundle)
    else:
        graph = {k for k, e in bundle.index.entries.items()
                 if e.dtype == _bundleread.STRING and k not in bundle.index.slices}
        arrays = _bundleread.read_tensors(bundle, (wanted & bundle.plain_keys()) | graph)
        out = Prefetched(bundle.prefix, arrays, bundle, partial=True)
        logger.debug("%s: read %d of %d tensors (the ones this restore asks for)",
                     prefix, len(arrays), len(bundle.plain_keys()))
    verify_files(bundle.directory, rest, checksums=checksums, checkpoint=prefix)
    return out


def _read_whole(bundle: Bundle) -> dict[str, tuple[tf.DType, np.ndarray]]:
    """Reads every tensor, checking every byte of the data files (module docstring)."""
    prefix, index, records = bundle.prefix, bundle.index, bundle.records
    checksums = bundle.checksums
    index_path = os.path.join(bundle.directory, bundle.index_name)
    arrays = {}
    dests: dict[int, list] = {s: [] for s in range(index.num_shards)}
    checked: dict[int, list] = {s: [] for s in range(index.num_shards)}  # entry per dest
    covered = dict.fromkeys(range(index.num_shards), 0)
    strings: list[tuple] = []
    for piece in bundle.all_pieces():  # a partitioned tensor's slices; the others whole
        key, entry = piece.id, piece.entry
        dtype = _bundleread.PLAIN.get(entry.dtype)
        if dtype is None:
            if entry.dtype == tf.string.as_datatype_enum and entry.size:
                # The object graph: read (small) to check its CRC32C, which runs over
                # its encoding; TensorFlow reads it again itself.
                strings.append((entry, bytearray(entry.size)))
                dests[entry.shard_id].append((entry.offset, strings[-1][1]))
                checked[entry.shard_id].append(entry)
                covered[entry.shard_id] += entry.size
            continue  # variants: not covered, so the file is checked by its CRC32
        shape = [d.size for d in entry.shape.dim]
        array = _bundleread.aligned_empty(shape, np.dtype(dtype.as_numpy_dtype), entry.offset)
        if array.nbytes != entry.size:
            raise fail(prefix, index_path, f"records {entry.size} bytes for tensor "
                       f"{key!r} of shape {shape}, {dtype.name} (which needs {array.nbytes})")
        arrays[key] = (dtype, array)
        covered[entry.shard_id] += entry.size
        if entry.size:
            dests[entry.shard_id].append((entry.offset, array.reshape(-1).view(np.uint8)))
            checked[entry.shard_id].append(entry)
    # Each data file is checked by TensorFlow's own CRC32C of every tensor
    # (recorded in the index, which the manifest's checksum has just verified) when
    # the tensors cover the whole file and a hardware CRC32C is installed, and/or
    # by the manifest's checksum of the whole file: when that is CRC32C too, both
    # come from the same per-piece CRCs (combined), so both are checked.
    file_reads = []
    by_entries: set[int] = set()  # shards checked tensor by tensor
    try:
        for shard, name in enumerate(bundle.data_names):
            rec = records[name]
            tiled = covered[shard] == rec.size
            entries = tiled and reads.has_fast_crc32c()
            whole = rec.crc is not None and (not entries or rec.algorithm == fastcrc.CRC32C)
            if entries:
                by_entries.add(shard)
            file_reads.append(reads.FileRead(
                os.path.join(bundle.directory, name), rec.size, dests[shard],
                checksum=checksums and (entries or whole),
                algorithm=fastcrc.CRC32C if entries else rec.algorithm,
                whole_file=whole))
    except ValueError as e:  # overlapping tensors or one past the end: a damaged index
        raise fail(prefix, index_path, f"describes an impossible layout ({e})") from e
    try:
        reads.read_all(file_reads)
    except reads.ShortReadError as e:
        raise fail(prefix, e.path, "is shorter than its manifest records "
                   "(truncated while being read)") from e
    except FileNotFoundError as e:
        raise fail(prefix, e.filename, "is missing") from e
    for shard, fr in enumerate(file_reads):
        if fr.checksum and shard in by_entries:
            for entry, encoded in strings:
                if entry.shard_id == shard:
                    _bundleread.check_string(bundle, fr.path, entry, encoded)
            for entry, crc in zip(checked[shard], fr.dest_crcs, strict=True):
                if entry.dtype not in _bundleread.PLAIN:
                    continue
                if masked(crc) != entry.crc32c:
                    raise fail(prefix, fr.path, f"fails the CRC32C check of the tensor at "
                               f"byte {entry.offset} (stored {entry.crc32c:#010x}, computed "
                               f"{masked(crc):#010x})")
    for fr, name in zip(file_reads, bundle.data_names, strict=True):
        rec = records[name]
        if fr.whole_file and fr.crc != rec.crc:
            raise fail(prefix, fr.path, f"fails its {rec.mismatch(fr.crc)}")
    return arrays


def prepared(prefix: str, *, checksums: bool, options, verify, root=None) -> Serving:
    """Verifies ``prefix`` and returns the context its TensorFlow restore runs in.

    The fast path when it applies (see the module docstring), else
    ``verify(prefix, checksums=...)`` and a context that changes nothing.
    ``root``: the ``tf.train.Checkpoint`` restored into, whose objects
    say which tensors the restore will ask for.
    """
    fast = None
    manifest = None
    io_device = getattr(options, "experimental_io_device", None) if options else None
    if os.path.exists(prefix + ".index"):
        owned = is_owned(prefix, marker_suffix=".index")
        manifest = load_manifest(manifest_path(prefix), checkpoint=prefix, owned=owned)
        if manifest is not None and not io_device and tf.executing_eagerly():
            fast = prefetch(prefix, manifest, checksums=checksums, root=root)
    if fast is None:
        verify(prefix, checksums=checksums)
        # TensorFlow's reader trusts the index: it gets none that asks for the impossible.
        _bundle.check_for_reader(prefix, data_sizes=None if manifest is None else {
            r.name: r.size for r in manifest.files})
    return Serving(fast)


# -- Serving TensorFlow's RestoreV2 from the prefetched arrays -----------------

_active = threading.local()  # .source: the Prefetched this thread's restore reads from
_hook_lock = threading.Lock()
_hook_users = 0
_original_restore_v2 = None
# Prefix -> sources kept for the deferred restorations of restores that returned.
_kept: dict[str, list[Prefetched]] = {}
_released: collections.deque = collections.deque()  # kept sources TensorFlow dropped


def _as_str(x) -> str | None:
    if isinstance(x, bytes):
        return x.decode()
    if isinstance(x, str):
        return x
    if tf.is_tensor(x) and x.dtype == tf.string and x.shape.rank == 0 and hasattr(x, "numpy"):
        return x.numpy().decode()
    return None


def _source_for(path: str) -> Prefetched | None:
    source: Prefetched | None = getattr(_active, "source", None)
    if source is not None and source.prefix == path:
        return source
    if _released:
        _hook(0)  # forget restores TensorFlow dropped
    with _hook_lock:
        kept = list(_kept.get(path, ()))
    for source in reversed(kept):  # the newest restore of this prefix first
        if source.bundle.current():
            return source
    return None


def _restore_v2(prefix, tensor_names, shape_and_slices, dtypes, name=None):
    """``io_ops.restore_v2`` that answers from prefetched or freshly read, verified arrays."""
    original = _original_restore_v2
    if not tf.executing_eagerly():
        return original(prefix, tensor_names, shape_and_slices, dtypes, name=name)
    path = _as_str(prefix)
    names = [_as_str(n) for n in tensor_names] if isinstance(tensor_names, (list, tuple)) else None
    slices = ([_as_str(s) for s in shape_and_slices]
              if isinstance(shape_and_slices, (list, tuple)) else None)
    source = _source_for(os.path.abspath(path)) if path is not None else None
    if source is None or names is None or slices is None:
        return original(prefix, tensor_names, shape_and_slices, dtypes, name=name)
    out: list = [None] * len(names)
    planned: dict[int, _bundleread.Request] = {}
    missing = []
    bundle = source.bundle
    for i, (key, spec, dtype) in enumerate(zip(names, slices, dtypes, strict=True)):
        have = source.arrays.get(key) if not spec else None
        if have is not None and tf.as_dtype(dtype).base_dtype == have[0]:
            del source.arrays[key]  # handed over: TensorFlow's tensor owns the memory now
            out[i] = _to_tensor(*have)
            continue
        request = _bundleread.plan(bundle, key, spec, dtype) if bundle is not None else None
        if request is None or (any(p.id not in source.arrays for p in request.pieces)
                               and not bundle.readable(key, dtype)):
            missing.append(i)
        else:
            planned[i] = request
    if planned:
        _answer(source, planned, out)
    if missing:
        got = original(prefix, [names[i] for i in missing], [slices[i] for i in missing],
                       [dtypes[i] for i in missing], name=name)
        for i, t in zip(missing, got, strict=True):
            out[i] = t
    return out


def _answer(source: Prefetched, planned: dict[int, _bundleread.Request], out: list) -> None:
    """Fills ``out[i]`` for each planned request, from prefetched pieces or pieces read now.

    Pieces not prefetched (a wrong prediction, a deferred restoration) are
    read and verified before any tensor of the call is made. A piece that
    is exactly one request's slice, and used by no other request of the
    call, is handed over without a copy (and leaves ``source``); other
    slices are copied out of the pieces they overlap (a restore into
    another number of shards), which stay for later calls.
    """
    uses = collections.Counter(p.id for r in planned.values() for p in r.pieces)
    absent = {p.id: p for r in planned.values() for p in r.pieces if p.id not in source.arrays}
    fresh = _bundleread.read_pieces(source.bundle, absent.values()) if absent else {}
    if absent:
        logger.debug("%s: read %d pieces TensorFlow asked for", source.prefix, len(absent))

    def array_of(piece_id):
        have = fresh.get(piece_id)
        return (have if have is not None else source.arrays[piece_id])[1]

    for i, request in planned.items():
        if request.exact and uses[request.pieces[0].id] == 1:
            piece_id = request.pieces[0].id
            array = fresh.pop(piece_id, None)
            array = array if array is not None else source.arrays.pop(piece_id)
            out[i] = _to_tensor(request.dtype, array[1].reshape(request.target.shape))
        else:
            out[i] = _to_tensor(request.dtype, _bundleread.assemble(request, array_of))


def _hook(delta: int) -> None:
    """Installs the ``RestoreV2`` hook for its first user; removes it after its last."""
    global _hook_users, _original_restore_v2
    from tensorflow.python.ops import io_ops

    with _hook_lock:
        delta -= _drain()
        if _hook_users == 0 and delta > 0:
            _original_restore_v2 = io_ops.restore_v2
            io_ops.restore_v2 = _restore_v2
        _hook_users += delta
        if _hook_users == 0 and delta and io_ops.restore_v2 is _restore_v2:
            io_ops.restore_v2 = _original_restore_v2  # (unless someone replaced it since)


def _release(source: Prefetched) -> None:
    """Finalizer of a kept restore's coordinator: takes no lock (it runs where GC runs)."""
    _released.append(source)


def _drain() -> int:
    """Forgets the kept restores TensorFlow dropped; returns how many (``_hook_lock`` held)."""
    n = 0
    while _released:
        source = _released.popleft()
        kept = _kept.get(source.prefix, [])
        if source in kept:
            kept.remove(source)
        if not kept:
            _kept.pop(source.prefix, None)
        n += 1
    return n


class Serving:
    """While entered, this thread's ``RestoreV2`` of the checkpoint is answered by us.

    TensorFlow's ``io_ops.restore_v2`` is replaced only while some thread is
    inside such a context or some kept restore lives (``keep``); other
    threads (outside kept restores), other checkpoints, and the tensors this
    reader leaves to TensorFlow (module docstring) go to the original. A
    context without a source changes nothing.
    """

    def __init__(self, source: Prefetched | None):
        self.source = source
        self._previous = None

    def __enter__(self) -> Serving:
        if self.source is not None:
            _hook(+1)
            self._previous = getattr(_active, "source", None)
            _active.source = self.source
        return self

    def __exit__(self, *exc) -> None:
        if self.source is not None:
            _active.source = self._previous
            self.source.arrays.clear()
            _hook(-1)

    def keep(self, status) -> None:
        """Serves the deferred restorations of ``status`` too, while TensorFlow keeps it.

        Objects created after the restore returned get their values when
        they are created (TensorFlow's deferred restoration); their tensors
        are then read and verified here like the ones not predicted, as long
        as the ``.index`` is the file verified (else TensorFlow reads them,
        checking its own CRC32C). Held until TensorFlow drops the restore's
        coordinator (the load status and every pending deferred restoration).
        """
        from asyncckpt.tf import _compat

        coordinator = _compat.restore_coordinator(status)
        if self.source is None or self.source.bundle is None or coordinator is None:
            return
        # Its own (empty) arrays: the prefetched ones are this thread's until the exit.
        source = Prefetched(self.source.prefix, bundle=self.source.bundle,
                            partial=self.source.partial)
        _hook(+1)
        with _hook_lock:
            _kept.setdefault(source.prefix, []).append(source)
        try:
            weakref.finalize(coordinator, _release, source)
        except TypeError:  # pragma: no cover - a coordinator without weak references
            _release(source)


def serving(source: Prefetched) -> Serving:
    """The context in which this thread's ``RestoreV2`` of ``source.prefix`` uses ``source``."""
    return Serving(source)
