"""Which rank saves and loads which part of a checkpoint's shared state (the model/optimizer state, as opposed to
a rank's own RNG and data position).

It need not be the same on every rank: DDP replicates it, FSDP2 shards it, and pipeline parallelism gives each
stage other layers. Each rank therefore records its own skeleton (`rank_document`), and on load each rank is
checked against its own record (`check_same_tensors`). Tensors that several ranks hold under one key are replicas,
which DCP writes once: only those proven the same by their fingerprints (`digests`); one that differs is saved by
every rank under its own key (`own_key`). An elastic checkpoint is one global state by name instead, of which each
rank held a part: `global_leaves` gathers it, `elastic_skeleton` gives a rank of another mesh the names it holds,
and `check_held` refuses a mesh that holds a saved name nowhere.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from detrace.errors import CheckpointError
from detrace.state import dist, manifest, tree
from detrace.state.storage import read_json
from detrace.state.tree import JSON

NOT_ELASTIC = ("an elastic checkpoint needs the same own state (RNG, data position, extra) on every rank and the "
                "same model and optimizer values wherever two ranks hold one name, and the ranks' differ: seed every "
                "generator alike (detrace.deterministic), read the data in global samples, and keep the replicas "
                "of a parameter equal")
_VALUE = "="
"""Marks the key of a non-tensor value (its path, `tree.leaves`) among the tensor keys that `dist.differing` takes."""


def value_digests(skeleton: Any) -> dict[str, int]:
    """The fingerprint of each non-tensor value of a shared skeleton (a learning rate, a scheduler's step), by path."""
    from detrace.digest import fingerprint

    return {_VALUE + path: fingerprint(torch.frombuffer(bytearray(json.dumps(leaf).encode()), dtype=torch.uint8)).digest
            for path, leaf in tree.leaves(skeleton).items() if not tree.tensor_keys(leaf)}


def first_differing(apart: set[str]) -> str:
    """Which value of an elastic save differs across ranks, as the refusal says it: the first this rank holds."""
    return f"first: {_leaf_name(min(apart))!r}" if apart else "on other ranks"


def _leaf_name(key: str) -> str:
    """A key of `digests` or `value_digests` as an error names it: the tensor's key, or the value's path."""
    return ".".join(str(part) for part in json.loads(key[len(_VALUE):])) if key.startswith(_VALUE) else key


def global_leaves(directory: Path, world: int, first: dict[str, Any], *, step: int) -> dict[str, JSON]:
    """Every leaf (tensor or value) of the shared state that the `world` ranks of an elastic checkpoint saved, by path
    (`tree.leaves`): the global state, of which each rank held a part (where two held one, it was the same). `first`
    is rank 0's document, already read."""
    every: dict[str, JSON] = {}
    for saved_rank in range(world):
        saved = first if saved_rank == 0 else rank_document(directory, saved_rank, step=step)
        for path, leaf in tree.leaves(saved["shared"]).items():
            every.setdefault(path, leaf)
    return every


def elastic_skeleton(directory: Path, template: Any, every: dict[str, JSON], *, rank: int, world: int) -> Any:
    """The skeleton of this rank's template with the saved leaves of the global state: every name it holds must have
    been saved, by some rank of the mesh that saved it."""
    whose = f" (rank {rank} of {world})" if world > 1 else ""

    def missing(path: str, leaf: JSON) -> CheckpointError:
        keys = tree.tensor_keys(leaf)
        what = f"tensor {keys[0]!r}" if keys else f"value {_leaf_name(_VALUE + path)!r}"
        instead = _in_place_of(keys[0], every) if keys else None
        return CheckpointError(f"this training state{whose} has {what} that {directory} does not hold" + (
            f" (it holds {instead!r} there: the model was split into other parameters, e.g. tensor-parallel chunks "
            "against whole weights)" if instead else ""))

    return tree.graft(template, every, missing=missing)


def _in_place_of(key: str, every: dict[str, JSON]) -> str | None:
    """A saved tensor of the module that holds the parameter `key`, or of the module above (a ParameterDict's), which
    a model split otherwise holds in its place (`wq.chunks.0` for `wq.weight`, and back), or None."""
    if not key.startswith("model."):  # the parameters themselves; their optimizer state follows them
        return None
    saved = sorted(name for leaf in every.values() for name in tree.tensor_keys(leaf))
    for parent in key.split(".")[:-1], key.split(".")[:-2]:
        if len(parent) > 1:  # not the whole model's state
            found = next((name for name in saved if name.startswith(".".join(parent) + ".")), None)
            if found is not None:
                return found
    return None


def check_held(directory: Path, every: dict[str, JSON], mine: dict[str, JSON]) -> None:
    """Every leaf of an elastic checkpoint's global state must be loaded by some rank (collective): a model that lost
    a layer, or a mesh that holds a part nowhere, is refused rather than resumed without it."""
    paths = sorted(every)
    held = dist.held_anywhere([path in mine for path in paths])
    lost = [path for path, flag in zip(paths, held, strict=True) if not flag]
    if lost:
        keys = tree.tensor_keys(every[lost[0]])
        what = f"tensor {keys[0]!r}" if keys else f"value {_leaf_name(_VALUE + lost[0])!r}"
        raise CheckpointError(f"{directory} holds {what} that no rank of this training state has")


def own_key(rank: int, key: str) -> str:
    """The key under which rank `rank` saves its own copy of the shared tensor `key` (one that differs by rank)."""
    return f"rank{rank}/{key}"


def template_names(skeleton: Any, rank: int) -> dict[str, str]:
    """The saved keys of a shared skeleton that rank `rank` saved -> the keys of the tensors they load into."""
    own = own_key(rank, "")
    return {key: key.removeprefix(own) for key in tree.tensor_keys(skeleton)}


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """The fingerprints of the tensors that are whole on this rank (not a DTensor, whose shards DCP places)."""
    from torch.distributed.tensor import DTensor

    from detrace.digest import fingerprint_many

    whole = sorted(key for key, tensor in tensors.items() if not isinstance(tensor, DTensor))
    prints = fingerprint_many([tensors[key] for key in whole])
    return {key: print_.digest for key, print_ in zip(whole, prints, strict=True)}


def own_digest(local: dict[str, Any]) -> int:
    """One fingerprint of the own state (skeleton and tensors), for `dist.differs`."""
    from detrace.digest import fingerprint, fingerprint_many

    skeleton, tensors = tree.split(local, "")
    text = json.dumps(skeleton, sort_keys=True).encode()
    digests = [fingerprint(torch.frombuffer(bytearray(text), dtype=torch.uint8)).digest]
    digests += [fp.digest for fp in fingerprint_many([tensors[key] for key in sorted(tensors)])]
    return fingerprint(torch.tensor(digests, dtype=torch.uint64)).digest


def rank_document(directory: Path, rank: int, *, step: int) -> dict[str, Any]:
    """What rank `rank` saved beside its tensors: the skeletons of its shared and its own state."""
    path = directory / manifest.rank_file(rank)
    document = read_json(path)
    # The manifest's checksum vouches for the bytes; this guards against a file of another layout.
    if (
        not isinstance(document, dict)
        or not {"rank", "step", "shared", "local"} <= set(document)
        or document["rank"] != rank
        or document["step"] != step
    ):
        raise CheckpointError(f"{path} is not the state of rank {rank} at step {step}")
    return document


def check_same_tensors(directory: Path, saved: set[str], current: set[str], *, rank: int, world: int) -> None:
    """This rank's tensors must be those the same rank saved (the names of a pipeline stage's layers, ...)."""
    whose = f" (rank {rank} of {world})" if world > 1 else ""
    if saved - current:
        raise CheckpointError(
            f"{directory} holds tensor {sorted(saved - current)[0]!r} that this training state{whose} does not have"
        )
    if current - saved:
        raise CheckpointError(
            f"this training state{whose} has tensor {sorted(current - saved)[0]!r} that {directory} does not hold"
        )
