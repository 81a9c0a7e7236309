"""The fingerprint manifest of a checkpoint: built last when saving, checked first when loading.

`manifest.json` lists the fingerprint (detrace.digest) of every tensor chunk that torch.distributed.checkpoint
stored, the scheme of those fingerprints (key `fingerprint`; detrace-fp1 when absent, as in every manifest written
before detrace-fp2 existed, so old checkpoints verify as they always did) and the SHA-256 of every JSON file beside
them. A checkpoint without it is incomplete (the commit
protocol writes it last), and any stored bit that no longer matches it is reported by tensor name, so a
corrupted checkpoint is never trained on silently.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from detrace import __version__
from detrace.digest.scheme import Fingerprint
from detrace.errors import CheckpointCorrupted, CheckpointError
from detrace.state import dist
from detrace.state.records import Frame, Wanted, open_regular, read_batches
from detrace.state.storage import StoredChunk, load_chunk, read_json, stored_chunks
from detrace.tracefile.integrity import file_sha256
from detrace.tracefile.schemes import SCHEME, SCHEMES

MANIFEST_FILE = "manifest.json"
# The version of the whole checkpoint layout, not only of this file. 2: every rank's file holds the skeleton
# of its own model/optimizer state (ranks may differ, as pipeline stages do); 1 had one state.json for all.
SCHEMA = "detrace.checkpoint/2"
_SCHEMA_FAMILY = "detrace.checkpoint/"

# Verification loads stored chunks in batches of about this many bytes, so memory stays bounded while the
# fingerprints of a batch are still computed in one bulk call.
_BATCH_BYTES = 256 * 2**20


def chunk_records(chunks: Iterable[tuple[str, tuple[int, ...], torch.Tensor]],
                  frames: Mapping[tuple[str, tuple[int, ...]], Frame] | None = None) -> list[dict[str, Any]]:
    """Manifest records of (fqn, offsets, data) chunks: fingerprints computed in one bulk call, each record naming
    the scheme (the manifest keeps it once). `frames`: where the writer found each chunk's tensor bytes in its
    record (detrace.state.records); a chunk that has one is verified by reading them in place."""
    from detrace.digest import fingerprint_many

    chunks = list(chunks)
    prints = fingerprint_many([data for _, _, data in chunks])
    records = []
    for (fqn, offsets, data), print_ in zip(chunks, prints, strict=True):
        record = {"fqn": fqn, "offsets": list(offsets), **_record(print_), "fingerprint": print_.scheme}
        frame = (frames or {}).get((fqn, tuple(offsets)))
        if frame is not None and _in_place(data, frame):
            record |= {"data_at": frame.data_at, "frame": frame.sha256}
        records.append(record)
    return records


def _in_place(data: torch.Tensor, frame: Frame) -> bool:
    """Whether verify may read this chunk's stored bytes as its elements: a plain dense tensor, C-contiguous (the
    planner stores it so), whose bytes fill the record's tensor entry."""
    return (data.layout == torch.strided and not data.is_quantized and data.is_contiguous()
            and data.numel() * data.element_size() == frame.data_bytes)


def build(*, step: int, world_size: int, records: Iterable[dict[str, Any]], files: Sequence[Path],
          command: Sequence[str] | None = None) -> dict:
    """The manifest document of a checkpoint whose chunks have `records` and whose JSON files are `files`;
    `command`: the traced command that saved it (under `detrace run`), if any."""
    from detrace.digest.kernels import selected_scheme

    tensors: dict[str, list[dict[str, Any]]] = {}
    schemes = set()
    for record in records:
        schemes.add(record["fingerprint"])
        tensors.setdefault(record["fqn"], []).append(
            {key: value for key, value in record.items() if key not in ("fqn", "fingerprint")})
    if len(schemes) > 1:
        raise CheckpointError(f"the ranks fingerprinted this checkpoint with different schemes "
                              f"({', '.join(sorted(schemes))}): set DETRACE_FINGERPRINT_SCHEME alike on every rank")
    for entries in tensors.values():
        entries.sort(key=lambda entry: entry["offsets"])
    document = {
        "schema": SCHEMA,
        "step": step,
        "world_size": world_size,
        "detrace": __version__,
        "torch": torch.__version__,
        "fingerprint": schemes.pop() if schemes else selected_scheme(),
        "files": {path.name: file_sha256(path) for path in sorted(files)},
        "tensors": dict(sorted(tensors.items())),
    }
    if command:
        document["command"] = list(command)
    return document


def read(directory: Path) -> Manifest:
    """The manifest of a checkpoint directory, validated."""
    if not (directory / MANIFEST_FILE).is_file():
        raise CheckpointError(f"{directory} is not a complete detrace checkpoint (it has no {MANIFEST_FILE})")
    manifest = read_json(directory / MANIFEST_FILE)
    schema = manifest.get("schema") if isinstance(manifest, dict) else None
    if isinstance(schema, str) and schema.startswith(_SCHEMA_FAMILY) and schema != SCHEMA:
        written_by = manifest.get("detrace")
        by = f" by detrace {written_by}" if isinstance(written_by, str) else ""
        raise CheckpointError(
            f"{directory} was written{by} in checkpoint format {schema}, and this detrace reads only {SCHEMA}"
        )
    if schema != SCHEMA:
        raise CheckpointError(f"{directory / MANIFEST_FILE} is not a detrace checkpoint manifest ({SCHEMA})")
    return Manifest.from_json(manifest, directory / MANIFEST_FILE)


def _is_int(value: object, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """A checkpoint's manifest, validated against its schema: what verify and load both rely on."""

    step: int
    """Completed optimizer steps at save time."""
    world_size: int
    """Ranks that saved it."""
    files: dict[str, str]
    """JSON file name -> SHA-256."""
    tensors: dict[str, list[dict[str, Any]]]
    """Tensor name -> its chunks: offsets, digest, dtype, shape, numel, and for a chunk read in place (every chunk
    this detrace writes) `data_at` and `frame` (detrace.state.records)."""
    fingerprint: str = SCHEME
    """The scheme of the chunk digests (detrace-fp1 in manifests that name none)."""
    command: tuple[str, ...] | None = None
    """The command of the traced run that saved it (`detrace run`, check-resume, locate...); None when it was
    saved outside one: which run it belongs to is then unknown."""

    @classmethod
    def from_json(cls, raw: dict[str, Any], source: Path) -> Manifest:
        """Validate a parsed manifest; raises CheckpointError naming `source` and the field."""

        def fail(what: str, wanted: str) -> CheckpointError:
            return CheckpointError(f"{source} is malformed: {what} must be {wanted}")

        if not _is_int(raw.get("step")):
            raise fail("field 'step'", "a non-negative integer")
        if not _is_int(raw.get("world_size"), 1):
            raise fail("field 'world_size'", "a positive integer")
        files = raw.get("files")
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            raise fail("field 'files'", "an object mapping file names to SHA-256 digests")
        tensors = raw.get("tensors")
        if not isinstance(tensors, dict):
            raise fail("field 'tensors'", "an object mapping tensor names to lists of chunks")
        for name, entries in tensors.items():
            if not isinstance(entries, list) or not all(_chunk_entry(e) for e in entries):
                raise fail(f"the chunks of tensor {name!r}", "objects with offsets, digest, dtype, shape and numel")
        fingerprint = raw.get("fingerprint", SCHEME)
        if fingerprint not in SCHEMES:
            raise fail("field 'fingerprint'", f"one of {', '.join(SCHEMES)}")
        command = raw.get("command")
        if command is not None and (not isinstance(command, list) or not all(isinstance(a, str) for a in command)):
            raise fail("field 'command'", "a list of strings")
        return cls(step=raw["step"], world_size=raw["world_size"], files=files, tensors=tensors,
                   fingerprint=fingerprint, command=None if command is None else tuple(command))


def _chunk_entry(entry: object) -> bool:
    if not isinstance(entry, dict):
        return False
    dims = [entry.get("offsets"), entry.get("shape")]
    framed = "data_at" in entry or "frame" in entry
    return (all(isinstance(d, list) and all(_is_int(v) for v in d) for d in dims)
            and isinstance(entry.get("digest"), str) and isinstance(entry.get("dtype"), str)
            and _is_int(entry.get("numel"))
            and (not framed or (_is_int(entry.get("data_at")) and isinstance(entry.get("frame"), str)
                                and _dtype(entry["dtype"]) is not None)))


def _dtype(name: str) -> torch.dtype | None:
    """The plain dtype a manifest names (`float32`), or None (not a dtype, or a quantized one, whose names all start
    with "q": no chunk of those is read in place)."""
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) and not name.startswith("q") else None


def verify(directory: Path, *, collective: bool) -> Manifest:
    """Check a checkpoint directory against its manifest; return the manifest.

    Collective (when loading): every rank of the process group verifies its share of the chunks (the whole
    checkpoint is read once in total) and all ranks agree on the verdict, so that none goes on to load while
    another has found damage. Otherwise this process checks everything by itself.
    Raises CheckpointCorrupted naming the tensors or files that do not match.
    """
    rank, world = dist.rank_and_world() if collective else (0, 1)
    problems: list[str] = []
    error: CheckpointError | None = None
    before = _listing(directory)
    try:
        manifest = read(directory)
        problems += _check_files(directory, manifest)
        if not problems:
            chunks = stored_chunks(directory)
            if rank == 0:
                problems += _check_coverage(manifest, chunks)
            problems += _check_chunks(directory, manifest, chunks[rank::world])
    except CheckpointCorrupted as err:
        problems.append(str(err))
    except CheckpointError as err:
        error = err
    if error is None and (changed := _changed(before, _listing(directory))) is not None:
        # A file truncated or rewritten meanwhile (a job saving over it) reads as damage that the checkpoint may
        # not have had: no verdict either way (exit 2), not "corrupted" (exit 1).
        error = CheckpointError(f"{directory / changed} changed while it was being verified")
    failed = error is not None or bool(problems)
    if dist.any_rank(failed) if collective else failed:
        if error is not None:
            raise error
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise CheckpointCorrupted(f"{directory}: {problems[0]}{more}")
        raise CheckpointCorrupted(f"{directory}: another rank found damage; see its error")
    return manifest


Listing = dict[str, "tuple[int, int, int, int] | None"]
"""A version directory's entries: name -> (inode, mode, size, modification time in ns) of what it names (a link
followed), None where that cannot be read."""


def _listing(directory: Path) -> Listing:
    listing: Listing = {}
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                try:
                    st = entry.stat()
                except OSError:
                    listing[entry.name] = None
                else:
                    listing[entry.name] = (st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns)
    except OSError:  # no directory there: `read` says so
        pass
    return listing


def _changed(before: Listing, after: Listing) -> str | None:
    """The first entry (by name) that appeared, went or changed between two listings, or None."""
    return next((name for name in sorted(before.keys() | after.keys())
                 if (name in before, before.get(name)) != (name in after, after.get(name))), None)


def rank_file(rank: int) -> str:
    """The name of the state file every rank writes into a checkpoint version."""
    return f"rank-{rank}.json"


def _check_files(directory: Path, manifest: Manifest) -> list[str]:
    # Every rank of the saving job wrote its state file: a manifest that lists fewer has lost a rank.
    problems = [f"rank {rank}'s state file {rank_file(rank)} is missing (the manifest says world size "
                f"{manifest.world_size})"
                for rank in range(manifest.world_size) if rank_file(rank) not in manifest.files]
    for name, digest in manifest.files.items():
        path = directory / name
        if Path(name).name != name:
            problems.append(f"file {name} is missing")
            continue
        try:  # refused before it is read: a FIFO in its place would block the read for ever
            os.close(open_regular(path))
        except CheckpointCorrupted as err:
            problems.append(str(err))
            continue
        if file_sha256(path) != digest:
            problems.append(f"file {name} does not match its checksum in the manifest")
    return problems


def _check_coverage(manifest: Manifest, chunks: list[StoredChunk]) -> list[str]:
    stored = {(chunk.fqn, chunk.offsets) for chunk in chunks}
    return [
        f"tensor {fqn!r} is in the manifest but not in the checkpoint"
        for fqn, entries in manifest.tensors.items()
        if any((fqn, tuple(entry["offsets"])) not in stored for entry in entries)
    ]


def _check_chunks(directory: Path, manifest: Manifest, chunks: list[StoredChunk]) -> list[str]:
    problems: list[str] = []
    expected = {
        (fqn, tuple(entry.pop("offsets"))): entry
        for fqn, entries in manifest.tensors.items()
        for entry in (dict(entry) for entry in entries)
    }
    known = []
    for chunk in chunks:
        if (chunk.fqn, chunk.offsets) in expected:
            known.append(chunk)
        else:
            problems.append(f"tensor {_describe(chunk)} has no fingerprint in the manifest")
    # Chunks whose manifest entry locates their bytes are read in place; the others (checkpoints written before
    # detrace.state.records existed) with torch's record reader.
    framed = [chunk for chunk in known if "frame" in expected[(chunk.fqn, chunk.offsets)]]
    others = [chunk for chunk in known if "frame" not in expected[(chunk.fqn, chunk.offsets)]]
    wanted = [_wanted(chunk, expected[(chunk.fqn, chunk.offsets)]) for chunk in framed]
    workers = torch.get_num_threads()
    done = 0
    for batch in read_batches(directory, wanted, batch_bytes=_BATCH_BYTES, workers=workers,
                              scheme=manifest.fingerprint):
        problems += _compare(manifest, expected, [(framed[done + i], data) for i, (_, data) in enumerate(batch)])
        done += len(batch)
    loaded: list[tuple[StoredChunk, torch.Tensor | CheckpointCorrupted]] = []
    size = 0
    for chunk, data in _read_ahead(directory, others, workers):
        loaded.append((chunk, data))
        size += data.numel() * data.element_size() if isinstance(data, torch.Tensor) else 0
        if size >= _BATCH_BYTES:
            problems += _compare(manifest, expected, loaded)
            loaded, size = [], 0
    return problems + _compare(manifest, expected, loaded)


def _wanted(chunk: StoredChunk, entry: dict[str, Any]) -> Wanted:
    dtype = _dtype(entry["dtype"])
    assert dtype is not None  # the manifest was validated
    shape = tuple(entry["shape"])
    data_bytes = entry["numel"] * dtype.itemsize
    return Wanted(fqn=chunk.fqn, label=_describe(chunk), file=chunk.file, start=chunk.start, length=chunk.length,
                  frame=Frame(data_at=entry["data_at"], data_bytes=data_bytes, sha256=entry["frame"]),
                  dtype=dtype, shape=shape)


def _compare(manifest: Manifest, expected: dict[tuple[str, tuple[int, ...]], dict[str, Any]],
             batch: Sequence[tuple[StoredChunk, torch.Tensor | Fingerprint | CheckpointCorrupted]]) -> list[str]:
    """The problems of a batch of read chunks (tensors, or fingerprints already computed while reading): damage
    found while reading, fingerprints that differ."""
    from detrace.digest import fingerprint_many

    tensors = [data for _, data in batch if isinstance(data, torch.Tensor)]
    prints = iter(fingerprint_many(tensors, scheme=manifest.fingerprint))
    problems = []
    for chunk, data in batch:
        if isinstance(data, CheckpointCorrupted):
            problems.append(str(data))
            continue
        entry = expected[(chunk.fqn, chunk.offsets)]
        print_ = next(prints) if isinstance(data, torch.Tensor) else data
        if _record(print_) != {key: entry[key] for key in ("digest", "dtype", "shape", "numel")}:
            problems.append(f"tensor {_describe(chunk)} does not match its fingerprint in the manifest")
    return problems


def _read_ahead(directory: Path, chunks: list[StoredChunk],
                workers: int) -> Iterator[tuple[StoredChunk, torch.Tensor | CheckpointCorrupted]]:
    """The chunks read back in order, the next `workers` of them read in threads while the caller hashes: file
    reads and torch's record reader release the GIL, so reading overlaps hashing. A damaged record comes back as
    its CheckpointCorrupted; any other CheckpointError is raised."""

    def load(chunk: StoredChunk) -> torch.Tensor | CheckpointCorrupted:
        try:
            return load_chunk(directory, chunk)
        except CheckpointCorrupted as err:
            return err

    if workers <= 1:
        yield from ((chunk, load(chunk)) for chunk in chunks)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="detrace-verify") as pool:
        pending: deque[tuple[StoredChunk, Future[torch.Tensor | CheckpointCorrupted]]] = deque()
        for chunk in chunks:
            pending.append((chunk, pool.submit(load, chunk)))
            if len(pending) > workers:
                first, future = pending.popleft()
                yield first, future.result()
        while pending:
            first, future = pending.popleft()
            yield first, future.result()


def _describe(chunk: StoredChunk) -> str:
    where = f" (chunk at {list(chunk.offsets)})" if any(chunk.offsets) else ""
    return f"{chunk.fqn!r}{where}"


def _record(print_: Any) -> dict[str, Any]:
    return {
        "digest": f"{print_.digest:x}",
        "dtype": str(print_.dtype),
        "shape": list(print_.shape),
        "numel": int(print_.numel),
    }
