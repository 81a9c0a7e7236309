"""MXFP8 (OCP Microscaling Formats v1.0): blocks of 32 elements along the last dimension, one E8M0 scale
per block, elements in FP8 E4M3 (``mxfp8``) or E5M2 (``mxfp8_e5m2``).

Encoding one block V[0..31] (spec section 6.3):

- ``shared_exp = floor(log2(max|V|)) - emax_elem`` with ``emax_elem`` = 8 (E4M3) or 15 (E5M2), clamped to
  the E8M0 range [-127, 127]; the scale is ``X = 2**shared_exp``, stored as the byte ``shared_exp + 127``.
- ``P[i] = V[i] / X`` rounded to nearest-even in the element type; values beyond its largest normal number
  saturate to it (so 1.75 * 2**emax is the top, and a block maximum with a larger mantissa is clipped).
- Decoding is ``P[i] * X``.

Choices the spec leaves open, made here the way common implementations make them: an all-zero block gets
the smallest scale (byte 0, ``2**-127``); a block whose maximum is Inf or NaN gets the NaN scale (byte 255),
so the whole block decodes to NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from detrace.errors import UsageError
from detrace.ops.formats.blocks import check_input, from_blocks, to_blocks
from detrace.ops.formats.elements import FP8_DTYPES, FP8_EMAX, exp2i, to_fp8

MX_BLOCK = 32
E8M0_BIAS = 127
E8M0_NAN = 255


@dataclass(frozen=True, eq=False)
class MXFP8Tensor:
    """An MXFP8-encoded tensor: FP8 elements and one E8M0 scale per 32-element block of the last dim."""

    data: torch.Tensor  # float8_e4m3fn or float8_e5m2, shape [..., blocks * 32] (last dim zero-padded)
    scales: torch.Tensor  # float8_e8m0fnu, shape [..., blocks]
    shape: tuple[int, ...]  # logical shape of the encoded tensor
    elem: str = "e4m3"  # "e4m3" or "e5m2"

    @property
    def dtype(self) -> str:
        """The format name, which is what a fingerprint of this object records as its dtype."""
        return f"mxfp8_{self.elem}"

    def __detrace_components__(self) -> dict[str, torch.Tensor]:
        return {"data": self.data, "scales": self.scales}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return mxfp8_decode(self, dtype)


def mxfp8_encode(x: torch.Tensor, elem: str = "e4m3") -> MXFP8Tensor:
    """Encode a floating-point tensor to MXFP8 along its last dimension."""
    check_input(x, "mxfp8_encode")
    if elem not in FP8_DTYPES:
        raise UsageError(f"MXFP8 elements are 'e4m3' or 'e5m2', not {elem!r}")
    with torch.no_grad():
        blocks = to_blocks(x, MX_BLOCK)
        amax = blocks.abs().amax(dim=-1)
        # frexp gives amax = m * 2**e with m in [0.5, 1): floor(log2(amax)) = e - 1, exactly (subnormals too).
        _, exponent = torch.frexp(amax)
        shared = (exponent.to(torch.int32) - 1 - FP8_EMAX[elem]).clamp(-E8M0_BIAS, E8M0_BIAS)
        shared = torch.where(amax == 0, -E8M0_BIAS, shared)
        biased = torch.where(torch.isfinite(amax), shared + E8M0_BIAS, E8M0_NAN).to(torch.uint8)
        # Dividing by X = 2**shared is exact in float32 except far below the FP8 range, where both round to 0.
        scaled = blocks * exp2i(-shared).unsqueeze(-1)
        data = to_fp8(scaled, FP8_DTYPES[elem])
    return MXFP8Tensor(
        data=data.flatten(-2),
        scales=biased.view(torch.float8_e8m0fnu),
        shape=tuple(x.shape),
        elem=elem,
    )


def mxfp8_decode(q: MXFP8Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode an MXFP8 tensor: element times 2**(scale byte - 127); a NaN scale makes its block NaN."""
    with torch.no_grad():
        biased = q.scales.view(torch.uint8)
        elements = q.data.float().reshape(*biased.shape, MX_BLOCK)
        values = elements * exp2i(biased.to(torch.int32) - E8M0_BIAS).unsqueeze(-1)
        values = torch.where((biased == E8M0_NAN).unsqueeze(-1), float("nan"), values)
        return from_blocks(values, q.shape, dtype)
