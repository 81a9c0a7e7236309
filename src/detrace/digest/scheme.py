"""The definitions of the fingerprint schemes ``detrace-fp1`` and ``detrace-fp2``, in NumPy; the `Fingerprint` record.

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

``detrace-fp2`` (format version 2, selected with ``DETRACE_FINGERPRINT_SCHEME=fp2``) keeps the rows of 4096 bytes
and the keyed sum, in 32-bit lanes that vector units multiply natively (fp1's 64-bit multiplies are emulated in
vector code), so it hashes faster than memory is read:

1. The same zero-padded rows, read as 1024 unsigned 32-bit words ``w[r, c]``.
2. Two keys per position: ``A[r, c] = TA[c] ^ RA(r)`` and ``B[r, c] = TB[c] ^ RB(r)``, 32 bits each, the column
   number in the low 10 bits of ``TA[c]``/``TB[c]`` and a 22-bit bijection of the row above them. ``RA`` keys the
   row number modulo 2**22 and ``RB`` the row's high bits XOR its low bits, so the pair ``(A, B)`` differs at
   every two positions of the first 2**44 rows (64 PiB), and ``A`` alone at every two of the first 16 GiB.
3. Two sums mod 2**32: ``SA = sum of mixA(w ^ A)`` and ``SB = sum of mixB(w ^ B)``, ``mixA`` a 32-bit finalizer
   (lowbias32: two xorshift-multiply rounds), ``mixB`` one such round; odd multipliers, so both are bijections.
4. ``digest = (SA + HA) mod 2**32 + 2**32 * ((SB + HB) mod 2**32)``, ``HA``/``HB`` the low/high halves of the
   BLAKE2b header of ``detrace-fp2|dtype|shape``.

A change confined to one 32-bit word changes both ``SA`` and ``SB`` (each term is a bijection of the word); a
swap or any other change of several words passes both sums only with probability about 2**-64 (two independent
keyed 32-bit sums). Partial sums combine lane by lane (`add`), in any order.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from detrace.tracefile.schemes import SCHEME, SCHEME2  # re-exported: the names, defined apart from torch

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
def header(dtype: str, shape: tuple[int, ...], scheme: str = SCHEME) -> int:
    text = f"{scheme}|{dtype}|{','.join(map(str, shape))}"
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def np_bytes_sum(data: np.ndarray, scheme: str = SCHEME) -> int:
    """S for a 1-D uint8 array: pad to whole rows, key, mix, sum (the definition, step by step)."""
    if data.size == 0:
        return 0
    rows = -(-data.size // ROW_BYTES)
    padded = np.zeros(rows * ROW_BYTES, dtype=np.uint8)
    padded[: data.size] = data
    words = padded.view("<u8").reshape(rows, ROW_WORDS)
    spec = SPECS[scheme]
    return np_total(spec.row_sums(words, spec.rowkeys(np.arange(rows))), scheme)


# ---------------------------------------------------------------------------------------------------------
# detrace-fp2: the same rows in 32-bit lanes, two keyed sums mod 2**32

M32 = (1 << 32) - 1
M22 = (1 << 22) - 1
ROW_WORDS32 = 1024
COL2_BITS = 10  # log2(ROW_WORDS32)
# The two 32-bit mixes, as (first shift, ((multiplier, shift), ...)): x ^= x >> s0, then per step x *= c;
# x ^= x >> s. mixA is lowbias32 (two rounds, full avalanche); mixB one round with other constants: its sum is
# keyed apart from A's and only adds the second 32 bits, and a third multiply per word would cost a quarter of
# the speed. Odd multipliers: both are bijections.
MIXA = (16, ((0x7FEB352D, 15), (0x846CA68B, 16)))
MIXB = (16, ((0x21F0AAAD, 15),))
Mix = tuple[int, tuple[tuple[int, int], ...]]
# row-key bijections on 22 bits: add, multiply by odd constants, xorshift (all mod 2**22)
RA = (0x2F5A3B1, 0x1D7E6A5, 11, 0x3A9C4E7, 12)
RB = (0x0C6E2D9, 0x2B17F43, 11, 0x15E3A9B, 12)


def _col_table(seed: int) -> np.ndarray:
    return np.array([(_splitmix64(seed + c) & M32 & ~((1 << COL2_BITS) - 1)) | c for c in range(ROW_WORDS32)],
                    dtype=np.uint32)


TA_U32 = _col_table(0xF2A_0000)
TB_U32 = _col_table(0xF2B_0000)


def np_mix32(x: np.ndarray, mix: Mix) -> np.ndarray:
    first, steps = mix
    x = x ^ (x >> np.uint32(first))
    for factor, shift in steps:
        x = x * np.uint32(factor)
        x = x ^ (x >> np.uint32(shift))
    return x


def _bij22(x: np.ndarray, constants: tuple[int, int, int, int, int]) -> np.ndarray:
    add, c1, s1, c2, s2 = constants
    m = np.uint64(M22)
    x = (x + np.uint64(add)) & m
    x = (x * np.uint64(c1 | 1)) & m
    x = x ^ (x >> np.uint64(s1))
    x = (x * np.uint64(c2 | 1)) & m
    return x ^ (x >> np.uint64(s2))


def np_rowkeys2(rows: np.ndarray) -> np.ndarray:
    """(RA(r), RB(r)) for an array of row numbers, packed as uint64: RA in the low 32 bits, RB in the high."""
    r = rows.astype(np.uint64)
    low = r & np.uint64(M22)
    high = (r >> np.uint64(22)) & np.uint64(M22)
    ra = _bij22(low, RA) << np.uint64(COL2_BITS)
    rb = _bij22(high ^ low, RB) << np.uint64(COL2_BITS)
    return ra | (rb << np.uint64(32))


def np_row_sums2(words: np.ndarray, rowkeys: np.ndarray) -> np.ndarray:
    """Per-row (SA, SB) packed as uint64 for words [N, W] (uint64 rows, read as 2W 32-bit words) and row keys [N]."""
    w32 = np.ascontiguousarray(words).view(np.uint32)
    width = w32.shape[1]
    ka = (rowkeys & np.uint64(M32)).astype(np.uint32)[:, None]
    kb = (rowkeys >> np.uint64(32)).astype(np.uint32)[:, None]
    sa = np_mix32(w32 ^ TA_U32[None, :width] ^ ka, MIXA).sum(axis=1, dtype=np.uint32)
    sb = np_mix32(w32 ^ TB_U32[None, :width] ^ kb, MIXB).sum(axis=1, dtype=np.uint32)
    return sa.astype(np.uint64) | (sb.astype(np.uint64) << np.uint64(32))


def add(a: int, b: int, scheme: str = SCHEME) -> int:
    """a + b for partial sums of `scheme`: mod 2**64 (fp1), or lane by lane mod 2**32 (fp2)."""
    if scheme == SCHEME:
        return (a + b) & M64
    return ((a + b) & M32) | (((a >> 32) + (b >> 32)) & M32) << 32


def np_total(values: np.ndarray, scheme: str = SCHEME) -> int:
    """The sum of uint64 partial sums of `scheme` (see `add`)."""
    values = np.asarray(values, dtype=np.uint64)
    if scheme == SCHEME:
        return int(values.sum(dtype=np.uint64))
    # Two contiguous reductions (a lane-wise sum along axis 0 of [N, 2] uint32 takes twice as long): the low lanes'
    # sum is exact in 64 bits (N < 2**32), and the whole sum mod 2**64 less it is 2**32 times the high lanes' sum.
    low = int((values & np.uint64(M32)).sum(dtype=np.uint64))
    high = (int(values.sum(dtype=np.uint64)) - low) >> 32
    return (low & M32) | (high & M32) << 32


def np_add(acc: np.ndarray, values: np.ndarray, scheme: str = SCHEME) -> None:
    """acc += values in place (uint64 arrays of one length), with `scheme`'s addition."""
    if scheme == SCHEME:
        acc += values
    else:
        lanes = acc.view(np.uint32)
        lanes += values.view(np.uint32)


def np_accumulate(acc: np.ndarray, owners: np.ndarray, values: np.ndarray, scheme: str = SCHEME) -> None:
    """acc[owners[i]] += values[i] in place (uint64 arrays), with `scheme`'s addition."""
    if scheme == SCHEME:
        np.add.at(acc, owners, values)
    else:
        np.add.at(acc.view(np.uint32).reshape(-1, 2), owners,
                  np.ascontiguousarray(values).view(np.uint32).reshape(-1, 2))


RK0_2 = int(np_rowkeys2(np.zeros(1, dtype=np.int64))[0])


def _fp2_zero_tails() -> list[int]:
    """Z0 of fp2: for W = 0..512, the lane sums of the zero 32-bit words 2W..1023 of row 0."""
    ka, kb = np.uint32(RK0_2 & M32), np.uint32(RK0_2 >> 32)
    tails = [np.concatenate([np.cumsum(np_mix32(table ^ key, mix)[::-1], dtype=np.uint32)[::-1],
                             np.zeros(1, dtype=np.uint32)])
             for table, key, mix in ((TA_U32, ka, MIXA), (TB_U32, kb, MIXB))]
    return [int(tails[0][2 * w]) | int(tails[1][2 * w]) << 32 for w in range(ROW_WORDS + 1)]


Z0_2 = _fp2_zero_tails()


@dataclass(frozen=True)
class SchemeSpec:
    """What the planner needs of a scheme: its row keys, row sums and row-0 padding constants (host side)."""

    name: str
    rowkeys: Callable[[np.ndarray], np.ndarray]
    row_sums: Callable[[np.ndarray, np.ndarray], np.ndarray]
    rk0: int
    z0: list[int]


SPECS = {
    SCHEME: SchemeSpec(SCHEME, np_rowkeys, np_row_sums, RK0, Z0),
    SCHEME2: SchemeSpec(SCHEME2, np_rowkeys2, np_row_sums2, RK0_2, Z0_2),
}


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
    scheme: str = SCHEME  # the scheme that computed the digest: digests of two schemes are never compared

    @property
    def hex(self) -> str:
        return f"{self.digest:016x}"

    def __str__(self) -> str:
        shape = "x".join(map(str, self.shape)) or "scalar"
        return f"{self.hex} {self.dtype}[{shape}]"


def with_digest(record: Fingerprint, digest: int) -> Fingerprint:
    """`record` with another digest: `dataclasses.replace(record, digest=digest)` at a quarter of the cost of the
    frozen __init__ (its eight object.__setattr__ calls are about 1 us, a fiftieth of a 1 MiB fingerprint). The other
    fields are the record's, already built."""
    copy = object.__new__(type(record))
    fields = copy.__dict__
    fields.update(record.__dict__)
    fields["digest"] = digest
    return copy


def combine(dtype: str, shape: tuple[int, ...], parts: tuple[tuple[str, Fingerprint], ...],
            scheme: str = SCHEME) -> int:
    """The digest of a component object: BLAKE2b of its dtype, shape and each named component digest."""
    text = "|".join(f"{name}={fp.hex}" for name, fp in parts)
    head = f"{scheme}:components|{dtype}|{','.join(map(str, shape))}|{text}"
    return int.from_bytes(hashlib.blake2b(head.encode(), digest_size=8).digest(), "little")
