"""The determinism recipe: what `detrace.deterministic()` sets, strict versus non-strict, conflicting user
settings (errors naming them, nothing half-applied), environment variables that come too late, the audit
and the settings snapshot of the trace header."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest
import torch

from detrace import recipe
from detrace.errors import DeterminismError, UsageError
from detrace.recipe import deterministic
from detrace.recipe.doctor import audit

ENV = (
    "CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "TORCHINDUCTOR_DETERMINISTIC", "TORCHINDUCTOR_MAX_AUTOTUNE", "TORCHINDUCTOR_COORDINATE_DESCENT_TUNING",
)


@pytest.fixture(autouse=True)
def pristine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from torch's defaults and an environment without the recipe's variables (conftest's
    autouse fixture puts the process-wide state back afterwards)."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    inductor = sys.modules.get("torch._inductor.config")
    for option in ("deterministic", "max_autotune", "coordinate_descent_tuning") if inductor else ():
        setattr(inductor, option, False)
    monkeypatch.setattr(recipe, "_applied", {})
    monkeypatch.setattr(recipe, "_seeded", {})
    torch.use_deterministic_algorithms(False)


def test_recipe_sets_every_switch_and_seeds_every_rng() -> None:
    result = deterministic(1234)
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and os.environ["NCCL_ALGO"] == "Ring"
    assert os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"
    assert result.settings["torch._inductor.config.deterministic"] == "True"
    assert [f for f in audit() if f.status not in ("ok", "risk")] == []
    assert result.seed == 1234 and result.strict and result.notices == ()
    assert result.settings["detrace.seed"] == "1234"
    assert random.random() == random.Random(1234).random()
    assert np.random.rand() == np.random.RandomState(1234).rand()
    assert torch.equal(torch.rand(3), torch.rand(3, generator=torch.Generator().manual_seed(1234)))


def test_recipe_makes_real_cpu_nondeterminism_deterministic() -> None:
    """index_put_ with accumulate and repeated indices, on 2 threads: the recipe gives the same bits every time."""
    deterministic(0)
    torch.set_num_threads(2)
    values = torch.randn(200_000, dtype=torch.float32, generator=torch.Generator().manual_seed(1))
    index = torch.randint(0, 64, (200_000,), generator=torch.Generator().manual_seed(2))
    results = {torch.zeros(64).index_put_((index,), values, accumulate=True).numpy().tobytes() for _ in range(5)}
    assert len(results) == 1


def test_non_strict_only_warns_on_nondeterministic_ops_and_strict_can_follow() -> None:
    assert not deterministic(5, strict=False).strict
    assert torch.is_deterministic_algorithms_warn_only_enabled()
    deterministic(5)  # our own earlier choice is not a user's conflicting setting
    assert not torch.is_deterministic_algorithms_warn_only_enabled()


def _set_env(name: str, value: str) -> Callable[[pytest.MonkeyPatch], None]:
    return lambda monkeypatch: monkeypatch.setenv(name, value)


def _inductor_autotune(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")
    if "torch._inductor.config" in sys.modules:
        sys.modules["torch._inductor.config"].max_autotune = True  # restored by the `pristine` fixture


CONFLICTS = {
    "torch.backends.cudnn.benchmark=True": lambda mp: mp.setattr(torch.backends.cudnn, "benchmark", True),
    "torch.backends.cuda.matmul.allow_tf32=True": lambda mp: setattr(torch.backends.cuda.matmul, "allow_tf32", True),
    "torch.float32_matmul_precision=high": lambda mp: torch.set_float32_matmul_precision("high"),
    "torch.use_deterministic_algorithms=warn_only": lambda mp: torch.use_deterministic_algorithms(True, warn_only=True),
    "torch.utils.deterministic.fill_uninitialized_memory=False": lambda mp: mp.setattr(
        torch.utils.deterministic, "fill_uninitialized_memory", False
    ),
    "NCCL_ALGO=NVLS": _set_env("NCCL_ALGO", "NVLS"),
    "CUBLAS_WORKSPACE_CONFIG=:0:0": _set_env("CUBLAS_WORKSPACE_CONFIG", ":0:0"),
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO=1": _set_env("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1"),
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE=1": _set_env("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "1"),
    "torch._inductor.config.max_autotune=True": _inductor_autotune,
}


@pytest.mark.parametrize("setting", CONFLICTS)
def test_a_conflicting_user_setting_is_an_error_naming_it(setting: str, monkeypatch: pytest.MonkeyPatch) -> None:
    CONFLICTS[setting](monkeypatch)
    for strict in (True, False):
        if setting.endswith("warn_only") and not strict:
            continue  # warn-only is what non-strict mode asks for
        with pytest.raises(DeterminismError, match=rf"^conflicting setting .*{re.escape(setting)}") as caught:
            deterministic(0, strict=strict)
        assert caught.value.exit_code == 2
        assert not torch.backends.cudnn.deterministic  # fails closed: nothing was applied
    # (TF32 matmuls and the float32 matmul precision are one setting in torch: each shows as the other too.)
    assert setting.split("=")[0] in [f.name for f in audit() if f.off]


@pytest.fixture
def cuda_started(monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulated: this CPU-only machine cannot start CUDA, so `torch.cuda.is_initialized` says it did."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)


def test_too_late_cublas_setting_raises_in_strict_mode(cuda_started: None) -> None:
    with pytest.raises(DeterminismError, match="CUBLAS_WORKSPACE_CONFIG must be set before CUDA starts"):
        deterministic(0)
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_too_late_cublas_setting_warns_in_non_strict_mode(cuda_started: None) -> None:
    with pytest.warns(RuntimeWarning, match="CUBLAS_WORKSPACE_CONFIG must be set before CUDA starts"):
        result = deterministic(0, strict=False)
    assert len(result.notices) == 1 and torch.are_deterministic_algorithms_enabled()


def test_a_setting_made_before_cuda_started_is_in_time(cuda_started: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    deterministic(0)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_too_late_nccl_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Simulated: an NCCL process group (no NCCL on this machine) that is already initialised."""
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    with pytest.raises(DeterminismError, match="NCCL_ALGO must be set before NCCL starts"):
        deterministic(0)
    assert [f.status for f in audit() if f.name == "NCCL_ALGO"] == ["too-late"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_too_late_on_a_real_gpu() -> None:
    program = "import torch, detrace; x = torch.ones(2, device='cuda'); x @ x; detrace.deterministic(0)"
    environment = {key: value for key, value in os.environ.items() if key not in ENV}

    def run() -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-c", program]
        return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300)

    late = run()
    assert late.returncode != 0 and "CUBLAS_WORKSPACE_CONFIG must be set before CUDA starts" in late.stderr
    environment["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    in_time = run()
    assert in_time.returncode == 0, in_time.stderr


@pytest.mark.parametrize("seed", [-1, 2**32, True, 1.5])
def test_seed_must_be_a_32_bit_integer(seed: object) -> None:
    with pytest.raises(UsageError, match="the seed must be an integer from 0 to 2\\*\\*32-1"):
        deterministic(seed)  # type: ignore[arg-type]


def test_settings_is_a_flat_json_snapshot_that_initialises_nothing() -> None:
    inductor_imported = "torch._inductor.config" in sys.modules
    snapshot = recipe.settings()
    assert json.loads(json.dumps(snapshot)) == snapshot
    assert all(isinstance(value, str) for value in snapshot.values())
    assert {switch.name for switch in recipe.SWITCHES} <= set(snapshot)
    assert snapshot["detrace.seed"] == "<unset>" and snapshot["torch.num_threads"] == str(torch.get_num_threads())
    assert not torch.cuda.is_initialized()
    assert ("torch._inductor.config" in sys.modules) == inductor_imported


def test_the_documentation_lists_every_switch() -> None:
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "determinism.md").read_text()
    assert [switch.name for switch in recipe.SWITCHES if f"`{switch.name}`" not in text] == []
