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
from detrace.parallel.layout import Layout
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


def test_a_number_longer_than_python_converts_is_none() -> None:
    # int() raises ValueError past sys.get_int_max_str_digits() (4300): a traceback wherever it was let through
    assert parse_count("1" * 10_000) is None
    assert parse_count("0" * 10_000 + "7") == 7  # leading zeros are not digits of the value


@pytest.mark.parametrize(("layouts", "words"), [
    ("fsdp" + "1" * 10_000 + ",fsdp1", "has one of 10000 digits"),
    ("1" * 10_000 + "x1,1x1", "has one of 10000 digits"),
    ("fsdp01,fsdp1", "'fsdp01' and 'fsdp1' are the same layout"),
    ("2x2,dp2xtp2", "'2x2' and 'dp2xtp2' are the same layout"),
    ("tp2xfsdp2,fsdp2xtp2", "'tp2xfsdp2' and 'fsdp2xtp2' are the same layout"),
])
def test_check_topology_layouts_are_refused_in_one_sentence(layouts: str, words: str, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["check-topology", "--layouts", layouts, "--", "python", "t.py"]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and err.count("\n") == 1 and len(err) < 300


def test_a_layout_written_with_leading_zeros_is_named_without_them() -> None:
    assert Layout.parse("fsdp02xtp01").name == "fsdp2xtp1" and Layout.parse("02x2").name == "2x2"
