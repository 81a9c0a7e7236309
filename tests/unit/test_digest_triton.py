"""fp2's Triton kernel (detrace.digest._triton), run on CPU by the Triton interpreter (TRITON_INTERPRET=1): the
bits of the definition (detrace.digest.scheme), the same as the C and torch kernels' (tests/integration/test_digest.py).

Skipped only where triton is not installed (the test extras install it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _tools import triton_tests

from detrace.digest import kernels, reference_fingerprint, scheme

device, pytestmark = triton_tests()  # before a test imports detrace.digest._triton
DEVICE = torch.device(device)


def test_fp2_triton_kernel_gives_the_definition_bits():
    from detrace.digest._triton import fp2_row_sums

    gen = np.random.default_rng(3)
    tables = kernels.device_tables(DEVICE)
    for width, n in ((8, 3), (32, 9), (128, 2), (512, 11)):  # row counts around the kernel's block of 8 rows
        words = gen.integers(0, 2**64, size=(n, width), dtype=np.uint64)
        rowkeys = scheme.np_rowkeys2(np.arange(5, 5 + n) * 4099)
        got = fp2_row_sums(torch.from_numpy(words.view(np.int64)).to(DEVICE),
                           torch.from_numpy(rowkeys.view(np.int64)).to(DEVICE), tables.colkeys2_u32)
        assert np.array_equal(got.cpu().numpy().view(np.uint64), scheme.np_row_sums2(words, rowkeys))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_fp2_triton_rows_of_a_tensor_give_its_fingerprint(dtype):
    from detrace.digest._triton import fp2_row_sums

    x = torch.randn(3001, generator=torch.Generator().manual_seed(7)).to(dtype)  # whole rows and a padded tail
    data = x.view(torch.uint8).numpy()
    rows = -(-data.size // scheme.ROW_BYTES)
    padded = np.zeros(rows * scheme.ROW_BYTES, dtype=np.uint8)
    padded[: data.size] = data
    words = torch.from_numpy(padded.view(np.int64).reshape(rows, scheme.ROW_WORDS)).to(DEVICE)
    keys = torch.from_numpy(scheme.np_rowkeys2(np.arange(rows)).view(np.int64)).to(DEVICE)
    sums = fp2_row_sums(words, keys, kernels.device_tables(DEVICE).colkeys2_u32).cpu().numpy().view(np.uint64)
    head = scheme.header(str(dtype).removeprefix("torch."), (3001,), scheme.SCHEME2)
    digest = scheme.add(scheme.np_total(sums, scheme.SCHEME2), head, scheme.SCHEME2)
    assert digest == reference_fingerprint(x, scheme="fp2").digest
