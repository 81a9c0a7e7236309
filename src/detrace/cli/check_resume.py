"""`detrace check-resume --at K[,K2...] [--out DIR] [--timeout S] [--every-control] [--json] -- CMD...`: the
four-arm resume proof.

Arms: a continuous run; the same again (the run must equal itself, or no resume can be judged); per stop point K,
a run stopped after step K and resumed in a fresh process (it must continue with exactly the bits of the
continuous run); and negative controls (resume with one part of the state left out: the RNG states, the data
position, the optimizer state, the model), one of which must diverge, or the check proves nothing. Exit codes:
0 exact, 1 resume-changed-the-run, 2 error, 3 nondeterministic, 4 inconclusive.
"""

from __future__ import annotations

import contextlib
import json
import shlex
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from detrace.analyze import DiffResult
from detrace.cli._args import ArgumentParser, seconds, split_command
from detrace.errors import UsageError
from detrace.investigate.check_resume import PartCompared, ResumeResult, StopPoint, check_resume, parse_stop_points
from detrace.investigate.native_resume import NativeContract, recover
from detrace.launch.launcher import LaunchResult, run_traced
from detrace.report.meaning import apart_notes, forgotten, locate_command, locate_next, warned
from detrace.report.terminal import diff_lines, render_diff
from detrace.tracefile.layout import default_out

SCHEMA = "detrace.check-resume/1"


def _diff(result: DiffResult | None) -> dict[str, Any] | None:
    return result.to_json() if result is not None else None


def _point(point: StopPoint) -> dict[str, Any]:
    runs = {"stopped": point.stopped, "resumed": point.resumed, "resumed_again": point.resumed_again,
            **{f"control_{c.control.removeprefix('skip-')}": c.run for c in point.controls}}
    return {"at": point.at, "verdict": point.verdict,
            "runs": {name: str(path) for name, path in runs.items() if path is not None},
            "resume": _diff(point.resume_diff), "control": _diff(point.control_diff),
            "controls": [{"control": c.control, "part": c.part, "mattered": c.mattered, "diff": c.diff.to_json()}
                         for c in point.controls],
            "untried": list(point.untried), "depends": point.dependence,
            "restored": [c.to_json() for c in point.restored],
            "resumed_again": _diff(point.again_diff)}


def to_json(result: ResumeResult, cmd: list[str]) -> dict[str, Any]:
    """The `--json` object, schema detrace.check-resume/1."""
    deciding = result.deciding
    changed = next((p for p in result.points if p.verdict == "resume-changed-the-run"), None)
    return {"schema": SCHEMA, "verdict": result.verdict, "exit_code": result.exit_code, "at": result.at,
            "first": deciding.first.to_json() if deciding.first is not None else None,
            "forgot": _forgot(result, changed) if changed is not None else None,
            "suggest": locate_command(cmd) if result.verdict == "nondeterministic" else None,
            "runs": {"continuous": str(result.continuous), "continuous_again": str(result.again)},
            "repeat": result.repeat_diff.to_json(), "points": [_point(p) for p in result.points]}


def _forgot(result: ResumeResult, point: StopPoint) -> str | None:
    """What the resume after `point` forgot, in the user's words; an RNG part that differs as it does at a stop
    point that resumed exactly is not named."""
    harmless = [part for part in point.differing if part in result.harmless]
    return forgotten(point.resume_diff.first, [part for part in point.differing if part not in harmless],
                     equal=[*point.equal, *harmless])


def _final(result: ResumeResult, point: StopPoint, forgot: str | None) -> str:
    """What a first divergence in the final state (an EMA saved at the end) means in a resume check: the continuous
    runs agree, so not an unseeded draw after the training (the diff's own hint) but state the resume left behind."""
    restored = bool(point.equal) and all(part in result.harmless for part in point.differing)
    return ("every step matched, and the state the run ended with differs"
            + (" although every restored part compared equal" if restored else "")
            + (": see what the resume forgot, below" if forgot is not None else
               ": the resumed run did not restore all of the state the continuous run ended with"))


def _not_compared(result: DiffResult | None, start: int, why: str) -> None:
    """Under a first divergence at `start`, the first step compared: the runs may part earlier."""
    first = result.first if result is not None else None
    if first is not None and first.step <= start:
        print(f"  steps before {start} were not compared: {why}")


def _summary(result: ResumeResult, cmd: list[str]) -> None:
    verdict = result.verdict
    stops = ", ".join(map(str, result.at))
    if verdict == "nondeterministic":
        if result.repeat_diff.verdict != "identical":
            print("nondeterministic: two continuous runs of the same command differ, so no resume can be judged:")
            render_diff(result.repeat_diff)
            _not_compared(result.repeat_diff, result.at[0], f"the check's runs record from step {result.at[0]}, "
                          "where the first resumed run starts, so the two runs may part earlier")
        else:
            point = next(p for p in result.points if p.verdict == "nondeterministic")
            print(f"nondeterministic: the run resumed after step {point.at} differs from the continuous run, and "
                  "a second resumed run differs from the first, so the difference is not the resume's:")
            render_diff(point.again_diff)  # type: ignore[arg-type]
            _not_compared(point.again_diff, point.at, "the resumed runs start there")
        print(locate_next(cmd))
    elif verdict == "resume-changed-the-run":
        point = next(p for p in result.points if p.verdict == verdict)
        print(f"resume-changed-the-run: resuming after step {point.at} changed the run (two continuous runs agree, "
              "and a second resume differs in the same way):")
        forgot = _forgot(result, point)
        render_diff(point.resume_diff, final=_final(result, point, forgot))
        _not_compared(point.resume_diff, point.at, "the resumed run starts there")
        if forgot is not None:
            print(f"what the resume forgot: {forgot}")
        for line in warned(point.stopped, point.resumed):
            print(line)
    elif verdict == "inconclusive":
        point = next(p for p in result.points if p.verdict == verdict)
        left_out = ", ".join(c.control for c in point.controls)
        print(f"inconclusive: the run resumed after step {point.at} matched, but so did every negative control "
              f"({left_out}): {point.dependence}, so this check cannot tell a correct resume from a wrong one "
              "(does CMD train, and record its steps, after that step?)")
    else:
        control = next((line for line in diff_lines(result.deciding) if line.startswith("first divergence")),
                       "first divergence: (no detail)")
        deciding = result.points[0].deciding_control
        assert deciding is not None  # an exact point ran a control that diverged
        print(f"exact: two continuous runs agree, and resuming after step {stops} changed no bit; the negative "
              f"control ({deciding.control}) diverged as it must, {control}")
        for point in result.points:
            print(point.dependence)
        for point in result.points:
            for note in apart_notes(point.resume_diff):
                print(f"note: after step {point.at}, {note}")
        for line in warned(*(run for point in result.points for run in (point.stopped, point.resumed))):
            print(f"note: {line}")  # records that could not be made: the runs agree on what was recorded


def restored_lines(point: StopPoint) -> list[str]:
    """The state the resumed run restored, part by part, against the continuous run's: which parts are equal and
    which differ (where, with the values that tell them apart)."""
    if not point.restored:
        return []
    equal = [c.part for c in point.restored if c.equal]
    lines = [f"restored after step {point.at}, before the resumed run's first update, against the continuous "
             f"run's state at that point: {'equal: ' + ', '.join(equal) if equal else 'no part equal'}"]
    lines += [f"  differs: {_differs(c)}" for c in point.restored if c.equal is False]
    unseeded = [c.part for c in point.restored if c.equal is None]
    if unseeded:
        lines.append(f"  not compared: {', '.join(unseeded)} (the two continuous runs differ in it already: the run "
                     "never seeds it)")
    return lines


def _differs(compared: PartCompared) -> str:
    text = compared.part
    if compared.continuous is not None or compared.resumed is not None:
        text += f" (resumed: {compared.resumed or '?'}; continuous: {compared.continuous or '?'})"
    return f"{text} on {', '.join(compared.where)}"


class Interrupted(BaseException):
    """SIGTERM or SIGHUP (a closed terminal or ssh session) while a native check runs: raised like SIGINT's
    KeyboardInterrupt, so that the check puts CMD's checkpoints back before it ends (a BaseException: nothing on the
    way catches it as an error)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """SIGTERM and SIGHUP raise Interrupted in the main thread for the block (while CMD runs, the launcher passes
    SIGTERM on to CMD instead, and the arm ends with it). A second signal while the check puts files back is not
    raised: it would stop the putting back halfway."""
    raised: list[int] = []

    def handler(signum: int, frame: object) -> None:
        if not raised:
            raised.append(signum)
            raise Interrupted(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _launch(cmd: list[str], out: Path, **options: Any) -> LaunchResult:
    """A traced run of CMD; one that SIGTERM interrupted (the launcher passed it on to CMD) ends the check as
    SIGTERM between runs does."""
    result = run_traced(cmd, out, **options)
    if result.interrupted:
        raise Interrupted(signal.SIGTERM)
    return result


def _say(line: str) -> None:
    with contextlib.suppress(OSError):  # (after SIGHUP the terminal may be gone: the files still go back)
        print(f"detrace check-resume: {line}", file=sys.stderr)


def main(argv: list[str]) -> int:
    options, cmd = split_command(argv)
    parser = ArgumentParser("check-resume", "Verify that stopping after step K and resuming changes no bit, with "
                            "a second continuous run (is the run deterministic at all?) and negative controls. "
                            "Exit codes: 0 exact, 1 resume-changed-the-run, 2 error, 3 nondeterministic (the run "
                            "differs from itself; the resume is not judged), 4 inconclusive (no negative control "
                            "diverged).", usage="detrace check-resume --at K[,K...] [options] -- CMD...")
    parser.add_argument("--at", metavar="K[,K...]",
                        help="stop after this many optimizer steps, then resume; several stop points: 2,5")
    parser.add_argument("--out", type=Path, help="directory for the runs (default: detrace-runs/resume-<time>)")
    parser.add_argument("--timeout", type=seconds, help="seconds each run may take before it is killed")
    parser.add_argument("--every-control", action="store_true",
                        help="run every negative control (each leaves out one part of the state), not only until "
                             "one diverges: says each part the rest of the run depends on, at one run per part")
    parser.add_argument("--native", action="store_true",
                        help="prove CMD's own checkpoints (torch.save, safetensors, torch.distributed.checkpoint; "
                             "HF Trainer, Lightning, torchtitan-style loops) with no edit: stop right after its save "
                             "at step K, run it again to resume from disk")
    parser.add_argument("--resume-args", metavar="ARGS",
                        help="with --native: arguments appended to CMD to make it resume (e.g. --init_from=resume)")
    parser.add_argument("--force", action="store_true",
                        help="with --native: move a checkpoint that was there before the check aside for the check "
                             "(put back after it) instead of refusing")
    parser.add_argument("--recover", type=Path, metavar="OUT",
                        help="put back the checkpoints that a --native check writing into OUT had moved aside when "
                             "it was killed (its journal in OUT says what moved where); the next --native check in "
                             "the same working directory does it by itself")
    parser.add_argument("--json", action="store_true", help=f"print one JSON object (schema {SCHEMA}) on stdout")
    args = parser.parse_args(options)
    if args.recover is not None:
        if cmd or args.at is not None:
            raise UsageError("--recover OUT goes alone: it runs no check, it puts back what a killed one moved")
        recover(args.recover, _say)
        return 0
    if args.at is None:
        raise UsageError("--at is required: the step(s) to stop after, e.g. --at 2 or --at 2,4")
    if not args.native and (args.resume_args is not None or args.force):
        raise UsageError("--resume-args and --force go with --native (CMD's own checkpoints)")
    out = args.out or default_out("resume")
    at = parse_stop_points(args.at)
    contract = NativeContract(cmd, out=out, resume_args=shlex.split(args.resume_args or ""), force=args.force,
                              at=at, progress=_say) if args.native else None
    try:
        with _interruptible() if args.native else contextlib.nullcontext():
            result = check_resume(cmd, at=at, out=out, timeout=args.timeout, every_control=args.every_control,
                                  contract=contract, progress=_say, **({"launch": _launch} if args.native else {}))
    except Interrupted as stop:
        name = signal.Signals(stop.signum).name
        _say(f"interrupted by {name}; CMD's checkpoints are back where they were (see {out})")
        return 128 + stop.signum
    if args.json:
        print(json.dumps(to_json(result, cmd)))
    else:
        _summary(result, cmd)
        for point in result.points:
            for line in restored_lines(point):
                print(line)
    return result.exit_code
