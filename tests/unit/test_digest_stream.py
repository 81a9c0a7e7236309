"""A tensor's fingerprint from its bytes fed piece by piece, in any order: the digest of the whole tensor."""

from __future__ import annotations

import errno
import importlib.util
import mmap
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from detrace.digest import fingerprint
from detrace.digest.kernels import native_kernel, native_rows, native_total
from detrace.digest.scheme import ROW_BYTES, SCHEME, SCHEME2
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


def _shrunk_map(tmp_path: Path) -> np.ndarray:
    """A 1 MiB file mapped whole, then truncated to its first 4 KiB row (the map stays 1 MiB long)."""
    path = tmp_path / "shrinks"
    path.write_bytes(bytes(range(256)) * 4096)
    with path.open("rb") as stream:
        mapped = mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ)
    os.truncate(path, ROW_BYTES)
    return np.frombuffer(mapped, dtype=np.uint8)


def _sigbus_handler() -> int | None:
    """The address of the process's SIGBUS handler (None: the default), read with sigaction."""
    import ctypes

    class SigAction(ctypes.Structure):  # glibc's struct sigaction on Linux: the handler first
        _fields_ = [("handler", ctypes.c_void_p), ("mask", ctypes.c_ulong * 16), ("flags", ctypes.c_int),
                    ("restorer", ctypes.c_void_p)]

    action = SigAction()
    assert ctypes.CDLL(None).sigaction(signal.SIGBUS, None, ctypes.byref(action)) == 0
    return action.handler


@pytest.mark.parametrize("scheme", [SCHEME, SCHEME2])
def test_a_mapped_file_that_shrank_under_the_kernel_is_an_error_not_a_bus_error(scheme: str, tmp_path: Path
                                                                                ) -> None:
    """Reading a mapped page past a file's new end raises SIGBUS: inside the native kernel's loop, while
    bus_errors_caught() is in force, that is OSError(EFAULT) from the call (again and again), and the rows still
    there hash as before. The handler there was is back after the block, and a handler reset meanwhile (as Lightning
    resets every signal's, to the default for one installed in C) does not matter to a later block."""
    if not hashes_in_place(scheme) or not sys.platform.startswith("linux"):
        pytest.skip("the native kernel was not built, or this is not Linux (the test reads sigaction's struct)")
    rows = _shrunk_map(tmp_path).reshape(-1, ROW_BYTES)
    keys = np.arange(len(rows), dtype=np.uint64)
    first = int(native_rows(rows[:1], keys[:1], scheme, threads=1)[0])
    before = _sigbus_handler()
    kernel = native_kernel(scheme)
    for _ in range(2):
        with kernel.bus_errors_caught(), native_kernel(SCHEME2 if scheme == SCHEME else SCHEME).bus_errors_caught():
            assert _sigbus_handler() != before  # nested, and the other scheme's module inside
            for threads in (1, 2, 1):
                with pytest.raises(OSError) as raised:
                    native_rows(rows, keys, scheme, threads=threads)
                assert raised.value.errno == errno.EFAULT
                with pytest.raises(OSError) as raised:  # the one call per thread that hashes a tensor or a piece
                    native_total(rows.reshape(-1)[:-5], keys, scheme, threads=threads)  # the partial last row copied
                assert raised.value.errno == errno.EFAULT
        assert _sigbus_handler() == before
        signal.signal(signal.SIGBUS, signal.SIG_DFL)  # what a framework's reset leaves
        before = _sigbus_handler()
    assert int(native_rows(rows[:1], keys[:1], scheme, threads=1)[0]) == first


def test_a_bus_error_outside_the_kernel_still_ends_the_process(tmp_path: Path) -> None:
    """The handler hands every other SIGBUS on to the one there was: a plain read past the shrunk file's end, inside
    the catch but outside the kernel, still ends the process by SIGBUS (here the default action), after a caught
    one."""
    if not hashes_in_place(SCHEME):
        pytest.skip("the native kernel was not built")
    spec = importlib.util.find_spec("detrace._fp1")
    assert spec is not None and spec.origin is not None
    script = f"""
import importlib.util, mmap, os, sys
import numpy as np
spec = importlib.util.spec_from_file_location("detrace._fp1", {spec.origin!r})
fp1 = importlib.util.module_from_spec(spec); spec.loader.exec_module(fp1)
fp1.catch_bus_errors(True)
path = {str(tmp_path / "shrinks")!r}
open(path, "wb").write(bytes(1 << 20))
with open(path, "rb") as stream:
    data = np.frombuffer(mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ), dtype=np.uint8)
os.truncate(path, 4096)
words = data.view(np.uint64).reshape(256, 512)
try:
    fp1.row_sums(words, 512, np.zeros(256, np.uint64), np.zeros(512, np.uint64), np.empty(256, np.uint64), 0, 256)
except OSError as err:
    print("caught", err.errno, flush=True)
print(int(data[-1]), flush=True)  # not inside the kernel: SIGBUS, the default action
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.stdout == f"caught {errno.EFAULT}\n" and done.returncode == -signal.SIGBUS, (done.stdout,
                                                                                            done.stderr)
