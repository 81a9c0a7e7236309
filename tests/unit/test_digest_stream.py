"""A tensor's fingerprint from its bytes fed piece by piece, in any order: the digest of the whole tensor."""

from __future__ import annotations

import pytest
import torch

from detrace.digest import fingerprint
from detrace.digest.stream import StreamedFingerprint


@pytest.mark.parametrize("scheme", ["fp1", "fp2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8, torch.float64, torch.bool])
def test_pieces_in_any_order_give_the_whole_tensors_digest(scheme: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    for numel in (0, 1, 3, 1025, 4096, 70_001, 300_000):
        tensor = (torch.randn(numel) * 10).to(dtype).reshape(1, numel)
        whole = fingerprint(tensor, scheme=scheme)
        streamed = StreamedFingerprint(dtype, (1, numel), whole.scheme)
        data = tensor.view(-1).view(torch.uint8)
        for at in reversed(range(0, data.numel(), 8192)):
            streamed.add(data[at : at + 8192].clone(), at)
        assert streamed.result() == whole


def test_a_piece_off_the_row_grid_is_refused() -> None:
    streamed = StreamedFingerprint(torch.float32, (4096,), "detrace-fp1")
    with pytest.raises(ValueError, match="does not fit"):
        streamed.add(torch.zeros(100, dtype=torch.uint8), 4)
