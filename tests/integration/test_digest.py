"""Fingerprints: the contract, the guarantees (each proven here), and agreement of all implementations."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import types
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import detrace
from detrace import digest as dg
from detrace.digest import Fingerprint, fingerprint, fingerprint_many, kernels, plan, reference_fingerprint, scheme
from detrace.digest import native as native_module
from detrace.errors import FingerprintError, UsageError

ALL_DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16,
    torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu, torch.float4_e2m1fn_x2,
    torch.int8, torch.int16, torch.int32, torch.int64,
    torch.uint8, torch.uint16, torch.uint32, torch.uint64,
    torch.bool, torch.complex32, torch.complex64, torch.complex128,
]


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A tensor of `dtype` whose bytes are random (any bit pattern, including NaN payloads)."""
    gen = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = int(np.prod(shape, dtype=np.int64)) * itemsize
    raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw &= 1
    return raw.view(dtype).reshape(shape)


def flip_bit(t: torch.Tensor, index: int, bit: int) -> torch.Tensor:
    out = t.clone()
    raw = out.reshape(-1).view(torch.uint8)
    byte = index * t.element_size() + bit // 8
    raw[byte] ^= 1 << (bit % 8)
    return out


def hash_tensor(t: torch.Tensor) -> int:
    return torch.hash_tensor(t).view(torch.int64).item() & ((1 << 64) - 1)


@pytest.fixture(params=["eager", "auto", "native"])
def backend(request, monkeypatch):
    monkeypatch.setenv(dg.ENV_BACKEND, request.param)
    return request.param


# --------------------------------------------------------------------------------------------------
# The contract


def test_contract_fields_and_hex():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    fp = fingerprint(t)
    assert isinstance(fp, Fingerprint)
    assert 0 <= fp.digest < 2**64
    assert fp.hex == f"{fp.digest:016x}" and len(fp.hex) == 16
    assert (fp.dtype, fp.shape, fp.numel) == ("float32", (3, 4), 12)
    assert fp.chunks is None and fp.chunk_dim is None and fp.components == ()
    with pytest.raises(AttributeError):
        fp.digest = 0  # frozen
    assert detrace.fingerprint is fingerprint and detrace.fingerprint_many is fingerprint_many
    assert detrace.Fingerprint is Fingerprint


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_is_fingerprinted_by_name(dtype, backend):
    t = random_bits((5, 3), dtype)
    fp = fingerprint(t)
    assert fp.dtype == str(dtype).removeprefix("torch.")
    assert fp.shape == (5, 3) and fp.numel == 15
    assert fp == reference_fingerprint(t)


@pytest.mark.parametrize("dtype", [torch.bits8, torch.bits16, torch.bits1x8, torch.bits2x4, torch.bits4x2], ids=str)
def test_bits_dtypes(dtype):
    t = random_bits((6, 4), torch.uint8).view(dtype)
    assert fingerprint(t) == reference_fingerprint(t) and fingerprint(t).dtype == str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------------
# Same bits on every path: reference (NumPy), eager, compiled, and every size class of the planner

# sizes in bytes around every boundary: narrow widths (64, 512), rows (4096), the in-place body path
BYTE_SIZES = [0, 1, 7, 8, 9, 63, 64, 65, 511, 512, 513, 4095, 4096, 4097, 3 * 4096 + 5,
              plan.BODY_MIN_BYTES - 8, plan.BODY_MIN_BYTES, plan.BODY_MIN_BYTES + 4096 + 24, 2 * plan.BODY_MIN_BYTES]


def size_zoo() -> list[torch.Tensor]:
    tensors = []
    for i, nbytes in enumerate(BYTE_SIZES):
        for dtype in (torch.uint8, torch.bfloat16, torch.float32, torch.float64, torch.complex128):
            itemsize = torch.empty((), dtype=dtype).element_size()
            if nbytes % itemsize == 0:
                tensors.append(random_bits((nbytes // itemsize,), dtype, seed=i))
    tensors.append(random_bits((), torch.float32, seed=99))
    tensors.append(random_bits((7, 0, 3), torch.float16, seed=98))
    return tensors


def test_all_size_classes_match_the_reference(backend):
    zoo = size_zoo()
    expected = [reference_fingerprint(t) for t in zoo]
    assert fingerprint_many(zoo) == expected
    assert [fingerprint(t) for t in zoo] == expected


def test_packed_batches_flushed_early_give_the_same_bits(monkeypatch):
    monkeypatch.setenv(dg.ENV_BACKEND, "eager")
    monkeypatch.setattr(plan, "PACK_FLUSH_BYTES", 10_000)
    zoo = size_zoo()
    assert fingerprint_many(zoo) == [reference_fingerprint(t) for t in zoo]


def test_numpy_definition_matches_torch_kernels_row_by_row():
    gen = np.random.default_rng(1)
    words = gen.integers(0, 2**63, size=(6, 512), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    rows = np.array([0, 1, 2, 1000, 2**40, 2**55 - 1], dtype=np.int64)
    rowkeys = scheme.np_rowkeys(rows)
    assert np.array_equal(kernels._torch_rowkeys(torch.from_numpy(rows)).numpy().view(np.uint64), rowkeys)
    expected = scheme.np_row_sums(words, rowkeys)
    colkeys = torch.from_numpy(scheme.T_U64.view(np.int64).copy())
    args = (torch.from_numpy(words.view(np.int64)), torch.from_numpy(rowkeys.view(np.int64)), colkeys)
    assert np.array_equal(kernels._torch_row_sums(*args).numpy().view(np.uint64), expected)
    assert np.array_equal(kernels._eager_kernel(scheme.SCHEME, "rows", *args).numpy().view(np.uint64), expected)
    total = np.uint64(expected.sum(dtype=np.uint64))
    assert kernels._eager_kernel(scheme.SCHEME, "total", *args).numpy().view(np.uint64)[0] == total


def test_positions_have_distinct_keys():
    # Injective keys: the low 9 bits are the column, and RK is a bijection of the row number.
    cols = scheme.T_U64 & np.uint64(511)
    assert np.array_equal(cols, np.arange(512, dtype=np.uint64))
    rowkeys = scheme.np_rowkeys(np.arange(1 << 16))
    assert np.all(rowkeys & np.uint64(511) == 0)
    assert np.unique(rowkeys).size == rowkeys.size


@pytest.mark.slow
def test_compiled_kernels_match_the_reference(monkeypatch):
    pytest.importorskip("torch._inductor")
    monkeypatch.setenv(dg.ENV_BACKEND, "compiled")
    zoo = size_zoo()
    many = [random_bits((40,), torch.float32, seed=s) for s in range(300)]  # narrow rows, compiled
    chunky = random_bits((300, 1500), torch.bfloat16, seed=5)
    got = fingerprint_many([*zoo, *many, chunky])
    assert got == [reference_fingerprint(t) for t in [*zoo, *many, chunky]]
    assert fingerprint(chunky, chunks=300) == reference_fingerprint(chunky, chunks=300)
    assert fingerprint(chunky, chunks=7, dim=1) == reference_fingerprint(chunky, chunks=7, dim=1)
    assert fingerprint(many[0].reshape(4, 10), chunks=4) == reference_fingerprint(many[0].reshape(4, 10), chunks=4)
    big = random_bits((3 * plan.BODY_MIN_BYTES + 100,), torch.uint8, seed=8)
    old = torch.get_num_threads()
    try:  # the compiled kernels reduce in parallel: the thread count must not matter
        digests = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            digests.append(fingerprint(big))
    finally:
        torch.set_num_threads(old)
    assert digests[0] == digests[1] == reference_fingerprint(big)


def test_compile_failure_falls_back_to_eager_with_the_same_bits(monkeypatch):
    def broken_compile(*args, **kwargs):
        raise RuntimeError("no compiler here")

    compiled = kernels._CompiledKernels()
    monkeypatch.setattr(kernels, "_compiled", compiled)
    monkeypatch.setattr(torch, "compile", broken_compile)
    t = random_bits((plan.BODY_MIN_BYTES // 4,), torch.float32, seed=3)
    monkeypatch.setenv(dg.ENV_BACKEND, "compiled")
    with pytest.raises(FingerprintError, match=r"torch\.compile failed"):
        fingerprint(t)
    monkeypatch.setattr(kernels, "_compiled", kernels._CompiledKernels())
    monkeypatch.setattr(kernels._auto, "eager_words", kernels.AUTO_COMPILE_WORDS)  # auto now wants compiled kernels
    monkeypatch.setattr(kernels.cpu_kernel, "fn", None)  # the C kernel not built: else auto never compiles on CPU
    monkeypatch.setenv(dg.ENV_BACKEND, "auto")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fp = fingerprint(t)
    assert fp == reference_fingerprint(t)
    assert any("compiled fingerprint kernels are unavailable" in str(w.message) for w in caught)


def test_auto_on_the_cpu_never_pauses_for_torch_compile(monkeypatch):
    """Item 8: the default path hashes with the native kernel built at install, never compiles (4-50 s pauses
    before)."""
    def no_compile(*args, **kwargs):
        raise AssertionError("auto compiled a kernel on the CPU")

    monkeypatch.setattr(kernels, "_compiled", kernels._CompiledKernels())
    monkeypatch.setattr(torch, "compile", no_compile)
    monkeypatch.setattr(kernels._auto, "eager_words", kernels.AUTO_COMPILE_WORDS)
    monkeypatch.setenv(dg.ENV_BACKEND, "auto")
    t = random_bits((2**20,), torch.float32, seed=5)  # 4 MiB: the body kernel
    loaded, calls = kernels.cpu_kernel.fn_total_at, []
    assert loaded is not None, kernels.cpu_kernel.failed  # built by the install

    def counting(*args):
        calls.append(args[4:])  # the rows each call hashes
        return loaded(*args)

    monkeypatch.setattr(kernels.cpu_kernel, "fn_total_at", counting)
    assert fingerprint(t) == reference_fingerprint(t)
    assert calls  # the native kernel did the work


def test_without_the_native_kernel_auto_hashes_the_same_bits_and_native_says_why(monkeypatch):
    monkeypatch.setattr(kernels.cpu_kernel, "fn", None)
    monkeypatch.setattr(kernels.cpu_kernel, "failed", "the C extension detrace._fp1 was not built at install (test)")
    t = random_bits((2**18,), torch.float32, seed=6)
    monkeypatch.setenv(dg.ENV_BACKEND, "auto")
    assert fingerprint(t) == reference_fingerprint(t)
    monkeypatch.setenv(dg.ENV_BACKEND, "native")
    with pytest.raises(FingerprintError, match=r"native, but the C extension detrace\._fp1 was not built"):
        fingerprint(t)


def test_the_native_kernel_checks_its_buffers_and_splits_rows_over_threads():
    from detrace._fp1 import row_sums

    words = np.arange(6 * 4, dtype=np.uint64).reshape(6, 4)
    rowkeys, colkeys = np.arange(6, dtype=np.uint64) * np.uint64(3), np.arange(4, dtype=np.uint64)
    out = np.empty(6, np.uint64)
    with pytest.raises(ValueError, match="shorter than"):
        row_sums(words, 5, rowkeys, colkeys, out, 0, 6)  # rows of 5 words do not fit 24 words
    with pytest.raises(ValueError, match="0 <= start <= stop"):
        row_sums(words, 4, rowkeys, colkeys, out, 4, 2)
    # the same sums as NumPy's, whole or split over threads, from a strided (non-contiguous) view too
    big = np.random.default_rng(0).integers(0, 2**63, size=(1024, 2 * 512), dtype=np.uint64)[:, ::2]
    keys = np.arange(1024, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    expected = scheme.np_row_sums(big, keys).tolist()
    for threads in (1, 4):
        assert kernels.cpu_kernel.row_sums(big, keys, scheme.T_U64[:512], threads).tolist() == expected


def test_the_fp2_kernel_checks_its_buffers_as_fp1_does():
    from detrace._fp2 import row_sums

    words = np.arange(6 * 4, dtype=np.uint32).reshape(6, 4)
    rowkeys, out = np.arange(6, dtype=np.uint64), np.empty(6, np.uint64)
    colkeys = np.concatenate([scheme.TA_U32, scheme.TB_U32])
    with pytest.raises(ValueError, match="shorter than"):
        row_sums(words, 5, rowkeys, colkeys, out, 0, 6)
    with pytest.raises(ValueError, match="0 <= start <= stop"):
        row_sums(words, 4, rowkeys, colkeys, out, 4, 2)
    with pytest.raises(ValueError, match="shorter than"):  # 2047 column keys: TB cut short
        row_sums(words, 4, rowkeys, colkeys[:2047], out, 0, 6)
    with pytest.raises(ValueError, match="misaligned"):  # the loop reads the column keys as uint32
        row_sums(words, 4, rowkeys, np.frombuffer(b"\0" + colkeys.tobytes(), np.uint8)[1:], out, 0, 6)
    row_sums(words, 4, rowkeys, colkeys, out, 0, 6)
    assert np.array_equal(out, scheme.np_row_sums2(words.view(np.uint64), rowkeys))


@pytest.mark.parametrize("name", ["fp1", "fp2"])
def test_the_native_total_checks_its_buffers_and_pads_the_last_row(name):
    """`total` (one C call: whole rows where they lie, the last row zero-padded) gives the definition's sum for any
    length, alignment and row range, and refuses buffers that do not fit."""
    full = kernels.SCHEME_NAMES[name]
    spec, native = scheme.SPECS[full], kernels.cpu_kernel2 if name == "fp2" else kernels.cpu_kernel
    total, colkeys = native.fn_total, kernels.device_tables(torch.device("cpu")).host_colkeys(full)
    assert total is not None, native.failed
    raw = np.random.default_rng(3).integers(0, 256, 9 * 4096 + 8, dtype=np.uint8)
    for size in (1, 3, 4095, 4096, 4097, 2 * 4096 + 5, 9 * 4096 + 7):
        for at in (0, 1, 2, 5):  # every alignment of the words
            data = raw[at : at + size]
            rows = -(-size // 4096)
            keys = spec.rowkeys(np.arange(rows))
            assert total(data, keys, colkeys, 0, rows) == scheme.np_bytes_sum(data, full), (size, at)
            split = rows // 2  # two row ranges add up to the whole, as the threads' do
            assert scheme.add(total(data, keys, colkeys, 0, split), total(data, keys, colkeys, split, rows),
                              full) == scheme.np_bytes_sum(data, full)
            # total_at: the same bytes by address (the one-tensor path's entry)
            at_address = native.fn_total_at(data.ctypes.data, data.size, keys, colkeys, 0, rows)
            assert at_address == scheme.np_bytes_sum(data, full)
    keys = spec.rowkeys(np.arange(3))
    with pytest.raises(ValueError, match="start <= stop"):
        total(raw[: 2 * 4096 + 1], keys, colkeys, 0, 4)  # 3 rows of data
    with pytest.raises(ValueError, match="start <= stop"):
        total(raw[: 2 * 4096 + 1], keys[:2], colkeys, 0, 3)  # a row key short
    with pytest.raises(ValueError, match="start <= stop"):
        total(raw[: 4096], keys, colkeys[:-1], 0, 1)  # column keys cut short
    with pytest.raises(ValueError, match="start <= stop"):
        native.fn_total_at(raw.ctypes.data, 2 * 4096 + 1, keys, colkeys, 0, 4)  # 3 rows of data
    with pytest.raises(ValueError, match="address not null"):
        native.fn_total_at(0, 4096, keys, colkeys, 0, 1)
    with pytest.raises(ValueError, match="nbytes must be >= 0"):
        native.fn_total_at(raw.ctypes.data, -1, keys, colkeys, 0, 0)


@pytest.mark.parametrize("name", ["fp1", "fp2"])
def test_one_tensor_hashed_in_place_gives_the_reference_bits_at_any_address(name, monkeypatch):
    """`fingerprint` of one CPU tensor of 256 KiB or more is one native `total` call on its bytes where they lie: every
    dtype, sizes with a partial last row, storage offsets that leave its words unaligned."""
    native = kernels.cpu_kernel2 if name == "fp2" else kernels.cpu_kernel
    loaded, calls = native.fn_total_at, []
    assert loaded is not None, native.failed

    def counting(*args):
        calls.append(args[4:])
        return loaded(*args)

    monkeypatch.setattr(native, "fn_total_at", counting)
    monkeypatch.setenv(dg.ENV_BACKEND, "auto")
    for i, dtype in enumerate(ALL_DTYPES):
        itemsize = torch.empty((), dtype=dtype).element_size()
        count = (plan.BODY_MIN_BYTES + 4096 + 24) // itemsize + 1  # a partial last row
        base = random_bits((count + 1,), dtype, seed=i)
        for t in (base[:count], base[1:]):  # at the storage's start, and one element on: unaligned words
            calls.clear()
            assert fingerprint(t, scheme=name) == reference_fingerprint(t, scheme=name), (dtype, t.data_ptr() % 8)
            assert calls == [(0, -(-count * itemsize // 4096))], "one native call over every row"


@pytest.mark.parametrize("name", ["fp1", "fp2"])
def test_one_tensor_layouts_cached_per_dtype_shape_and_scheme_give_the_reference_bits(name, monkeypatch):
    """The one-tensor path caches what depends only on (dtype, shape, scheme): tensors that share one of them but
    not their bytes' meaning (another dtype of the same size, the other scheme, a transposed, conjugated or negated
    view, a tensor that needs grad) each give the reference's bits, and the cache stays bounded."""
    monkeypatch.setenv(dg.ENV_BACKEND, "auto")
    monkeypatch.setattr(plan, "_one_layouts", {})
    monkeypatch.setattr(plan, "_ONE_LAYOUTS_MAX", 4)
    other = "fp1" if name == "fp2" else "fp2"
    square = random_bits((512, 512), torch.float16, seed=1)  # 512 KiB
    complex_ = random_bits((256, 256), torch.complex64, seed=2)
    cases = [square, square.view(torch.bfloat16), square.t(), square.t().contiguous(), square.view(torch.int16) + 1,
             complex_, complex_.conj(), complex_.conj().imag, complex_.conj().resolve_conj(),
             random_bits((64, 2048), torch.float32, seed=3).requires_grad_()]
    assert cases[6].is_conj() and cases[7].is_neg()
    for t in cases * 2:  # the second time from the cache
        assert fingerprint(t, scheme=name) == reference_fingerprint(t, scheme=name), (t.dtype, t.stride())
        assert fingerprint(t, scheme=other) == reference_fingerprint(t, scheme=other)
        assert len(plan._one_layouts) <= 4
    assert fingerprint(square, scheme=name).digest != fingerprint(square.view(torch.bfloat16), scheme=name).digest
    record = fingerprint(square, scheme=name)  # with_digest: the record as dataclasses.replace makes it
    assert scheme.with_digest(record, 5) == dataclasses.replace(record, digest=5) != record
    assert hash(scheme.with_digest(record, 5)) == hash(dataclasses.replace(record, digest=5))


def test_a_native_module_built_from_an_older_source_is_not_used(monkeypatch):
    """A stale build (the entry points of an older `_fpkernel.h`: no `total_at`) leaves the kernel unusable as a
    whole, so digests fall back to NumPy/eager with the same bits instead of failing on the missing entry point."""
    stale = types.ModuleType("detrace._fp_stale")
    from detrace import _fp2

    stale.row_sums, stale.total, stale.catch_bus_errors = _fp2.row_sums, _fp2.total, _fp2.catch_bus_errors
    monkeypatch.setitem(sys.modules, "detrace._fp_stale", stale)
    old = native_module._Kernel("detrace._fp_stale", scheme.SCHEME2)
    assert not old.usable and old.fn_total is None and "total_at" in (old.failed or "")
    monkeypatch.setattr(kernels, "cpu_kernel2", old)
    monkeypatch.setenv(dg.ENV_BACKEND, "auto")
    t = random_bits((plan.BODY_MIN_BYTES,), torch.float32, seed=4)
    assert fingerprint(t, scheme="fp2") == reference_fingerprint(t, scheme="fp2")


def test_unknown_backend_is_a_usage_error(monkeypatch):
    monkeypatch.setenv(dg.ENV_BACKEND, "fastest")
    with pytest.raises(UsageError, match="DETRACE_FINGERPRINT_BACKEND"):
        fingerprint(torch.ones(2))


def test_reference_backend_serves_the_public_api(monkeypatch):
    monkeypatch.setenv(dg.ENV_BACKEND, "reference")
    t = random_bits((9, 9), torch.float16)
    assert fingerprint(t, chunks=3) == reference_fingerprint(t, chunks=3)
    monkeypatch.setenv(dg.ENV_BACKEND, "eager")
    assert fingerprint(t, chunks=3) == reference_fingerprint(t, chunks=3)


# --------------------------------------------------------------------------------------------------
# Depends only on bits + shape + dtype


def test_layout_does_not_matter(backend):
    base = random_bits((64, 96), torch.float32, seed=7)
    expected = fingerprint(base)
    big = torch.zeros(3, 64, 96)
    big[1] = base
    copies = [
        big[1],  # offset view
        base.t().contiguous().t(),  # column-major strides
        base.t().t(),
        torch.as_strided(torch.cat([torch.zeros(5), base.reshape(-1)]), (64, 96), (96, 1), 5),  # odd offset
        base.clone().requires_grad_(True),
        torch.nn.Parameter(base.clone()),
    ]
    for copy in copies:
        assert fingerprint(copy) == expected
    # transposed-then-contiguous copy has the transposed content, so it has the transposed digest
    assert fingerprint(base.t().contiguous()) == fingerprint(base.t())
    assert fingerprint(torch.ones(3).expand(4, 3)) == fingerprint(torch.ones(4, 3))
    z = torch.complex(torch.randn(6), torch.randn(6))
    assert fingerprint(z.conj()) == fingerprint(z.conj().resolve_conj())
    assert fingerprint(torch._neg_view(z)) == fingerprint(-z)


def test_misaligned_byte_tensors_on_the_body_path(backend):
    raw = random_bits((plan.BODY_MIN_BYTES + 4096 + 40,), torch.uint8, seed=11)
    for offset in range(1, 9):
        view = raw[offset : offset + plan.BODY_MIN_BYTES + 4096 + 17]
        assert fingerprint(view) == reference_fingerprint(view.clone())


@pytest.mark.parametrize("name", ["fp1", "fp2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_one_large_cpu_tensor_skips_the_batch_planner_with_the_same_bits(monkeypatch, name, dtype):
    def no_planner(*args, **kwargs):
        raise AssertionError("the planner ran")

    big = random_bits((plan.BODY_MIN_BYTES + 4096 * 3 + 6,), dtype, seed=12)  # whole rows and a tail row
    tensors = (big, big[:-3], torch.nn.Parameter(big[: plan.BODY_MIN_BYTES // big.element_size()]))
    expected = [reference_fingerprint(t, scheme=name) for t in tensors]
    monkeypatch.setenv(dg.ENV_BACKEND, "auto")
    misaligned = big[1:]  # not 8-byte aligned: the planner hashes an aligned copy
    assert fingerprint(misaligned, scheme=name) == reference_fingerprint(misaligned, scheme=name)
    monkeypatch.setattr(dg, "Planner", no_planner)
    assert [fingerprint(t, scheme=name) for t in tensors] == expected


def test_same_digest_with_one_and_two_threads(backend):
    tensors = [random_bits((plan.BODY_MIN_BYTES,), torch.float32, seed=1), random_bits((300, 41), torch.bfloat16)]
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fingerprint_many(tensors)
        torch.set_num_threads(2)
        two = fingerprint_many(tensors)
    finally:
        torch.set_num_threads(old)
    assert one == two


@pytest.mark.slow
def test_same_digest_in_two_separate_processes(monkeypatch):
    script = textwrap.dedent(
        """
        import json, torch
        from detrace.digest import fingerprint_many
        g = torch.Generator().manual_seed(1234)
        ts = [torch.randn(1000, 300, generator=g), torch.randn(33, generator=g).bfloat16(),
              torch.randint(0, 9, (5, 7), generator=g), torch.zeros(()), torch.zeros(0)]
        print(json.dumps([f.hex for f in fingerprint_many(ts)]))
        """
    )
    # this process and another with a different string-hash salt: no Python hash() may leak into a digest
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    env = {"PYTHONHASHSEED": seed, "DETRACE_FINGERPRINT_BACKEND": "eager", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    other = json.loads(done.stdout)
    g = torch.Generator().manual_seed(1234)
    ts = [torch.randn(1000, 300, generator=g), torch.randn(33, generator=g).bfloat16(),
          torch.randint(0, 9, (5, 7), generator=g), torch.zeros(()), torch.zeros(0)]
    assert other == [f.hex for f in fingerprint_many(ts)]  # the default backend here
    monkeypatch.setenv("DETRACE_FINGERPRINT_BACKEND", "eager")
    assert other == [f.hex for f in fingerprint_many(ts)]  # the same backend, another salt


# --------------------------------------------------------------------------------------------------
# Order-sensitive, side by side with torch.hash_tensor (an XOR fold)

needs_hash_tensor = pytest.mark.skipif(not hasattr(torch, "hash_tensor"), reason="torch.hash_tensor needs torch>=2.8")


@needs_hash_tensor
def test_hash_tensor_misses_what_detrace_catches(backend):
    x = torch.arange(1.0, 65.0)
    swapped = x.clone()
    swapped[[10, 11]] = swapped[[11, 10]]  # adjacent swap inside one small block
    permuted = x[torch.randperm(64, generator=torch.Generator().manual_seed(0))]
    m = torch.arange(12.0).reshape(3, 4) ** 2
    square = torch.arange(16.0).reshape(4, 4)
    paired = x.clone()
    paired[[3, 40]] = (paired[[3, 40]].view(torch.int32) ^ 0x10).view(torch.float32)  # the same change twice
    cases = [(x, swapped), (x, permuted), (square, square.t().contiguous()), (x, paired)]
    for a, b in cases:
        assert not torch.equal(a, b)
        assert hash_tensor(a) == hash_tensor(b), "hash_tensor (XOR fold) misses this change"
        assert fingerprint(a).digest != fingerprint(b).digest, "detrace must catch it"
    # a non-symmetric matrix and its transpose (same shape via reshape of the transposed copy)
    assert fingerprint(m).digest != fingerprint(m.t().contiguous().reshape(3, 4)).digest


@given(st.integers(2, 300), st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_permutation_of_distinct_elements_changes_the_digest(n, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randperm(10_000, generator=gen)[:n].to(torch.int32)
    perm = torch.randperm(n, generator=gen)
    if torch.equal(perm, torch.arange(n)):
        perm = perm.roll(1)
    assert fingerprint(x[perm]).digest != fingerprint(x).digest


@given(st.integers(0, 2**32 - 1), st.sampled_from([torch.bfloat16, torch.float32, torch.int8, torch.float64]))
@settings(max_examples=60, deadline=None)
def test_every_adjacent_swap_changes_the_digest(seed, dtype):
    x = random_bits((37,), dtype, seed=seed % 1000)
    i = seed % 36
    if torch.equal(x[i : i + 1].view(torch.uint8), x[i + 1 : i + 2].view(torch.uint8)):
        return
    y = x.clone()
    y[[i, i + 1]] = y[[i + 1, i]]
    assert fingerprint(y).digest != fingerprint(x).digest


# --------------------------------------------------------------------------------------------------
# One flipped bit anywhere; equal changes never cancel; special values


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_single_bit_flip_changes_the_digest(dtype, backend):
    x = random_bits((33,), dtype, seed=17)
    bits = x.element_size() * 8
    variants = [flip_bit(x, index, bit) for index in (0, 16, 32) for bit in range(bits)]
    digests = [fp.digest for fp in fingerprint_many([x, *variants])]
    assert len(set(digests)) == len(digests), "every flip gives its own digest, all differ from the original"


@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.uint8, torch.float16]),
    n=st.integers(2, 2000),
    data=st.data(),
)
@settings(max_examples=80, deadline=None)
def test_one_changed_element_always_changes_the_digest(dtype, n, data):
    x = random_bits((n,), dtype, seed=n)
    i = data.draw(st.integers(0, n - 1))
    y = x.clone()
    raw = y[i : i + 1].view(torch.uint8)
    new = data.draw(st.binary(min_size=raw.numel(), max_size=raw.numel()))
    raw.copy_(torch.tensor(list(new), dtype=torch.uint8))
    changed = not torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    assert (fingerprint(x).digest != fingerprint(y).digest) == changed


@given(st.integers(3, 5000), st.data())
@settings(max_examples=80, deadline=None)
def test_two_equal_changes_never_cancel(n, data):
    x = random_bits((n,), torch.int32, seed=n)
    i, j = data.draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True))
    delta = data.draw(st.integers(1, 2**31 - 1))
    xor = x.clone()
    xor[[i, j]] ^= delta  # the same XOR change at two positions: an XOR fold cancels it exactly
    add = x.clone()
    add[[i, j]] += delta  # the same additive change at two positions
    base = fingerprint(x).digest
    assert fingerprint(xor).digest != base
    assert fingerprint(add).digest != base
    if hasattr(torch, "hash_tensor"):
        assert hash_tensor(xor) == hash_tensor(x)


def test_special_values_are_distinct(backend):
    values = [
        torch.tensor(0.0), torch.tensor(-0.0),
        torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32).reshape(()),  # quiet NaN
        torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32).reshape(()),  # NaN, other payload
        torch.tensor([0xFFC00000], dtype=torch.int64).to(torch.uint32).view(torch.float32).reshape(()),  # -NaN
        torch.zeros(0), torch.zeros(1), torch.zeros(2), torch.zeros(1, 1), torch.zeros(0, 3), torch.zeros(3, 0),
        torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.int32), torch.zeros((), dtype=torch.bool),
        torch.zeros(0, dtype=torch.int32), torch.zeros(4, dtype=torch.uint8), torch.zeros(1, dtype=torch.int32),
    ]
    digests = [fp.digest for fp in fingerprint_many(values)]
    assert len(set(digests)) == len(digests)


def test_same_bytes_different_shape_or_dtype_differ(backend):
    x = random_bits((24,), torch.float32)
    views = [x, x.reshape(4, 6), x.reshape(6, 4), x.reshape(2, 3, 4), x.view(torch.int32),
             x.view(torch.uint8), x.view(torch.bfloat16), x.view(torch.complex64)]
    digests = [fp.digest for fp in fingerprint_many(views)]
    assert len(set(digests)) == len(digests)


# --------------------------------------------------------------------------------------------------
# Chunk-wise mode


def test_chunks_are_the_digests_of_the_slices(backend):
    x = random_bits((10, 6, 5), torch.bfloat16, seed=2)
    for chunks, dim in [(1, 0), (3, 0), (4, 1), (10, 0), (100, 0), (2, -1), (5, 2), (7, -2)]:
        fp = fingerprint(x, chunks=chunks, dim=dim)
        pieces = torch.tensor_split(x, min(chunks, x.shape[dim]), dim=dim)
        assert fp.chunks == tuple(fingerprint(p).digest for p in pieces)
        assert fp.chunk_dim == dim % x.dim()
        assert fp.digest == fingerprint(x).digest


def test_chunks_name_the_rows_that_differ(backend):
    tokens = random_bits((64, 1100), torch.float32, seed=4)  # rows longer than 4096 bytes
    routing = torch.randint(0, 8, (64, 2), generator=torch.Generator().manual_seed(0))  # narrow rows
    for t in (tokens, routing):
        changed = t.clone()
        changed[[5, 40]] = changed[[40, 5]] if not torch.equal(t[5], t[40]) else changed[[5, 40]] + 1
        a, b = fingerprint(t, chunks=t.shape[0]), fingerprint(changed, chunks=t.shape[0])
        assert [i for i, (u, v) in enumerate(zip(a.chunks, b.chunks, strict=True)) if u != v] == [5, 40]
    same = torch.ones(4, 3)
    assert len(set(fingerprint(same, chunks=4).chunks)) == 1  # equal rows have equal digests


def test_chunk_edge_cases(backend):
    assert fingerprint(torch.zeros(0, 3), chunks=4).chunks == ()
    assert fingerprint(torch.zeros(3, 0), chunks=3).chunks == tuple([fingerprint(torch.zeros(1, 0)).digest] * 3)
    with pytest.raises(UsageError):
        fingerprint(torch.zeros(()), chunks=2)
    with pytest.raises(UsageError):
        fingerprint(torch.zeros(3), chunks=0)
    with pytest.raises(UsageError):
        fingerprint(torch.zeros(3), chunks=2, dim=1)
    many = fingerprint_many([torch.ones(4, 2), torch.zeros(2, 2)], chunks=2)
    assert [len(fp.chunks) for fp in many] == [2, 2]


# --------------------------------------------------------------------------------------------------
# Batched and staged modes


def test_batched_reads_back_once_per_device(monkeypatch):
    calls = []
    original = torch.Tensor.cpu

    def counting_cpu(self, *args, **kwargs):
        calls.append(self.shape)
        return original(self, *args, **kwargs)

    monkeypatch.setenv(dg.ENV_BACKEND, "eager")  # device kernels even on CPU (auto uses NumPy for small)
    monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
    tensors = [random_bits((n,), torch.float32, seed=n) for n in (1, 10, 100, 1000, 70_000, 100_000)]
    fps = fingerprint_many(tensors)
    assert len(calls) == 1
    monkeypatch.setattr(torch.Tensor, "cpu", original)
    assert fps == [reference_fingerprint(t) for t in tensors]


def test_staged_batches_are_collected_together():
    a = [torch.randn(5), torch.randn(3000)]
    b = [torch.randn(2, 2)]
    first, second = dg.stage(a), dg.stage(b, chunks=2)
    assert len(first) == 2
    got = dg.collect([first, second])
    assert got == [fingerprint_many(a), fingerprint_many(b, chunks=2)]
    assert first.result() == got[0]


def test_many_small_tensors_in_one_call():
    tensors = [random_bits((n % 50,), torch.float16, seed=n) for n in range(2000)]
    assert fingerprint_many(tensors) == [reference_fingerprint(t) for t in tensors]


# --------------------------------------------------------------------------------------------------
# Quantized tensors: the component protocol


class Packed:
    """A stand-in quantized tensor that is not a torch.Tensor."""

    def __init__(self, data: torch.Tensor, scales: torch.Tensor) -> None:
        self.data, self.scales = data, scales
        self.shape = (data.shape[0], data.shape[1] * 2)
        self.dtype = "int4_packed"

    def __detrace_components__(self):
        return {"data": self.data, "scales": self.scales}


def test_components_are_fingerprinted_separately(backend):
    data = random_bits((4, 8), torch.uint8)
    scales = torch.rand(4, 1)
    fp = fingerprint(Packed(data, scales))
    assert [name for name, _ in fp.components] == ["data", "scales"]
    assert fp.components[0][1] == fingerprint(data) and fp.components[1][1] == fingerprint(scales)
    assert (fp.dtype, fp.shape, fp.numel) == ("int4_packed", (4, 16), 64)
    assert fp == reference_fingerprint(Packed(data, scales))
    other = fingerprint(Packed(data, scales * 2))
    assert other.digest != fp.digest
    assert other.components[0] == fp.components[0] and other.components[1] != fp.components[1]
    chunked = fingerprint(Packed(data, scales), chunks=4)
    assert chunked.components[0][1].chunks == fingerprint(data, chunks=4).chunks


def test_tensor_subclass_with_components():
    class Subclass(torch.Tensor):
        def __detrace_components__(self):
            return {"values": self.as_subclass(torch.Tensor), "extra": torch.tensor([1, 2])}

    t = torch.arange(4.0).as_subclass(Subclass)
    fp = fingerprint(t)
    assert [name for name, _ in fp.components] == ["values", "extra"]
    assert fp.dtype == "float32" and fp.shape == (4,)


def test_torch_quantized_tensors_are_components():
    q = torch.quantize_per_tensor(torch.randn(10), scale=0.1, zero_point=3, dtype=torch.qint8)
    fp = fingerprint(q)
    assert [name for name, _ in fp.components] == ["int_repr", "scale", "zero_point"]
    q2 = torch.quantize_per_tensor(q.dequantize(), scale=0.1, zero_point=4, dtype=torch.qint8)
    assert fingerprint(q2).digest != fp.digest


# --------------------------------------------------------------------------------------------------
# What cannot be fingerprinted: one clear sentence, never a wrong answer


def test_unfingerprintable_inputs_raise_one_sentence():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.randn(3)

    class BadComponents:
        def __detrace_components__(self):
            return [torch.ones(1)]

    cases = [
        torch.empty(3, device="meta"),
        fake,
        torch.randn(4, 4).to_sparse(),
        torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
        [1.0, 2.0],
        np.zeros(3),
        BadComponents(),
    ]
    for case in cases:
        with pytest.raises(FingerprintError) as info:
            fingerprint(case)
        message = str(info.value)
        assert message and "\n" not in message
    with pytest.raises(FingerprintError):
        fingerprint_many([torch.ones(2), torch.empty(2, device="meta")])


def test_fingerprinting_is_invisible_to_dispatch_modes():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    for x in (torch.randn(100), torch.randn(plan.BODY_MIN_BYTES // 2 + 5)):  # the planner, one tensor's fast path
        expected = fingerprint(x)
        with Recorder() as recorder:
            got = fingerprint(x)
        assert got == expected and recorder.ops == []


# --------------------------------------------------------------------------------------------------
# detrace-fp2: 32-bit lanes, the same properties, the same bits from every implementation


@pytest.fixture
def fp2(monkeypatch):
    monkeypatch.setenv(dg.ENV_SCHEME, "fp2")


def test_fp2_every_path_gives_the_reference_bits(backend, fp2):
    zoo = [*size_zoo(), random_bits((33, 65), torch.float32, seed=3).t(), random_bits((9, 4100), torch.bfloat16)[:, 3:]]
    expected = [reference_fingerprint(t) for t in zoo]
    assert {fp.scheme for fp in expected} == {scheme.SCHEME2}
    assert fingerprint_many(zoo) == expected
    chunked = random_bits((300, 1500), torch.bfloat16, seed=5)
    assert fingerprint(chunked, chunks=7) == reference_fingerprint(chunked, chunks=7)
    # fp1 and fp2 are different functions of the same bits
    assert {fp.digest for fp in expected[3:8]}.isdisjoint(fp.digest for fp in fingerprint_many(zoo[3:8], scheme="fp1"))


def test_fp2_kernels_match_the_definition_row_by_row():
    gen = np.random.default_rng(2)
    rows = np.array([0, 1, 2, 1000, 2**22 + 1000, 2**40 + 3], dtype=np.int64)
    rowkeys = scheme.np_rowkeys2(rows)
    tables = kernels.device_tables(torch.device("cpu"))
    for width in (8, 32, 128, 512):
        words = gen.integers(0, 2**64, size=(6, width), dtype=np.uint64)
        expected = scheme.np_row_sums2(words, rowkeys)
        args = (torch.from_numpy(words.view(np.int64)), torch.from_numpy(rowkeys.view(np.int64)))
        eager = kernels._eager_kernel(scheme.SCHEME2, "rows", *args, tables.colkeys2[:, : 2 * width])
        assert np.array_equal(eager.numpy().view(np.uint64), expected)
        native = kernels.cpu_kernel2.row_sums(words.view(np.uint32), rowkeys, tables.colkeys2_u32.numpy(), 2)
        assert np.array_equal(native, expected)
        total = kernels._eager_kernel(scheme.SCHEME2, "total", *args, tables.colkeys2[:, : 2 * width])
        assert total.numpy().view(np.uint64)[0] == scheme.np_total(expected, scheme.SCHEME2)
    with pytest.raises(ValueError, match="width"):
        kernels.cpu_kernel2.fn(np.zeros(2048, np.uint32), 2048, np.zeros(1, np.uint64), tables.colkeys2_u32.numpy(),
                               np.zeros(1, np.uint64), 0, 1)


def test_fp2_totals_add_lane_by_lane():
    gen = np.random.default_rng(8)
    for n in (0, 1, 2, 3, 1000):
        values = gen.integers(0, 2**64, size=n, dtype=np.uint64)
        low = sum(int(v) & scheme.M32 for v in values) & scheme.M32
        high = sum(int(v) >> 32 for v in values) & scheme.M32
        assert scheme.np_total(values, scheme.SCHEME2) == low | high << 32
    assert scheme.np_total(np.full(5, 2**32 - 1, dtype=np.uint64), scheme.SCHEME2) == 2**32 - 5  # no carry upward


def test_fp2_positions_have_distinct_keys():
    cols = np.stack([scheme.TA_U32, scheme.TB_U32]) & np.uint32(1023)
    assert (cols == np.arange(1024, dtype=np.uint32)).all()
    rowkeys = scheme.np_rowkeys2(np.concatenate([np.arange(1 << 16), (1 << 22) + np.arange(1 << 16)]))
    assert np.all(rowkeys & np.uint64(1023 | 1023 << 32) == 0)
    assert np.unique(rowkeys).size == rowkeys.size  # (A, B) distinct, also 2**22 rows apart
    assert np.unique(rowkeys[: 1 << 16] & np.uint64(2**32 - 1)).size == 1 << 16  # A alone within 16 GiB


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64, torch.complex128], ids=str)
def test_fp2_every_single_bit_flip_changes_the_digest(dtype, fp2):
    x = random_bits((1100,), dtype, seed=19)  # more than one row for every dtype
    bits = x.element_size() * 8
    variants = [flip_bit(x, index, bit) for index in (0, 1, 550, 1099) for bit in range(bits)]
    digests = [fp.digest for fp in fingerprint_many([x, *variants])]
    assert len(set(digests)) == len(digests), "every flip gives its own digest, all differ from the original"


@given(n=st.integers(2, 3000), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.uint8]), data=st.data())
@settings(max_examples=60, deadline=None)
def test_fp2_swaps_flips_and_moved_chunks_change_the_digest(n, dtype, data):
    os.environ[dg.ENV_SCHEME] = "fp2"  # hypothesis runs each example without function-scoped fixtures
    try:
        x = random_bits((n,), dtype, seed=n)
        raw = x.view(torch.uint8)
        base = fingerprint(x).digest
        i, j = data.draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True))
        swapped = x.clone()
        swapped[[i, j]] = swapped[[j, i]]
        if not torch.equal(swapped.view(torch.uint8), raw):
            assert fingerprint(swapped).digest != base, "a swap of two elements"
        bit = data.draw(st.integers(0, raw.numel() * 8 - 1))
        assert fingerprint(flip_bit(raw, bit // 8, bit % 8).view(dtype)).digest != base, "a one-bit flip"
        size = data.draw(st.integers(1, n - 1))
        start = data.draw(st.integers(0, n - size))
        to = data.draw(st.integers(0, n - size))
        rest = torch.cat([x[:start], x[start + size :]])
        moved = torch.cat([rest[:to], x[start : start + size], rest[to:]])
        if not torch.equal(moved.view(torch.uint8), raw):
            assert fingerprint(moved).digest != base, "a moved chunk"
        paired = x.view(torch.uint8).clone()
        delta = data.draw(st.integers(1, 255))
        paired[[i, j]] ^= delta  # the same change at two positions does not cancel
        assert fingerprint(paired.view(dtype)).digest != base
    finally:
        del os.environ[dg.ENV_SCHEME]


def test_fp2_layout_and_threads_do_not_matter(fp2):
    base = random_bits((257, 130), torch.float32, seed=4)
    views = [base.t().contiguous().t(), base[:, 1:].contiguous(), torch.empty(300, 140)[:257, :130].copy_(base)]
    expected = fingerprint(base)
    assert all(fingerprint(v) == expected for v in views[::2])
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fingerprint(random_bits((1 << 20,), torch.bfloat16, seed=6))
        torch.set_num_threads(2)
        assert fingerprint(random_bits((1 << 20,), torch.bfloat16, seed=6)) == one
    finally:
        torch.set_num_threads(old)


def test_the_scheme_is_chosen_by_name_and_a_wrong_name_is_refused(monkeypatch):
    x = torch.arange(10.0)
    assert fingerprint(x).scheme == scheme.SCHEME  # fp1 stays the default
    assert fingerprint(x, scheme="fp2") == fingerprint(x, scheme=scheme.SCHEME2) != fingerprint(x)
    monkeypatch.setenv(dg.ENV_SCHEME, "fp2")
    assert fingerprint(x).scheme == scheme.SCHEME2
    monkeypatch.setenv(dg.ENV_SCHEME, "fp3")
    with pytest.raises(UsageError, match="DETRACE_FINGERPRINT_SCHEME='fp3' is not one of fp1, fp2"):
        fingerprint(x)
    with pytest.raises(UsageError, match="'md5' is not one of fp1, fp2"):
        fingerprint(x, scheme="md5")
