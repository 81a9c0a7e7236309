"""`detrace doctor`: the audit as plain lines when piped and as a rich table on a terminal; exit 1 when a
setting is off, naming it."""

from __future__ import annotations

import os
import pty
import subprocess
import sys

import pytest

from detrace.cli import main as detrace

RECIPE_ENV = ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NVTE_ALLOW_NONDETERMINISTIC_ALGO",
              "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "TORCHINDUCTOR_MAX_AUTOTUNE")


def _clean_environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key not in RECIPE_ENV}


def test_doctor_in_a_clean_environment_exits_0(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture) -> None:
    for key in RECIPE_ENV:
        monkeypatch.delenv(key, raising=False)
    assert detrace(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "detrace doctor: no setting is off"
    assert any(line.startswith("pending   CUBLAS_WORKSPACE_CONFIG = <unset>") for line in lines)
    assert any(line.startswith("ok        torch.backends.cudnn.benchmark = False") for line in lines)
    for scheme in ("fp1", "fp2"):
        assert any(line.startswith(f"ok        detrace fingerprint kernel {scheme} (CPU) = native  (the C kernel "
                                   "compiled at install, ") for line in lines)


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as info:
        return {flag for line in info if line.startswith("flags") for flag in line.split(":", 1)[1].split()}


def test_doctor_names_each_native_kernels_vector_path_and_compiler(capsys: pytest.CaptureFixture) -> None:
    """The path named is the clone the loader picks for this CPU (built by GCC here): fp2 has an AVX-512F clone,
    fp1 an x86-64-v4 one (AVX-512 DQ multiplies 64-bit words)."""
    import platform

    detrace(["doctor"])
    out = capsys.readouterr().out
    if platform.machine() == "x86_64" and sys.platform == "linux":
        flags = _cpu_flags()
        fp2 = "avx512f" if "avx512f" in flags else "avx2" if "avx2" in flags else "x86-64 baseline"
        v4 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx2", "fma", "movbe"} <= flags
        fp1 = "x86-64-v4 (AVX-512)" if v4 else "avx2" if "avx2" in flags else "x86-64 baseline"
    else:
        fp1 = fp2 = "arm64 baseline (NEON)" if platform.machine() in ("aarch64", "arm64") else "the build's baseline"
    assert f"detrace fingerprint kernel fp1 (CPU) = native  (the C kernel compiled at install, {fp1}" in out
    assert f"detrace fingerprint kernel fp2 (CPU) = native  (the C kernel compiled at install, {fp2}" in out
    assert out.count(" path, built by gcc ") + out.count(" path, built by clang ") == 2


@pytest.mark.parametrize("scheme", ["fp1", "fp2"])
def test_doctor_says_when_the_native_fingerprint_kernel_was_not_built(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture, scheme: str) -> None:
    from detrace.digest import native

    kernel = native.kernel if scheme == "fp1" else native.kernel2
    monkeypatch.setattr(kernel, "fn", None)
    monkeypatch.setattr(kernel, "failed", f"the C extension detrace._{scheme} was not built at install (test)")
    assert detrace(["doctor"]) == 0  # slower, not less deterministic
    out = capsys.readouterr().out
    assert (f"ok        detrace fingerprint kernel {scheme} (CPU) = NumPy/eager  (the same bits, several times slower: "
            f"the C extension detrace._{scheme} was not built") in out
    other = "fp2" if scheme == "fp1" else "fp1"
    assert f"ok        detrace fingerprint kernel {other} (CPU) = native" in out


def test_doctor_names_what_is_off_and_exits_1(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("NCCL_ALGO", "NVLS")
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")
    assert detrace(["doctor"]) == 1
    out = capsys.readouterr().out
    assert "conflict  NCCL_ALGO = NVLS  (the recipe needs Ring or Tree" in out
    assert out.splitlines()[-1] == "detrace doctor: 2 settings off: NCCL_ALGO, NVTE_ALLOW_NONDETERMINISTIC_ALGO"


def test_doctor_draws_a_table_on_a_terminal() -> None:
    controller, terminal = pty.openpty()
    environment = {**_clean_environment(), "NCCL_ALGO": "CollNet", "COLUMNS": "160"}
    with subprocess.Popen([sys.executable, "-m", "detrace", "doctor"], stdout=terminal, stderr=terminal,
                          env=environment) as process:
        os.close(terminal)
        output = b""
        while True:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the terminal closes when the process exits
                break
            if not chunk:
                break
            output += chunk
        process.wait(timeout=120)
    os.close(controller)
    text = output.decode()
    assert process.returncode == 1
    assert "detrace doctor: determinism settings" in text and "┃" in text and "NCCL_ALGO" in text


def test_doctor_takes_no_arguments(capsys: pytest.CaptureFixture) -> None:
    assert detrace(["doctor", "--fix"]) == 2
    assert capsys.readouterr().err.startswith("detrace doctor: error: unrecognized arguments: --fix")


def test_doctor_reports_inductor_autotuning_and_cudagraphs(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture) -> None:
    monkeypatch.delitem(sys.modules, "torch._inductor.config", raising=False)  # read from the environment
    monkeypatch.setenv("TORCHINDUCTOR_CUDAGRAPHS", "1")
    monkeypatch.delenv("TORCHINDUCTOR_MAX_AUTOTUNE_GEMM", raising=False)
    assert detrace(["doctor"]) in (0, 1)
    out = capsys.readouterr().out
    assert "risk      torch._inductor.config.triton.cudagraphs = True  (compiled regions replay as CUDA graphs" in out
    assert "ok        torch._inductor.config.max_autotune_gemm = False  (when on, matrix multiplications" in out
    assert "torch._inductor.config.deterministic = False" in out


def test_audit_warns_that_inductor_reads_the_deterministic_flag_when_it_compiles(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import torch
    import torch._dynamo  # the program compiles

    from detrace.recipe.doctor import audit

    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: False)
    found = [f for f in audit() if f.name == "torch.compile"]
    assert len(found) == 1 and found[0].status == "risk" and "before the first compiled call" in found[0].detail
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert not [f for f in audit() if f.name == "torch.compile"]
