"""Reading a directory's ``checkpoint`` state file, and rebuilding a damaged one.

TensorFlow's ``get_checkpoint_state`` ignores a state file it cannot parse
(a flipped bit, a truncated or garbage file: a manager then starts from
scratch while every checkpoint is intact), raises ``UnicodeDecodeError`` on
bytes that are not UTF-8, blocks on a FIFO, and follows whatever paths the
file names, in the directory or not. ``read_state`` reads it as TensorFlow
does when it is whole, and otherwise rebuilds the state from the committed
checkpoints on disk, with a warning naming the file and what is wrong (one
that parses but whose latest checkpoint is not there is rebuilt too, when
anything committed is there to rebuild it from):

* a checkpoint is committed when asyncckpt's manifest is there, readable,
  covers its ``.index``, and every file it lists has its recorded size
  (looked at, not read: the restore verifies checksums, and skips a
  checkpoint that fails them);
* the order and timestamps are the manifests' (``created``, the commit);
* the managed list is what managers wrote (``MANAGED_KEY`` in the
  manifest), the latest the newest committed one.

A state file naming a checkpoint outside its directory is damaged too: its
entries are never followed there. The rebuilt state is not written back: a
reader does not write, and a manager writes its state file again at its
next commit.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from asyncckpt import layout
from asyncckpt._engine import contained
from asyncckpt._engine.manifest import read_manifest, verify_files
from asyncckpt.errors import CorruptCheckpointError
from asyncckpt.tf import _compat

logger = logging.getLogger(__name__)

# In the manifest's ``extra`` of every checkpoint a manager saves (``_dirview`` writes it).
MANAGED_KEY = "managed"


def _damage(directory: str, filename: str) -> tuple[object | None, str | None]:
    """The parsed state file (paths joined to ``directory``, as TensorFlow's), what is wrong.

    ``(None, None)``: no state file. A state file that parses but whose
    latest checkpoint is not there comes with its problem.
    """
    path = os.path.join(directory, filename)
    try:
        data = contained.read_file(path, checkpoint=directory)
    except FileNotFoundError:
        return None, None
    except (CorruptCheckpointError, OSError) as e:
        return None, str(e)
    try:
        state = _compat.parse_checkpoint_state(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 text ({e})"
    except ValueError as e:
        return None, str(e)
    if not state.model_checkpoint_path:
        return None, "it names no latest checkpoint"
    for i, p in enumerate([state.model_checkpoint_path, *state.all_model_checkpoint_paths]):
        if contained.inside(directory, p) is None:
            return None, f"it names {p!r}, which is not in {directory!r}"
        full = os.path.join(directory, p)  # TensorFlow's spelling: relative to the directory
        if i == 0:
            state.model_checkpoint_path = full
        else:
            state.all_model_checkpoint_paths[i - 1] = full
    latest = state.model_checkpoint_path
    if not (os.path.exists(latest + layout.TF_INDEX_SUFFIX) or os.path.isfile(latest)):
        # (damaged, or its files deleted by hand: rebuilt if anything is committed there)
        return state, f"the latest checkpoint it names, {latest!r}, is not there"
    return state, None


@dataclass(frozen=True)
class _Committed:
    created: float
    name: str
    managed: bool


def committed_checkpoints(directory: str) -> list[tuple[str, float, bool]]:
    """``(name, commit time, written by a manager)`` of every committed checkpoint, oldest first.

    Committed: its asyncckpt manifest is readable, lists its ``.index``, and
    every file it lists is there with its recorded size.
    """
    found = []
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for entry in entries:
        if not entry.name.endswith(layout.TF_INDEX_SUFFIX):
            continue
        name = entry.name[: -len(layout.TF_INDEX_SUFFIX)]
        prefix = os.path.join(directory, name)
        try:
            if not entry.is_file():
                continue
            manifest = read_manifest(layout.tf_manifest_path(prefix), checkpoint=prefix)
            if (manifest.framework != "tensorflow"
                    or entry.name not in {r.name for r in manifest.files}):
                continue
            verify_files(directory, manifest.files, checksums=False, checkpoint=prefix)
        except (OSError, CorruptCheckpointError):
            continue
        found.append(_Committed(float(manifest.created), name,
                                bool(manifest.extra.get(MANAGED_KEY))))
    found.sort(key=lambda c: (c.created, layout.tf_step_of(c.name) or -1, c.name))
    return [(c.name, c.created, c.managed) for c in found]


def rebuild(directory: str):
    """A ``CheckpointState`` of the committed checkpoints in ``directory`` (module docstring).

    None when nothing is committed there.
    """
    found = committed_checkpoints(directory)
    if not found:
        return None
    latest = found[-1][0]
    listed = [(n, t) for n, t, managed in found if managed and n != latest] + [found[-1][:2]]
    stamps = [t for _, t in listed]
    text = _compat.checkpoint_state_text(
        os.path.abspath(directory), os.path.join(directory, latest),
        [os.path.join(directory, n) for n, _ in listed], stamps,
        # Just before the oldest: every listed checkpoint is retention's to manage.
        min(stamps) - 1.0)
    return _compat.parse_checkpoint_state(text)


def read_state(directory: str, latest_filename: str | None = None):
    """The directory's ``CheckpointState``, as ``tf.train.get_checkpoint_state`` returns it.

    A damaged state file (module docstring) is rebuilt from the committed
    checkpoints, with a warning; None when there is no state file, or when
    nothing is committed to rebuild it from.
    """
    filename = latest_filename or layout.TF_STATE_FILE
    parsed, problem = _damage(directory, filename)
    if problem is None:
        return parsed
    state = rebuild(directory)
    path = os.path.join(directory, filename)
    if state is None and parsed is not None:
        return parsed  # it parses, and nothing on disk says more: TensorFlow's reading
    if state is None:
        logger.warning("the checkpoint state file %s is damaged (%s) and nothing committed is "
                       "there to rebuild it from: no checkpoint", path, problem)
        return None
    logger.warning("the checkpoint state file %s is damaged (%s): rebuilt from the %d "
                   "committed checkpoint(s) there, the latest %s", path, problem,
                   len(state.all_model_checkpoint_paths), state.model_checkpoint_path)
    return state


def latest_checkpoint(directory: str, latest_filename: str | None = None) -> str | None:
    """``tf.train.latest_checkpoint`` of a local directory, over ``read_state``.

    The latest checkpoint the state file names if its files are there
    (TensorFlow's rule: a V2 ``.index``, or a V1 file of that name), a
    rebuilt state's latest if the state file is damaged; None otherwise.
    """
    state = read_state(directory, latest_filename)
    if state is None or not state.model_checkpoint_path:
        return None
    path = state.model_checkpoint_path
    if os.path.exists(path + layout.TF_INDEX_SUFFIX) or os.path.isfile(path):
        return path
    logger.error("Couldn't match files for checkpoint %s", path)
    return None
