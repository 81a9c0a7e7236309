"""The pipeline drop-ins end to end: examples/llama_parallel.py at layout pp2xfsdp2 under detrace's
ScheduleInterleaved1F1B (two pipelines of two ranks, each rank two of the four stages, each stage's pieces sharded
over the two data ranks) against the one process, checked by `detrace check-topology`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from detrace.cli import main as cli

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama_parallel.py"


@pytest.mark.slow
def test_llama_pipelined_in_interleaved_stages_and_sharded_with_detraces_imports_gives_the_one_process_bits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = cli(["check-topology", "--json", "--out", str(tmp_path / "runs"), "--timeout", "600", "--layouts",
                "1x1,pp2xfsdp2", "--", sys.executable, str(EXAMPLE), "--api", "detrace", "--schedule",
                "interleaved-1f1b"])
    captured = capsys.readouterr()
    assert captured.out.strip(), captured.err
    report = json.loads(captured.out.strip().splitlines()[-1])
    assert code == 0, report
    assert report["identical"] is True and report["layouts"] == ["1x1", "pp2xfsdp2"]
    assert report["tensors"] == 21 and report["steps"] == 2  # every parameter of the Llama, both stages' together
