"""The `detrace-fp2` kernel in Triton: the per-row lane sums of `detrace.digest.scheme`'s fp2 on a GPU.

One program hashes `BLOCK_ROWS` rows of `WIDTH` 32-bit words (16, 64, 256 or 1024: the planner's row widths);
each row's two sums are taken in 64-bit integers and reduced mod 2**32 at the end, so the bits do not depend on
how Triton orders the reduction. Imported only when a CUDA tensor is hashed with fp2 (importing Triton costs a
fraction of a second). Under `TRITON_INTERPRET=1` it runs on CPU tensors, which is how the tests hold it to the
reference without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from detrace.digest.scheme import MIXA, MIXB

_BLOCK_ROWS = 8


@triton.jit
def _round(x, C: tl.constexpr, S: tl.constexpr):
    x = x * tl.full(x.shape, C, tl.uint32)
    return x ^ (x >> S)


@triton.jit
def _fp2_rows_kernel(words, rowkeys, colkeys, out, n_rows,
                     WIDTH: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                     A0: tl.constexpr, A1: tl.constexpr, A2: tl.constexpr, A3: tl.constexpr, A4: tl.constexpr,
                     B0: tl.constexpr, B1: tl.constexpr, B2: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, WIDTH)
    live = rows < n_rows
    w = tl.load(words + rows[:, None] * WIDTH + cols[None, :], mask=live[:, None], other=0).to(tl.uint32, bitcast=True)
    key = tl.load(rowkeys + rows, mask=live, other=0).to(tl.uint64, bitcast=True)
    ka = (key & 0xFFFFFFFF).to(tl.uint32)
    kb = (key >> 32).to(tl.uint32)
    ta = tl.load(colkeys + cols).to(tl.uint32, bitcast=True)
    tb = tl.load(colkeys + 1024 + cols).to(tl.uint32, bitcast=True)
    xa = w ^ ta[None, :] ^ ka[:, None]
    xa = _round(_round(xa ^ (xa >> A0), A1, A2), A3, A4)  # mixA: two rounds
    xb = w ^ tb[None, :] ^ kb[:, None]
    xb = _round(xb ^ (xb >> B0), B1, B2)  # mixB: one round
    sa = tl.sum(xa.to(tl.uint64), axis=1) & 0xFFFFFFFF
    sb = tl.sum(xb.to(tl.uint64), axis=1) & 0xFFFFFFFF
    tl.store(out + rows, (sa | (sb << 32)).to(tl.int64, bitcast=True), mask=live)


def fp2_row_sums(words: torch.Tensor, rowkeys: torch.Tensor, colkeys: torch.Tensor) -> torch.Tensor:
    """Packed per-row (SA, SB) (int64 [N]) of int64 words [N, W] (read as 2W 32-bit words), row keys int64 [N]
    and the 2048 column keys (int32: TA then TB), all on one device."""
    w32 = words.contiguous().view(torch.int32)
    n, width = w32.shape
    out = torch.empty(n, dtype=torch.int64, device=words.device)
    (a0, ((a1, a2), (a3, a4))), (b0, ((b1, b2),)) = MIXA, MIXB
    if n:
        _fp2_rows_kernel[(triton.cdiv(n, _BLOCK_ROWS),)](w32, rowkeys.contiguous(), colkeys, out, n, WIDTH=width,
                                                        BLOCK_ROWS=_BLOCK_ROWS, A0=a0, A1=a1, A2=a2, A3=a3, A4=a4,
                                                        B0=b0, B1=b1, B2=b2)
    return out
