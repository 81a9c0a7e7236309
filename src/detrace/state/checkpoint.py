"""Checkpoint directories: sharded writes, an atomic commit, and verified reads.

Layout of a checkpoint root (what `TrainState.save(root)` and `DETRACE_CKPT_DIR` name):

    root/latest                  the name of the current version, replaced atomically (os.replace)
    root/step-00000012/          one complete version
        manifest.json            fingerprints of every stored tensor chunk + checksums of the JSON files
        dcp_metadata.json        torch.distributed.checkpoint's metadata, as JSON
        __0_0.distcp ...         tensor chunks, one file per rank (torch.save records, their bytes verified in place)
        rank-0.json ...          each rank's skeletons (non-tensor values, tensor keys): its model/optimizer
                                 state and its own state (step, RNG, data position, extra)
    root/.tmp-TOKEN/             a save in progress: invisible until committed
    root/.tmp-TOKEN.lock         its lock, held (flock) by the saving job's rank 0 while the save is in progress

The model/optimizer state ("shared", as opposed to a rank's own RNG and data position) need not be the same
on every rank: DDP replicates it, FSDP2 shards it, and pipeline parallelism gives each stage other layers.
Each rank therefore records its own skeleton, and on load each rank is checked against its own record.
Tensors that several ranks hold under one key are replicas, which DCP writes once.

Every rank writes its part into the temporary directory; rank 0 writes the manifest last, renames the
directory into place and only then repoints `latest`. A crash at any moment leaves `latest` naming the
previous, complete version; the half-written one is never read and is removed by the next save, once its
writer's lock is free: two jobs may save into one root without one removing the other's save in progress.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from detrace.errors import CheckpointError, os_error_text
from detrace.state import dist, manifest, tree
from detrace.state.storage import (
    FingerprintingSavePlanner,
    JsonFileSystemReader,
    JsonFileSystemWriter,
    read_json,
    read_metadata,
    write_json,
)
from detrace.state.tree import JSON

LATEST_FILE = "latest"
_VERSION = re.compile(r"step-(\d{8,})(?:\.(\d+))?")
_TMP_PREFIX = ".tmp-"
_LATEST_LIMIT = 64
"""The most bytes a version name in `latest` takes (step-NNNNNNNN.K and a newline, with room to spare)."""
_LATEST_SHOWN = 32
"""How much of a `latest` that names no version an error quotes."""


@dataclass(frozen=True, kw_only=True)
class Loaded:
    """What `read` hands back to a TrainState."""

    step: int
    """Number of completed optimizer steps at save time."""
    shared: dict[str, Any]
    """The model/optimizer/scheduler/scaler state, its tensors those of the template, filled in place."""
    local: dict[str, Any]
    """This rank's own state (RNG, data position, extra)."""
    directory: Path
    """The version directory that was read."""


def write(root: Path, *, step: int, shared: dict[str, Any], local: dict[str, Any], keep: int = 1,
          elastic: bool = False) -> Path:
    """Save a checkpoint of `step` under `root` on every rank; returns the committed version directory.

    `shared` is this rank's model/optimizer state as DCP's state_dict helpers give it: replicated (DCP
    writes a tensor that several ranks hold under one key once), sharded (DTensors), or this rank's own
    part (a pipeline stage's layers). `local` is this rank's RNG, data position and extra state.
    Collective: every rank of the process group must call it.

    `elastic`: refuse (on every rank) unless every rank's own state is the same and the ranks' shared states are
    parts of one global state (a name that several ranks hold, tensor or value, has the same bits on each), so that
    `read(elastic=True)` may resume the checkpoint on any other mesh: each rank of it takes the names it holds.
    """
    if keep < 1:
        raise CheckpointError(f"keep must be at least 1, not {keep}")
    rank = dist.rank_and_world()[0]
    if elastic and dist.differs(_own_digest(local)):  # which value: each leaf's digest, on this rarer path only
        skeleton, tensors = tree.split(local, "")
        apart = dist.differing({**_digests(tensors), **_value_digests(skeleton)})
        raise CheckpointError(f"{_NOT_ELASTIC} ({_first(apart)})")
    dist.together(lambda: _prepare_root(root))
    # Rank 0 holds this save's lock from before its temporary directory exists until after the commit: another job
    # saving into the same root removes only what a dead writer left (see _Writer).
    writer = dist.together(lambda: _Writer(root) if rank == 0 else None)
    try:
        return _write_locked(root, writer, step=step, shared=shared, local=local, keep=keep, elastic=elastic)
    finally:
        if writer is not None:
            writer.release()


def _write_locked(root: Path, writer: _Writer | None, *, step: int, shared: dict[str, Any], local: dict[str, Any],
                  keep: int, elastic: bool) -> Path:
    rank, world = dist.rank_and_world()
    token = dist.from_rank0(writer.token if writer is not None else 0)
    tmp = root / _writer_entry(token)

    # A value that cannot be stored may sit in one rank's own state only: every rank must stop, not just it.
    shared_skeleton, shared_tensors = dist.together(lambda: tree.split(shared, ""))
    # DCP writes a tensor that several ranks hold under one key once, from whichever rank it picks: only a tensor
    # proven the same on every rank may be. One that differs (a DDP model's buffers: each rank's forward updates
    # its own BatchNorm statistics) is saved by every rank as its own, and restored to the rank that saved it.
    digests = _digests(shared_tensors)
    if elastic:  # the ranks' values (a learning rate, a step count) must be the same where they overlap too
        digests.update(_value_digests(shared_skeleton))
    apart = dist.differing(digests) if world > 1 else set()
    # every rank stops, those that hold none of the names that differ too
    if elastic and dist.any_rank(bool(apart)):
        raise CheckpointError(f"{_NOT_ELASTIC} ({_first(apart)})")
    names = {key: own_key(rank, key) for key in apart}
    shared_skeleton = tree.rename(shared_skeleton, names)
    shared_tensors = {names.get(key, key): tensor for key, tensor in shared_tensors.items()}
    local_skeleton, local_tensors = dist.together(lambda: tree.split(local, f"rank{rank}"))
    planner = FingerprintingSavePlanner()
    storage = JsonFileSystemWriter(tmp, sync_files=True)
    try:
        with _single_process_is_intended():
            dcp.save(
                {**shared_tensors, **local_tensors},
                storage_writer=storage,
                planner=planner,
                no_dist=not dist.active(),
            )
    except (RuntimeError, OSError, CheckpointException) as err:
        raise CheckpointError(f"cannot write a checkpoint into {tmp}: {_write_failure(err, root)}") from None
    # Every rank records its own skeleton of the shared state: under pipeline parallelism no two stages
    # have the same one, and a rank's record is what its resume is checked against.
    write_json(
        tmp / manifest.rank_file(rank),
        {"rank": rank, "step": step, "elastic": elastic, "shared": shared_skeleton, "local": local_skeleton},
    )
    write_json(tmp / _fingerprint_file(rank), manifest.chunk_records(planner.written_chunks(), storage.frames))
    dist.barrier()  # every rank's part is on disk before rank 0 commits
    suffix = _commit(root, tmp, step=step, world=world, keep=keep) if rank == 0 else 0
    # nobody returns (and, say, exits) before the checkpoint is visible
    return root / _version_name(step, dist.from_rank0(suffix))


def resolve(path: Path) -> Path:
    """The version directory that `path` (a checkpoint root or a version directory) designates."""
    if (path / manifest.MANIFEST_FILE).is_file():
        return path
    latest = path / LATEST_FILE
    if latest.is_file():
        return path / _latest_name(latest)
    if not path.exists():
        raise CheckpointError(f"there is no checkpoint at {path}")
    raise CheckpointError(f"{path} is not a detrace checkpoint (no {manifest.MANIFEST_FILE}, no {LATEST_FILE})")


def _latest_name(latest: Path) -> str:
    """The version `latest` names. Whatever else it holds (bytes that are not text, another file it links to) is
    quoted by a short prefix, its unprintable characters escaped: never the whole file."""
    try:
        with latest.open("rb") as handle:
            raw = handle.read(_LATEST_LIMIT + 1)
    except OSError as err:
        raise CheckpointError(f"cannot read {latest}: {err.strerror or err}") from None
    name = raw.decode("ascii", errors="replace").strip()
    if len(raw) <= _LATEST_LIMIT and _VERSION.fullmatch(name):
        return name
    shown = raw[:_LATEST_SHOWN].decode("utf-8", errors="replace")
    raise CheckpointError(f"{latest} does not name a checkpoint version (it holds {shown!r}"
                          f"{'...' if len(raw) > _LATEST_SHOWN else ''})")


def read(path: Path, *, shared: dict[str, Any], check: Callable[[Path, Any, Any], None], elastic: bool = False
         ) -> Loaded:
    """Verify and load the checkpoint at `path` on every rank (collective).

    `shared` is a template of this rank's shared state (what `write` got, from the current model and
    optimizer): DCP loads into its tensors in place, in whatever sharding they have now. Each rank checks
    the template against the skeleton that the same rank saved, so ranks may hold different tensors (the
    stages of a pipeline). `check(directory, shared skeleton, local skeleton)` raises if the saved state does
    not fit; it runs, like every other check, before anything is loaded, so a checkpoint that is refused
    leaves the training state untouched, and a refusal on any rank stops every rank.

    `elastic`: every rank's own state was the same when saved and the ranks' shared states were parts of one global
    state (`write(elastic=True)` checked it): each rank loads rank 0's own state and, of the global state, the names
    its template holds (DCP reshards the tensors), and every saved name must be held by some rank. The checkpoint
    resumes on any mesh whose ranks name the model's parameters by their global names (data, FSDP, tensor-parallel
    chunks, pipeline stages, experts).
    """
    directory = resolve(path)
    rank, world = dist.rank_and_world()
    saved_world = manifest.read(directory).world_size  # first: another world size is refused as such
    if saved_world != world and not elastic:
        raise CheckpointError(
            f"{directory} was saved by {saved_world} ranks and cannot resume {world}: "
            "each rank's RNG and data position belong to one rank"
        )
    document = manifest.verify(directory, collective=True)
    template_skeleton, template_tensors = tree.split(shared, "")

    saved_rank = 0 if elastic else rank

    def fits() -> tuple[Any, Any, dict[str, JSON]]:
        saved = _rank_document(directory, saved_rank, step=document.step)
        if elastic and "elastic" not in saved:  # rank files before 2026-12-05 did not say; their optimizer is nested
            raise CheckpointError(f"{directory} was saved by an earlier detrace, whose checkpoints hold the optimizer "
                                  "state by parameter index: it resumes only on the mesh that wrote it, by a "
                                  "TrainState with elastic=False")
        if elastic and saved["elastic"] is not True:  # each rank's own state, or the optimizer's nested form
            raise CheckpointError(f"{directory} was not saved as an elastic checkpoint (by a TrainState with "
                                  "elastic=True): it resumes only on the mesh that wrote it, by a TrainState without")
        if elastic:
            check(directory, saved["shared"], saved["local"])
            # Rank 0 alone reads the saved ranks' documents, and hands their union to the others below: N reads of
            # the shared file system, not N for every rank (a million at a thousand ranks)
            every = _global_leaves(directory, saved_world, saved, step=document.step) if rank == 0 else {}
            return saved["shared"], saved["local"], every
        _check_same_tensors(directory, set(_template_names(saved["shared"], saved_rank).values()),
                            set(template_tensors), rank=rank, world=world)
        check(directory, saved["shared"], saved["local"])
        return saved["shared"], saved["local"], {}

    # A rank whose state does not fit must not leave the others waiting in DCP's collective load.
    elsewhere = f"{directory} does not fit the training state of another rank; see that rank's error"
    shared_skeleton, local_skeleton, every = dist.together(fits, elsewhere=elsewhere)
    if elastic:
        every = dist.json_from_rank0(every)  # every rank got here: rank 0's reads succeeded
        shared_skeleton = dist.together(
            lambda: _elastic_skeleton(directory, template_skeleton, every, rank=rank, world=world), elsewhere=elsewhere)
        _check_held(directory, every, tree.leaves(template_skeleton))
    # The rank's own copies (see `write`) load into the template's tensors of the same names.
    shared_tensors = {key: template_tensors[name] for key, name in _template_names(shared_skeleton, saved_rank).items()}

    # This rank's own tensors (RNG states, ...) are allocated from what was saved, not from a template.
    metadata = read_metadata(directory)
    local_tensors = {}
    for key in tree.tensor_keys(local_skeleton):
        entry = metadata.state_dict_metadata[key]
        if not isinstance(entry, TensorStorageMetadata):  # the key names a tensor of the skeleton
            raise CheckpointError(f"{directory}: {key!r} is not stored as a tensor")
        local_tensors[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    try:
        with _single_process_is_intended():
            dcp.load(
                {**shared_tensors, **local_tensors},
                storage_reader=JsonFileSystemReader(directory),
                planner=DefaultLoadPlanner(flatten_state_dict=False),
                no_dist=not dist.active(),
            )
    except (RuntimeError, ValueError, OSError, CheckpointException) as err:
        # DCP reports a failure on any rank as CheckpointException (a BaseException); its message names the key.
        raise CheckpointError(f"{directory} does not fit this training state: {_first_line(err)}") from None
    return Loaded(
        step=document.step,
        shared=tree.join(shared_skeleton, shared_tensors),
        local=tree.join(local_skeleton, local_tensors),
        directory=directory,
    )


@contextlib.contextmanager
def _single_process_is_intended() -> Iterator[None]:
    """DCP warns that it assumes a single process when there is no process group; here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


FULL_DISK_BYTES = 64 << 20
"""Free bytes below which torch's torn-write error ("unexpected pos") is read as a full disk."""


def _write_failure(err: BaseException, root: Path) -> str:
    """Why a save failed, in words: torch's stream writer reports a full disk as "[enforce fail at
    inline_container.cc:...] unexpected pos", which the free space on the device then explains."""
    cause = next(iter(err.failures.values()))[0] if isinstance(err, CheckpointException) and err.failures else err
    if isinstance(cause, OSError):
        return os_error_text(cause, root)
    if "unexpected pos" in str(cause) or "failed writing" in str(cause):
        with contextlib.suppress(OSError):
            if shutil.disk_usage(root).free < FULL_DISK_BYTES:
                return os_error_text(OSError(errno.ENOSPC, "full"), root)
    return _first_line(err)


def _first_line(err: BaseException) -> str:
    """The first line of what went wrong; for DCP's CheckpointException, of the first rank's own error."""
    if isinstance(err, CheckpointException) and err.failures:
        err = next(iter(err.failures.values()))[0]
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__


_NOT_ELASTIC = ("an elastic checkpoint needs the same own state (RNG, data position, extra) on every rank and the "
                "same model and optimizer values wherever two ranks hold one name, and the ranks' differ: seed every "
                "generator alike (detrace.deterministic), read the data in global samples, and keep the replicas "
                "of a parameter equal")
_VALUE = "="
"""Marks the key of a non-tensor value (its path, `tree.leaves`) among the tensor keys that `dist.differing` takes."""


def _value_digests(skeleton: Any) -> dict[str, int]:
    """The fingerprint of each non-tensor value of a shared skeleton (a learning rate, a scheduler's step), by path."""
    from detrace.digest import fingerprint

    return {_VALUE + path: fingerprint(torch.frombuffer(bytearray(json.dumps(leaf).encode()), dtype=torch.uint8)).digest
            for path, leaf in tree.leaves(skeleton).items() if not tree.tensor_keys(leaf)}


def _first(apart: set[str]) -> str:
    """Which value of an elastic save differs across ranks, as the refusal says it: the first this rank holds."""
    return f"first: {_leaf_name(min(apart))!r}" if apart else "on other ranks"


def _leaf_name(key: str) -> str:
    """A key of `_digests` or `_value_digests` as an error names it: the tensor's key, or the value's path."""
    return ".".join(str(part) for part in json.loads(key[len(_VALUE):])) if key.startswith(_VALUE) else key


def _global_leaves(directory: Path, world: int, first: dict[str, Any], *, step: int) -> dict[str, JSON]:
    """Every leaf (tensor or value) of the shared state that the `world` ranks of an elastic checkpoint saved, by path
    (`tree.leaves`): the global state, of which each rank held a part (where two held one, it was the same). `first`
    is rank 0's document, already read."""
    every: dict[str, JSON] = {}
    for saved_rank in range(world):
        saved = first if saved_rank == 0 else _rank_document(directory, saved_rank, step=step)
        for path, leaf in tree.leaves(saved["shared"]).items():
            every.setdefault(path, leaf)
    return every


def _elastic_skeleton(directory: Path, template: Any, every: dict[str, JSON], *, rank: int, world: int) -> Any:
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


def _check_held(directory: Path, every: dict[str, JSON], mine: dict[str, JSON]) -> None:
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


def _template_names(skeleton: Any, rank: int) -> dict[str, str]:
    """The saved keys of a shared skeleton that rank `rank` saved -> the keys of the tensors they load into."""
    own = own_key(rank, "")
    return {key: key.removeprefix(own) for key in tree.tensor_keys(skeleton)}


def _digests(tensors: dict[str, torch.Tensor]) -> dict[str, int]:
    """The fingerprints of the tensors that are whole on this rank (not a DTensor, whose shards DCP places)."""
    from torch.distributed.tensor import DTensor

    from detrace.digest import fingerprint_many

    whole = sorted(key for key, tensor in tensors.items() if not isinstance(tensor, DTensor))
    prints = fingerprint_many([tensors[key] for key in whole])
    return {key: print_.digest for key, print_ in zip(whole, prints, strict=True)}


def _own_digest(local: dict[str, Any]) -> int:
    """One fingerprint of the own state (skeleton and tensors), for `dist.differs`."""
    from detrace.digest import fingerprint, fingerprint_many

    skeleton, tensors = tree.split(local, "")
    text = json.dumps(skeleton, sort_keys=True).encode()
    digests = [fingerprint(torch.frombuffer(bytearray(text), dtype=torch.uint8)).digest]
    digests += [fp.digest for fp in fingerprint_many([tensors[key] for key in sorted(tensors)])]
    return fingerprint(torch.tensor(digests, dtype=torch.uint64)).digest


def _rank_document(directory: Path, rank: int, *, step: int) -> dict[str, Any]:
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


def _check_same_tensors(directory: Path, saved: set[str], current: set[str], *, rank: int, world: int) -> None:
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


def _commit(root: Path, tmp: Path, *, step: int, world: int, keep: int) -> int:
    """Make the version in `tmp` the current one; returns its name's suffix (see `_version_name`)."""
    records = [record for rank in range(world) for record in read_json(tmp / _fingerprint_file(rank))]
    for rank in range(world):
        (tmp / _fingerprint_file(rank)).unlink()
    files = [path for path in tmp.iterdir() if path.suffix == ".json"]
    write_json(tmp / manifest.MANIFEST_FILE, manifest.build(step=step, world_size=world, records=records, files=files,
                                                            command=_traced_command()))
    _fsync_dir(tmp)
    suffix = _free_suffix(root, step)
    while True:
        try:
            os.rename(tmp, root / _version_name(step, suffix))
            break
        except OSError as err:  # another job committed that name since: the next free one
            if err.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            suffix = _free_suffix(root, step)
    name = _version_name(step, suffix)
    _fsync_dir(root)
    # The version becomes the current one only now, in one atomic step.
    pointer = tmp.with_name(f"{tmp.name}.{LATEST_FILE}")
    pointer.write_text(name + "\n")
    with pointer.open("rb") as stream:
        os.fsync(stream.fileno())
    os.replace(pointer, root / LATEST_FILE)
    _fsync_dir(root)
    _remove_old(root, current=name, keep=keep)
    return suffix


def _prepare_root(root: Path) -> None:
    """Create the checkpoint root, or say in one sentence why it cannot be one (before any rank writes)."""
    blocker = next((p for p in (root, *root.parents) if p.exists() and not p.is_dir()), None)
    if blocker == root:
        raise CheckpointError(f"checkpoint directory {root} is a file, not a directory")
    if blocker is not None:
        raise CheckpointError(f"checkpoint directory {root} cannot be created: {blocker} is a file")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"checkpoint directory {root} cannot be created: {err.strerror or err}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise CheckpointError(f"checkpoint directory {root} is not writable")


def _traced_command() -> tuple[str, ...] | None:
    """The command of the traced run this process belongs to (what its run.json names), or None."""
    from detrace.errors import UsageError
    from detrace.record.config import TraceConfig

    try:
        config = TraceConfig.from_env()
    except UsageError:  # not a tracer's configuration: no run to name
        return None
    return None if config is None else config.command


def _version_name(step: int, suffix: int) -> str:
    """`step-00000012`, or `step-00000012.N` (suffix N) when that step was saved before (e.g. by a rerun)."""
    return f"step-{step:08d}" + (f".{suffix}" if suffix else "")


def _free_suffix(root: Path, step: int) -> int:
    suffix = 0
    while (root / _version_name(step, suffix)).exists():
        suffix += 1
    return suffix


_WRITER = re.compile(rf"{re.escape(_TMP_PREFIX)}([0-9a-f]{{16}})(?:\.lock|\.{LATEST_FILE})?")
"""A writer's entries: its temporary directory, its lock file and its pointer file."""


def _writer_entry(token: int, suffix: str = "") -> str:
    return f"{_TMP_PREFIX}{token:016x}{suffix}"


class _Writer:
    """The lock of one save into a checkpoint root, held by rank 0 of the saving job.

    Its temporary entries (`.tmp-TOKEN/`, `.tmp-TOKEN.latest`) exist only while `.tmp-TOKEN.lock` exists and is
    locked (flock) by the writer: the lock is taken before they are made and removed after they are gone. An
    entry whose lock is free (the kernel frees it when its process dies) or missing was left by a dead writer,
    and only such entries are removed, once this writer holds its own lock."""

    def __init__(self, root: Path) -> None:
        while True:
            self.token = secrets.randbits(64)
            self.path = root / _writer_entry(self.token, ".lock")
            try:
                self.stream = self.path.open("a")
            except OSError as err:
                raise CheckpointError(f"cannot lock a save into {root}: {os_error_text(err, root)}") from None
            fcntl.flock(self.stream, fcntl.LOCK_EX)
            # A clean-up may have judged the file stale between its creation and the lock: then it is gone.
            with contextlib.suppress(FileNotFoundError):
                if os.path.samestat(os.fstat(self.stream.fileno()), self.path.stat()):
                    break
            self.stream.close()
        _remove_stale(root, own=self.token)

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.stream.close()


def _remove_stale(root: Path, *, own: int) -> None:
    """Remove what dead writers left behind (temporary directories and pointer files), never a live writer's."""
    writers = set()
    for path in root.iterdir():
        if not path.name.startswith(_TMP_PREFIX):
            continue
        match = _WRITER.fullmatch(path.name)
        if match is None:  # an older detrace's entry, which took no lock
            _remove(path)
        else:
            writers.add(int(match.group(1), 16))
    for token in writers - {own}:
        _remove_if_dead(root, token)


def _remove_if_dead(root: Path, token: int) -> None:
    """Remove writer `token`'s entries when its lock is free or missing (its process is gone)."""
    lock = root / _writer_entry(token, ".lock")
    try:
        stream = lock.open("r")
    except FileNotFoundError:
        stream = None
    try:
        if stream is not None:
            try:
                fcntl.flock(stream, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # a live writer
        for suffix in ("", f".{LATEST_FILE}"):
            _remove(root / _writer_entry(token, suffix))
        if stream is not None:
            lock.unlink(missing_ok=True)
    finally:
        if stream is not None:
            stream.close()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _remove_old(root: Path, *, current: str, keep: int) -> None:
    """Keep the `keep` most recently committed versions, the current one always among them."""
    versions = [
        path for path in root.iterdir()
        if _VERSION.fullmatch(path.name) and path.name != current and (path / manifest.MANIFEST_FILE).is_file()
    ]
    versions.sort(key=lambda path: (path / manifest.MANIFEST_FILE).stat().st_mtime_ns, reverse=True)
    for path in versions[keep - 1 :]:
        shutil.rmtree(path)


def _fsync_dir(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _fingerprint_file(rank: int) -> str:
    return f"fingerprints-rank-{rank}.json"
