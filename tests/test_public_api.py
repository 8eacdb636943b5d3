"""The public API: each namespace's ``__all__``, as documented, and every deprecated spelling.

``docs/architecture.md`` ("Public API") lists each namespace's names with why
each is public, and the spellings that left in asyncckpt 0.2 with where they
went. Pinned here: each ``__all__`` is the documented list and every name in
it resolves; each old spelling still works for one release and warns
(``DeprecationWarning``) at the line that used it; every error asyncckpt
defines is an ``AsyncCkptError``. Cheap: one TensorFlow/JAX/Keras import,
no training, a few tiny saves.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pathlib
import pkgutil
import re
import sys
import warnings

import numpy as np
import pytest

import asyncckpt

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: Each namespace's public names: what docs/architecture.md lists and ``__all__`` says.
PUBLIC = {
    "asyncckpt": {
        "AsyncCkptError", "AsyncOptions", "CheckpointNotFoundError", "CoordinationError",
        "CoordinationTimeoutError", "CorruptCheckpointError", "DirectoryLockedError",
        "EngineClosedError", "HostMemoryError", "PeerFailedError", "RestoreOptions",
        "SaveHandle", "SaveStats", "UnsupportedObjectError", "__version__",
    },
    "asyncckpt.tf": {
        "Checkpoint", "CheckpointManager", "PartialRestore", "latest_checkpoint",
        "verify_checkpoint",
    },
    "asyncckpt.jax": {
        "PLACEHOLDER", "AsyncCheckpointer", "CheckpointManager", "Checkpointer", "FormatOptions",
        "PyTreeCheckpointer", "RootMetadata", "StandardCheckpointer", "StepAlreadyExistsError",
        "StepMetadata",
    },
    "asyncckpt.keras": {
        "BackupAndRestore", "BackupOptions", "ModelCheckpoint", "PreemptionOptions",
        "ResumableDataset",
    },
    "asyncckpt.jobrunner": {"EpochStats", "JobOptions", "JobRunner", "Restored", "UploadError"},
    "asyncckpt.preemption": {
        "AgreementOptions", "GraceOptions", "Platform", "PreemptionCheckpointHandler",
        "PreemptionSave", "TerminationConfig", "detect_platform",
    },
    "asyncckpt.storage": {"RemoteOptions", "RetryPolicy", "StorageError", "UnsupportedURLError"},
}

#: Names that left a namespace in 0.2: old spelling -> where the object lives now.
MOVED = {
    "asyncckpt.JobRunner": "asyncckpt.jobrunner.JobRunner",
    "asyncckpt.RetentionPolicy": "asyncckpt._engine.retention.RetentionPolicy",
    "asyncckpt.tf.CheckpointNotFoundError": "asyncckpt.tf.checkpoint.CheckpointNotFoundError",
    "asyncckpt.jax.CoordinationError": "asyncckpt.CoordinationError",
    "asyncckpt.preemption.CoordinationError": "asyncckpt.CoordinationError",
    "asyncckpt.preemption.CoordinationTimeoutError": "asyncckpt.CoordinationTimeoutError",
    "asyncckpt.preemption.PeerFailedError": "asyncckpt.PeerFailedError",
    "asyncckpt.jobrunner.ArrayStore": "asyncckpt.jobrunner.store.ArrayStore",
    "asyncckpt.jobrunner.select_names": "asyncckpt.jobrunner.store.select_names",
    "asyncckpt.storage.AlreadyExistsError": "asyncckpt.storage.base.AlreadyExistsError",
    "asyncckpt.storage.ObjectInfo": "asyncckpt.storage.base.ObjectInfo",
    "asyncckpt.storage.ObjectStore": "asyncckpt.storage.base.ObjectStore",
    "asyncckpt.storage.open_store": "asyncckpt.storage.stores.open_store",
    "asyncckpt.storage.RemoteTier": "asyncckpt.storage.tier.RemoteTier",
    "asyncckpt.storage.TieredDirectory": "asyncckpt.storage.tier.TieredDirectory",
    "asyncckpt.storage.SUPPORTED_SCHEMES": "asyncckpt.storage.url.SUPPORTED_SCHEMES",
    "asyncckpt.storage.Location": "asyncckpt.storage.url.Location",
    "asyncckpt.storage.is_url": "asyncckpt.storage.url.is_url",
    "asyncckpt.storage.parse_location": "asyncckpt.storage.url.parse_location",
}

#: What ``asyncckpt.engine`` listed before it became ``asyncckpt._engine`` (28 names).
ENGINE_NAMES = {
    "AsyncEngine": "writer", "Candidate": "retention", "Decision": "retention",
    "DurableWriter": "files", "FileRecord": "files", "Manifest": "manifest",
    "RetentionPolicy": "retention", "SaveHandle": "writer", "SaveJob": "_jobs",
    "SaveStats": "metrics", "Slot": "slots", "StagingPool": "slots",
    "WriteTimeEstimator": "metrics", "cleanup_stale_temps": "commit",
    "directory_guard": "commit", "ensure_writable_dir": "commit", "forget_temp": "commit",
    "has_owner_marker": "manifest", "is_owned": "manifest", "is_temp_name": "commit",
    "load_manifest": "manifest", "make_temp_dir": "commit", "publish_dir": "commit",
    "publish_files": "commit", "read_manifest": "manifest", "remove_tree": "commit",
    "verify_files": "manifest", "write_text_atomic": "commit",
}

#: Renamed members: (class, old, new, kind), kind "method", "property" or "keyword".
RENAMED = [
    ("asyncckpt._engine.writer.AsyncEngine", "sync", "wait_until_finished", "method"),
    ("asyncckpt._engine.writer.AsyncEngine", "estimated_write_seconds", "estimated_write_s",
     "property"),
    ("asyncckpt.jobrunner.store.ArrayStore", "sync", "wait_until_finished", "method"),
    ("asyncckpt.keras.ModelCheckpoint", "sync", "wait_until_finished", "method"),
    ("asyncckpt.storage.tier.RemoteTier", "wait", "wait_until_finished", "method"),
    ("asyncckpt.storage.tier.TieredDirectory", "wait", "wait_until_finished", "method"),
    ("asyncckpt.RestoreOptions", "verify_checksums", "checksums", "keyword"),
    ("asyncckpt.storage.RemoteOptions", "every_seconds", "every_s", "keyword"),
    ("asyncckpt.jobrunner.Restored", "seconds", "restore_s", "keyword"),
]


def _resolve(dotted: str):
    """The object a dotted name names (a module attribute, a class attribute)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


@pytest.fixture(scope="module", autouse=True)
def _frameworks():
    # Every namespace imported once (TensorFlow, JAX, Keras), outside the timed checks.
    for name in PUBLIC:
        importlib.import_module(name)


def _documented() -> tuple[dict[str, set[str]], dict[str, str]]:
    """docs/architecture.md's "Public API": names per namespace, and old -> new spellings."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## Public API\n", 1)[1].split("\n## ", 1)[0]
    listed: dict[str, set[str]] = {}
    renamed: dict[str, str] = {}
    for part in section.split("\n### ")[1:]:
        heading, _, body = part.partition("\n")
        cells = [[c.strip() for c in line.strip("|").split("|")]
                 for line in body.splitlines()
                 if line.startswith("| ") and not line.startswith("| ---")][1:]
        namespace = re.match(r"`([a-z._]+)` \(\d+ names\)$", heading)
        if namespace:
            listed[namespace.group(1)] = {re.fullmatch(r"`([^`]+)`", row[0]).group(1)
                                          for row in cells}
            count = int(re.search(r"\((\d+) names\)", heading).group(1))
            assert count == len(cells), heading
        elif heading.startswith("Old spellings"):  # `old` | `new` | why
            renamed.update({re.fullmatch(r"`([^`]+)`", row[0]).group(1):
                            re.fullmatch(r"`([^`]+)`", row[1]).group(1) for row in cells})
    return listed, renamed


def test_each_namespace_lists_the_documented_names_and_they_resolve():
    listed, _ = _documented()
    assert listed == PUBLIC
    for namespace, names in PUBLIC.items():
        module = importlib.import_module(namespace)
        assert set(module.__all__) == names, namespace
        assert len(module.__all__) == len(names), f"{namespace}: a name listed twice"
        for name in names:
            assert getattr(module, name) is not None
    assert sum(map(len, PUBLIC.values())) == 51  # 94 names in 8 namespaces before 0.2


def test_every_name_is_in_one_namespace_only():
    """One spelling per concept: no name listed by two namespaces (a class has one home)."""
    homes: dict[int, list[str]] = {}
    for namespace, names in PUBLIC.items():
        for name in names - {"__version__"}:
            homes.setdefault(id(getattr(importlib.import_module(namespace), name)), []).append(
                f"{namespace}.{name}")
    assert [h for h in homes.values() if len(h) > 1] == []


def test_the_docs_table_of_old_spellings_is_what_this_test_checks():
    _, renamed = _documented()
    expected = {old: new for old, new in MOVED.items()}
    expected.update({f"asyncckpt.engine.{n}": f"asyncckpt._engine.{m}.{n}"
                     for n, m in ENGINE_NAMES.items() if n not in ("SaveHandle", "SaveStats")})
    expected.update({"asyncckpt.engine.SaveHandle": "asyncckpt.SaveHandle",
                     "asyncckpt.engine.SaveStats": "asyncckpt.SaveStats",
                     "asyncckpt.engine": "asyncckpt._engine"})
    short = {"asyncckpt._engine.writer.AsyncEngine": "AsyncEngine",
             "asyncckpt.jobrunner.store.ArrayStore": "ArrayStore",
             "asyncckpt.keras.ModelCheckpoint": "ModelCheckpoint",
             "asyncckpt.storage.tier.RemoteTier": "RemoteTier",
             "asyncckpt.storage.tier.TieredDirectory": "TieredDirectory",
             "asyncckpt.RestoreOptions": "RestoreOptions",
             "asyncckpt.storage.RemoteOptions": "RemoteOptions",
             "asyncckpt.jobrunner.Restored": "Restored"}
    for owner, old, new, kind in RENAMED:
        suffix = "()" if kind == "method" else ""
        expected[f"{short[owner]}.{old}{suffix}"] = f"{short[owner]}.{new}{suffix}"
    docs_engine = {k: v for k, v in renamed.items() if k.startswith("asyncckpt.engine.")}
    assert {k: v for k, v in renamed.items() if k not in docs_engine} == {
        k: v for k, v in expected.items() if not k.startswith("asyncckpt.engine.")}
    # The engine's 28 names are documented as one row each, pointing at their module.
    assert docs_engine == {k: v for k, v in expected.items() if k.startswith("asyncckpt.engine.")}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_name_that_left_its_namespace_warns_and_still_works(old):
    namespace, _, name = old.rpartition(".")
    module = importlib.import_module(namespace)
    assert name not in module.__all__
    with pytest.warns(DeprecationWarning, match=rf"{re.escape(old)} is deprecated .* 0\.3") as w:
        obj = getattr(module, name)
    assert w[0].filename == __file__  # the warning points at the line that used it
    assert obj is _resolve(MOVED[old])


def test_from_import_of_a_moved_name_warns_at_the_import_line():
    with pytest.warns(DeprecationWarning, match="asyncckpt.JobRunner") as w:
        from asyncckpt import JobRunner  # noqa: F401  (the old spelling, on purpose)
    assert w[0].filename == __file__
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        asyncckpt.NoSuchName  # noqa: B018


def test_the_engine_shim_warns_and_hands_out_the_private_engine(monkeypatch):
    for name in [m for m in sys.modules if m == "asyncckpt.engine"
                 or m.startswith("asyncckpt.engine.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(asyncckpt, "engine", raising=False)
    with pytest.warns(DeprecationWarning, match=r"asyncckpt\.engine is deprecated") as w:
        import asyncckpt.engine.writer as writer  # the old module path, on purpose
    assert w[0].filename == __file__
    assert sys.modules["asyncckpt.engine.writer"] is importlib.import_module(
        "asyncckpt._engine.writer")
    assert writer is sys.modules["asyncckpt._engine.writer"]
    engine = sys.modules["asyncckpt.engine"]
    for name, module in ENGINE_NAMES.items():
        with pytest.warns(DeprecationWarning, match=rf"asyncckpt\.engine\.{name} is deprecated"):
            obj = getattr(engine, name)
        assert obj is getattr(importlib.import_module(f"asyncckpt._engine.{module}"), name)
    with pytest.warns(DeprecationWarning, match="use asyncckpt.SaveStats"):
        assert engine.SaveStats is asyncckpt.SaveStats
    from asyncckpt.engine.commit import publish_dir  # warned once, at the first import

    assert publish_dir is importlib.import_module("asyncckpt._engine.commit").publish_dir
    with pytest.raises(AttributeError):
        engine.NoSuchName  # noqa: B018


def test_the_private_engine_lists_nothing():
    import asyncckpt._engine as private

    assert not hasattr(private, "__all__")
    names = [n for n, v in vars(private).items()
             if not n.startswith("_") and not inspect.ismodule(v)]  # its modules, once loaded
    assert names == []


def _renamed_member(owner: str, old: str):
    cls = _resolve(owner)
    return cls, inspect.getattr_static(cls, old)


@pytest.mark.parametrize(("owner", "old", "new", "kind"), RENAMED,
                         ids=[f"{o.rsplit('.', 1)[1]}.{old}" for o, old, _, _ in RENAMED])
def test_a_renamed_member_is_documented_deprecated(owner, old, new, kind):
    cls, member = _renamed_member(owner, old)
    assert "Deprecated spelling" in (member.__doc__ or "")
    if kind == "keyword":
        assert new in {f.name for f in dataclasses.fields(cls)}  # the fields know the new name
        assert old not in {f.name for f in dataclasses.fields(cls)}
        assert old not in inspect.signature(cls).parameters
    else:
        assert callable(getattr(cls, new)) if kind == "method" else hasattr(cls, new)


def _warns_here(old: str):
    return pytest.warns(DeprecationWarning, match=rf"{re.escape(old)}.* is deprecated .* 0\.3")


def test_renamed_waits_warn_and_still_wait(tmp_path):
    from asyncckpt.jobrunner.store import ArrayStore
    from asyncckpt.storage.tier import RemoteTier, TieredDirectory

    with ArrayStore(tmp_path / "store") as store:
        handle = store.save(1, {"w": np.arange(4.0)})
        with _warns_here("ArrayStore.sync()") as w:
            store.sync()
        assert w[0].filename == __file__
        assert handle.done()  # it waited: the save is durable
        with _warns_here("AsyncEngine.sync()"):
            store.engine.sync(timeout=60)
        with _warns_here("AsyncEngine.estimated_write_seconds"):
            assert store.engine.estimated_write_seconds == store.engine.estimated_write_s
        assert store.engine.estimated_write_s is not None
    tier = RemoteTier(str(tmp_path / "remote"))
    with _warns_here("RemoteTier.wait()"):
        tier.wait(5.0, raise_errors=False)  # keywords are passed on
    tier.close()
    tiered = TieredDirectory(tmp_path / "local", remote=str(tmp_path / "remote2"))
    with _warns_here("TieredDirectory.wait()"):
        tiered.wait(5.0)
    tiered.close()


def test_model_checkpoint_sync_warns_and_waits(tmp_path):
    import asyncckpt.keras as ak

    callback = ak.ModelCheckpoint(str(tmp_path / "m.weights.h5"), save_weights_only=True)
    with _warns_here("ModelCheckpoint.sync()") as w:
        callback.sync()  # nothing saved yet: returns at once
    assert w[0].filename == __file__


def test_renamed_keywords_warn_and_still_set_the_new_field(tmp_path):
    from asyncckpt.jobrunner import JobOptions, JobRunner
    from asyncckpt.storage import RemoteOptions

    with _warns_here("RestoreOptions(verify_checksums=...)") as w:
        opts = asyncckpt.RestoreOptions(verify_checksums=False)
    assert w[0].filename == __file__
    assert opts == asyncckpt.RestoreOptions(checksums=False)
    with _warns_here("RestoreOptions.verify_checksums"):
        assert opts.verify_checksums is False
    with pytest.raises(TypeError, match="give checksums= only"), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        asyncckpt.RestoreOptions(checksums=True, verify_checksums=False)
    with _warns_here("RemoteOptions(every_seconds=...)"):
        remote = RemoteOptions(every_seconds=30.0)
    assert remote.every_s == 30.0 and remote == RemoteOptions(every_s=30.0)
    with _warns_here("RemoteOptions.every_seconds"):
        assert remote.every_seconds == 30.0

    state = {"w": np.zeros(3)}
    runner = JobRunner(tmp_path / "job", init=lambda: None, epoch=lambda n: None,
                       state=lambda: state, load=lambda arrays: None,
                       options=JobOptions(num_epochs=1))
    runner.run()
    restored = runner.load_parts(1)
    runner.close()
    with _warns_here("Restored.seconds"):
        assert restored.seconds == restored.restore_s >= 0


def test_the_tf_drop_ins_wait_by_both_spellings_without_a_warning(tmp_path):
    import tensorflow as tf

    import asyncckpt.tf as at

    ckpt = at.Checkpoint(v=tf.Variable(1.0))
    manager = at.CheckpointManager(ckpt, str(tmp_path), max_to_keep=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        manager.save()
        manager.wait_until_finished()  # asyncckpt's spelling
        manager.sync()  # TensorFlow's: kept, not deprecated
        ckpt.wait_until_finished(timeout=60)
        ckpt.sync()
    manager.close()
    assert tf.train.latest_checkpoint(str(tmp_path)) == manager.latest_checkpoint


def test_one_wait_spelling_on_every_object_that_saves_in_the_background():
    import asyncckpt.jax as aj
    import asyncckpt.keras as ak
    import asyncckpt.tf as at
    from asyncckpt._engine.writer import AsyncEngine
    from asyncckpt.jobrunner.store import ArrayStore
    from asyncckpt.storage.tier import RemoteTier, TieredDirectory

    for cls in (at.Checkpoint, at.CheckpointManager, aj.CheckpointManager,
                aj.StandardCheckpointer, aj.AsyncCheckpointer, aj.Checkpointer,
                aj.PyTreeCheckpointer, ak.ModelCheckpoint, ArrayStore, AsyncEngine, RemoteTier,
                TieredDirectory):
        assert callable(getattr(cls, "wait_until_finished", None)), cls


def _defined_exceptions():
    """Every exception class a module of asyncckpt defines under a public name."""
    import asyncckpt.jax

    found = {asyncckpt.jax.StepAlreadyExistsError}  # made on first use
    for info in pkgutil.walk_packages(asyncckpt.__path__, "asyncckpt."):
        if info.name == "asyncckpt.engine" or info.name.endswith("__main__"):
            continue  # the deprecation shim (warns), the command
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException)
                    and obj.__module__.startswith("asyncckpt") and not name.startswith("_")):
                found.add(obj)
    return found


def test_every_asyncckpt_error_is_an_asyncckpt_error():
    found = _defined_exceptions()
    assert len(found) >= 20
    outside = sorted(f"{c.__module__}.{c.__qualname__}" for c in found
                     if not issubclass(c, asyncckpt.AsyncCkptError))
    assert outside == []
    # The TensorFlow front end's missing checkpoint is both; so is orbax's step error.
    import tensorflow as tf
    from orbax.checkpoint.checkpoint_manager import StepAlreadyExistsError

    import asyncckpt.jax as aj
    from asyncckpt.tf.checkpoint import CheckpointNotFoundError

    assert issubclass(CheckpointNotFoundError, asyncckpt.CheckpointNotFoundError)
    assert issubclass(CheckpointNotFoundError, tf.errors.NotFoundError)
    assert issubclass(aj.StepAlreadyExistsError, StepAlreadyExistsError)
