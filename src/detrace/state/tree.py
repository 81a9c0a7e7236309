"""The pickle-free codec of a training state: nested state dicts split into JSON and a flat dict of tensors.

A state dict (model, optimizer, scheduler, RNG, data position) is a tree of dicts, lists and tuples whose
leaves are tensors or plain values. `split` turns it into a JSON-able skeleton, where each tensor leaf is
replaced by `{"__tensor__": key}`, and a flat `{key: tensor}` dict that torch.distributed.checkpoint writes.
`join` is the inverse. Nothing here ever needs pickle: tuples and dicts with non-string keys get explicit
JSON forms, and anything else is refused with the path of the offending value.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import torch

from detrace.errors import CheckpointError

# Markers of the JSON forms. A user dict that uses one of these names as a key is stored in the pair-list
# form, so a marker is never ambiguous.
_TENSOR = "__tensor__"
_TUPLE = "__tuple__"
_PAIRS = "__dict__"
_MARKERS = frozenset((_TENSOR, _TUPLE, _PAIRS))

JSON = Any  # str | int | float | bool | None | list[JSON] | dict[str, JSON]


MAX_DEPTH = 64
"""Levels of nesting a state may have: far more than any state dict has, far less than Python's recursion limit."""


def split(tree: Any, prefix: str) -> tuple[JSON, dict[str, torch.Tensor]]:
    """Split `tree` into (JSON skeleton, {key: tensor}); keys are dotted paths, after `prefix` if given."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = _encode(tree, prefix, tensors, ())
    return skeleton, tensors


def join(skeleton: JSON, tensors: Mapping[str, torch.Tensor]) -> Any:
    """Rebuild the tree that `split` took apart, taking tensor leaves from `tensors`."""
    return _decode(skeleton, tensors)


def tensor_keys(skeleton: JSON) -> list[str]:
    """Keys of the tensor leaves in a skeleton, in tree order."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {_TENSOR}:
            return [skeleton[_TENSOR]]
        if set(skeleton) == {_PAIRS}:
            return [key for pair in skeleton[_PAIRS] for key in tensor_keys(pair)]
        return [key for value in skeleton.values() for key in tensor_keys(value)]
    if isinstance(skeleton, list):
        return [key for value in skeleton for key in tensor_keys(value)]
    return []


def rename(skeleton: JSON, names: Mapping[str, str]) -> JSON:
    """`skeleton` with the keys of its tensor leaves replaced as `names` maps them (the others kept)."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {_TENSOR}:
            return {_TENSOR: names.get(skeleton[_TENSOR], skeleton[_TENSOR])}
        return {key: rename(value, names) for key, value in skeleton.items()}
    if isinstance(skeleton, list):
        return [rename(value, names) for value in skeleton]
    return skeleton


def leaves(skeleton: JSON) -> dict[str, JSON]:
    """Every leaf of a skeleton (a tensor's `{"__tensor__": key}` or a JSON value) by its path: the JSON of the list
    of keys and indices that lead to it, unambiguous whatever the keys hold (dots included)."""
    found: dict[str, JSON] = {}

    def walk(value: JSON, path: tuple[str | int, ...]) -> None:
        if isinstance(value, dict) and set(value) != {_TENSOR} and value:
            for key, item in value.items():
                walk(item, (*path, key))
        elif isinstance(value, list) and value:
            for index, item in enumerate(value):
                walk(item, (*path, index))
        else:
            found[json.dumps(path)] = value

    walk(skeleton, ())
    return found


def graft(skeleton: JSON, saved: Mapping[str, JSON], *, missing: Callable[[str, JSON], Exception]) -> JSON:
    """`skeleton` with each leaf replaced by the leaf of `saved` (`leaves`' paths) at its path: the values of a saved
    state in the shape of a current one. `missing(path, leaf)` is raised for a leaf that `saved` lacks, or that is a
    tensor in one and a value in the other."""
    def walk(value: JSON, path: tuple[str | int, ...]) -> JSON:
        if isinstance(value, dict) and set(value) != {_TENSOR} and value:
            return {key: walk(item, (*path, key)) for key, item in value.items()}
        if isinstance(value, list) and value:
            return [walk(item, (*path, index)) for index, item in enumerate(value)]
        key = json.dumps(path)
        if key not in saved or _is_tensor(saved[key]) != _is_tensor(value):
            raise missing(key, value)
        return saved[key]

    return walk(skeleton, ())


def _is_tensor(leaf: JSON) -> bool:
    return isinstance(leaf, dict) and set(leaf) == {_TENSOR}


def _encode(value: Any, path: str, tensors: dict[str, torch.Tensor], within: tuple[int, ...]) -> JSON:
    """`within`: the ids of the containers that hold `value`, outermost first (a cycle comes back to one)."""
    if isinstance(value, (tuple, list, Mapping)):
        if id(value) in within:
            raise CheckpointError(f"cannot save {path!r}: it contains itself (a cycle), which has no finite form")
        if len(within) >= MAX_DEPTH:
            raise CheckpointError(f"cannot save {path[:200]!r}: the state is nested deeper than {MAX_DEPTH} levels")
        within = (*within, id(value))
    if isinstance(value, torch.Tensor):
        if path in tensors:
            raise CheckpointError(f"two tensors of the training state have the same key {path!r}")
        tensors[path] = value
        return {_TENSOR: path}
    # bool before int: bool is an int subclass, and both are JSON as they are.
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(item, _child(path, i), tensors, within) for i, item in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(item, _child(path, i), tensors, within) for i, item in enumerate(value)]
    if isinstance(value, Mapping):
        if all(isinstance(key, str) for key in value) and not _MARKERS.intersection(value):
            return {key: _encode(item, _child(path, key), tensors, within) for key, item in value.items()}
        return {
            _PAIRS: [
                [_encode(key, _child(path, f"<key {i}>"), tensors, within),
                 _encode(item, _child(path, key), tensors, within)]
                for i, (key, item) in enumerate(value.items())
            ]
        }
    raise CheckpointError(
        f"cannot save {path!r}: a value of type {type(value).__name__} is neither a tensor nor JSON data"
    )


def _child(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _decode(value: JSON, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [_decode(item, tensors) for item in value]
    if not isinstance(value, dict):
        return value
    if set(value) == {_TENSOR}:
        key = value[_TENSOR]
        if key not in tensors:
            raise CheckpointError(f"the checkpoint's tensor {key!r} was not loaded")
        return tensors[key]
    if set(value) == {_TUPLE}:
        return tuple(_decode(item, tensors) for item in value[_TUPLE])
    if set(value) == {_PAIRS}:
        return {_decode(key, tensors): _decode(item, tensors) for key, item in value[_PAIRS]}
    return {key: _decode(item, tensors) for key, item in value.items()}
