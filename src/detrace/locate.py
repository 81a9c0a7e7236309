"""The ladder driver: from "two runs of CMD differ" to "this op, this step, this rank", without touching CMD.

`locate` runs CMD under the zero-edit tracer (`detrace.tracing.launch.run_traced`) a bounded number of times,
each run narrower than the last, and compares pairs of runs with `detrace.diff`:

    rung 1  semantic (metrics + collectives + optimizer), every step, every rank    2 runs
            identical: "deterministic over N steps"; else the earliest divergent step and the origin ranks
    rung 2  module, only that step, only those ranks                                  2 runs
    rung 3  op, only that step, only those ranks: the first op with equal inputs
            and different outputs (the culprit)                                       2 runs
    rung 4  capture of the culprit's call (that op only, that step, that rank),
            then `detrace.replay` on it: is the op itself nondeterministic, and what fixes it    1 run

That is 7 runs. A narrow run records every rung in steps 0..S. Nondeterminism is random, so a narrower pair
may part earlier than S (caught in detail all the same; the stage moves to that step), not part by S (run once
more, recording every step), or, at the op rung, show no origin op (run once more). A first pair that is
identical gets a third run, and each narrow rung retries at most once, so the ladder costs at most 12 runs;
a rung that still does not settle
makes the verdict "inconclusive", with what the broader rungs established. Every run starts from the same
state (a fresh process of the same command, environment and working directory), and every run directory is
kept under `out`.

The checkpointed ladder, for a CMD that follows the resume contract (`detrace.TrainState`, docs/resume.md): the
broad runs save a checkpoint every K steps (DETRACE_CKPT_EVERY); one run resumed from a checkpoint of run A must
reproduce A's trace over the next window (the proof); then every narrower run resumes from A's latest checkpoint
at or before the divergent step and stops right after it (DETRACE_RESUME_FROM, DETRACE_STOP_AT), so it executes
at most K + 1 steps wherever the divergence lies. A proof that fails makes the narrow runs full runs again; a
CMD that writes no checkpoint gets today's full runs.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from detrace.compare import DiffResult, Divergence, diff, first_divergent_step, first_origin
from detrace.compare.pairs import first_origin_call, ranks_spec, same_over
from detrace.errors import CommandFailed, TraceError, UsageError
from detrace.replay import ReplayConfig, ReplayResult, list_captures, replay_file
from detrace.state.manifest import MANIFEST_FILE
from detrace.tracefile import open_run, read_rank, write_json_atomic
from detrace.tracing.launch import run_traced

LOCATE_SCHEMA = "detrace.locate/1"
LADDER_SCHEMA = "detrace.ladder/1"
LOCATE_FILE = "locate.json"
"""The `detrace.locate/1` object, as `detrace locate --json` prints it."""
LADDER_FILE = "ladder.json"
"""Everything the rungs established (stages, diffs, the culprit's records, every replay arm): the report's input."""
REPORT_FILE = "report.html"
REFERENCE_RUN = "1-semantic-a"
"""Run A of the broad rung: the narrow runs resume from its checkpoints, and the resume proof is held against it."""
CHECKPOINTS = "checkpoints"
"""Subdirectory of `out` where the broad run A keeps its checkpoints (and other runs their scratch saves)."""

BASE_RUNS = 7
"""Runs of a ladder whose every narrower pair reproduces the divergence: 2 + 2 + 2 + 1."""
MAX_RUNS = 14
"""Runs at most: a third broad run when the first pair is identical, the resume proof of a checkpointed ladder
(twice when the first resumed run differs), and each narrow pair once more."""

DEFAULT_STEPS = 8
"""Steps of the embedded default workload: its race strikes at a random step (on an idle machine, in roughly one
step in five), so eight steps make a pair that never parts unlikely; a step costs a fraction of a second."""
DEFAULT_BATCH = 32
"""Sequences per step of the embedded default (the preset has 8): 32 x 32 tokens routed to 4 experts each make
the MoE backward's accumulating index_put (4096 rows into 1024) long enough for its two threads to overlap, so
the race recurs in the ladder's narrower reruns."""


DEFAULT_CHECKPOINT_EVERY = 8
"""K when locate chooses: a narrow run resumed from a checkpoint executes at most K + 1 steps (six of them in a
ladder whose pairs reproduce the divergence), and the broad runs each write one checkpoint per K steps (run A's
are all kept, in OUT/checkpoints: a long run of a large model wants a larger `--checkpoint-every`)."""


def default_command(steps: int = DEFAULT_STEPS) -> list[str]:
    """The embedded default: the reference workload with its nondeterministic `index` MoE dispatch on 2 threads."""
    return [sys.executable, "-m", "detrace.examples.train", "--preset", "tiny", "--steps", str(steps),
            "--threads", "2", "--dispatch", "index", "--batch-size", str(DEFAULT_BATCH)]


@dataclass(frozen=True, kw_only=True)
class LocateConfig:
    """One `detrace locate` invocation."""

    command: tuple[str, ...]
    """CMD, exactly as `detrace run` would start it (a script, `python -m ...`, `torchrun ...`)."""
    out: Path
    """Directory that receives every run directory, locate.json, ladder.json and report.html."""
    timeout: float | None = 900.0
    """Seconds one run of CMD may take before it counts as hung; None waits forever."""
    retries: int = 1
    """Extra attempts of a narrow pair whose runs happen not to differ (nondeterminism is random)."""
    max_numel: int | None = None
    """Skip fingerprinting tensors above this many elements at the module and op rungs (shape still recorded)."""
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    """How the kernel rung replays the culprit."""
    env: dict[str, str] | None = None
    """Extra environment for CMD (the same for every run, so every arm starts from the same state)."""
    checkpoint_every: int | None = None
    """K: the broad runs of a CMD that follows the resume contract save a checkpoint every K steps, and the
    narrow runs resume from the last one before the divergence. None: `DEFAULT_CHECKPOINT_EVERY`."""
    checkpoints: bool = True
    """False: ask CMD for no checkpoint, so every run is a full run (the ladder before checkpoints)."""

    def __post_init__(self) -> None:
        if not self.command:
            raise UsageError("locate needs a command to run")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise UsageError(f"--checkpoint-every must be a positive number of steps, not {self.checkpoint_every}")
        if self.timeout is not None and not self.timeout > 0:
            raise UsageError(f"--timeout must be a positive number of seconds, not {self.timeout}")
        if not 0 <= self.retries <= 1:
            raise UsageError("locate retries a narrow pair at most once (retries must be 0 or 1)")


class RunFailed(CommandFailed):
    """CMD crashed or hung during one run of the ladder; carries the end of its output."""

    def __init__(self, message: str, output_tail: str = "") -> None:
        super().__init__(message)
        self.output_tail = output_tail


@dataclass(kw_only=True)
class Stage:
    """One rung of the ladder as it ran."""

    rung: str
    """semantic | resume (the proof that resuming is exact) | module | op | kernel."""
    steps: str
    """The steps this rung records in detail."""
    ranks: str
    runs: list[str] = field(default_factory=list)
    """Run directories, in the order they ran (pairs: a, b; a retried pair: c, d)."""
    diff: dict[str, Any] | None = None
    """The `detrace.diff/1` object of this rung's last pair (kernel rung: none)."""
    found: dict[str, Any] | None = None
    """The divergence this rung settled on: the diff's `first` object plus occurrence, index, event, detail."""
    note: str = ""
    """What the rung established, in one sentence."""
    wide: bool = False
    """Record every step, not only steps 0..S: set for the retry of a pair that did not part by step S."""
    start: int = 0
    """The global step this stage's runs start at: 0 (from the beginning), or the checkpoint they resume from."""
    resume_from: str | None = None
    """The checkpoint version its runs resume from (DETRACE_RESUME_FROM); None: they start at step 0."""

    def to_json(self) -> dict[str, Any]:
        return {"rung": self.rung, "steps": self.steps, "ranks": self.ranks, "runs": self.runs,
                "diff": self.diff, "found": self.found, "note": self.note, "start": self.start}


@dataclass(frozen=True, kw_only=True)
class RunCost:
    """What one run of CMD cost."""

    run: str
    """Its directory name under `out`."""
    rung: str
    start: int
    """The global step it started at (0, or the checkpoint it resumed from)."""
    stop: int | None
    """DETRACE_STOP_AT: it stopped once this many steps had completed; None: it ran to its end."""
    seconds: float
    """Wall time of the process."""

    def to_json(self, total: int) -> dict[str, Any]:
        """With `total`, the steps a full run executes (the broad rung's count)."""
        end = total if self.stop is None else min(self.stop, total)
        return {"run": self.run, "rung": self.rung, "start": self.start, "steps": max(0, end - self.start),
                "seconds": round(self.seconds, 3)}


@dataclass(kw_only=True)
class LocateResult:
    """What the ladder found."""

    verdict: str
    """deterministic | nondeterministic | inconclusive."""
    message: str
    """The one-sentence answer."""
    command: list[str]
    out: Path
    steps: int = 0
    """Steps the broad rung recorded."""
    culprit: dict[str, Any] | None = None
    """The narrowest divergence found (a `Stage.found`); its rank, step, phase, module, name, origin go to JSON."""
    culprit_records: list[dict[str, Any]] = field(default_factory=list)
    """The culprit call's records in both op-rung runs: role, index, shape, dtype, equal."""
    replay: ReplayResult | None = None
    stages: list[Stage] = field(default_factory=list)
    report: str = ""
    costs: list[RunCost] = field(default_factory=list)
    """Every run of CMD, in the order they ran."""
    notes: list[str] = field(default_factory=list)
    """What the summary adds: a CMD without the resume contract, or a resume that was not exact."""
    checkpoint_every: int | None = None
    """K of the checkpointed ladder; None when CMD wrote no checkpoint (it does not follow the contract)."""
    resume: str = "no-contract"
    """no-contract (CMD wrote no checkpoint: every run is a full run) | unused (no narrow run needed a
    checkpoint) | exact (proven: narrow runs resumed) | inexact (the proof failed: narrow runs are full runs)."""

    @property
    def runs(self) -> list[str]:
        return [run for stage in self.stages for run in stage.runs]

    @property
    def exit_code(self) -> int:
        return {"deterministic": 0, "nondeterministic": 1}.get(self.verdict, 2)

    def cost(self) -> dict[str, Any]:
        """What the ladder cost: runs, steps executed per run and where each started, and the resume used."""
        per_run = [c.to_json(self.steps) for c in self.costs]
        return {"runs": len(per_run), "steps": sum(r["steps"] for r in per_run),
                "seconds": round(sum(c.seconds for c in self.costs), 3),
                "checkpoint_every": self.checkpoint_every, "resume": self.resume, "per_run": per_run}

    def to_json(self) -> dict[str, Any]:
        """The `detrace.locate/1` object (docs/locate.md shows one), with the ladder's cost."""
        culprit = None if self.culprit is None else {k: self.culprit[k] for k in
                                                      ("rank", "step", "phase", "module", "name", "origin")}
        return {"schema": LOCATE_SCHEMA, "verdict": self.verdict, "culprit": culprit,
                "replay": None if self.replay is None else self.replay.summary(),
                "runs": self.runs, "report": self.report, "cost": self.cost()}

    def ladder_json(self) -> dict[str, Any]:
        """`detrace.ladder/1`: everything `detrace report` draws."""
        return {"schema": LADDER_SCHEMA, "verdict": self.verdict, "message": self.message,
                "command": self.command, "steps": self.steps, "culprit": self.culprit,
                "culprit_records": self.culprit_records,
                "replay": None if self.replay is None else self.replay.to_json(),
                "stages": [s.to_json() for s in self.stages], "runs": self.runs, "report": self.report,
                "notes": self.notes, "cost": self.cost()}


class Progress:
    """What the ladder tells its caller while it works; the CLI renders it with rich, the API stays silent."""

    def run_started(self, name: str, planned: int) -> None:
        """A run of CMD begins; `planned` is the number of runs the ladder now expects in total."""

    def run_finished(self, name: str, elapsed: float) -> None:
        """That run ended (successfully)."""

    def rung(self, stage: Stage) -> None:
        """A rung reached its conclusion (`stage.note`)."""


def _where(d: dict[str, Any]) -> str:
    return (f"step {d['step']}, rank {d['rank']}: {d['phase']} {d['name']}"
            + (f" in {d['module']}" if d["module"] else "") + f" ({d['role']})")


def _found(d: Divergence) -> dict[str, Any]:
    """A divergence as ladder.json keeps it: the diff's `first` object plus the call's identity and shapes."""
    return {**d.to_json(), "occurrence": d.occurrence, "index": d.index, "event": d.event,
            "detail": json.loads(json.dumps(d.detail, default=str))}


class Ladder:
    """Runs the rungs in order; see the module docstring."""

    def __init__(self, config: LocateConfig, progress: Progress | None = None) -> None:
        self.config = config
        self.progress = progress or Progress()
        self.planned = BASE_RUNS
        self.stages: list[Stage] = []
        self.costs: list[RunCost] = []
        self.every = config.checkpoint_every or DEFAULT_CHECKPOINT_EVERY
        self.checkpoints: dict[int, Path] = {}
        """Run A's checkpoints: completed steps -> version directory. Empty: CMD ignores the contract."""
        self.resume = "no-contract"
        self.completed: list[str] = []
        """The rungs at which CMD ran to completion so far (a later failure is then the rung's doing)."""

    # -- running CMD ---------------------------------------------------------------------------------------

    def _window(self, stage: Stage) -> str:
        """The tracer's step window for one run of a stage: every rung records every step from the stage's start
        (0, or the checkpoint it resumes from) up to its step S.

        Nondeterminism is random: a narrower pair may part at an earlier step than the broad pair did. Recording
        the stage's rung from its start on means that wherever the pair parts, it parts inside the detailed
        window, and no module or op in S is mistaken for an origin because its parameters already differed at
        an unrecorded step (a resumed pair starts from one checkpoint: nothing differs before its start).
        """
        stop = self._stop(stage)
        if stage.steps == "all" or (stage.wide and stop is None):
            return "all"
        return f"{stage.start}-{stop - 1 if stage.wide and stop is not None else stage.steps}"

    def _stop(self, stage: Stage) -> int | None:
        """DETRACE_STOP_AT for a narrow stage's runs: right after step S (a wide retry: after the window of K
        steps from the stage's start, or S if later); None: full runs (no contract, or resuming was inexact)."""
        if self.resume in ("no-contract", "inexact") or stage.steps == "all":
            return None
        return max(stage.start + self.every, int(stage.steps)) + 1 if stage.wide else int(stage.steps) + 1

    def _place(self, stage: Stage) -> None:
        """Start the stage's runs from run A's latest checkpoint at or before its step, once resuming is proven."""
        stage.start, stage.resume_from = 0, None
        if self.resume == "exact":
            start = max((c for c in self.checkpoints if c <= int(stage.steps)), default=0)
            if start:
                stage.start, stage.resume_from = start, str(self.checkpoints[start])

    def _contract_env(self, name: str, *, periodic: bool = False, stop: int | None = None,
                      resume_from: str | None = None) -> dict[str, str]:
        """The resume contract's variables for one run (docs/resume.md); its saves go to its own directory."""
        env = {"DETRACE_CKPT_DIR": str(self.config.out / CHECKPOINTS / name)}
        if periodic:
            env["DETRACE_CKPT_EVERY"] = str(self.every)
        if stop is not None:
            env["DETRACE_STOP_AT"] = str(stop)
        if resume_from is not None:
            env["DETRACE_RESUME_FROM"] = resume_from
        return env

    def _run(self, stage: Stage, name: str, *, rung: str, capture: str | None = None, window: str | None = None,
             contract: dict[str, str] | None = None) -> Path:
        """One run of CMD. `contract`: the resume contract's variables (None: a narrow run as the stage says)."""
        out = self.config.out / name
        self.progress.run_started(name, self.planned)
        stage.runs.append(str(out))
        if contract is None and stage.steps == "all":  # a broad run: checkpoints every K steps, if CMD obliges
            contract = self._contract_env(name, periodic=True) if self.config.checkpoints else {}
        elif contract is None:
            stop = self._stop(stage)
            contract = {} if stop is None else self._contract_env(name, stop=stop, resume_from=stage.resume_from)
        stop_at = contract.get("DETRACE_STOP_AT")
        start = stage.start if "DETRACE_RESUME_FROM" in contract else 0
        # The capture run is not compared with anything: it fingerprints nothing (max_numel 0), which halves
        # its cost, and only copies the one call it captures.
        max_numel = 0 if capture else self.config.max_numel if rung in ("module", "op") else None
        what = f"{'the capture run (op rung)' if capture else f'the {rung} rung'}" + (
            f", resumed from the checkpoint after step {start}" if start else "")
        try:
            result = run_traced(list(self.config.command), out, rung=rung, steps=window or self._window(stage),
                                ranks=stage.ranks, max_numel=max_numel, capture=capture,
                                env={**(self.config.env or {}), **contract}, timeout=self.config.timeout, quiet=True)
        except CommandFailed as err:
            raise RunFailed(f"run {name} of the ladder failed, at {what}: {err}") from None
        self.costs.append(RunCost(run=name, rung=rung, start=start, stop=None if stop_at is None else int(stop_at),
                                  seconds=result.elapsed))
        if result.returncode != 0:
            if self.completed:
                cause = (f"CMD ran to completion at the {self.completed[0]} rung, so detrace's "
                         f"{'capture' if capture else rung} rung made it fail")
            else:
                cause = ("no run has completed yet, so locate cannot tell whether CMD or detrace's "
                         f"{rung} rung made it fail: run CMD without detrace to see")
            raise RunFailed(f"CMD exited with status {result.returncode} in run {name} of the ladder ({what}; kept "
                            f"in {out}); {cause}", result.output_tail)
        if rung not in self.completed:
            self.completed.append(rung)
        if name != REFERENCE_RUN:  # only run A's checkpoints are resumed from
            shutil.rmtree(self.config.out / CHECKPOINTS / name, ignore_errors=True)
        self.progress.run_finished(name, result.elapsed)
        return out

    def _pair(self, stage: Stage, rung: str, first: str, second: str) -> DiffResult:
        prefix = f"{len(self.stages)}-{rung}"
        a = self._run(stage, f"{prefix}-{first}", rung=rung)
        b = self._run(stage, f"{prefix}-{second}", rung=rung)
        result = diff(a, b)
        if result.verdict == "incomparable":
            raise TraceError(f"two {rung}-rung runs of the same command are not comparable: {result.reason}")
        stage.diff = result.to_json()
        return result

    def _narrow(self, stage: Stage, rung: str) -> dict[str, Any] | None:
        """Run a pair at `rung` in the stage's window, once more if it does not reproduce the divergence there.

        A narrow run records its rung in every step up to S: a pair that happens to part before S
        (nondeterminism is random) is caught there in detail, and the stage moves to that earlier step. A pair
        that did not part by S is retried recording every step (a random race may strike later in the retry). At
        the op rung the pair must show an origin op (equal inputs, different output).
        Returns the divergence the stage settles on (`Stage.found`), or None when no pair parted.
        """
        names = iter("abcd")
        for attempt in range(1 + self.config.retries):
            if attempt:
                self.planned += 2
            result = self._pair(stage, rung, next(names), next(names))
            if result.verdict != "diverged" or result.first is None:
                stage.found = None
                stage.wide = True
                continue
            parted = first_divergent_step(result)
            if parted is not None:
                stage.steps = str(parted)  # where this pair parted (earlier than S, or later in a wide retry)
            if rung != "op":
                stage.found = _found(result.first)
                break
            origin = first_origin(result)
            stage.found = _found(origin) if origin else self._origin_call(stage) or _found(result.first)
            if stage.found["origin"]:
                break
        return stage.found

    def _origin_call(self, stage: Stage) -> dict[str, Any] | None:
        """The first origin op call on the window's ranks when the diff's first differing record was absorbed."""
        a, b = stage.runs[-2:]
        for rank in (int(r) for r in stage.ranks.split(",")):
            found = first_origin_call(a, b, rank)
            if found is not None:
                return _found(found)
        return None

    # -- the rungs -----------------------------------------------------------------------------------------

    def run(self) -> LocateResult:
        result = self._ladder()
        narrowed = any(stage.rung in ("module", "op", "kernel") for stage in self.stages)
        if narrowed and self.resume == "no-contract":
            result.notes.append("CMD wrote no checkpoint, so every narrow run re-ran it from step 0: on long runs, "
                                "the resume contract (detrace.TrainState, docs/resume.md) lets locate resume them "
                                "from a checkpoint next to the divergence")
        elif narrowed and self.resume == "inexact":
            result.notes.append(next(s.note for s in self.stages if s.rung == "resume"))
        return result

    def _ladder(self) -> LocateResult:
        cfg = self.config
        result = LocateResult(verdict="inconclusive", message="", command=list(cfg.command), out=cfg.out)
        result.stages = self.stages
        result.costs = self.costs

        broad = Stage(rung="semantic", steps="all", ranks="all")
        self.stages.append(broad)
        first_pair = self._pair(broad, "semantic", "a", "b")
        result.steps = _recorded_steps(Path(broad.runs[0]))
        self.checkpoints = _checkpoints(self.config.out / CHECKPOINTS / REFERENCE_RUN)
        if self.checkpoints:
            self.resume = result.resume = "unused"
            result.checkpoint_every = self.every
        if first_pair.verdict == "identical" or first_pair.first is None:
            # A race that strikes at random steps can spare one pair: a third run, compared with the first,
            # before the verdict is "deterministic".
            self.planned += 1
            third = self._run(broad, f"{len(self.stages)}-semantic-c", rung="semantic")
            first_pair = diff(Path(broad.runs[0]), third)
            if first_pair.verdict == "incomparable":
                raise TraceError(f"two semantic-rung runs of the same command are not comparable: {first_pair.reason}")
            broad.diff = first_pair.to_json()
        if first_pair.verdict == "identical" or first_pair.first is None:
            broad.note = f"the three runs are bit-identical over {result.steps} steps"
            self.progress.rung(broad)
            result.verdict = "deterministic"
            result.message = f"every recorded bit of three runs is identical over {result.steps} steps"
            return result
        first = first_pair.first
        broad.found = _found(first)
        step = first_divergent_step(first_pair)
        step = first.step if step is None else step
        origin_ranks = first_pair.origin_ranks or [first.rank]
        window = {"steps": str(step), "ranks": ranks_spec(origin_ranks)}
        broad.note = f"the runs part at {_where(broad.found)}; origin rank(s) {window['ranks']}"
        self.progress.rung(broad)
        result.culprit = broad.found
        self._prove_resume(step)
        result.resume = self.resume

        for rung in ("module", "op"):
            stage = Stage(rung=rung, steps=window["steps"], ranks=window["ranks"])
            self._place(stage)
            self.stages.append(stage)
            found = self._narrow(stage, rung)
            if found is None:
                stage.note = (f"{len(stage.runs)} runs at the {rung} rung (recording steps 0-{stage.steps}, then every "
                              f"step) on rank(s) {window['ranks']} did not differ: the nondeterminism did not recur")
            elif rung == "op" and not found["origin"]:
                stage.note = (f"the first op that differs ({_where(found)}) already had differing inputs, and no "
                              "op of that step had equal inputs and a differing output")
            else:
                stage.note = f"first {'origin' if found['origin'] else 'divergence'} at {_where(found)}"
                self.progress.rung(stage)
                result.culprit = found
                window["steps"] = stage.steps  # the op rung records the step the module rung confirmed
                continue
            self.progress.rung(stage)
            result.message = (f"two runs part at step {step} on rank(s) {window['ranks']}, but the {rung}-rung "
                              f"reruns could not pin it down: {stage.note}")
            return result

        op_stage = self.stages[-1]
        culprit = op_stage.found
        assert culprit is not None
        result.culprit_records = _call_records(op_stage.runs[-2], op_stage.runs[-1], culprit)
        result.verdict = "nondeterministic"
        result.message = (f"culprit: {culprit['name']}" + (f" in {culprit['module']}" if culprit["module"] else "")
                          + f", {culprit['phase']} of step {culprit['step']} on rank {culprit['rank']}")
        result.replay = self._kernel(culprit)
        if result.replay is not None:
            fix = ", ".join(result.replay.fixed_by) or "no switch tried"
            result.message += ("; the op itself is nondeterministic (fixed by " + fix + ")"
                               if result.replay.nondeterministic else
                               "; replayed alone it was deterministic, so its inputs or surroundings decide")
        return result

    def _prove_resume(self, step: int) -> None:
        """Once: a run resumed from one of run A's checkpoints before `step` must reproduce A's trace over the
        next window, or no narrow run resumes.

        The window is the steps after checkpoint P, up to K of them and none at or after the divergent step
        (the runs differ there by themselves). Step P itself is left out: run A saved a checkpoint in it and the
        resumed run loaded one, and under a process group both record their collectives. The resumed run also
        saves every K steps, so that its saves fall in the same steps as A's.
        """
        if not self.checkpoints or not max((c for c in self.checkpoints if c <= step), default=0):
            return  # no checkpoint before the divergence: narrow runs start at step 0 (and stop after it)
        proof_from = max((c for c in self.checkpoints if c <= step - 2), default=0)
        if not proof_from:
            return  # the divergence is too close to the first checkpoint to prove anything before it
        last = min(proof_from + self.every, step - 1)
        stage = Stage(rung="resume", steps=f"{proof_from + 1}-{last}", ranks="all", start=proof_from,
                      resume_from=str(self.checkpoints[proof_from]))
        self.stages.append(stage)
        reference = self.config.out / REFERENCE_RUN
        resumed: list[Path] = []
        difference: str | None = None
        for attempt in "ab":
            # A resumed run that differs from A may have met the nondeterminism itself (it can strike before the
            # step where A and B first parted): a second one tells which. Either reproducing A proves the resume.
            self.planned += 1
            name = f"{len(self.stages)}-resume-{attempt}"
            try:
                resumed.append(self._run(stage, name, rung="semantic", window=stage.steps,
                                         contract=self._contract_env(name, periodic=True, stop=last + 1,
                                                                     resume_from=stage.resume_from)))
            except RunFailed as err:
                difference = f"the resumed run failed ({err})"
                break
            difference = same_over(reference, resumed[-1], proof_from + 1, last)
            if difference is None:
                break
        where = f"resuming from the checkpoint after step {proof_from}"
        if difference is None:
            self.resume = "exact"
            stage.note = f"{where} reproduced run A over steps {stage.steps}: the narrow runs resume from checkpoints"
        elif len(resumed) == 2 and same_over(resumed[0], resumed[1], proof_from + 1, last) is not None:
            self.resume = "inexact"
            stage.note = (f"two runs {where} differ from run A and from each other over steps {stage.steps} "
                          f"({difference}): the nondeterminism strikes there already, so the resume cannot be "
                          "proven exact, and every narrow run is a full run")
        else:
            self.resume = "inexact"
            stage.note = (f"{where} did not reproduce run A over steps {stage.steps} ({difference}): the resume is "
                          "not exact, so every narrow run is a full run")
        self.progress.rung(stage)

    def _kernel(self, culprit: dict[str, Any]) -> ReplayResult | None:
        stage = Stage(rung="kernel", steps=str(culprit["step"]), ranks=str(culprit["rank"]))
        self._place(stage)
        self.stages.append(stage)
        # No rank= key: the run's rank window already limits it to that rank, and a single process learns its
        # rank only at the end of its first step. module= is always given ("" for none) to pin the occurrence.
        selector = (f"step={culprit['step']},phase={culprit['phase']},name={culprit['name']},"
                    f"occurrence={culprit['occurrence']},module={culprit['module'] or ''}")
        run = self._run(stage, f"{len(self.stages)}-capture", rung="op", capture=selector)
        captures = [p for p in list_captures(run) if p.name.startswith(f"rank-{culprit['rank']:05d}-")]
        if not captures:
            stage.note = f"the capture run recorded no call matching {selector} on rank {culprit['rank']}"
            self.progress.rung(stage)
            return None
        replayed = replay_file(captures[0], self.config.replay)
        stage.note = (f"replayed {replayed.base.repeats} times: " + (
            f"nondeterministic, up to {replayed.base.differing_elements} elements differ by up to "
            f"{replayed.base.max_ulp} ULP; fixed by {', '.join(replayed.fixed_by) or 'no switch tried'}"
            if replayed.nondeterministic else "deterministic in isolation"))
        self.progress.rung(stage)
        return replayed


def _checkpoints(root: Path) -> dict[int, Path]:
    """The checkpoint versions a run saved under `root` (docs/resume.md's layout): completed steps -> directory.
    Only complete versions count (their manifest is written last); none when CMD ignored the contract."""
    found: dict[int, Path] = {}
    if root.is_dir():
        for version in root.iterdir():
            match = re.fullmatch(r"step-(\d+)", version.name)
            if match and (version / MANIFEST_FILE).is_file():
                found[int(match.group(1))] = version
    return found


def _recorded_steps(run_dir: Path) -> int:
    """Steps covered by a run: one more than the last step any rank recorded."""
    try:
        info = open_run(run_dir)
    except TraceError as err:
        raise TraceError(f"CMD ran but left no trace in {run_dir} ({err}); is it a Python program that "
                         "trains with torch?") from None
    return 1 + max(read_rank(run_dir, rank).last_step for rank in info.ranks)


def _call_records(run_a: str, run_b: str, culprit: dict[str, Any]) -> list[dict[str, Any]]:
    """The culprit call's records in both runs, side by side: which inputs matched and which outputs did not."""
    def call(run: str) -> dict[tuple[str, int], dict[str, Any]]:
        rows = read_rank(run, culprit["rank"]).table.to_pylist()
        event = next((r["event"] for r in rows if r["seq"] == culprit["seq"]), None)
        return {(r["role"], r["index"]): r for r in rows if event is not None and r["event"] == event}

    a, b = call(run_a), call(run_b)
    records = []
    for key in a.keys() | b.keys():
        ra, rb = a.get(key), b.get(key)
        row = ra or rb
        assert row is not None
        records.append({"role": key[0], "index": key[1], "shape": row["shape"], "dtype": row["dtype"],
                        "numel": row["numel"], "equal": ra is not None and rb is not None
                        and ra["digest"] == rb["digest"] and ra["shape"] == rb["shape"]})
    order = {"input": 0, "mutated": 1, "output": 2}
    return sorted(records, key=lambda r: (order.get(r["role"], 3), r["role"], r["index"]))


def default_out(base: Path | None = None) -> Path:
    """A fresh `detrace-locate-<timestamp>` directory name under `base` (the working directory by default)."""
    base = base or Path.cwd()
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = base / f"detrace-locate-{stamp}"
    n = 1
    while out.exists():
        n += 1
        out = base / f"detrace-locate-{stamp}-{n}"
    return out


def prepare_out(out: Path, *, force: bool) -> None:
    """Create the output directory; refuse to mix a new ladder into an old one unless `force`."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UsageError(f"--out {out} is not empty; choose another directory or pass --force")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot create --out {out}: {err.strerror}") from None


def locate(config: LocateConfig, progress: Progress | None = None, *, force: bool = False) -> LocateResult:
    """Drive the ladder on `config.command`; write locate.json, ladder.json and report.html into `config.out`.

    Raises `RunFailed` (a `CommandFailed`) when CMD crashes or hangs in any run, `TraceError` when its traces
    cannot be compared. Runs already made stay in `config.out`.
    """
    from detrace.report.html import write_report

    config = dataclasses.replace(config, out=config.out.resolve())
    prepare_out(config.out, force=force)
    result = Ladder(config, progress).run()
    result.report = str(config.out / REPORT_FILE)
    write_json_atomic(config.out / LADDER_FILE, result.ladder_json())
    write_report(config.out, Path(result.report))
    write_json_atomic(config.out / LOCATE_FILE, result.to_json())
    return result


def load_ladder(out: str | Path) -> dict[str, Any]:
    """Read a locate directory's ladder.json."""
    path = Path(out) / LADDER_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise TraceError(f"{out} is not a locate directory (no {LADDER_FILE})") from None
    except (OSError, ValueError) as err:
        raise TraceError(f"{path} is unreadable: {err}") from None
    if data.get("schema") != LADDER_SCHEMA:
        raise TraceError(f"{path} has schema {data.get('schema')!r}; this detrace reads {LADDER_SCHEMA}")
    return data
