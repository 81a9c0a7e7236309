"""End to end: the tracer never breaks the program it traces. When detrace itself fails inside a program, the
commands say that detrace failed, naming the frame, instead of blaming the program. (A program that counts its FLOPs
with a forward and backward on meta tensors, as litgpt's pretrain does, gets `detrace check`'s verdict, not a crash
inside detrace: tests/e2e/test_loops_e2e.py checks examples/loops/meta_flops.py.) Real processes; the logic is in
tests/integration/test_tracer_never_breaks.py and tests/unit/test_tracer_failure.py."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from detrace.cli import main

pytestmark = pytest.mark.slow

BREAKS_DETRACE = """
import torch
import detrace.record.rungs.metrics as metrics

metrics.record = None  # stands for a bug of detrace's: its backward wrapper fails in its own code
model = torch.nn.Linear(4, 1)
model(torch.ones(2, 4)).sum().backward()
"""


def _script(tmp_path: Path, text: str) -> str:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(text))
    return str(path)


@pytest.mark.parametrize("command", ["check", "run"])
def test_a_failure_of_detrace_is_called_so(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    script = _script(tmp_path, BREAKS_DETRACE)
    assert main([command, "--out", str(tmp_path / command), "--", sys.executable, script]) == 2
    err = capsys.readouterr().err
    assert "detrace failed, not CMD: TypeError: 'NoneType' object is not callable was raised in detrace's own code " \
           "(detrace/record/rungs/metrics.py, line" in err, err
    assert "Traceback" not in err.split("detrace failed")[-1]
