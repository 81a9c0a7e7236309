"""A tensor's fingerprint from its bytes fed piece by piece, in any order: the digest of the whole tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from detrace.digest import fingerprint
from detrace.digest.stream import StreamedFingerprint, hashes_in_place


@pytest.mark.parametrize("scheme", ["fp1", "fp2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.float64, torch.bool])
def test_pieces_in_any_order_give_the_whole_tensors_digest(scheme: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    for numel in (0, 1, 3, 1025, 4096, 70_001, 300_000):
        tensor = (torch.randn(numel) * 10).to(dtype).reshape(1, numel)
        whole = fingerprint(tensor, scheme=scheme)
        streamed = StreamedFingerprint(dtype, (1, numel), whole.scheme)
        data = tensor.view(-1).view(torch.uint8).numpy()
        for at in reversed(range(0, data.size, 8192)):
            streamed.add(data[at : at + 8192].copy(), at)
        assert streamed.result() == whole


@pytest.mark.parametrize("scheme", ["detrace-fp1", "detrace-fp2"])
def test_pieces_at_any_address_are_hashed_in_place_by_the_native_kernel(scheme: str) -> None:
    """Verify hashes a record's bytes where they lie in the mapped file, at whatever offset DCP packed them."""
    if not hashes_in_place(scheme):
        pytest.skip("the native kernel was not built")
    torch.manual_seed(0)
    tensor = torch.randn(3, 70_001)
    whole = fingerprint(tensor, scheme=scheme)
    for offset in (1, 3, 5):  # never on a word boundary
        shifted = np.zeros(tensor.numel() * 4 + offset, dtype=np.uint8)[offset:]
        shifted[:] = tensor.view(-1).view(torch.uint8).numpy()
        assert shifted.ctypes.data % 4
        streamed = StreamedFingerprint(tensor.dtype, tuple(tensor.shape), scheme)
        for at in range(0, shifted.size, 3 * 4096):
            streamed.add(shifted[at : at + 3 * 4096], at)
        assert streamed.result() == whole


def test_a_piece_off_the_row_grid_is_refused() -> None:
    streamed = StreamedFingerprint(torch.float32, (4096,), "detrace-fp1")
    with pytest.raises(ValueError, match="does not fit"):
        streamed.add(np.zeros(100, dtype=np.uint8), 4)
