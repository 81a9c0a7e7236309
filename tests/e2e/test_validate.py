"""The validation matrix: its commands, its verdict cells, its table and its errors; and the CI subset for real
(one process through `detrace check` / `detrace check-resume`, with and without the recipe)."""

from __future__ import annotations

from pathlib import Path

import pytest

from detrace.cli.validate import main
from detrace.investigate import validate
from detrace.investigate.validate import CONFIGS, FAST, Cell, Config, table

SINGLE = next(config for config in CONFIGS if config.name == "single index")
DDP = Config(name="ddp x2, one thread", nproc=2, args=("--parallel", "ddp"), threads=1)


def test_commands_launch_the_trainer_directly_or_under_torchrun() -> None:
    single = SINGLE.command(steps=3, deterministic=False)
    assert single[1:] == ["-m", "detrace.workload.train", "--steps", "3", "--threads", "8",
                          "--dispatch", "index", "--no-deterministic"]  # fmt: skip
    ddp = DDP.command(steps=3, deterministic=True)
    assert ddp[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert ddp[-1] == "--deterministic"


def test_nondeterministic_path_needs_index_dispatch_and_two_threads() -> None:
    assert SINGLE.nondeterministic_path
    assert not DDP.nondeterministic_path
    assert not Config(name="f", nproc=1, args=("--dispatch", "fixed"), threads=2).nondeterministic_path
    assert set(FAST) <= {c.name for c in CONFIGS}
    assert {"dp-ep x4", "pp-dp x4"} <= {c.name for c in CONFIGS}


@pytest.mark.parametrize(
    "code,report,deterministic,expected",
    [
        (0, {"identical": True}, True, Cell("identical", True)),
        (1, {"diffs": [{"first": {"step": 2, "rank": 0, "kind": "numeric", "phase": "other", "name": "loss"}}]},
         True, Cell("diverged (numeric) at step 2 rank 0 other loss", False)),
        (1, {"diffs": [{"first": {"step": 1, "rank": 1, "kind": "numeric", "phase": "backward",
                                  "name": "aten.index_put.default"}}]},
         False, Cell("detected (numeric) at step 1 rank 1 backward aten.index_put.default", True)),
        (0, {"identical": True}, False, Cell("NOT detected (runs identical)", False)),
        (2, None, True, Cell("error: run 1/2 exited with code 1: ImportError: boom", False)),
    ],
)  # fmt: skip
def test_check_cells(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, code: int, report: object, deterministic: bool, expected: Cell
) -> None:
    why = "run 1/2 exited with code 1: ImportError: boom"
    monkeypatch.setattr(validate, "_detrace", lambda args, *, timeout, log: (code, report, why))
    assert validate._check(SINGLE, steps=3, deterministic=deterministic, out=tmp_path, timeout=1) == expected


def test_resume_cells(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    first = {"step": 2, "rank": 1, "kind": "structural", "phase": "collective", "name": "all_reduce"}
    diverged = {"verdict": "resume-changed-the-run", "first": first}
    racing = {"verdict": "nondeterministic", "first": {**first, "kind": "numeric"}}
    answers = iter([(0, {"verdict": "exact"}, ""), (1, diverged, ""), (4, {"verdict": "inconclusive"}, ""),
                    (2, None, "resumed run exited with code 1: boom"), (3, racing, "")])  # fmt: skip
    monkeypatch.setattr(validate, "_detrace", lambda args, *, timeout, log: next(answers))
    cells = [validate._resume(SINGLE, steps=4, at=2, out=tmp_path, timeout=1) for _ in range(5)]
    assert cells[0] == Cell("exact (at 2)", True)
    assert cells[1] == Cell("diverged (structural) at step 2 rank 1 collective all_reduce", False)
    assert cells[2].text.startswith("unproven: the negative control") and cells[2].ok is False
    assert cells[3] == Cell("error: resumed run exited with code 1: boom", False)
    assert cells[4] == Cell("nondeterministic, resume not judged (numeric) at step 2 rank 1 collective all_reduce",
                            False)


def test_a_failed_command_is_explained_by_the_cause_it_quotes() -> None:
    stderr = """detrace check-resume: continuous run: out/continuous
detrace check-resume: error: resumed run exited with code 1; its output ends with:
W1129 13:31:11 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 11627 closing signal SIGTERM
detrace.workload.train: error: checkpoint/step-00000002 does not fit: Connection reset. ... a remote worker ...
detrace.workload.train: error: checkpoint/step-00000002 holds tensor 'model.embedding.weight' that ...
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
"""
    assert validate._reason(stderr) == (
        "resumed run exited with code 1: detrace.workload.train: error: checkpoint/step-00000002 holds tensor "
        "'model.embedding.weight' that ..."
    )
    assert validate._reason("Traceback (most recent call last):\nValueError: bad\n") == "ValueError: bad"
    assert validate._reason("") == ""


def test_the_verification_commands_stderr_is_kept(tmp_path: Path) -> None:
    code, report, why = validate._detrace(["check", "--runs", "1", "--", "true"], timeout=60, log=tmp_path / "c.log")
    assert (code, report) == (2, None) and "--runs must be at least 2" in why
    assert why in (tmp_path / "c.log").read_text()


def test_table_marks_only_failures() -> None:
    rows = [(SINGLE, Cell("identical", True), Cell("exact (at 2)", True), Cell("detected", True), 3.2),
            (DDP, Cell("diverged", False), Cell("exact (at 2)", True), Cell("n/a", None), 10.0)]  # fmt: skip
    lines = table(rows).splitlines()
    assert lines[0].startswith("| config") and "nondeterminism detected without recipe" in lines[0]
    assert lines[1].startswith("|---")
    assert "✗" not in lines[2] and "| 3 s" in lines[2]
    assert "✗ diverged" in lines[3] and "✗ n/a" not in lines[3]
    assert len({len(line) for line in lines}) == 1  # aligned columns


def test_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--list"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == len(CONFIGS)


@pytest.mark.parametrize(
    "argv,message",
    [(["--only", "nope"], "unknown config 'nope'"), (["--at", "4", "--steps", "4"], "--at 4"), (["--bogus"], "bogus")],
)
def test_errors_are_one_sentence(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("detrace validate: error: ") and message in err and "\n" not in err


@pytest.mark.slow
@pytest.mark.race
def test_the_ci_subset_is_green(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The fast subset for real, with the documented defaults (--steps 4 --at 2): one process, every verification
    command on the real trainer, each in a process of its own as a user types it (`detrace validate` itself runs in
    this process: it only starts them and reads their JSON)."""
    code = main(["--fast", "--out", str(tmp_path)])
    printed = capsys.readouterr()
    assert code == 0, printed.out + printed.err[-3000:]
    rows = {cells[0]: cells[1:] for cells in _table_cells(printed.out)}
    assert list(rows) == list(FAST)
    for name, (same, resume, found, _) in rows.items():
        assert same == "identical" and resume == "exact (at 2)", name
        config = next(c for c in CONFIGS if c.name == name)
        # Without the recipe the runs really diverge where the trainer has a nondeterministic path.
        assert found.startswith("detected (") if config.nondeterministic_path else found.startswith("n/a")


def _table_cells(stdout: str) -> list[list[str]]:
    """The body rows of the Markdown table at the end of `stdout`, as lists of stripped cells."""
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]
