"""One strict integer parser everywhere: superscripts and other Unicode digits pass str.isdigit() but not int(),
and each place that checked with isdigit() then raised ValueError (a traceback) instead of one sentence."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from detrace._numbers import parse_count
from detrace.cli import main
from detrace.defects.faults import FaultSpec
from detrace.defects.guard import parse_env
from detrace.errors import UsageError
from detrace.investigate.check_resume import parse_stop_points
from detrace.record.config import TraceConfig
from detrace.record.steps import step_offset
from detrace.state.contract import stop_requested
from detrace.tracefile.selection import parse_window


def test_only_ascii_digits_are_a_number() -> None:
    assert parse_count(" 12 ") == 12 and parse_count("0") == 0
    for text in ("²", "1²", "٣", "-1", "+1", "1_000", "", " ", "1.0", "0x1"):
        assert parse_count(text) is None, text


@pytest.mark.parametrize(("parse", "words"), [
    (lambda: parse_env("²"), "DETRACE_GUARD"),
    (lambda: parse_stop_points("²"), "--at must be a step"),
    (lambda: FaultSpec.parse("bitflip:step=²,rank=0,tensor=w,bit=1"), "step must be a non-negative integer"),
    (lambda: parse_window("0-²"), "malformed SPEC"),
    (lambda: step_offset({"DETRACE_STEP_OFFSET": "²"}), "DETRACE_STEP_OFFSET"),
    (lambda: TraceConfig(out=Path("x"), rung="op", capture="step=²"), "step must be a non-negative integer"),
])
def test_a_superscript_is_a_usage_error_everywhere(parse: Callable[[], object], words: str) -> None:
    with pytest.raises(UsageError, match=words):
        parse()


def test_a_superscript_stop_step_is_a_usage_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETRACE_STOP_AT", "²")
    with pytest.raises(UsageError, match="DETRACE_STOP_AT"):
        stop_requested()


@pytest.mark.parametrize("argv", [["run", "--guard", "²", "--", "true"], ["check-resume", "--at", "²", "--", "true"],
                                  ["replay", ".", "--event", "²"]])
def test_superscripts_on_the_command_line_are_one_sentence(argv: list[str], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1
