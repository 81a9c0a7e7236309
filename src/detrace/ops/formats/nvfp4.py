"""NVFP4: blocks of 16 FP4 (E2M1) elements along the last dimension, one FP8 E4M3 scale per block, and one
FP32 scale per tensor, with the recipe NVIDIA's libraries use (Transformer Engine, cuBLAS block scaling):

- per tensor: ``s_enc = 448 * 6 / amax(x)`` (FP32; 1 when amax is 0 or the quotient is 0, capped at the
  largest FP32). The stored per-tensor scale is the decode scale ``tensor_scale = 1 / s_enc``.
- per block: ``block_scale = e4m3(amax(block) / 6 * s_enc)``, rounded to nearest-even, saturating at 448.
- elements: ``e2m1(x * (s_enc / block_scale))``, rounded to nearest with ties to even, saturating at 6; a
  block whose scale is 0 encodes zeros.
- decoding: ``element * block_scale * tensor_scale``.

Two E2M1 codes share a byte (element 2i in the low nibble), stored as ``torch.float4_e2m1fn_x2``. A NaN
anywhere makes the per-tensor scale NaN, so the tensor decodes to NaN; Inf saturates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from detrace.ops.formats.blocks import check_input, from_blocks, to_blocks
from detrace.ops.formats.elements import FP4_E2M1_MAX, e2m1_codes, e2m1_values, pack_fp4, to_fp8, unpack_fp4

NVFP4_BLOCK = 16
FP8_E4M3_MAX = 448.0


@dataclass(frozen=True, eq=False)
class NVFP4Tensor:
    """An NVFP4-encoded tensor: packed E2M1 elements, E4M3 block scales and an FP32 per-tensor scale."""

    data: torch.Tensor  # float4_e2m1fn_x2, shape [..., blocks * 8] (two elements per byte)
    block_scales: torch.Tensor  # float8_e4m3fn, shape [..., blocks]
    tensor_scale: torch.Tensor  # float32 scalar: the per-tensor decode scale
    shape: tuple[int, ...]  # logical shape of the encoded tensor

    @property
    def dtype(self) -> str:
        """The format name, which is what a fingerprint of this object records as its dtype."""
        return "nvfp4"

    def __detrace_components__(self) -> dict[str, torch.Tensor]:
        return {"data": self.data, "block_scales": self.block_scales, "tensor_scale": self.tensor_scale}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return nvfp4_decode(self, dtype)


def nvfp4_encode(x: torch.Tensor) -> NVFP4Tensor:
    """Encode a floating-point tensor to NVFP4 along its last dimension."""
    check_input(x, "nvfp4_encode")
    with torch.no_grad():
        blocks = to_blocks(x, NVFP4_BLOCK)
        amax = blocks.abs().amax() if blocks.numel() else torch.zeros((), device=blocks.device)
        s_enc = (FP8_E4M3_MAX * FP4_E2M1_MAX) / amax
        s_enc = s_enc.clamp(max=torch.finfo(torch.float32).max)
        s_enc = torch.where((amax == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)
        block_amax = blocks.abs().amax(dim=-1)
        block_scales = to_fp8(block_amax / FP4_E2M1_MAX * s_enc, torch.float8_e4m3fn)
        scale32 = block_scales.float()
        encode = torch.where(scale32 == 0, torch.zeros_like(scale32), s_enc / scale32)
        codes = e2m1_codes(blocks * encode.unsqueeze(-1))
        data = pack_fp4(codes.flatten(-2))
    return NVFP4Tensor(data=data, block_scales=block_scales, tensor_scale=1.0 / s_enc, shape=tuple(x.shape))


def nvfp4_decode(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode an NVFP4 tensor: element * block scale * per-tensor scale."""
    with torch.no_grad():
        scale32 = q.block_scales.float()
        elements = e2m1_values(unpack_fp4(q.data)).reshape(*scale32.shape, NVFP4_BLOCK)
        values = elements * scale32.unsqueeze(-1) * q.tensor_scale.float()
        return from_blocks(values, q.shape, dtype)
