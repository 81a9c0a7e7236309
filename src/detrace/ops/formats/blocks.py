"""Blocking along the last dimension: pad to a whole number of blocks, view as [..., blocks, size]."""

from __future__ import annotations

import torch

from detrace.errors import UsageError


def check_input(x: torch.Tensor, what: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise UsageError(f"{what} needs a torch.Tensor, not {type(x).__name__}")
    if not (x.is_floating_point() and x.dtype.itemsize >= 2):
        raise UsageError(f"{what} needs a float16, bfloat16, float32 or float64 tensor, not {x.dtype}")


def to_blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """float32 [..., n_blocks, size] of `x` (a scalar counts as shape [1]), the last dim padded with zeros.

    float64 input is rounded to float32 first (the formats' usual inputs are float32, bfloat16, float16)."""
    x = x.float() if x.dim() else x.float().reshape(1)
    pad = -x.shape[-1] % size
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], x.shape[-1] // size, size)


def from_blocks(blocks: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Undo `to_blocks`: merge blocks, drop the padding, restore shape and dtype."""
    flat = blocks.flatten(-2)
    last = shape[-1] if shape else 1
    return flat[..., :last].reshape(shape).to(dtype)
