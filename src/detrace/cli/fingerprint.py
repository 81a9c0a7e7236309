"""`detrace fingerprint [FILE]`: fingerprints of the tensors in a file, or a demo of what they catch.

With FILE (a `torch.save` file, read with ``weights_only=True``, or a ``.safetensors`` file), prints one line
per tensor: digest, dtype, shape and its name inside the file. Without FILE, shows on a small tensor that a
permutation, an adjacent swap and two equal changes alter detrace's digest but not `torch.hash_tensor`.
`--scheme fp1|fp2` picks the fingerprint scheme (default: DETRACE_FINGERPRINT_SCHEME, else fp1).
"""

from __future__ import annotations

import json
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from detrace.cli._args import ArgumentParser
from detrace.errors import CheckpointError, UsageError

# safetensors dtype names -> torch dtypes (the format is small enough to read without the package)
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8, "BOOL": torch.bool,
    "C64": torch.complex64,
}


def _parser() -> ArgumentParser:
    parser = ArgumentParser("fingerprint", __doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", help="a torch.save (.pt) or .safetensors file; omit for a demo")
    parser.add_argument("--chunks", type=int, help="also print N chunk digests per tensor along --dim")
    parser.add_argument("--dim", type=int, default=0, help="dimension for --chunks (default 0)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per tensor")
    parser.add_argument("--scheme", choices=("fp1", "fp2"),
                        help="fingerprint scheme (default: DETRACE_FINGERPRINT_SCHEME, else fp1)")
    return parser


def _walk(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(name, leaf) pairs of nested dicts/lists/tuples, names joined with dots, in file order."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _walk(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _walk(value, f"{prefix}.{i}" if prefix else str(i))
    else:
        yield prefix or "<root>", obj


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a .safetensors file, memory-mapped (copy-on-write: the file is never modified)."""
    mapped = np.memmap(path, dtype=np.uint8, mode="c") if path.stat().st_size else np.zeros(0, dtype=np.uint8)
    if mapped.size < 8:
        raise CheckpointError(f"{path} is too short to be a safetensors file")
    (size,) = struct.unpack("<Q", mapped[:8].tobytes())
    if size > mapped.size - 8:  # a slice past the end would be empty: "0 tensors" for a broken file
        raise CheckpointError(f"{path} has no valid safetensors header: its header length {size} runs past the "
                              f"end of the file ({mapped.size} bytes)")
    try:
        header = json.loads(mapped[8 : 8 + size].tobytes())
        entries = {name: info for name, info in header.items() if name != "__metadata__"}
        layout = {name: (info["dtype"], info["shape"], info["data_offsets"]) for name, info in entries.items()}
    except (ValueError, UnicodeDecodeError, TypeError, KeyError, AttributeError) as err:
        raise CheckpointError(f"{path} has no valid safetensors header ({type(err).__name__}: {err})") from None
    tensors = {}
    for name, (dtype_name, shape, (begin, end)) in layout.items():
        dtype = _SAFETENSORS_DTYPES.get(dtype_name)
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name!r} has an unsupported dtype {dtype_name!r}")
        data = torch.from_numpy(mapped[8 + size + begin : 8 + size + end])
        try:
            if data.data_ptr() % dtype.itemsize:  # bytes not aligned for this dtype: copy them
                data = data.clone()
            tensors[name] = data.view(dtype).reshape(shape)
        except (RuntimeError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: tensor {name!r} does not match its header ({err})") from None
    return tensors


def _load(path: Path) -> list[tuple[str, Any]]:
    if not path.exists():
        raise UsageError(f"no such file: {path}")
    if not path.is_file():  # a FIFO would block the read for ever, a device never ends
        raise UsageError(f"{path} is not a regular file (a FIFO, a device or a directory); fingerprint reads "
                         "only regular files")
    if path.suffix == ".safetensors":
        return list(_walk(_read_safetensors(path)))
    with path.open("rb") as handle:
        magic = handle.read(4)
    if magic[:2] != b"PK" and magic[:1] != b"\x80":
        raise CheckpointError(f"{path} is neither a torch.save file nor a .safetensors file")
    try:  # zip-format files are memory-mapped, so a large checkpoint is not read into memory at once
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=magic[:2] == b"PK")
    except Exception as err:  # torch.load raises many kinds; all mean "unreadable"
        lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
        reason = next((line for line in lines if "Unpickler error" in line), lines[0])
        raise CheckpointError(f"cannot read {path} as a weights-only torch file: {reason}") from None
    return list(_walk(obj))


def _fingerprint_file(path: Path, chunks: int | None, dim: int, as_json: bool, scheme: str | None) -> int:
    from detrace.digest import fingerprint_many

    start = time.perf_counter()
    items = _load(path)
    named = [(name, value) for name, value in items if isinstance(value, torch.Tensor)]
    skipped = len(items) - len(named)
    values = [value for _, value in named]
    # --chunks reaches the tensors that have dimension --dim; the others (scalars, say) get plain digests
    chunked = [chunks is not None and -v.dim() <= dim < v.dim() for v in values]
    if chunks is not None and values and not any(chunked):
        raise UsageError(f"--dim {dim} is a dimension of no tensor in {path} (they have at most "
                         f"{max(v.dim() for v in values)}); --chunks needs one they have")
    with_chunks = iter(fingerprint_many([v for v, c in zip(values, chunked, strict=True) if c], chunks=chunks, dim=dim,
                                        scheme=scheme))
    plain = iter(fingerprint_many([v for v, c in zip(values, chunked, strict=True) if not c], scheme=scheme))
    fingerprints = [next(with_chunks) if c else next(plain) for c in chunked]
    for (name, _), fp in zip(named, fingerprints, strict=True):
        if as_json:
            record = {"name": name, "digest": fp.hex, "dtype": fp.dtype, "shape": list(fp.shape),
                      "numel": fp.numel, "chunks": None if fp.chunks is None else [f"{c:016x}" for c in fp.chunks],
                      "scheme": fp.scheme}
            print(json.dumps(record))
            continue
        shape = "x".join(map(str, fp.shape)) or "scalar"
        print(f"{fp.hex}  {fp.dtype:<14} {shape:<18} {name}")
        if fp.chunks is not None:
            print("    chunks along dim {}: {}".format(fp.chunk_dim, " ".join(f"{c:016x}" for c in fp.chunks)))
    if not as_json:
        total = sum(value.numel() * value.element_size() for _, value in named)
        note = f", skipped {skipped} non-tensor values" if skipped else ""
        print(f"{len(named)} tensors, {total} bytes, {time.perf_counter() - start:.2f} s{note}", file=sys.stderr)
    return 0


def _demo(scheme: str | None) -> int:
    from detrace.digest import fingerprint

    base = torch.arange(1.0, 9.0)  # [1, 2, ..., 8], float32
    swapped = base.clone()
    swapped[[2, 3]] = swapped[[3, 2]]
    reversed_ = base.flip(0)
    pair = base.clone()
    pair[[1, 5]] = (pair[[1, 5]].view(torch.int32) ^ 1).view(torch.float32)  # the same bit flipped twice
    single = base.clone()
    single[4] = torch.nextafter(single[4], torch.tensor(float("inf")))
    rows = [("original", base), ("adjacent swap (x[2] <-> x[3])", swapped), ("permutation (reversed)", reversed_),
            ("equal change at two positions", pair), ("one element, one ulp up", single)]

    def hash_tensor(t: torch.Tensor) -> str:
        fn = getattr(torch, "hash_tensor", None)
        return f"{fn(t).view(torch.int64).item() & ((1 << 64) - 1):016x}" if fn is not None else "(needs torch>=2.8)"

    print(f"x = {base.tolist()} (float32)\n")
    print(f"{'change':<32} {'detrace fingerprint':<20} {'torch.hash_tensor':<20}")
    first_fp, first_hash = fingerprint(base, scheme=scheme).hex, hash_tensor(base)
    for label, tensor in rows:
        fp, hashed = fingerprint(tensor, scheme=scheme).hex, hash_tensor(tensor)
        fp_mark = "" if tensor is base else ("  changed" if fp != first_fp else "  SAME")
        hash_mark = "" if tensor is base else ("  changed" if hashed != first_hash else "  SAME")
        print(f"{label:<32} {fp + fp_mark:<20} {hashed + hash_mark}")
    print("\ntorch.hash_tensor XOR-folds the elements, so order is invisible and equal changes cancel;")
    print("detrace keys each position and mixes before summing, so every one of these changes is caught.")
    return 0


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.chunks is not None and args.chunks < 1:
        raise UsageError("--chunks must be a positive integer")
    if args.file is None:
        if args.chunks is not None or args.json:
            raise UsageError("--chunks and --json need a FILE")
        return _demo(args.scheme)
    return _fingerprint_file(Path(args.file), args.chunks, args.dim, args.json, args.scheme)
