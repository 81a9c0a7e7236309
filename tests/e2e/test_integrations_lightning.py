"""DetraceCallback on a real Lightning Trainer under DDP: examples/lightning_train.py (an MLP with dropout, a random
augmentation in the dataset, gradient accumulation, an LR scheduler, `self.log(..., sync_dist=True)`) as 2 processes
started by torchrun on gloo, with the DistributedSampler Lightning installs. `detrace check-resume` proves the
callback's resume exact, and the same script without it, resumed by Lightning's own `ckpt_path`, changes the run.
The one-process runs and the callback's logic are checked in process (tests/integration/test_lightning.py)."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from detrace.cli import main
from detrace.investigate.check_resume import check_resume
from detrace.launch.launcher import LaunchResult, run_traced

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parents[2] / "examples" / "lightning_train.py"
AT = 3  # 24 samples, 4 per batch per rank: 3 batches (2 steps) per epoch; step 3 is epoch 1's second, after 2 batches


def _torchrun(report: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(SCRIPT),
            "--devices", "2", "--steps", "4", "--report", str(report), *options]


def _finals(report: Path) -> dict[tuple[str, int], set[str]]:
    """(kind of run, rank) -> the final parameters that rank ended with."""
    found: dict[tuple[str, int], set[str]] = {}
    for line in report.read_text().splitlines():
        run = json.loads(line)
        kind = ("control" if run["DETRACE_RESUME_CONTROL"] else "resumed" if run["DETRACE_RESUME"] == "1"
                else "stopped" if run["DETRACE_STOP_AT"] else "continuous")
        found.setdefault((kind, run["rank"]), set()).add(run["params"])
    return found


class _RepeatsCopied:
    """A launcher that runs each environment once and answers a repeat of it with a copy of the first run's trace.

    For the control arm only: check-resume repeats the continuous run and a resume that differed, to tell a
    nondeterministic script from a resume that changes the run. The callback's arm of the same script ran both
    repeats for real and agreed; here they would only double the runs."""

    def __init__(self) -> None:
        self.ran: dict[tuple[tuple[str, str], ...], LaunchResult] = {}

    def __call__(self, cmd: Sequence[str], out: str | Path, *, env: Mapping[str, str] | None = None,
                 **options: Any) -> LaunchResult:
        key = tuple(sorted((env or {}).items()))
        first = self.ran.get(key)
        if first is None:
            self.ran[key] = result = run_traced(cmd, out, env=env, **options)
            return result
        shutil.copytree(first.out, out, dirs_exist_ok=True)
        return LaunchResult(returncode=0, out=Path(out), command=first.command, elapsed=0.0, output_tail="")


def test_ddp_resume_is_exact_with_the_callback_and_changed_by_lightning_alone(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "report.jsonl"
    code = main(["check-resume", "--at", str(AT), "--out", str(tmp_path / "check"), "--json", "--",
                 *_torchrun(report)])
    payload = json.loads(capsys.readouterr().out)
    assert (code, payload["verdict"]) == (0, "exact"), payload
    point = payload["points"][0]
    assert point["resume"]["verdict"] == "identical" and point["resume"]["compared"]["ranks"] == 2
    # the resumed processes' checkpoint load and Lightning's logging all-reduce are not the training
    assert any("compared apart from the training" in note for note in point["resume"]["notes"]), point["resume"]
    assert point["control"]["verdict"] == "diverged"
    finals = _finals(report)
    for rank in (0, 1):  # bit-equal final parameters on every rank, and the negative control elsewhere
        assert len(finals["continuous", rank]) == 1 and finals["resumed", rank] == finals["continuous", rank]
        assert finals["control", rank].isdisjoint(finals["continuous", rank])
    # Every rank wrote its part of detrace's state beside the file Lightning wrote on rank 0.
    ckpt = tmp_path / "check" / f"at-{AT}" / "checkpoint" / f"step-{AT:08d}.ckpt"
    written = {path.name for path in Path(f"{ckpt}.detrace").glob("step-*/rank-*.json")}
    assert ckpt.is_file() and written == {"rank-0.json", "rank-1.json"}

    # The negative control: the script without the callback, resumed by Lightning's own ckpt_path.
    plain = tmp_path / "plain.jsonl"
    result = check_resume(_torchrun(plain, "--plain"), at=[AT], out=tmp_path / "plain", launch=_RepeatsCopied())
    assert result.verdict == "resume-changed-the-run"
    first = result.deciding.first
    assert first is not None and (first.step, first.phase) == (AT, "data"), first  # the batch at the resume
    finals = _finals(plain)
    assert all(finals["resumed", rank].isdisjoint(finals["continuous", rank]) for rank in (0, 1)), finals
