"""The CLI dispatcher: help, unknown commands, and errors mapped to exit codes without tracebacks (in process; the
CLI as a process, its pipes and its imports: tests/integration/test_cli_processes.py)."""

from __future__ import annotations

import pytest

from detrace.cli import COMMANDS, main


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_no_arguments_prints_usage_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: detrace COMMAND" in capsys.readouterr().out


def test_unknown_command_is_one_sentence(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown command 'frobnicate'" in err


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_has_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([name, "--help"])
    assert exit_info.value.code == 0
    assert f"detrace {name}" in capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_bad_option_is_a_usage_error_not_a_traceback(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([name, "--no-such-option"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith(f"detrace {name}: error:")
