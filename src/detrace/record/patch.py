"""Replacing an attribute for the life of a tracer, and putting it back."""

from __future__ import annotations

from collections.abc import Callable
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
