"""`detrace check-resume`: exact resume verified on a user's command, a proof with four arms (a continuous run,
the same again, stopped after step K and resumed in a fresh process, and negative controls, one of which must
diverge). It drives the launcher and the diff; of the traces it reads only the state and the input batch at
each stop point.

Each negative control resumes with one part of the state left out (the RNG states, the data position, the
optimizer state, the model). A loop that draws no random number after the stop (no dropout, a seeded sampler) is
proven by the data or the optimizer control; the controls that diverged say what the rest of the run depends on.

check-resume speaks to CMD through the environment contract that `detrace.TrainState` implements
(DETRACE_CKPT_DIR, DETRACE_STOP_AT, DETRACE_RESUME, DETRACE_RESUME_CONTROL; see docs/resume.md).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow.compute as pc

from detrace._numbers import parse_count
from detrace.analyze import DiffResult, diff
from detrace.errors import CommandFailed, TraceError, UsageError
from detrace.integrations.advice import advice, framework_of
from detrace.investigate.check import Progress, run_checked
from detrace.launch.launcher import Launcher, run_traced
from detrace.tracefile import open_run, read_rank
from detrace.tracefile.layout import prepare_out
from detrace.tracefile.state_parts import ENV_STATE_AT, PARTS, RECORDED, RNG_PARTS, StateParts, read_state_parts
from detrace.verdicts import RESUME, ResumeVerdict

CONTROL_PARTS = {
    "skip-rng": "RNG states",
    "skip-data": "data position",
    "skip-optimizer": "optimizer state",
    "skip-model": "model",
}
"""The part of the state each negative control (the contract's `CONTROLS`, in their order) leaves out."""


def controls_for(cmd: list[str]) -> tuple[str, ...]:
    """The negative controls CMD can apply, in the order they are tried: a framework that restores the model
    itself (transformers, accelerate, Lightning) cannot leave the model out."""
    # Imported here: the package detrace.state imports torch, which the command does not need before it runs.
    from detrace.state.contract import CONTROLS, MODEL_CONTROL

    return tuple(c for c in CONTROLS if c != MODEL_CONTROL or framework_of(cmd) == "plain")


@dataclass(frozen=True, kw_only=True)
class ControlRun:
    """One negative control of a stop point: the run resumed with one part of the state left out."""

    control: str
    """The contract's name of the control (DETRACE_RESUME_CONTROL), a key of `CONTROL_PARTS`."""
    run: Path
    diff: DiffResult
    """Continuous vs this control: diverged when the rest of the run depends on the part left out."""
    applied: bool = True
    """Whether the part was there to leave out (a native checkpoint may hold no RNG state, or no optimizer)."""

    def __post_init__(self) -> None:
        if self.control not in CONTROL_PARTS:
            raise ValueError(f"unknown negative control {self.control!r}")

    @property
    def part(self) -> str:
        """The part left out, in words: "RNG states", "data position", "optimizer state", "model"."""
        return CONTROL_PARTS[self.control]

    @property
    def mattered(self) -> bool:
        """Leaving the part out changed the run."""
        return self.diff.verdict == "diverged"


@dataclass(frozen=True, kw_only=True)
class PartCompared:
    """One part of the state a resumed run restored, compared bit for bit with the continuous run's at the same
    point: as the optimizer step after the stop point begins (the resumed run's first update)."""

    part: str
    """One of detrace.tracefile.state_parts.PARTS: "parameters", "optimizer state", "param groups", "scheduler",
    "torch RNG state", ..., "data position"."""
    equal: bool | None
    """None: not compared, since the two continuous runs differ in it already (a generator the run never seeds)."""
    where: tuple[str, ...] = ()
    """Where it differs: "rank 1", "rank 0, optimizer 1"."""
    continuous: str | None = None
    resumed: str | None = None
    """The values shown next to a difference (learning rate and weight decay, the schedulers' step), each run's;
    "none" for a part one of the runs does not have (a scheduler), None when there is nothing to show."""

    def __post_init__(self) -> None:
        if self.part not in PARTS:
            raise ValueError(f"unknown part of the state {self.part!r}")

    def to_json(self) -> dict[str, object]:
        return {"part": self.part, "equal": self.equal, "where": list(self.where), "continuous": self.continuous,
                "resumed": self.resumed}


def compare_parts(continuous: Path, again: Path, resumed: Path, k: int,
                  resume_diff: DiffResult) -> tuple[PartCompared, ...]:
    """The resumed run's state before its first update after step `k`, part by part, against the continuous run's
    at the same point (empty when a run recorded none: its optimizer never stepped there). A part the two
    continuous runs differ in (Python's or NumPy's generator, never seeded) is not compared; a part that neither
    run has (no scheduler, no CUDA) is left out. The data position is the trace's: the input batch of step `k` on
    each rank (a rank's first divergence, when it is that batch)."""
    def at_k(run: Path) -> dict[tuple[int, int], StateParts]:
        return {(s.rank, s.optimizer): s for s in read_state_parts(run) if s.step == k}

    base, twice, mine = at_k(continuous), at_k(again), at_k(resumed)
    if not base or not mine:
        return ()
    compared = []
    for part in RECORDED:
        keys = sorted(set(base) | set(mine))
        if all(key in base and key in mine and base[key].parts[part] is None is mine[key].parts[part]
               for key in keys):
            continue  # neither run has it
        if any(key in base and key in twice and base[key].parts[part] != twice[key].parts[part] for key in keys):
            compared.append(PartCompared(part=part, equal=None))
            continue
        where = [key for key in keys
                 if key not in base or key not in mine or base[key].parts[part] != mine[key].parts[part]]
        first = where[0] if where else None
        compared.append(PartCompared(
            part=part, equal=not where, where=tuple(f"rank {r}" + (f", optimizer {o}" if o else "") for r, o in where),
            continuous=_shown(base.get(first), part) if first else None,
            resumed=_shown(mine.get(first), part) if first else None))
    data = tuple(f"rank {r.rank}" for r in resume_diff.ranks
                 if r.first is not None and r.first.step == k and r.first.phase == "data"
                 and not _same_samples(continuous, resumed, r.rank, k))
    compared.append(PartCompared(part=PARTS[-1], equal=not data, where=data))
    return tuple(compared)


Batch = tuple[list[int] | None, list[tuple[str, tuple[int, ...], int | None]]]
"""A step's input batches on one rank: the dataset indices a sampler recorded (None when none did), and each tensor
of them (dtype, shape, digest), in order."""


def _batch(run: Path, rank: int, k: int) -> Batch | None:
    """The input batches of step `k` on `rank` (the batch rung's "batch" and "samples" calls), or None when the
    trace cannot be read."""
    try:
        table = read_rank(run, rank).table
    except TraceError:
        return None
    rows = table.filter(pc.and_(pc.equal(table["step"], k), pc.equal(table["phase"], "data"))).select(
        ["name", "role", "dtype", "shape", "digest", "extra"]).to_pylist()
    samples = [index for row in rows if row["name"] == "samples" and row["extra"]
               for index in json.loads(row["extra"]).get("samples", [])]
    tensors = [(row["dtype"], tuple(row["shape"]), row["digest"]) for row in rows
               if row["name"] == "batch" and row["role"] == "input"]
    return (samples or None), tensors


def _same_samples(continuous: Path, resumed: Path, rank: int, k: int) -> bool:
    """Whether step `k`'s batch on `rank` holds the same samples in both runs, only their random augmentation
    differing: the same dataset indices, when a sampler recorded them; else every tensor of the batch that names
    its samples (integer: labels, token ids) equal, and only floating-point ones (what an augmentation draws)
    differing."""
    mine, theirs = _batch(continuous, rank, k), _batch(resumed, rank, k)
    if mine is None or theirs is None:
        return False
    if mine[0] is not None and theirs[0] is not None:
        return mine[0] == theirs[0]
    a, b = mine[1], theirs[1]
    if len(a) != len(b) or any(x[:2] != y[:2] for x, y in zip(a, b, strict=True)):
        return False  # other shapes: other samples
    naming = [x == y for x, y in zip(a, b, strict=True) if not x[0].startswith(_FLOATING)]
    return bool(naming) and all(naming) and a != b


_FLOATING = ("float", "bfloat", "complex")
"""The dtypes (by name) of the tensors an augmentation changes; the others (integers, booleans) name the samples."""


def _shown(parts: StateParts | None, part: str) -> str | None:
    if parts is None:
        return "not recorded"
    if parts.parts[part] is None:
        return "none"
    return parts.shown.get(part)


@dataclass(frozen=True, kw_only=True)
class StopPoint:
    """One stop point of `detrace check-resume`: stopped after step `at`, resumed, and the negative control."""

    at: int
    """The step after which the run was stopped and resumed (a global step: steps counted from 1)."""
    verdict: ResumeVerdict
    """exact, resume-changed-the-run, nondeterministic (the resumed run did not repeat itself) or inconclusive."""
    stopped: Path
    resumed: Path
    resume_diff: DiffResult
    """Continuous vs resumed, on the steps both have (`at` and up)."""
    restored: tuple[PartCompared, ...] = ()
    """The resumed run's state before its first update, part by part, against the continuous run's (empty when a
    run recorded none)."""
    controls: tuple[ControlRun, ...] = ()
    """The negative controls run (when the resume matched), in order: one must diverge. By default they stop at the
    first that does; with every control, each is run."""
    untried: tuple[str, ...] = ()
    """The controls that were not run (the first divergent one proved the point already)."""
    resumed_again: Path | None = None
    again_diff: DiffResult | None = None
    """Resumed vs resumed once more (run when the resume differed): a resume that changes the run does so the
    same way twice; a run that differs from itself is nondeterministic."""

    @property
    def dependence(self) -> str | None:
        """What the negative controls showed, in words: "after step 3 this run depends on its data position and
        optimizer state, not on its RNG states (not tried: its model; ...)"; None when no control ran."""
        if not self.controls:
            return None
        mattered = [c.part for c in self.controls if c.mattered]
        unchanged = [c.part for c in self.controls if not c.mattered and c.applied]
        absent = [c.part for c in self.controls if not c.mattered and not c.applied]
        words = (f"after step {self.at} this run depends on its {_join(mattered, 'and')}" if mattered else
                 f"after step {self.at} leaving out its {_join(unchanged, 'or')} changed nothing" if unchanged else
                 f"after step {self.at} no part of the state could be left out")
        if mattered and unchanged:
            words += f", not on its {_join(unchanged, 'or')}"
        if absent:
            words += f" (its checkpoint holds no {_join(absent, 'or')} to leave out)"
        if self.untried:
            untried = _join([CONTROL_PARTS[c] for c in self.untried], "and")
            words += f" (not tried: its {untried}; --every-control tries each part)"
        return words

    @property
    def differing(self) -> list[str]:
        """The parts of the restored state that differ from the continuous run's."""
        return [c.part for c in self.restored if c.equal is False]

    @property
    def equal(self) -> list[str]:
        """The parts of the restored state equal to the continuous run's."""
        return [c.part for c in self.restored if c.equal]

    @property
    def deciding_control(self) -> ControlRun | None:
        """The control that proves the check would notice a wrong resume (the first that diverged), else the last
        one run (none diverged), else None (no control ran)."""
        return next((c for c in self.controls if c.mattered), self.controls[-1] if self.controls else None)

    @property
    def control_diff(self) -> DiffResult | None:
        control = self.deciding_control
        return control.diff if control is not None else None

    @property
    def first(self) -> DiffResult | None:
        """The diff that names this point's verdict."""
        if self.verdict == "nondeterministic":
            return self.again_diff
        return self.control_diff if self.verdict in ("exact", "inconclusive") else self.resume_diff


@dataclass(frozen=True, kw_only=True)
class ResumeResult:
    """The outcome of `detrace check-resume`: four arms (continuous, continuous again, stopped and resumed, the
    negative control), the last two per stop point."""

    at: list[int]
    """The stop points, ascending."""
    continuous: Path
    again: Path
    repeat_diff: DiffResult
    """Continuous vs continuous again: must be identical, or nothing can be said of the resume."""
    points: list[StopPoint] = field(default_factory=list)
    """One per stop point; empty when the two continuous runs differ (no resume was tried)."""

    @property
    def verdict(self) -> ResumeVerdict:
        """nondeterministic (before anything else: never blame a resume for a run that differs from itself), then
        resume-changed-the-run, inconclusive (a control that did not diverge proves nothing), exact."""
        if self.repeat_diff.verdict != "identical":
            return "nondeterministic"
        verdicts = {point.verdict for point in self.points}
        order: tuple[ResumeVerdict, ...] = ("nondeterministic", "resume-changed-the-run", "inconclusive", "exact")
        return next(v for v in order if v in verdicts)

    @property
    def exit_code(self) -> int:
        return RESUME[self.verdict]

    @property
    def harmless(self) -> set[str]:
        """The RNG parts that differ at a stop point that resumed exactly: a generator the rest of the run never
        draws from, whose difference explains no other stop point's either."""
        return {part for point in self.points if point.verdict == "exact" for part in point.differing
                if part in RNG_PARTS}

    @property
    def deciding(self) -> DiffResult:
        """The diff whose first divergence the verdict names."""
        if self.repeat_diff.verdict != "identical":
            return self.repeat_diff
        point = next(p for p in self.points if p.verdict == self.verdict)
        return point.first  # type: ignore[return-value]


def _join(words: list[str], conjunction: str) -> str:
    """"a", "a and b", "a, b and c"."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} {conjunction} {words[-1]}"


def parse_stop_points(text: str) -> list[int]:
    """`--at 2,5`: the stop points, ascending, each a step of at least 1."""
    points = set()
    for item in text.split(","):
        point = parse_count(item)
        if point is None or point < 1:
            raise UsageError(f"--at must be a step of at least 1 (steps completed before stopping), or several "
                             f"such as 2,5; not {text!r}")
        points.add(point)
    return sorted(points)


def _comparable(result: DiffResult, what: str) -> DiffResult:
    if result.verdict == "incomparable":
        raise CommandFailed(f"{what} cannot be compared: {result.reason}")
    return result


class RerunArm(Exception):
    """Raised by `Contract.after` when the arm must run again (its message says why; the run is discarded)."""


FORCE_TRIES = 3
"""Times an arm is run again on RerunArm before the check gives up."""


class Contract:
    """How check-resume makes CMD stop, resume and leave a part out: detrace's environment contract (TrainState and
    the integrations: DETRACE_CKPT_DIR, DETRACE_STOP_AT, DETRACE_RESUME, DETRACE_RESUME_CONTROL). The native
    contract (detrace.investigate.native_resume) drives CMD's own checkpoints instead. Each arm runs between
    `before(arm)` and `after(arm, run)`."""

    def __init__(self, cmd: list[str]) -> None:
        self.cmd = cmd
        self.controls = controls_for(cmd)
        """The negative controls, in the order they are tried."""

    def before(self, arm: str, run: Path, point: Path | None) -> None:
        """An arm ("continuous", "again", "stopped", "resumed", "resumed-again", "control-PART") is about to run
        into `run`; `point` is its stop point's directory (None for the continuous arms)."""

    def after(self, arm: str, run: Path, point: Path | None) -> None:
        """The arm ran into `run`: check what it did (refuse a run that proves nothing) and tidy up after it."""

    def stop(self, k: int, point: Path) -> tuple[list[str], dict[str, str]]:
        """The command and environment of the arm stopped after step `k`."""
        return self.cmd, {"DETRACE_CKPT_DIR": str(point / "checkpoint"), "DETRACE_STOP_AT": str(k)}

    def stopped(self, k: int, run: Path, point: Path) -> None:
        """The stopped arm ran: it must have saved a checkpoint after step `k`."""
        ckpt = point / "checkpoint"
        if not ckpt.exists():
            raise CommandFailed(
                f"CMD wrote no checkpoint to {ckpt} when asked to stop after step {k}; does it use "
                f"{advice(self.cmd)}, and does it run more than that many steps?")

    def resume(self, point: Path, control: str | None = None) -> tuple[list[str], dict[str, str]]:
        """The command and environment of a resumed arm, or of a negative control."""
        env = {"DETRACE_CKPT_DIR": str(point / "checkpoint"), "DETRACE_RESUME": "1"}
        if control is not None:
            env["DETRACE_RESUME_CONTROL"] = control
        return self.cmd, env

    def applied(self, control: str, run: Path) -> bool:
        """Whether the control run left its part out (the contract's scripts always do)."""
        return True

    def finish(self) -> None:
        """The check is over, or stopped by an error: put back what was moved."""


def check_resume(cmd: list[str], *, at: list[int], out: Path, timeout: float | None = None,
                 every_control: bool = False, progress: Progress = lambda _: None,
                 launch: Launcher = run_traced, contract: Contract | None = None) -> ResumeResult:
    """The four-arm resume proof: a continuous run, a second continuous run (equal to the first, or the run is
    nondeterministic and no resume can be judged), for each stop point K a run stopped after step K and resumed
    (equal to the continuous run from step K on), and negative controls, one of which must diverge: tried in order
    until one does, or each of them with `every_control`. A resumed run that differs is resumed once more: only a
    difference that repeats is blamed on the resume. `contract`: how CMD is made to stop and resume (detrace's
    environment contract by default)."""
    if not at or any(k < 1 for k in at):
        raise UsageError(f"--at must be a step of at least 1 (steps completed before stopping), got {at}")
    if not cmd:
        raise UsageError("no command given; put it after '--', e.g. detrace check-resume --at 3 -- python train.py")
    at = sorted(set(at))
    out = prepare_out(out, holds="runs")
    contract = contract if contract is not None else Contract(cmd)
    # Records before the first stop point are never compared: the resumed processes start there or later.
    window = f"{at[0]}::1"

    def arm(name: str, run: Path, *, label: str, point: Path | None = None, command: list[str] = cmd,
            env: dict[str, str] | None = None, state_at: list[int] = at) -> None:
        # Each run digests its state, part by part, as the step after each stop point it reaches begins.
        env = {**(env or {}), ENV_STATE_AT: ",".join(map(str, state_at))}
        for _ in range(FORCE_TRIES):
            contract.before(name, run, point)
            run_checked(command, run, progress=progress, timeout=timeout, launch=launch, steps=window, label=label,
                        env=env)
            try:
                contract.after(name, run, point)
                return
            except RerunArm as rerun:
                progress(f"{rerun}; running it again")
                shutil.rmtree(run)  # detrace's own trace of a run that resumed from an old checkpoint
        raise CommandFailed(f"the {label} still resumed from a checkpoint that was there before the check after "
                            f"{FORCE_TRIES} tries; move CMD's checkpoints away by hand")

    try:
        return _check(cmd, at, out, arm, contract, every_control)
    finally:
        contract.finish()


Arm = Callable[..., None]


def _check(cmd: list[str], at: list[int], out: Path, arm: Arm, contract: Contract,
           every_control: bool) -> ResumeResult:
    continuous, again = out / "continuous", out / "continuous-again"
    arm("continuous", continuous, label="continuous run")
    last = _last_step(continuous)
    if last is None or last < at[-1]:
        # Checked after the first run, not after both: a stop point at or past the end leaves nothing to resume.
        if last is None:
            raise UsageError(f"the continuous run ended with no step from {at[0]} on (steps count from 0), so "
                             f"stopping after {at[-1]} steps leaves no step to resume")
        raise UsageError(f"the continuous run has {last + 1} steps (steps count from 0: its last is step {last}), "
                         f"so stopping after {at[-1]} steps leaves no step to resume; give --at below {last + 1}")
    arm("again", again, label="continuous run, again")
    repeat = _comparable(diff(continuous, again), "the two continuous runs")
    result = ResumeResult(at=at, continuous=continuous, again=again, repeat_diff=repeat)
    if repeat.verdict != "identical":
        return result
    for k in at:
        result.points.append(_stop_point(arm, k, out / f"at-{k}", continuous, again, contract, every_control))
    return result


def _last_step(run: Path) -> int | None:
    """The last global step a finished run recorded (run.json's `steps`, from its ranks' footers), or None."""
    try:
        steps = open_run(run).header.steps
    except TraceError:
        return None
    return None if steps is None else steps[1]


def _stop_point(arm: Arm, k: int, out: Path, continuous: Path, again: Path, contract: Contract,
                every_control: bool) -> StopPoint:
    """One stop point's arms, each run by `arm(name, run, label=..., point=..., command=..., env=...)`."""
    stopped, resumed = out / "stopped", out / "resumed"
    command, env = contract.stop(k, out)
    arm("stopped", stopped, label=f"run stopped after step {k}", point=out, command=command, env=env, state_at=[])
    contract.stopped(k, stopped, out)
    command, env = contract.resume(out)
    arm("resumed", resumed, label=f"run resumed after step {k}", point=out, command=command, env=env, state_at=[k])
    # The resumed arm (and each control) runs CMD with its --resume-args on purpose: no note that the commands differ.
    resume_diff = _comparable(diff(continuous, resumed, command_differs=True),
                              f"the continuous run and the run resumed after step {k}")
    restored = compare_parts(continuous, again, resumed, k, resume_diff)
    if resume_diff.verdict != "identical":
        again = out / "resumed-again"
        arm("resumed-again", again, label=f"run resumed after step {k}, again", point=out, command=command, env=env,
            state_at=[k])
        again_diff = _comparable(diff(resumed, again), f"the two runs resumed after step {k}")
        verdict: ResumeVerdict = "resume-changed-the-run" if again_diff.verdict == "identical" else "nondeterministic"
        return StopPoint(at=k, verdict=verdict, stopped=stopped, resumed=resumed, resume_diff=resume_diff,
                         restored=restored, resumed_again=again, again_diff=again_diff)
    runs: list[ControlRun] = []
    for control in contract.controls:
        part = CONTROL_PARTS[control]
        name = f"control-{control.removeprefix('skip-')}"
        run = out / name
        command, env = contract.resume(out, control)
        arm(name, run, label=f"negative control after step {k} ({control}: without the {part})", point=out,
            command=command, env=env, state_at=[])
        runs.append(ControlRun(control=control, run=run, applied=contract.applied(control, run), diff=_comparable(
            diff(continuous, run, command_differs=True),
            f"the continuous run and the negative control after step {k} ({control})")))
        if runs[-1].mattered and not every_control:
            break
    verdict = "exact" if any(c.mattered for c in runs) else "inconclusive"
    return StopPoint(at=k, verdict=verdict, stopped=stopped, resumed=resumed, resume_diff=resume_diff,
                     restored=restored, controls=tuple(runs), untried=contract.controls[len(runs):])
