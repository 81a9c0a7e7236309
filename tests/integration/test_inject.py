"""The injected sitecustomize: inert without DETRACE_TRACE, armed on the program's own `import torch`, chained."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import detrace.record
from detrace.launch.inject import DIRECTORY
from detrace.record.config import ENV_VAR, TraceConfig


def python(code: str, *, config: str | None = None, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (ENV_VAR, "PYTHONPATH", "OMP_NUM_THREADS")}
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in (DIRECTORY, extra_path) if p is not None)
    if config is not None:
        env[ENV_VAR] = config
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_inert_without_configuration() -> None:
    result = python("import sys; print(sorted(m for m in ('torch', 'detrace') if m in sys.modules))")
    assert result.stdout.strip() == "[]" and result.stderr == ""


def test_armed_only_when_the_program_imports_torch(tmp_path: Path) -> None:
    config = TraceConfig(out=tmp_path / "run", launched=True).to_env()
    before = python("import sys; print('torch' in sys.modules, 'detrace' in sys.modules)", config=config)
    assert before.stdout.strip() == "False False"
    # A setting the program makes before importing torch still takes effect: torch is not imported earlier.
    after = python("import os; os.environ['OMP_NUM_THREADS'] = '1'\n"
                   "import torch, detrace.record as t; print(t.active() is not None, torch.get_num_threads())",
                   config=config)
    assert after.stdout.strip() == "True 1", after.stderr


def test_chains_the_shadowed_sitecustomize(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.CHAINED = True\n")
    result = python("import builtins; print(getattr(builtins, 'CHAINED', False))", extra_path=tmp_path)
    assert result.stdout.strip() == "True"
    config = TraceConfig(out=tmp_path / "run", launched=True).to_env()
    result = python("import builtins; print(getattr(builtins, 'CHAINED', False))", config=config, extra_path=tmp_path)
    assert result.stdout.strip() == "True"


def test_bad_configuration_is_reported_and_the_program_runs() -> None:
    result = python("import torch; print('ran')", config=json.dumps({"out": "x", "rung": "kernel"}))
    assert result.returncode == 0 and result.stdout.strip() == "ran"
    assert "detrace: the tracer was not started" in result.stderr and "unknown rung 'kernel'" in result.stderr


@pytest.mark.parametrize(("argv", "agent"), [
    (["python", "/venv/bin/torchrun", "--nproc-per-node", "2", "train.py"], True),
    (["python", "-m", "torch.distributed.run", "train.py"], True),
    (["python", "train.py"], False),
    (["python", "-m", "pkg"], False),
])
def test_torchrun_agent_is_recognised(monkeypatch: pytest.MonkeyPatch, argv: list[str], agent: bool) -> None:
    monkeypatch.setattr(sys, "orig_argv", argv)
    assert detrace.record._is_torchrun_agent() is agent
