"""End to end: the tracer never breaks the program it traces. A program that counts its FLOPs with a forward and
backward on meta tensors (litgpt's pretrain does) gets `detrace check`'s verdict, not a crash inside detrace; and when
detrace itself does fail inside a program, the commands say that detrace failed, naming the frame, instead of
blaming the program. Real processes; the logic is in tests/integration/test_tracer_never_breaks.py and
tests/unit/test_tracer_failure.py."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from detrace.cli import main

pytestmark = pytest.mark.slow

FLOPS_ON_META = """
import torch
from torch import nn

def make():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

with torch.device("meta"):  # count the FLOPs of one step, as litgpt does, without data
    counted = make()
    counted(torch.randn(4, 8)).sum().backward()
torch.manual_seed(0)
model = make()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(3):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    print(step, loss.item())
"""

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


def test_a_flop_count_on_meta_tensors_gets_a_verdict(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = _script(tmp_path, FLOPS_ON_META)
    assert main(["check", "--out", str(tmp_path / "check"), "--", sys.executable, script]) == 0
    assert "identical" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["check", "run"])
def test_a_failure_of_detrace_is_called_so(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    script = _script(tmp_path, BREAKS_DETRACE)
    assert main([command, "--out", str(tmp_path / command), "--", sys.executable, script]) == 2
    err = capsys.readouterr().err
    assert "detrace failed, not CMD: TypeError: 'NoneType' object is not callable was raised in detrace's own code " \
           "(detrace/record/rungs/metrics.py, line" in err, err
    assert "Traceback" not in err.split("detrace failed")[-1]
