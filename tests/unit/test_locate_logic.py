"""The ladder's narrowing and verdicts, in process: `locate(..., launch=)` runs a scripted command that writes
synthetic traces (tests/support/_synthetic.py) with a known answer, so each path of the ladder is checked in
milliseconds. tests/e2e/test_locate_e2e.py keeps the real ladders on real CPU nondeterminism."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from _synthetic import Fault, SyntheticRun, rank_table, write_table

from detrace.analyze.locate_result import LocateResult, load_ladder
from detrace.investigate.locate import LocateConfig, locate
from detrace.launch.launcher import LaunchResult

RUN = SyntheticRun(ranks=2, steps=4, ops=8)
RUNGS = {"semantic": ("metrics", "semantic"), "module": ("metrics", "semantic"), "op": ("metrics", "semantic", "op")}
RACE = Fault(rank=1, step=2, op=3)  # an injected fault, named as such: one backward op's output bits on rank 1


class Scripted:
    """A command whose runs write the records of `RUN` at the rung asked for; the runs named in `faulted` (by their
    ladder name, e.g. "1-semantic-b") show the fault `RACE`."""

    def __init__(self, faulted: set[str] | None = None, *, second_arm: bool = False) -> None:
        self.faulted = faulted or set()
        self.second_arm = second_arm  # every second arm of a pair (b, d) shows the fault: a race that recurs
        self.runs: list[str] = []

    def __call__(self, cmd: list[str], out: Path, *, rung: str, **_: object) -> LaunchResult:
        self.runs.append(out.name)
        fault = RACE if out.name in self.faulted or (self.second_arm and out.name[-2:] in ("-b", "-d")) else None
        for rank in range(RUN.ranks):
            table = rank_table(RUN, rank, fault)
            table = table.filter(pc.is_in(table["rung"], value_set=pa.array(RUNGS[rung])))
            write_table(out, rank, table, world_size=RUN.ranks)
        return LaunchResult(returncode=0, out=out, command=tuple(cmd), elapsed=0.01, output_tail="")


def _locate(tmp_path: Path, launcher: Scripted) -> LocateResult:
    return locate(LocateConfig(command=("python", "train.py"), out=tmp_path / "out"), launch=launcher)


def test_three_equal_runs_are_deterministic(tmp_path: Path) -> None:
    launcher = Scripted()
    result = _locate(tmp_path, launcher)
    assert result.verdict == "deterministic" and result.exit_code == 0 and result.culprit is None
    assert launcher.runs == ["1-semantic-a", "1-semantic-b", "1-semantic-c"]
    assert result.message == "every recorded bit of three runs is identical over 4 steps"
    assert load_ladder(tmp_path / "out").verdict == "deterministic"  # ladder.json, locate.json, the report


def test_a_recurring_race_is_narrowed_to_its_origin_op(tmp_path: Path) -> None:
    launcher = Scripted(second_arm=True)
    result = _locate(tmp_path, launcher)
    culprit = result.culprit
    assert culprit is not None and result.verdict == "nondeterministic" and result.exit_code == 1
    assert (culprit.rank, culprit.step, culprit.phase, culprit.origin) == (1, 2, "backward", True)
    assert culprit.name == "aten.add.Tensor" and culprit.module == "layers.3"  # backward op 3 of the synthetic loop
    assert [stage.rung for stage in result.stages] == ["semantic", "module", "op", "kernel"]
    assert result.stages[1].steps == "2" and result.stages[1].ranks == "1"  # the window the broad pair gave
    assert launcher.runs == ["1-semantic-a", "1-semantic-b", "2-module-a", "2-module-b", "3-op-a", "3-op-b",
                             "4-capture"]
    # the scripted command captures nothing, so the kernel rung says so instead of replaying
    assert result.replay is None and "recorded no call matching" in result.stages[-1].note


def test_a_difference_that_does_not_recur_is_inconclusive(tmp_path: Path) -> None:
    # Only the broad pair's second run shows the fault: a one-time event, which no rerun reproduces. The ladder
    # retries the module pair once, then says what it knows instead of guessing.
    launcher = Scripted({"1-semantic-b"})
    result = _locate(tmp_path, launcher)
    assert result.verdict == "inconclusive" and result.exit_code == 2
    assert result.culprit is not None and (result.culprit.step, result.culprit.rank) == (2, 1)
    assert launcher.runs == ["1-semantic-a", "1-semantic-b", "2-module-a", "2-module-b", "2-module-c", "2-module-d"]
    assert "the second arm does not reproduce it: 4 reruns at the module rung agree" in result.message
    assert "transient hardware fault" in result.message and "detrace recheck RUN --step 2" in result.message
    assert "did not recur" in result.stages[-1].note


@pytest.mark.parametrize("faulted", [{"1-semantic-b", "2-module-b", "2-module-d"}])
def test_an_op_pair_that_does_not_part_says_so(tmp_path: Path, faulted: set[str]) -> None:
    # The module rung confirms the divergence, but neither op pair parts: the ladder names the rung it stopped at.
    result = _locate(tmp_path, Scripted(faulted))
    assert result.verdict == "inconclusive"
    assert "the op-rung reruns could not pin it down" in result.message
    assert [stage.rung for stage in result.stages] == ["semantic", "module", "op"]
