"""torch.distributed.checkpoint storage without pickle, and the fingerprints of what it writes.

DCP's file system writer stores tensors with `torch.save` (which its reader loads with `weights_only=True`;
verify reads their bytes in place instead, detrace.state.records) but pickles its `.metadata` file, and reading
that back would run arbitrary code from the checkpoint. The writer and reader here keep DCP's sharded,
rank-parallel data path and store the metadata as JSON instead (`dcp_metadata.json`). Non-tensor values never
reach DCP (see `detrace.state.tree`), so neither does DCP's pickled "bytes" item type.

`FingerprintingSavePlanner` records, after DCP's global planning and deduplication, exactly which chunks this
rank writes, so the manifest fingerprints the bytes that are on disk, once each, by the rank that wrote them.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from detrace.errors import CheckpointCorrupted, CheckpointError
from detrace.state.records import Frame, frame_of, open_regular

METADATA_FILE = "dcp_metadata.json"
_SCHEMA = "detrace.dcp-metadata/1"


@dataclass(frozen=True, kw_only=True)
class StoredChunk:
    """One chunk of one tensor as DCP stored it: where it sits in the tensor and in which file."""

    fqn: str
    """Flat key of the tensor in the saved state (e.g. `model.0.weight`)."""
    offsets: tuple[int, ...]
    """Position of the chunk in the whole tensor (all zeros for an unsharded tensor)."""
    file: str
    """File, relative to the checkpoint directory, that holds the chunk."""
    start: int
    """Byte offset of the chunk's record in that file."""
    length: int
    """Byte length of the record."""


class JsonFileSystemWriter(FileSystemWriter):
    """DCP's file system writer, with the metadata written as JSON instead of a pickle, that locates the tensor
    bytes of every record it wrote (`frames`), so that verify reads them in place (detrace.state.records)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.frames: dict[tuple[str, tuple[int, ...]], Frame] = {}
        """(fqn, offsets) -> the frame of the record this rank wrote for that chunk (none for a record that is not
        one plain tensor)."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        written = super().write_data(plan, planner)
        by_file: dict[str, list[WriteResult]] = {}
        for result in written.wait():  # DCP's file system writer has written everything when it returns
            by_file.setdefault(result.storage_data.relative_path, []).append(result)
        for name, results in by_file.items():
            with (Path(self.path) / name).open("rb") as stream:
                for result in results:
                    frame = frame_of(stream, result.storage_data.offset, result.storage_data.length)
                    if frame is not None:
                        self.frames[(result.index.fqn, tuple(result.index.offset or ()))] = frame
        return written

    def finish(self, metadata: Metadata, results: list[list[Any]]) -> None:
        storage = {result.index: result.storage_data for per_rank in results for result in per_rank}
        document = {
            "schema": _SCHEMA,
            "version": metadata.version,
            "tensors": {fqn: _tensor_to_json(fqn, entry) for fqn, entry in metadata.state_dict_metadata.items()},
            "storage": [
                {
                    "fqn": index.fqn,
                    "offsets": list(index.offset) if index.offset is not None else None,
                    "index": index.index,
                    "file": info.relative_path,
                    "start": info.offset,
                    "length": info.length,
                    "transforms": list(info.transform_descriptors or []),
                }
                for index, info in storage.items()
            ],
        }
        write_json(Path(self.path) / METADATA_FILE, document)


class JsonFileSystemReader(FileSystemReader):
    """DCP's file system reader, reading the JSON metadata of `JsonFileSystemWriter`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        metadata.storage_meta = StorageMeta(load_id=self.load_id)
        return metadata


class FingerprintingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that remembers the final (deduplicated) plan of this rank."""

    def __init__(self) -> None:
        # The state handed to DCP is already flat (see detrace.state.tree), so DCP's own flattening, and
        # the planner data it would store, are not needed.
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=True)
        self._written: SavePlan | None = None

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        self._written = super().finish_plan(new_plan)
        return self._written

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        # Stored C-contiguous (a copy only for a chunk that is not): a record's tensor bytes are then its elements
        # in order, which verify hashes in place without reading the strides from the record's pickle.
        data = super().resolve_data(write_item)
        return data.contiguous() if isinstance(data, torch.Tensor) else data

    def written_chunks(self) -> Iterator[tuple[str, tuple[int, ...], torch.Tensor]]:
        """(fqn, offsets, data) of every tensor chunk this rank wrote, valid after `dcp.save` returned."""
        if self._written is None:
            raise CheckpointError("the checkpoint writer finished without a save plan")
        for item in self._written.items:
            if item.type == WriteItemType.BYTE_IO:
                raise CheckpointError(f"{item.index.fqn!r} is not a tensor and cannot be stored without pickle")
            yield item.index.fqn, tuple(item.index.offset or ()), cast(torch.Tensor, self.resolve_data(item))


def read_metadata(directory: Path) -> Metadata:
    """The DCP metadata of a checkpoint directory, from its JSON file."""
    document = read_json(directory / METADATA_FILE)
    try:
        if document["schema"] != _SCHEMA:
            raise CheckpointError(f"{directory / METADATA_FILE} has schema {document['schema']!r}, not {_SCHEMA!r}")
        tensors: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {
            str(fqn): _tensor_from_json(entry) for fqn, entry in document["tensors"].items()
        }
        storage = {
            MetadataIndex(entry["fqn"], entry["offsets"], entry["index"]): _StorageInfo(
                entry["file"], entry["start"], entry["length"], entry["transforms"] or None
            )
            for entry in document["storage"]
        }
        return Metadata(state_dict_metadata=tensors, storage_data=storage, version=document["version"])
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CheckpointError(f"{directory / METADATA_FILE} is malformed ({err!r})") from None


def stored_chunks(directory: Path) -> list[StoredChunk]:
    """Every stored tensor chunk of a checkpoint directory, in a fixed order."""
    metadata = read_metadata(directory)
    chunks = [
        StoredChunk(
            fqn=index.fqn, offsets=tuple(index.offset or ()), file=info.relative_path, start=info.offset,
            length=info.length,
        )
        for index, info in metadata.storage_data.items()
    ]
    return sorted(chunks, key=lambda chunk: (chunk.fqn, chunk.offsets))


def load_chunk(directory: Path, chunk: StoredChunk) -> torch.Tensor:
    """The tensor stored as `chunk`, read straight from its file: a `torch.save` record, read only with torch's
    restricted unpickler (`weights_only=True`), never the general one."""
    path = directory / chunk.file
    if Path(chunk.file).name != chunk.file:
        raise CheckpointError(f"{directory / METADATA_FILE} points outside the checkpoint ({chunk.file!r})")
    try:
        with os.fdopen(open_regular(path), "rb") as stream:
            stream.seek(chunk.start)
            record = stream.read(chunk.length)
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror or err}") from None
    if len(record) != chunk.length:
        missing = chunk.length - len(record)
        raise CheckpointCorrupted(f"{path} is truncated: tensor {chunk.fqn!r} is missing {missing} bytes")
    try:
        data = torch.load(io.BytesIO(record), map_location="cpu", weights_only=True)
    except Exception as err:  # any damage to the record surfaces as some exception of torch's reader
        raise CheckpointCorrupted(
            f"tensor {chunk.fqn!r} cannot be read back from {path} ({type(err).__name__})"
        ) from None
    if not isinstance(data, torch.Tensor):
        raise CheckpointError(f"{path} holds a {type(data).__name__} where tensor {chunk.fqn!r} should be")
    return data


def write_json(path: Path, document: Any) -> None:
    """Write JSON and make it durable (fsync) before returning: the commit protocol renames after this."""
    data = json.dumps(document, indent=1, sort_keys=True).encode()
    with path.open("wb") as stream:
        stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())


def read_json(path: Path) -> Any:
    """Read a JSON file of a checkpoint; a missing or malformed one is a CheckpointError (missing, or not a
    regular file: CheckpointCorrupted, see `open_regular`)."""
    try:
        with os.fdopen(open_regular(path), "rb") as stream:
            return json.loads(stream.read())
    except OSError as err:
        raise CheckpointError(f"cannot read {path}: {err.strerror or err}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err})") from None


def _tensor_to_json(fqn: str, entry: Any) -> dict[str, Any]:
    if not isinstance(entry, TensorStorageMetadata) or entry.properties.layout != torch.strided:
        raise CheckpointError(f"{fqn!r} is not a dense tensor and cannot be stored without pickle")
    return {
        "dtype": str(entry.properties.dtype).removeprefix("torch."),
        "requires_grad": entry.properties.requires_grad,
        "size": list(entry.size),
        "chunks": [{"offsets": list(chunk.offsets), "sizes": list(chunk.sizes)} for chunk in entry.chunks],
    }


def _tensor_from_json(entry: dict[str, Any]) -> TensorStorageMetadata:
    dtype = getattr(torch, entry["dtype"])
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {entry['dtype']!r}")
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=dtype, requires_grad=entry["requires_grad"]),
        size=torch.Size(entry["size"]),
        chunks=[
            ChunkStorageMetadata(offsets=torch.Size(chunk["offsets"]), sizes=torch.Size(chunk["sizes"]))
            for chunk in entry["chunks"]
        ],
    )
