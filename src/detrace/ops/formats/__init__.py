"""Reference encoders of block-scaled low-precision formats, and the component protocol of quantized tensors.

- MXFP8 (OCP Microscaling v1.0): `mxfp8_encode` / `mxfp8_decode`, `MXFP8Tensor`.
- NVFP4: `nvfp4_encode` / `nvfp4_decode`, `NVFP4Tensor`.
- `fake_quantize(x, fmt)`: quantize-dequantize along the last dimension, for fake-quantized layers.

The component protocol: any object (a tensor subclass or not) with a method ``__detrace_components__(self)``
returning an ordered ``dict[str, Tensor]`` is fingerprinted as its components, each recorded separately, so
a diff can say whether the encoded data or a scale buffer changed. The encoders here are written for clarity
and exactness, not speed; they run on any device.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from detrace.errors import UsageError
from detrace.ops.formats.mx import MX_BLOCK, MXFP8Tensor, mxfp8_decode, mxfp8_encode
from detrace.ops.formats.nvfp4 import NVFP4_BLOCK, NVFP4Tensor, nvfp4_decode, nvfp4_encode

__all__ = [
    "FORMATS",
    "MX_BLOCK",
    "NVFP4_BLOCK",
    "MXFP8Tensor",
    "NVFP4Tensor",
    "QuantizedComponents",
    "fake_quantize",
    "mxfp8_decode",
    "mxfp8_encode",
    "nvfp4_decode",
    "nvfp4_encode",
]

FORMATS = ("mxfp8", "mxfp8_e5m2", "nvfp4")


@runtime_checkable
class QuantizedComponents(Protocol):
    """What `detrace.fingerprint` looks for on quantized tensors."""

    def __detrace_components__(self) -> dict[str, torch.Tensor]: ...


def fake_quantize(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Quantize `x` to `fmt` along its last dimension and decode it again: same shape, same dtype.

    A last dimension that is not a multiple of the block size is padded with zeros for encoding (zeros do
    not change any block's scale) and cropped afterwards. The result carries no gradient: fake-quantized
    layers pass gradients straight through, e.g. ``x + (fake_quantize(x, fmt) - x).detach()``.
    """
    if fmt == "mxfp8":
        return mxfp8_decode(mxfp8_encode(x, "e4m3"), x.dtype)
    if fmt == "mxfp8_e5m2":
        return mxfp8_decode(mxfp8_encode(x, "e5m2"), x.dtype)
    if fmt == "nvfp4":
        return nvfp4_decode(nvfp4_encode(x), x.dtype)
    raise UsageError(f"unknown format {fmt!r}; expected one of {', '.join(FORMATS)}")
