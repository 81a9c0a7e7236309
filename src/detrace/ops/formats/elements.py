"""Element types of the block formats: FP8 (E4M3, E5M2) with saturation, and FP4 E2M1 codes."""

from __future__ import annotations

import torch

FP4_E2M1_MAX = 6.0
# The eight magnitudes of E2M1, indexed by the 3-bit code (exponent bits then the mantissa bit).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
# Exponent of the largest normal number of each element type (448 = 1.75 * 2**8, 57344 = 1.75 * 2**15).
FP8_EMAX = {"e4m3": 8, "e5m2": 15}


def exp2i(k: torch.Tensor) -> torch.Tensor:
    """Exactly 2**k as float32 for integer k in [-127, 127], built from its bits (pow/ldexp need not be exact
    on every device). 2**-127 is the subnormal with only bit 22 set."""
    k = k.to(torch.int32)
    bits = torch.where(k >= -126, (k + 127) << 23, torch.full_like(k, 1 << 22))
    return bits.view(torch.float32)


def to_fp8(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Round float32 `x` to nearest-even in `dtype`, saturating at the largest finite value (NaN stays NaN).

    The clamp makes saturation explicit: PyTorch's own casts overflow to Inf (E5M2) and have differed
    between releases for E4M3.
    """
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (sign bit 8, magnitude code 0..7) of float32 `x`: round to nearest, ties to an even
    code (the mantissa bit 0), saturating at 6. NaN gets code 0; a NaN block scale makes it decode to NaN."""
    a = x.abs()
    # Midpoints between neighbouring magnitudes; at a tie the even code wins, hence the mix of > and >=.
    magnitude = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    return magnitude | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of 4-bit E2M1 codes (uint8, 0..15)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    magnitude = table[(codes & 7).long()]
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes [..., 2n] into float4_e2m1fn_x2 [..., n]: element 2i in the low nibble, 2i+1 in the high
    nibble (the layout PyTorch's float4_e2m1fn_x2 matmul tests and cuBLAS use)."""
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous().view(torch.float4_e2m1fn_x2)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Codes [..., 2n] (uint8) of float4_e2m1fn_x2 [..., n]."""
    raw = packed.view(torch.uint8)
    return torch.stack((raw & 15, raw >> 4), dim=-1).reshape(*raw.shape[:-1], raw.shape[-1] * 2)
