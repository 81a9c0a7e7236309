"""Replacing an attribute for the life of a tracer, and putting it back; acting as a module is imported."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable, Sequence
from typing import Any

_MISSING = object()


def replace(owner: Any, name: str, value: Any) -> Callable[[], None]:
    """Set `owner.name = value`; the returned callable restores what was there (or deletes it if nothing was)."""
    previous = owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
    setattr(owner, name, value)

    def undo() -> None:
        if previous is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, previous)

    return undo


class _Loaded(importlib.abc.Loader):
    """A module's own loader, and `action()` once the module is executed."""

    def __init__(self, inner: Any, action: Callable[[], None]) -> None:
        self._inner = inner
        self._action = action

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._inner.exec_module(module)
        try:
            self._action()
        except Exception as err:  # the tracer's own failure must not fail the program's import
            print(f"detrace: what {module.__name__} holds was not wrapped ({type(err).__name__}: {err}); the "
                  "program goes on without it", file=sys.stderr)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loaders of the modules it watches (see `after_import`)."""

    def __init__(self, names: Sequence[str], action: Callable[[], None]) -> None:
        self.names = frozenset(names)
        self.action = action

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname not in self.names:
            return None
        for finder in sys.meta_path:  # the finders after this one, as the import system would ask them
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _Loaded(spec.loader, self.action)
                return spec
        return None


def after_import(names: Sequence[str], action: Callable[[], None]) -> Callable[[], None]:
    """Call `action()` each time one of the modules `names` is imported (after it is executed), for what must be
    wrapped before the program first calls it, in modules the tracer does not import itself (they cost start-up
    time); returns the undo. A module imported already is not waited for: call `action()` too."""
    finder = _AfterImport(names, action)
    sys.meta_path.insert(0, finder)

    def undo() -> None:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)

    return undo
