"""`check` and `check-resume` judged in process through their launch seam: a stand-in launcher writes the
synthetic trace each run would record (tests/support/_synthetic.py), so the verdict logic runs without CMD."""

from __future__ import annotations

from pathlib import Path

import pytest
from _synthetic import Fault, SyntheticRun, write_run

from detrace.errors import UsageError
from detrace.investigate.check import check
from detrace.investigate.check_resume import check_resume
from detrace.launch.launcher import LaunchResult
from detrace.tracefile.layout import run_header_path
from detrace.tracefile.writer import write_json_atomic

RUN = SyntheticRun(ranks=2, steps=3, ops=2)


def _launcher(faults: dict[str, Fault | None], launched: list[str], *, records: bool = True):  # type: ignore[no-untyped-def]
    """Writes run directory `out` as CMD would have (with the fault given for its name; no records at all when
    `records` is false: a step window past the run's end), with the run.json the launcher writes."""
    def launch(cmd, out, *, rung, steps, env, timeout, quiet):  # type: ignore[no-untyped-def]
        out = Path(out)
        launched.append(out.name)
        out.mkdir(parents=True)
        if records:
            write_run(out, RUN, faults.get(out.name))
        summary = {"steps": {"first": 0, "last": RUN.steps - 1}} if records else {}
        write_json_atomic(run_header_path(out), {"command": list(cmd), "status": "finished", **summary})
        return LaunchResult(returncode=0, out=out, command=tuple(cmd), elapsed=0.0, output_tail="")
    return launch


def test_check_says_identical_or_names_the_run_that_differs(tmp_path: Path) -> None:
    launched: list[str] = []
    same = check(["python", "t.py"], runs=3, out=tmp_path / "same", launch=_launcher({}, launched))
    assert same.identical and same.exit_code == 0 and launched == ["run-0", "run-1", "run-2"]
    differs = check(["python", "t.py"], out=tmp_path / "differs",
                    launch=_launcher({"run-1": Fault(rank=1, step=1, op=0)}, []))
    first = differs.first_divergent
    assert not differs.identical and differs.exit_code == 1 and first is not None and first.first is not None
    assert first.first.step == 1 and first.first.rank == 1


def test_check_resume_past_the_last_step_stops_after_one_run(tmp_path: Path) -> None:
    # It failed after two full runs ("continuous holds no trace"); now the first run tells.
    launched: list[str] = []
    with pytest.raises(UsageError, match=r"no step from 3 on .* stopping after 3 steps leaves no step to resume"):
        check_resume(["python", "t.py"], at=[3], out=tmp_path / "past", launch=_launcher({}, launched,
                                                                                          records=False))
    assert launched == ["continuous"]
    with pytest.raises(UsageError, match=r"its last step at 2 .* stopping after 5 steps"):
        check_resume(["python", "t.py"], at=[1, 5], out=tmp_path / "late", launch=_launcher({}, []))
