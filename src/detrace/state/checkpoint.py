"""Checkpoint versions: sharded writes and verified reads, on every rank together.

Layout of a checkpoint root (what `TrainState.save(root)` and `DETRACE_CKPT_DIR` name; its versions, `latest`
and the commit: `detrace.state.versions`):

    root/latest                  the name of the current version, replaced atomically (os.replace)
    root/step-00000012/          one complete version
        manifest.json            fingerprints of every stored tensor chunk + checksums of the JSON files
        dcp_metadata.json        torch.distributed.checkpoint's metadata, as JSON
        __0_0.distcp ...         tensor chunks, one file per rank (torch.save records, their bytes verified in place)
        rank-0.json ...          each rank's skeletons (non-tensor values, tensor keys): its model/optimizer
                                 state and its own state (step, RNG, data position, extra)
    root/.tmp-TOKEN/             a save in progress: invisible until committed

Every rank writes its part into the temporary directory, then rank 0 commits it (`versions.commit`). Which rank
saves and loads which part of the model/optimizer state (replicas, a rank's own copies, pipeline stages, an
elastic checkpoint's global names): `detrace.state.ranks`.
"""

from __future__ import annotations

import contextlib
import errno
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
from detrace.state import dist, manifest, ranks, tree, versions
from detrace.state.storage import (
    FingerprintingSavePlanner,
    JsonFileSystemReader,
    JsonFileSystemWriter,
    read_metadata,
    write_json,
)
from detrace.state.tree import JSON


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
    if elastic and dist.differs(ranks.own_digest(local)):  # which value: each leaf's digest, on this rarer path only
        skeleton, tensors = tree.split(local, "")
        apart = dist.differing({**ranks.digests(tensors), **ranks.value_digests(skeleton)})
        raise CheckpointError(f"{ranks.NOT_ELASTIC} ({ranks.first_differing(apart)})")
    dist.together(lambda: versions.prepare_root(root))
    # Rank 0 holds this save's lock from before its temporary directory exists until after the commit: another job
    # saving into the same root removes only what a dead writer left (see versions.Writer).
    writer = dist.together(lambda: versions.Writer(root) if rank == 0 else None)
    try:
        return _write_locked(root, writer, step=step, shared=shared, local=local, keep=keep, elastic=elastic)
    finally:
        if writer is not None:
            writer.release()


def _write_locked(root: Path, writer: versions.Writer | None, *, step: int, shared: dict[str, Any],
                  local: dict[str, Any], keep: int, elastic: bool) -> Path:
    rank, world = dist.rank_and_world()
    token = dist.from_rank0(writer.token if writer is not None else 0)
    tmp = root / versions.writer_entry(token)

    # A value that cannot be stored may sit in one rank's own state only: every rank must stop, not just it.
    shared_skeleton, shared_tensors = dist.together(lambda: tree.split(shared, ""))
    # DCP writes a tensor that several ranks hold under one key once, from whichever rank it picks: only a tensor
    # proven the same on every rank may be. One that differs (a DDP model's buffers: each rank's forward updates
    # its own BatchNorm statistics) is saved by every rank as its own, and restored to the rank that saved it.
    digests = ranks.digests(shared_tensors)
    if elastic:  # the ranks' values (a learning rate, a step count) must be the same where they overlap too
        digests.update(ranks.value_digests(shared_skeleton))
    apart = dist.differing(digests) if world > 1 else set()
    # every rank stops, those that hold none of the names that differ too
    if elastic and dist.any_rank(bool(apart)):
        raise CheckpointError(f"{ranks.NOT_ELASTIC} ({ranks.first_differing(apart)})")
    names = {key: ranks.own_key(rank, key) for key in apart}
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
    write_json(tmp / versions.fingerprint_file(rank), manifest.chunk_records(planner.written_chunks(), storage.frames))
    dist.barrier()  # every rank's part is on disk before rank 0 commits
    suffix = versions.commit(root, tmp, step=step, world=world, keep=keep) if rank == 0 else 0
    # nobody returns (and, say, exits) before the checkpoint is visible
    return root / versions.version_name(step, dist.from_rank0(suffix))


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
    directory = versions.resolve(path)
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
        saved = ranks.rank_document(directory, saved_rank, step=document.step)
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
            every = ranks.global_leaves(directory, saved_world, saved, step=document.step) if rank == 0 else {}
            return saved["shared"], saved["local"], every
        ranks.check_same_tensors(directory, set(ranks.template_names(saved["shared"], saved_rank).values()),
                            set(template_tensors), rank=rank, world=world)
        check(directory, saved["shared"], saved["local"])
        return saved["shared"], saved["local"], {}

    # A rank whose state does not fit must not leave the others waiting in DCP's collective load.
    elsewhere = f"{directory} does not fit the training state of another rank; see that rank's error"
    shared_skeleton, local_skeleton, every = dist.together(fits, elsewhere=elsewhere)
    if elastic:
        every = dist.json_from_rank0(every)  # every rank got here: rank 0's reads succeeded
        shared_skeleton = dist.together(
            lambda: ranks.elastic_skeleton(directory, template_skeleton, every, rank=rank, world=world),
            elsewhere=elsewhere)
        ranks.check_held(directory, every, tree.leaves(template_skeleton))
    # The rank's own copies (see `write`) load into the template's tensors of the same names.
    saved_names = ranks.template_names(shared_skeleton, saved_rank)
    shared_tensors = {key: template_tensors[name] for key, name in saved_names.items()}

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
