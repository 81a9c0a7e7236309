"""Default output directories: one folder (./detrace-runs), a stable link to the newest locate, and no empty
directory left behind by a failed command (issue 23, what a newcomer met)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _synthetic import SyntheticRun, rank_table, write_table

from detrace.cli import main as cli
from detrace.investigate.locate import driver
from detrace.launch.launcher import LaunchResult
from detrace.tracefile.layout import RUNS_DIR, default_out


def test_every_default_output_goes_under_one_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert default_out("check").resolve().parent == tmp_path / RUNS_DIR


def test_a_failed_locate_leaves_no_empty_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli(["locate", "--", "detrace-no-such-command-xyz"]) == 2
    assert "command not found" in capsys.readouterr().err
    assert not any((tmp_path / RUNS_DIR).glob("locate-*"))


def test_locate_links_its_newest_output_for_the_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    def launch(cmd: list[str], out: Path, **options: object) -> LaunchResult:
        write_table(out, 0, rank_table(SyntheticRun(ranks=1, steps=2, ops=2), 0), world_size=1)
        return LaunchResult(returncode=0, out=Path(out), command=tuple(cmd), elapsed=0.1, output_tail="")

    monkeypatch.setattr(driver, "run_traced", launch)  # every run of CMD: the same synthetic trace
    monkeypatch.chdir(tmp_path)
    assert cli(["locate", "--no-checkpoints", "--", "python", "train.py"]) == 0
    latest = Path(RUNS_DIR, "locate-latest")
    assert "detrace report detrace-runs/locate-latest" in capsys.readouterr().err
    assert (latest / "locate.json").is_file() and latest.resolve().name.startswith("locate-")
    assert cli(["report", str(latest)]) == 0  # the tour's step 3, as the README gives it
    assert (latest / "report.html").is_file()


@pytest.mark.parametrize(("command", "shown"), [
    ("check", ["usage: detrace check [options] -- CMD...", "0 identical, 1 diverged, 2 error"]),
    ("check-resume", ["usage: detrace check-resume --at K[,K...] [options] -- CMD...", "3 nondeterministic",
                      "4 inconclusive"]),
])
def test_help_shows_the_command_and_every_exit_code(command: str, shown: list[str],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(part in text for part in shown)


def test_the_readme_command_table_lists_every_command() -> None:
    from detrace.cli import COMMANDS

    table = [line for line in (Path(__file__).parents[2] / "README.md").read_text().splitlines()
             if line.startswith("| `detrace ")]
    assert sorted(c for c in COMMANDS if not any(line.startswith(f"| `detrace {c} ") or
                                                 line.startswith(f"| `detrace {c}`") for line in table)) == []


def test_a_plain_dataloader_in_trainstate_names_resumable_loader() -> None:
    import torch

    from detrace import TrainState
    from detrace.errors import UsageError

    loader = torch.utils.data.DataLoader(list(range(4)))
    with pytest.raises(UsageError, match=r"DataLoader lacks; wrap the dataset in detrace\.state\.ResumableLoader"):
        TrainState(model=torch.nn.Linear(1, 1), data=loader)


def test_a_compiled_kernels_advice_reaches_the_terminal() -> None:
    import io

    from detrace.analyze.replay_result import ADVICE_COMPILED, ArmResult, ReplayResult
    from detrace.cli.replay import render
    from detrace.report.terminal import make_console

    base = ArmResult(threads=2, deterministic=False, repeats=5, distinct=2, differing_elements=3, max_ulp=1,
                     matches_capture=True)
    advice = ADVICE_COMPILED.format(ops="aten.index_put")
    sink = io.StringIO()
    render(ReplayResult(op="inductor.cpp_fused_index_put_0", meta={}, shapes=[], base=base, arms=[base],
                        advice=[advice]), make_console(sink))
    assert f"advice: {advice}" in sink.getvalue()


@pytest.mark.parametrize("command", ["run", "check", "locate", "check-topology"])
def test_an_out_past_name_max_or_path_max_is_one_sentence(tmp_path: Path, command: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    for out in (tmp_path / ("x" * 300), tmp_path / ("y/" * 2100)):  # NAME_MAX 255, PATH_MAX 4096
        assert cli([command, "--out", str(out), "--", "true"]) == 2
        err = capsys.readouterr().err  # locate says first what it will do
        last = err.splitlines()[-1]
        assert "Traceback" not in err and last.startswith(f"detrace {command}: error: cannot write to ")
        assert last.endswith("File name too long") and len(last) < 300, err
    assert not any(tmp_path.iterdir())
