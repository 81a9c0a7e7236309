"""MXFP8 and NVFP4 reference encoders, checked against values worked out by hand from the specifications."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detrace import fingerprint
from detrace.errors import UsageError
from detrace.ops.formats import (
    FORMATS,
    MXFP8Tensor,
    NVFP4Tensor,
    QuantizedComponents,
    fake_quantize,
    mxfp8_decode,
    mxfp8_encode,
    nvfp4_decode,
    nvfp4_encode,
)
from detrace.ops.formats.elements import e2m1_codes, e2m1_values, exp2i, pack_fp4, unpack_fp4


def block(*values: float, size: int = 32) -> torch.Tensor:
    """One block as a [1, size] float32 tensor, zero-filled after `values`."""
    out = torch.zeros(1, size)
    out[0, : len(values)] = torch.tensor(values)
    return out


def scale_bytes(q: MXFP8Tensor) -> list[int]:
    return q.scales.view(torch.uint8).reshape(-1).tolist()


def test_exact_powers_of_two():
    k = torch.arange(-127, 128)
    assert torch.equal(exp2i(k), torch.tensor([2.0**i for i in k.tolist()], dtype=torch.float64).float())


# --------------------------------------------------------------------------------------------------
# MXFP8: scale selection X = 2**(floor(log2(amax)) - emax), emax = 8 (E4M3) or 15 (E5M2), E8M0 bias 127


@pytest.mark.parametrize(
    ("amax", "elem", "expected_byte"),
    [
        (448.0, "e4m3", 127),  # floor(log2 448) = 8, 8 - 8 = 0 -> 2**0
        (511.0, "e4m3", 127),  # still floor = 8
        (512.0, "e4m3", 128),  # floor = 9 -> 2**1
        (1.0, "e4m3", 119),  # 0 - 8 = -8 -> 127 - 8
        (0.75, "e4m3", 118),  # floor(log2 0.75) = -1 -> -9
        (57344.0, "e5m2", 127),  # floor(log2 57344) = 15, 15 - 15 = 0
        (1.0, "e5m2", 112),  # 0 - 15
        (2.0**-140, "e4m3", 0),  # -148 clamps to -127 (a float32 subnormal amax)
        (2.0**127, "e4m3", 246),  # 127 - 8 = 119
        (3.0e38, "e5m2", 239),  # floor(log2 3e38) = 127, 127 - 15 = 112
    ],
)
def test_mxfp8_scale_selection(amax, elem, expected_byte):
    q = mxfp8_encode(block(amax, -amax / 3), elem)
    assert scale_bytes(q) == [expected_byte]
    assert q.scales.dtype == torch.float8_e8m0fnu


def test_mxfp8_e4m3_values_worked_by_hand():
    # amax 448 -> X = 1; E4M3 has 3 mantissa bits, subnormals k * 2**-9, max normal 448
    x = block(448.0, 1.0, -2.0, 0.5, 1.0625, 1.1875, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 464.0, -500.0)
    q = mxfp8_encode(x)
    expected = block(
        448.0,
        1.0,
        -2.0,
        0.5,
        1.0,  # 1.0625 is the midpoint of 1.0 and 1.125: ties to even (mantissa 000)
        1.25,  # 1.1875 is the midpoint of 1.125 (001) and 1.25 (010): ties to even
        2.0**-9,  # smallest subnormal
        0.0,  # half of it: tie, rounds to even (zero)
        2.0**-8,  # 1.5 * 2**-9: tie between 1 and 2 subnormal steps, rounds to 2
        448.0,  # 464 > 448 saturates
        -448.0,  # -500 (still below 512, so X stays 1) saturates with its sign
    )
    assert torch.equal(q.data.float(), expected)
    assert torch.equal(mxfp8_decode(q), expected)


def test_mxfp8_scaled_block_round_trips_exactly():
    # amax = 3.5 -> floor(log2) = 1 -> X = 2**-7. Every value e4m3 * 2**-7 round-trips exactly.
    grid = torch.arange(0, 256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & (grid.abs() <= 448)]
    values = grid * 2.0**-7
    values = values[values.abs() <= 3.5]
    x = values[: (values.numel() // 32) * 32].reshape(-1, 32).clone()
    x[:, 0] = 3.5  # same amax in every block, so every block has the same scale
    q = mxfp8_encode(x)
    assert set(scale_bytes(q)) == {127 - 7}
    assert torch.equal(mxfp8_decode(q), x)


def test_mxfp8_e5m2_saturation_and_round_trip():
    x = block(57344.0, 61440.0, -1e6, 1.5, 0.25, 2.0**-16, 2.0**-17)
    q = mxfp8_encode(x, "e5m2")
    # amax 1e6 -> floor(log2) = 19 -> X = 2**4; then 57344/16 = 3584 (exact), 61440/16 = 3840 -> rounds to
    # 3584 (E5M2 has 2 mantissa bits: 3072, 3584, 4096; 3840 is the midpoint, ties to even 4096)
    assert scale_bytes(q) == [127 + 4]
    decoded = mxfp8_decode(q)
    assert decoded[0, 0] == 57344.0 and decoded[0, 1] == 65536.0
    assert decoded[0, 2] == -57344.0 * 16  # -1e6 / 16 = -62500 saturates to -57344, times X
    assert q.data.dtype == torch.float8_e5m2
    # small values under this scale fall below E5M2's subnormals (2**-16 * X) and flush to zero
    assert decoded[0, 5] == 0.0 and decoded[0, 6] == 0.0


def test_mxfp8_zeros_nan_and_inf_blocks():
    x = torch.zeros(3, 32)
    x[0, 5] = -0.0
    x[1, 3] = float("nan")
    x[2, 7] = float("inf")
    q = mxfp8_encode(x)
    assert scale_bytes(q) == [0, 255, 255]  # all-zero block: smallest scale; Inf/NaN: NaN scale
    decoded = mxfp8_decode(q)
    assert torch.equal(decoded[0], torch.zeros(32))
    assert torch.isnan(decoded[1:]).all()
    neg_zero = mxfp8_decode(mxfp8_encode(block(-0.0, 1.0)))
    assert torch.signbit(neg_zero[0, 0])


def test_mxfp8_padding_and_shapes():
    x = torch.randn(2, 3, 33, dtype=torch.bfloat16)
    q = mxfp8_encode(x)
    assert q.data.shape == (2, 3, 64) and q.scales.shape == (2, 3, 2) and q.shape == (2, 3, 33)
    assert torch.equal(q.data.float()[..., 33:], torch.zeros(2, 3, 31))
    assert mxfp8_decode(q, torch.bfloat16).shape == x.shape
    scalar = mxfp8_decode(mxfp8_encode(torch.tensor(3.0)))
    assert scalar.shape == () and scalar == 3.0


# --------------------------------------------------------------------------------------------------
# NVFP4: s_enc = 448 * 6 / amax, block scale = e4m3(amax_b / 6 * s_enc), elements e2m1(x * s_enc / scale)


def test_e2m1_rounding_worked_by_hand():
    x = torch.tensor([0.0, 0.2, 0.25, 0.3, 0.75, 1.25, 1.3, 1.75, 2.5, 2.6, 3.5, 5.0, 5.1, 7.0, 1e9, -0.75, -0.0])
    # ties go to the even code: 0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2.0, 2.5->2.0, 3.5->4.0, 5->4.0
    expected = [0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 1.5, 2.0, 2.0, 3.0, 4.0, 4.0, 6.0, 6.0, 6.0, -1.0, -0.0]
    values = e2m1_values(e2m1_codes(x))
    assert values.tolist() == expected
    assert torch.signbit(values[-1])
    assert e2m1_codes(torch.tensor([0.5, 1.0, 6.0, -6.0])).tolist() == [1, 2, 7, 15]


def test_fp4_packing_puts_the_first_element_in_the_low_nibble():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.dtype == torch.float4_e2m1fn_x2
    assert packed.view(torch.uint8).tolist() == [[0x21, 0x0F]]
    assert torch.equal(unpack_fp4(packed), codes)


def test_nvfp4_two_level_scales_worked_by_hand():
    # amax = 2688 -> s_enc = 448*6/2688 = 1, tensor_scale = 1.
    # block 0: amax 2688 -> scale e4m3(448) = 448; elements /448 are exactly E2M1 values.
    # block 1: amax 12 -> scale 2; elements /2.  block 2: all zero -> scale 0, decodes to zeros.
    b0 = [2688.0, 1344.0, -896.0, 672.0, 448.0, 224.0, 0.0, -2688.0]
    b1 = [12.0, -6.0, 3.0, 1.0, 2.0, 8.0]
    x = torch.zeros(1, 48)
    x[0, : len(b0)] = torch.tensor(b0)
    x[0, 16 : 16 + len(b1)] = torch.tensor(b1)
    q = nvfp4_encode(x)
    assert q.tensor_scale.item() == 1.0 and q.tensor_scale.dtype == torch.float32
    assert q.block_scales.float().tolist() == [[448.0, 2.0, 0.0]]
    assert q.data.dtype == torch.float4_e2m1fn_x2 and q.data.shape == (1, 24)
    assert torch.equal(nvfp4_decode(q), x)


def test_nvfp4_per_tensor_scale_and_saturation():
    # amax 12 -> s_enc = 2688 / 12 = 224 (exact); block scale = e4m3(12 / 6 * 224 = 448) = 448;
    # element scale s_enc / 448 = 0.5, so 12 -> 6, 7 -> 3.5 -> 4 and -5 -> -2.5 -> -2 (ties to even), 1 -> 0.5
    x = torch.tensor([[12.0, 7.0, 1.0, -5.0] + [0.0] * 12])
    q = nvfp4_encode(x)
    assert q.tensor_scale.item() == pytest.approx(1 / 224, rel=1e-7)
    assert q.block_scales.float().tolist() == [[448.0]]
    codes = unpack_fp4(q.data)[0, :4].tolist()
    assert [e2m1_values(torch.tensor(c, dtype=torch.uint8)).item() for c in codes] == [6.0, 4.0, 0.5, -2.0]
    decoded = nvfp4_decode(q)[0, :4]
    assert torch.allclose(decoded, torch.tensor([12.0, 8.0, 1.0, -4.0]), rtol=1e-6)


def test_nvfp4_special_inputs():
    zeros = nvfp4_encode(torch.zeros(2, 16))
    assert zeros.tensor_scale.item() == 1.0 and torch.equal(nvfp4_decode(zeros), torch.zeros(2, 16))
    x = torch.ones(2, 16)
    x[1, 3] = float("nan")
    assert torch.isnan(nvfp4_decode(nvfp4_encode(x))).all()
    odd = torch.randn(3, 21, dtype=torch.float16)
    q = nvfp4_encode(odd)
    assert q.data.shape == (3, 16) and q.block_scales.shape == (3, 2)
    assert nvfp4_decode(q, torch.float16).shape == odd.shape


# --------------------------------------------------------------------------------------------------
# fake_quantize and the component protocol


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fake_quantize_keeps_shape_and_dtype(fmt, dtype):
    x = torch.randn(4, 70, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_(True)
    y = fake_quantize(x, fmt)
    assert y.shape == x.shape and y.dtype == dtype and not y.requires_grad
    assert torch.isfinite(y).all()
    # worst cases relative to the tensor's amax: MX clips a block maximum with mantissa above 1.75 (12.5%);
    # E2M1 has a gap of 2 between 4 and 6 (1/6 of a block's amax) on top of the E4M3 block-scale rounding
    rel = ((y.float() - x.float()).abs().max() / x.float().abs().max()).item()
    assert rel <= {"mxfp8": 0.125, "mxfp8_e5m2": 0.125, "nvfp4": 0.25}[fmt]


@given(st.integers(0, 2**31 - 1), st.integers(1, 100), st.sampled_from(["mxfp8", "mxfp8_e5m2"]))
@settings(max_examples=40, deadline=None)
def test_mxfp8_fake_quantize_is_idempotent(seed, width, fmt):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(3, width, generator=gen) * torch.exp2(torch.randint(-20, 20, (3, 1), generator=gen).float())
    once = fake_quantize(x, fmt)
    assert torch.equal(fake_quantize(once, fmt), once)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fake_quantize_of_empty_and_scalar_tensors(fmt):
    for shape in [(3, 0), (0, 5), (0,), ()]:
        x = torch.ones(shape)
        assert torch.equal(fake_quantize(x, fmt), x)


def test_fake_quantize_rejects_unknown_formats_and_integer_inputs():
    with pytest.raises(UsageError):
        fake_quantize(torch.ones(4), "fp3")
    with pytest.raises(UsageError):
        fake_quantize(torch.ones(4, dtype=torch.int32), "mxfp8")


def test_encoded_tensors_are_fingerprinted_by_component():
    x = torch.randn(8, 64)
    mx, nv = mxfp8_encode(x), nvfp4_encode(x)
    assert isinstance(mx, QuantizedComponents) and isinstance(nv, QuantizedComponents)
    fp = fingerprint(mx)
    assert fp.dtype == "mxfp8_e4m3" and fp.shape == (8, 64)
    assert [name for name, _ in fp.components] == ["data", "scales"]
    assert fp.components[1][1].dtype == "float8_e8m0fnu"
    assert [name for name, _ in fingerprint(nv).components] == ["data", "block_scales", "tensor_scale"]
    # a change that moves only element bits shows up in "data" only
    y = x.clone()
    y[0, 1] = y[0, 1] * 0.5 if y[0, 1].abs() < y[0].abs().max() / 2 else y[0, 1]
    y[3, 5] = -x[3, 5]
    other = fingerprint(mxfp8_encode(y))
    assert other.components[0][1] != fp.components[0][1]
    assert other.components[1][1] == fp.components[1][1]
    # a change of one block's scale shows up in "scales"
    z = x.clone()
    z[2, :32] *= 4
    scaled = fingerprint(mxfp8_encode(z))
    assert scaled.components[1][1] != fp.components[1][1]
    assert isinstance(nv, NVFP4Tensor) and fingerprint(nv).dtype == "nvfp4"
