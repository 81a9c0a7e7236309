"""The capture format of the kernel rung: one op call's inputs and outputs, saved for replay.

A capture is a safetensors file (no pickle). Every tensor is stored as the raw bytes of its contiguous copy
(a flat uint8 tensor), so every dtype torch has round-trips, float8/float4/complex/unsigned included; its dtype
and shape live in the file's metadata. The call's non-tensor arguments are stored as JSON in which tensors are
replaced by references ({"tensor": "in3"}), so the call can be rebuilt exactly: `torch.ops.<ns>.<op>.<overload>`
applied to the decoded args and kwargs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from detrace.errors import TraceError

CAPTURE_VERSION = "detrace.capture/1"
CODE_HASH = "code_sha256"
"""The meta key of the SHA-256 of a compiled kernel's output code file, taken when the capture was made:
`detrace replay --trust-code` runs that file only while its bytes still have this hash."""
_KINDS = frozenset({"tensor", "list", "tuple", "dict", "dtype", "device", "torch", "value"})


@dataclass(frozen=True)
class Capture:
    """One captured op call."""

    op: str
    """Qualified op overload name, e.g. "aten.index_put_.default"."""
    args: list[Any]
    kwargs: dict[str, Any]
    outputs: list[torch.Tensor]
    """The outputs the traced run produced (tensors only, in order)."""
    meta: dict[str, Any]
    """Where it came from: rank, step, phase, module, occurrence, threads, deterministic flag..."""


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise TraceError(f"capture names unknown dtype {name!r}")
    return dtype


class _Encoder:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self.layout: dict[str, dict[str, Any]] = {}

    def tensor(self, value: torch.Tensor, prefix: str) -> str:
        key = f"{prefix}{len(self.tensors)}"
        data = value.detach().to("cpu").contiguous()
        flat = data.reshape(-1).view(torch.uint8) if data.numel() else torch.empty(0, dtype=torch.uint8)
        self.tensors[key] = flat.clone()
        self.layout[key] = {"dtype": str(data.dtype).removeprefix("torch."), "shape": list(data.shape),
                            "device": str(value.device), "requires_grad": bool(value.requires_grad)}
        return key

    def encode(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return {"tensor": self.tensor(value, "in")}
        if isinstance(value, (list, tuple)):
            return {"list" if isinstance(value, list) else "tuple": [self.encode(v) for v in value]}
        if isinstance(value, dict):
            return {"dict": {str(k): self.encode(v) for k, v in value.items()}}
        if isinstance(value, torch.dtype):
            return {"dtype": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"device": str(value)}
        if isinstance(value, (torch.memory_format, torch.layout)):
            return {"torch": str(value).removeprefix("torch.")}
        if value is None or isinstance(value, (bool, int, float, str)):
            return {"value": value}
        raise TraceError(f"cannot capture an argument of type {type(value).__name__}")


def save_capture(path: str | Path, *, op: str, args: tuple | list, kwargs: dict[str, Any],
                 outputs: list[torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write one op call to `path` (a .safetensors file)."""
    encoder = _Encoder()
    call = {"args": [encoder.encode(a) for a in args], "kwargs": {k: encoder.encode(v) for k, v in kwargs.items()}}
    out_keys = [encoder.tensor(t, "out") for t in outputs]
    header = {"schema": CAPTURE_VERSION, "op": op, "call": call, "outputs": out_keys,
              "layout": encoder.layout, "meta": meta}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(encoder.tensors, str(tmp), metadata={"detrace": json.dumps(header)})
    tmp.replace(path)
    return path


def load_capture(path: str | Path) -> Capture:
    """Read a capture back; tensors come back on the CPU with their original dtype and shape."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"capture file {path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
        raw = load_file(str(path))
        header = json.loads(metadata["detrace"])
    except (SafetensorError, KeyError, ValueError, OSError) as err:
        raise TraceError(f"{path} is not a readable detrace capture: {err}") from None
    if header.get("schema") != CAPTURE_VERSION:
        raise TraceError(f"{path} has capture schema {header.get('schema')!r}; expected {CAPTURE_VERSION}")

    def tensor(key: str) -> torch.Tensor:
        spec = header["layout"][key]
        dtype = _dtype(spec["dtype"])
        flat = raw[key]
        if flat.numel() == 0:
            return torch.empty(spec["shape"], dtype=dtype)
        return flat.view(dtype).reshape(spec["shape"])

    def decode(node: Any) -> Any:
        if not isinstance(node, dict) or len(node) != 1 or next(iter(node)) not in _KINDS:
            raise TraceError(f"{path} is not a readable detrace capture: its call holds {json.dumps(node)}, "
                             f"not an object with one key of {', '.join(sorted(_KINDS))}")
        (kind, value), = node.items()
        if kind == "tensor":
            return tensor(value)
        if kind in ("list", "tuple"):
            items = [decode(v) for v in value]
            return items if kind == "list" else tuple(items)
        if kind == "dict":
            return {k: decode(v) for k, v in value.items()}
        if kind == "dtype":
            return _dtype(value)
        if kind == "device":
            return torch.device(value)
        if kind == "torch":
            return getattr(torch, value)
        return value

    try:
        call = header["call"]
        return Capture(op=str(header["op"]), args=[decode(a) for a in call["args"]],
                       kwargs={str(k): decode(v) for k, v in call["kwargs"].items()},
                       outputs=[tensor(k) for k in header["outputs"]], meta=dict(header["meta"]))
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as err:
        # A header of the right schema whose parts have the wrong shape or type (a shared file, edited by hand).
        raise TraceError(f"{path} is not a readable detrace capture: its header is malformed "
                         f"({type(err).__name__}: {err})") from None


def resolve_op(name: str) -> Any:
    """`"aten.index_put_.default"` -> `torch.ops.aten.index_put_.default`."""
    namespace, _, rest = name.partition(".")
    packet, _, overload = rest.partition(".")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")
    except (AttributeError, RuntimeError):
        raise TraceError(f"op {name!r} does not exist in this PyTorch build") from None
