"""Old spellings kept for one release, each with a ``DeprecationWarning``.

asyncckpt 0.2 gave each concept one spelling and cut the public API to what
a user writes (``docs/architecture.md``, "Public API"). What users may have
written before keeps working until asyncckpt ``REMOVED_IN``, and warns where
it is used:

* a name that left a namespace's ``__all__`` (``moved``: the namespace's
  module ``__getattr__`` returns the object from where it lives now);
* a renamed method (``renamed_method``) or property (``renamed_property``);
* a renamed keyword of an options dataclass (``renamed_fields``: the old
  keyword is accepted by the constructor and the old attribute read);
* the package ``asyncckpt.engine``, now ``asyncckpt._engine``
  (``asyncckpt/engine/__init__.py``).

Nothing in asyncckpt, its benchmarks, examples or tests uses an old spelling
outside a check that it warns: the test suite turns these warnings into
errors where such code triggers them (``pyproject.toml``, ``filterwarnings``),
and ``tests/test_public_api.py`` checks each old spelling.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

REMOVED_IN = "0.3"

T = TypeVar("T")


def message(old: str, new: str) -> str:
    """The warning text: what is deprecated, when it goes, what to write instead."""
    return f"{old} is deprecated and will be removed in asyncckpt {REMOVED_IN}; {new}"


def warn(old: str, new: str, *, stacklevel: int = 2) -> None:
    """Warns that ``old`` is deprecated, at the caller ``stacklevel`` frames up."""
    warnings.warn(message(old, new), DeprecationWarning, stacklevel=stacklevel + 1)


def moved(namespace: str, names: Mapping[str, tuple[str, str | None, str]]
          ) -> Callable[[str], Any]:
    """A module ``__getattr__`` for names that are no longer in ``namespace``'s API.

    Args:
        namespace: The module the names were listed in (``"asyncckpt.storage"``).
        names: ``{old name: (module, attribute, what to write instead)}``; the
            object returned is ``module.attribute`` (the module itself for
            attribute None), imported on first use.
    """

    def __getattr__(name: str, *, stacklevel: int = 1) -> Any:
        # stacklevel: frames between the user's code and this function, for the
        # warning to point at the user's line (2 when another __getattr__ calls it).
        try:
            module, attribute, instead = names[name]
        except KeyError:
            raise AttributeError(f"module {namespace!r} has no attribute {name!r}") from None
        warn(f"{namespace}.{name}", instead, stacklevel=stacklevel + 1)
        found = importlib.import_module(module)
        return found if attribute is None else getattr(found, attribute)

    return __getattr__


def renamed_method(new: str, old: str, owner: str) -> Callable[..., Any]:
    """A method ``old`` that warns, then calls ``self.<new>`` with the same arguments."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        warn(f"{owner}.{old}()", f"use {owner}.{new}()")
        return getattr(self, new)(*args, **kwargs)

    method.__name__ = method.__qualname__ = old
    method.__doc__ = f"Deprecated spelling of ``{new}`` (removed in asyncckpt {REMOVED_IN})."
    return method


def renamed_property(new: str, old: str, owner: str) -> property:
    """A read-only property ``old`` that warns, then reads ``self.<new>``."""

    def getter(self: Any) -> Any:
        warn(f"{owner}.{old}", f"use {owner}.{new}")
        return getattr(self, new)

    return property(getter, doc=f"Deprecated spelling of ``{new}`` "
                                f"(removed in asyncckpt {REMOVED_IN}).")


def renamed_fields(**renames: str) -> Callable[[type[T]], type[T]]:
    """Class decorator (above ``@dataclass``): old keyword -> new field, for one release.

    The constructor takes each old keyword with a warning (giving both the
    old and the new one is a ``TypeError``), and reading the old attribute
    warns and returns the new one. Fields, equality, ``repr`` and
    ``dataclasses.replace`` know only the new names.
    """

    def decorate(cls: type[T]) -> type[T]:
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            for old, new in renames.items():
                if old in kwargs:
                    warn(f"{cls.__name__}({old}=...)", f"use {cls.__name__}({new}=...)")
                    if new in kwargs:
                        raise TypeError(f"{cls.__name__}() got both {new}= and its deprecated "
                                        f"spelling {old}=: give {new}= only")
                    kwargs[new] = kwargs.pop(old)
            init(self, *args, **kwargs)

        cls.__init__ = __init__  # type: ignore[misc]
        for old, new in renames.items():
            setattr(cls, old, renamed_property(new, old, cls.__name__))
        return cls

    return decorate
