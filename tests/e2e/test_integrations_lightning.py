"""DetraceCallback on a real Lightning Trainer (an MLP with dropout, a random augmentation in the dataset,
gradient accumulation, an LR scheduler): exact resume proven by `detrace check-resume` with 2 DataLoader
workers, the same without workers, Lightning alone caught changing the run, a flipped bit refused by tensor
name, and the contract's errors."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from _integrations import arms, check_resume, periodic_checkpoints_resume_exactly, run_example
from _tools import flip_one_bit

from detrace.cli import main
from detrace.state.storage import load_chunk, stored_chunks

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parents[2] / "examples" / "lightning_train.py"
AT = 2  # mid-epoch: 6 batches of 4 samples, 2 per optimizer step, so 3 steps per epoch


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Path, dict[str, set[str]]]:
    """`detrace check-resume` on the example with the callback and 2 DataLoader workers."""
    return check_resume(SCRIPT, tmp_path_factory.mktemp("lightning") / "check", at=AT)


def test_check_resume_proves_the_callback_exact(checked: tuple[int, Path, dict[str, set[str]]]) -> None:
    code, _, arms = checked
    assert code == 0
    assert len(arms["continuous"]) == 1 and arms["resumed"] == arms["continuous"]
    assert arms["control"] and arms["control"].isdisjoint(arms["continuous"])  # the negative control diverged


def test_resume_without_workers_is_exact_too(tmp_path: Path, checked: tuple[int, Path, dict[str, set[str]]]
                                              ) -> None:
    # Each sample's augmentation has its own seed: resumed with 0 workers from the checkpoint of the run with
    # 2, the run ends with the bits of the continuous 2-worker run. This script also hands the checkpoint to
    # `fit(ckpt_path=...)` itself (check-resume's arms leave that to the callback).
    report = tmp_path / "report.jsonl"
    run = run_example(SCRIPT, "--workers", "0", "--pass-ckpt", "--report", str(report),
                  env={"DETRACE_CKPT_DIR": str(checked[1] / f"at-{AT}" / "checkpoint"), "DETRACE_RESUME": "1"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert arms(report)["resumed"] == checked[2]["continuous"]


def test_locates_checkpointed_ladder_can_save_every_k_steps_and_resume_from_any(
        tmp_path: Path, checked: tuple[int, Path, dict[str, set[str]]]) -> None:
    # DETRACE_CKPT_EVERY and DETRACE_RESUME_FROM: the callback keeps Lightning's step-N.ckpt of every K-th step, and
    # `detrace locate` finds them and starts its narrow runs from one of them.
    versions = periodic_checkpoints_resume_exactly(SCRIPT, tmp_path, continuous=checked[2]["continuous"])
    assert versions[4].name == "step-00000004.ckpt"


def test_lightning_alone_changes_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "report.jsonl"
    code = main(["check-resume", "--at", str(AT), "--out", str(tmp_path / "check"), "--json", "--", sys.executable,
                 str(SCRIPT), "--plain", "--report", str(report)])
    payload = json.loads(capsys.readouterr().out)
    assert code == 1 and payload["verdict"] == "resume-changed-the-run", payload
    # the diff points at the data: the first record that differs is the batch entering the model at the resume
    assert (payload["first"]["step"], payload["first"]["phase"], payload["first"]["name"]) == (AT, "data", "batch")
    found = arms(report)
    assert len(found["continuous"]) == 1 and found["resumed"].isdisjoint(found["continuous"])


def test_a_flipped_bit_is_refused_naming_the_tensor(tmp_path: Path,
                                                    checked: tuple[int, Path, dict[str, set[str]]]) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checked[1] / f"at-{AT}" / "checkpoint", ckpt)
    version = next((ckpt / f"step-{AT:08d}.ckpt.detrace").glob("step-*"))
    chunk = next(chunk for chunk in stored_chunks(version) if chunk.fqn == "model.net.0.weight")
    flip_one_bit(version, load_chunk(version, chunk))
    run = run_example(SCRIPT, env={"DETRACE_CKPT_DIR": str(ckpt), "DETRACE_RESUME": "1"})
    assert run.returncode != 0
    assert "tensor 'model.net.0.weight' does not match its fingerprint in the manifest" in run.stderr


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DETRACE_RESUME": "1"}, "holds no Lightning checkpoint"),
        ({"DETRACE_RESUME": "yes"}, "DETRACE_RESUME must be 1 or 0"),
        ({"DETRACE_STOP_AT": "ten"}, "DETRACE_STOP_AT must be a step number"),
        ({"DETRACE_RESUME": "1", "DETRACE_RESUME_CONTROL": "skip-everything"}, "not a known negative control"),
        ({"DETRACE_CKPT_EVERY": "0"}, "DETRACE_CKPT_EVERY must be a step number of at least 1"),
        ({"DETRACE_RESUME_FROM": "/nowhere/step-00000002.ckpt"}, "but there is no such checkpoint"),
    ],
)
def test_contract_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], message: str) -> None:
    from detrace.errors import DetraceError
    from detrace.integrations.lightning import DetraceCallback

    for name, value in {"DETRACE_CKPT_DIR": str(tmp_path), **env}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(DetraceError, match=message):
        DetraceCallback().ckpt_path  # noqa: B018 (the property reads the contract)


def test_ddp_trains_with_one_warning_and_the_contract_is_refused_in_one_sentence(tmp_path: Path) -> None:
    """strategy="ddp" on 2 CPU processes: the callback does not support it yet. A plain run trains to its end with
    one warning per rank; a run asked to stop and save is refused with one sentence per rank and no traceback."""
    plain = run_example(SCRIPT, "--devices", "2", env={})
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert plain.stdout.count("final parameters:") == 2
    assert plain.stderr.count("leaves this run of 2 processes (DDPStrategy) alone") == 2
    refused = run_example(SCRIPT, "--devices", "2",
                          env={"DETRACE_CKPT_DIR": str(tmp_path / "ckpt"), "DETRACE_STOP_AT": "2"})
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "detrace: the Lightning integration cannot stop, save or resume a run of 2 processes (DDPStrategy) yet; " \
           "run it in one process" in refused.stderr
