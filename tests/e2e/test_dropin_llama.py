"""The drop-in path end to end: examples/llama_parallel.py, a Hugging Face Llama parallelized the torchtitan way,
checked by `detrace check-topology` at two layouts: the same bits with detrace's imports, other bits with torch's
(the control). fsdp2 shards the model without tensor parallelism and tp2 splits it without sharding, so the two
layouts put both drop-ins (fully_shard, and parallelize_module's plan) against each other. The plan is torchtitan's
with sequence parallelism (--sequence-parallel): SequenceParallel on the norms and the column- and row-wise layers
with their Shard(1) layouts, besides the plain ones (the attention's and the MLP's inner projections)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from detrace.cli import main as cli

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "llama_parallel.py"


def _check(capsys: pytest.CaptureFixture[str], tmp_path: Path, api: str) -> tuple[int, dict[str, object]]:
    code = cli(["check-topology", "--json", "--out", str(tmp_path / api), "--timeout", "600", "--layouts",
                "fsdp2,tp2", "--", sys.executable, str(EXAMPLE), "--api", api, "--sequence-parallel"])
    captured = capsys.readouterr()
    assert captured.out.strip(), captured.err
    return code, json.loads(captured.out.strip().splitlines()[-1])


@pytest.mark.slow
def test_sequence_parallel_llama_with_detraces_imports_gives_the_same_bits_on_fsdp2_and_tp2_and_torchs_does_not(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _check(capsys, tmp_path, "detrace")
    assert code == 0, report
    assert report["identical"] is True and report["layouts"] == ["fsdp2", "tp2"]
    assert report["tensors"] == 21 and report["steps"] == 2  # every parameter of the Llama, after each step
    code, report = _check(capsys, tmp_path, "torch")
    assert code == 1, report
    first = report["first"]
    assert report["identical"] is False and isinstance(first, dict) and first["step"] == 0
