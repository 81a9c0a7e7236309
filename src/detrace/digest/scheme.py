"""The definition of the fingerprint scheme ``detrace-fp1``, in NumPy, and the `Fingerprint` record.

The digest is defined on the tensor's logical bytes, so it depends only on bits, shape and dtype, never on
strides, storage offset, device, thread count or process:

1. Take the tensor's elements in C order as little-endian bytes and pad them with zero bytes to a multiple of
   4096. Read the result as rows of 512 unsigned 64-bit words ``w[r, c]``.
2. Key every position: ``K[r, c] = T[c] ^ RK(r)``. ``T[c]`` holds 55 fixed pseudo-random bits above the
   column number ``c`` (low 9 bits), and ``RK(r)`` is a bijection of the row number shifted left by 9 bits.
   So no two positions share a key.
3. ``S = sum over all words of mix(w[r, c] ^ K[r, c])  (mod 2**64)``, where ``mix`` is the murmur3 64-bit
   finalizer: xorshifts and multiplications by odd constants, a bijection of 64-bit words.
4. ``digest = (S + H(dtype, shape)) mod 2**64``, where ``H`` is an 8-byte BLAKE2b of the dtype name and the
   shape. Python's salted ``hash()`` is never used.

Why this gives the guarantees (docs/fingerprint.md has the long form):

- Integer addition mod 2**64 is associative and commutative, so any reduction order, thread count or
  device gives the same bits.
- A change confined to one 64-bit word changes ``mix(w ^ K)`` (a bijection) and so changes ``S`` by a
  nonzero amount mod 2**64: one flipped bit, one changed element of a dtype up to 8 bytes, and a swap of two
  elements that share a word always change the digest. Changes spread over several words change it except
  with probability about 2**-64.
- Positions enter through distinct keys ahead of a nonlinear mix, so permutations, transposes and adjacent
  swaps change the digest, and two equal changes at two positions do not cancel (XOR-folds such as
  ``torch.hash_tensor`` miss all three).
- Shape and dtype enter through ``H``: an empty tensor, an all-zero tensor and a zero scalar differ.

This module is the definition written to read like the steps above (NumPy ``uint64`` arithmetic wraps mod
2**64); the reference implementation is built from it, and the faster kernels (`detrace.digest.kernels`,
`detrace.digest.native`) are held to it by the tests. An object made of several tensors (a quantized tensor)
is fingerprinted through its components, combined by `combine`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

SCHEME = "detrace-fp1"

ROW_WORDS = 512  # 64-bit words per row
ROW_BYTES = ROW_WORDS * 8  # 4096
COL_BITS = 9  # log2(ROW_WORDS): the low bits of a key hold the column
M64 = (1 << 64) - 1
M55 = (1 << 55) - 1

# murmur3 fmix64 constants (odd, so each multiplication is a bijection mod 2**64)
MIX_C1 = 0xFF51AFD7ED558CCD
MIX_C2 = 0xC4CEB9FE1A85EC53
MIX_SHIFT = 33
# row-key bijection on 55-bit numbers: add, multiply by odd constants, xorshift (all mod 2**55)
RK_ADD = 0x2545F4914F6CDD1 & M55
RK_C1 = 0x5851F42D4C957F2D & M55 | 1
RK_C2 = 0x14057B7EF767814F & M55 | 1
RK_S1, RK_S2 = 28, 29


def signed(x: int) -> int:
    """The int64 with the same bits as the unsigned 64-bit `x`."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


# Column keys: 55 pseudo-random bits above the column number.
T_U64 = np.array(
    [((_splitmix64(0xDE7_4ACE_0000 + c) >> COL_BITS) << COL_BITS) | c for c in range(ROW_WORDS)],
    dtype=np.uint64,
)


# ---------------------------------------------------------------------------------------------------------
# The definition in NumPy (uint64 arithmetic wraps mod 2**64)


def np_mix(x: np.ndarray) -> np.ndarray:
    s = np.uint64(MIX_SHIFT)
    x = x ^ (x >> s)
    x = x * np.uint64(MIX_C1)
    x = x ^ (x >> s)
    x = x * np.uint64(MIX_C2)
    return x ^ (x >> s)


def np_rowkeys(rows: np.ndarray) -> np.ndarray:
    """RK(r) for an array of row numbers: a bijection of r < 2**55, shifted above the column bits."""
    m = np.uint64(M55)
    x = (rows.astype(np.uint64) + np.uint64(RK_ADD)) & m
    x = (x * np.uint64(RK_C1)) & m
    x = x ^ (x >> np.uint64(RK_S1))
    x = (x * np.uint64(RK_C2)) & m
    x = x ^ (x >> np.uint64(RK_S2))
    return x << np.uint64(COL_BITS)


def np_row_sums(words: np.ndarray, rowkeys: np.ndarray) -> np.ndarray:
    """Per-row sums (uint64, wrapping) of mix(w ^ T[c] ^ rk[r]) for words [N, W] and row keys [N]."""
    keys = T_U64[None, : words.shape[1]] ^ rowkeys[:, None]
    return np_mix(words ^ keys).sum(axis=1, dtype=np.uint64)


RK0 = int(np_rowkeys(np.zeros(1, dtype=np.int64))[0])
# Z0[W]: what the zero padding in columns W..511 of row 0 adds, so a row-0 piece can be hashed W words wide.
Z0 = [int(v) for v in np.concatenate([np.cumsum(np_mix(T_U64 ^ np.uint64(RK0))[::-1], dtype=np.uint64)[::-1],
                                      np.zeros(1, dtype=np.uint64)])]


@lru_cache(maxsize=65536)
def header(dtype: str, shape: tuple[int, ...]) -> int:
    text = f"{SCHEME}|{dtype}|{','.join(map(str, shape))}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def np_bytes_sum(data: np.ndarray) -> int:
    """S for a 1-D uint8 array: pad to whole rows, key, mix, sum (the definition, step by step)."""
    if data.size == 0:
        return 0
    rows = -(-data.size // ROW_BYTES)
    padded = np.zeros(rows * ROW_BYTES, dtype=np.uint8)
    padded[: data.size] = data
    words = padded.view("<u8").reshape(rows, ROW_WORDS)
    return int(np_row_sums(words, np_rowkeys(np.arange(rows))).sum(dtype=np.uint64))


# ---------------------------------------------------------------------------------------------------------
# The public record


@dataclass(frozen=True)
class Fingerprint:
    """The fingerprint of one tensor (or of a quantized tensor, through its components)."""

    digest: int  # unsigned 64-bit
    dtype: str  # torch dtype name without "torch.", or the format name of a component object
    shape: tuple[int, ...]
    numel: int
    chunks: tuple[int, ...] | None = None  # chunk-wise mode: one digest per chunk along chunk_dim
    chunk_dim: int | None = None
    components: tuple[tuple[str, Fingerprint], ...] = ()  # quantized tensors: ("data", fp), ("scales", fp)

    @property
    def hex(self) -> str:
        return f"{self.digest:016x}"

    def __str__(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        return f"{self.hex} {self.dtype}[{shape}]"


def combine(dtype: str, shape: tuple[int, ...], parts: tuple[tuple[str, Fingerprint], ...]) -> int:
    """The digest of a component object: BLAKE2b of its dtype, shape and each named component digest."""
    text = "|".join(f"{name}={fp.hex}" for name, fp in parts)
    head = f"{SCHEME}:components|{dtype}|{','.join(map(str, shape))}|{text}"
    return int.from_bytes(hashlib.blake2b(head.encode(), digest_size=8).digest(), "little")
