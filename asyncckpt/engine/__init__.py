"""Deprecated: the engine is private since asyncckpt 0.2 (``asyncckpt._engine``).

Kept for one release, removed in asyncckpt 0.3. Importing this package warns
(``DeprecationWarning``), and so does each name taken from it; what it gives
is the object itself, from the module of ``asyncckpt._engine`` that defines
it, so ``isinstance`` checks and module state are those of the library:

* the 28 names it listed (``AsyncEngine``, ``SaveHandle``, ``make_temp_dir``, ...);
* its modules, ``asyncckpt.engine.writer`` and the others, which are the
  modules of ``asyncckpt._engine`` under a second name.

The names a user needs are in ``asyncckpt``: ``SaveHandle`` and
``SaveStats``. This is the one module of the package that hands out
another's names without listing them as public API: a documented,
time-limited exception to the rule against re-exports, which
``tests/test_module_boundaries.py`` allows here and nowhere else.
"""

import importlib
import pkgutil
import sys

from asyncckpt import _deprecation, _engine

_INSTEAD = ("asyncckpt's public names are listed in asyncckpt, asyncckpt.tf, asyncckpt.jax, "
            "... (docs/architecture.md, 'Public API'); the engine is private")

# The names this package listed in its __all__ before asyncckpt 0.2, by module.
_MOVED = {
    "_jobs": ("SaveJob",),
    "commit": ("cleanup_stale_temps", "directory_guard", "ensure_writable_dir", "forget_temp",
               "is_temp_name", "make_temp_dir", "publish_dir", "publish_files", "remove_tree",
               "write_text_atomic"),
    "files": ("DurableWriter", "FileRecord"),
    "manifest": ("Manifest", "has_owner_marker", "is_owned", "load_manifest", "read_manifest",
                 "verify_files"),
    "metrics": ("SaveStats", "WriteTimeEstimator"),
    "retention": ("Candidate", "Decision", "RetentionPolicy"),
    "slots": ("Slot", "StagingPool"),
    "writer": ("AsyncEngine", "SaveHandle"),
}
_PUBLIC_NOW = {"SaveStats": "use asyncckpt.SaveStats", "SaveHandle": "use asyncckpt.SaveHandle"}

# stacklevel 2: the code whose import runs this module (warnings skips the
# import machinery's frames).
_deprecation.warn("asyncckpt.engine", _INSTEAD, stacklevel=2)

# asyncckpt.engine.<module> is asyncckpt._engine.<module>: the same module object.
for _info in pkgutil.iter_modules(_engine.__path__):
    sys.modules[f"{__name__}.{_info.name}"] = importlib.import_module(
        f"{_engine.__name__}.{_info.name}")

__getattr__ = _deprecation.moved(__name__, {
    **{name: (f"{_engine.__name__}.{module}", name, _PUBLIC_NOW.get(name, _INSTEAD))
       for module, names in _MOVED.items() for name in names},
    **{info.name: (f"{_engine.__name__}.{info.name}", None, _INSTEAD)
       for info in pkgutil.iter_modules(_engine.__path__)},
})
