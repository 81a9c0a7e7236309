"""The ladder's driver: runs CMD rung by rung, each pair narrower than the last (the package docstring tells the
ladder); `Ladder.run` hands back the `detrace.analyze.locate_result.LocateResult`."""

from __future__ import annotations

import shutil
from pathlib import Path

from detrace.analyze import DiffResult, Divergence, diff, first_divergent_step, first_origin
from detrace.analyze.diff_result import scope_label
from detrace.analyze.locate_result import (
    Cost,
    Finding,
    LocateResult,
    ResumeUse,
    Rung,
)
from detrace.analyze.pairs import first_origin_call, ranks_spec, same_over
from detrace.analyze.replay_result import ReplayResult
from detrace.errors import CommandFailed, TraceError
from detrace.integrations.advice import imports_detrace
from detrace.investigate.audit.records import ENV_AUDIT
from detrace.investigate.audit.report import prediction
from detrace.investigate.check import refuse_one_sided_loads
from detrace.investigate.locate.config import BASE_RUNS, DEFAULT_CHECKPOINT_EVERY, LocateConfig
from detrace.investigate.locate.evidence import call_records, recorded_steps
from detrace.investigate.locate.stages import Answer, Progress, RunFailed, SpentRun, StageRun
from detrace.launch.launcher import Launcher, run_traced
from detrace.report.meaning import apart_notes, short_run
from detrace.tracefile.checkpoints import read_checkpoint_log
from detrace.tracefile.layout import capture_paths

REFERENCE_RUN = "1-semantic-a"
"""Run A of the broad rung: the narrow runs resume from its checkpoints, and the resume proof is held against it."""
AUDIT_STEPS = 2
"""Steps of run A that `detrace audit`'s probe judges (DETRACE_AUDIT): the report says if it predicted the culprit."""
CHECKPOINTS = "checkpoints"
"""Subdirectory of `out` where the broad run A keeps its checkpoints (and other runs their scratch saves)."""


class Ladder:
    """Runs the rungs in order; see the module docstring."""

    def __init__(self, config: LocateConfig, progress: Progress | None = None, *,
                 launch: Launcher | None = None) -> None:
        self.config = config
        self.launch = launch or run_traced  # resolved here, not at import: the launch seam for tests
        self.progress = progress or Progress()
        self.planned = BASE_RUNS
        self.stages: list[StageRun] = []
        self.spent: list[SpentRun] = []
        self.every = config.checkpoint_every or DEFAULT_CHECKPOINT_EVERY
        self.checkpoints: dict[int, Path] = {}
        """Run A's checkpoints: completed steps -> version directory. Empty: CMD ignores the contract."""
        self.resume: ResumeUse = "no-contract"
        self.completed: list[str] = []
        """The rungs at which CMD ran to completion so far (a later failure is then the rung's doing)."""
        self.apart: list[str] = []
        """What the broad pair compared apart from the training (evaluations, checkpoint I/O), for the notes."""

    # -- running CMD ---------------------------------------------------------------------------------------

    def _window(self, stage: StageRun) -> str:
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

    def _stop(self, stage: StageRun) -> int | None:
        """DETRACE_STOP_AT for a narrow stage's runs: right after step S (a wide retry: after the window of K
        steps from the stage's start, or S if later); None: full runs (no contract, or resuming was inexact)."""
        if self.resume in ("no-contract", "inexact") or stage.steps == "all":
            return None
        return max(stage.start + self.every, int(stage.steps)) + 1 if stage.wide else int(stage.steps) + 1

    def _place(self, stage: StageRun) -> None:
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

    def _run(self, stage: StageRun, name: str, *, rung: str, capture: str | None = None, window: str | None = None,
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
        if name == REFERENCE_RUN:  # the first run is audited for free: the report says if it predicted the culprit
            contract = {**contract, ENV_AUDIT: str(AUDIT_STEPS)}
        stop_at = contract.get("DETRACE_STOP_AT")
        start = stage.start if "DETRACE_RESUME_FROM" in contract else 0
        # The capture run is not compared with anything: it fingerprints nothing (max_numel 0), which halves
        # its cost, and only copies the one call it captures.
        max_numel = 0 if capture else self.config.max_numel if rung in ("module", "op") else None
        what = f"{'the capture run (op rung)' if capture else f'the {rung} rung'}" + (
            f", resumed from the checkpoint after step {start}" if start else "")
        try:
            result = self.launch(list(self.config.command), out, rung=rung, steps=window or self._window(stage),
                                ranks=stage.ranks, max_numel=max_numel, capture=capture,
                                env={**(self.config.env or {}), **contract}, timeout=self.config.timeout, quiet=True)
        except CommandFailed as err:
            raise RunFailed(f"run {name} of the ladder failed, at {what}: {err}") from None
        self.spent.append(SpentRun(run=name, rung=rung, start=start, stop=None if stop_at is None else int(stop_at),
                                 seconds=result.elapsed))
        if result.returncode != 0:
            from detrace.state.contract import resume_problem  # torch: only once CMD has failed

            resumed = contract.get("DETRACE_RESUME_FROM")
            problem = resume_problem(Path(resumed)) if resumed is not None else None
            if problem is not None:
                # Something outside locate changed run A's checkpoint between the runs: not a rung's doing.
                cause = f"{problem}, so CMD could not resume, whatever the rung"
            elif self.completed:
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

    def _pair(self, stage: StageRun, rung: str, first: str, second: str) -> DiffResult:
        prefix = f"{len(self.stages)}-{rung}"
        a = self._run(stage, f"{prefix}-{first}", rung=rung)
        b = self._run(stage, f"{prefix}-{second}", rung=rung)
        return self._compare(stage, rung, a, b)

    def _compare(self, stage: StageRun, rung: str, a: Path, b: Path) -> DiffResult:
        """The diff of two runs of the same rung, kept in the stage; refused when one of them resumed by itself."""
        # A script that auto-resumes from its own folder (not DETRACE_CKPT_DIR) makes run b start where run a
        # ended: say so, as `detrace check` does, rather than that the runs share no global step.
        refuse_one_sided_loads([a, b], command="locate", labels=[a.name, b.name])
        result = diff(a, b)
        if result.verdict == "incomparable":
            raise TraceError(f"two {rung}-rung runs of the same command are not comparable: {result.reason}")
        stage.diff = result.to_json()
        return result

    def _narrow(self, stage: StageRun, rung: Rung) -> Finding | None:
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
                stage.found = Finding.of(result.first)
                break
            origin = first_origin(result) or self._origin_call(stage) or result.first
            stage.found = Finding.of(origin)
            if stage.found.origin:
                break
        return stage.found

    def _origin_call(self, stage: StageRun) -> Divergence | None:
        """The first origin op call on the window's ranks when the diff's first differing record was absorbed."""
        a, b = stage.runs[-2:]
        for rank in (int(r) for r in stage.ranks.split(",")):
            found = first_origin_call(a, b, rank)
            if found is not None:
                return found
        return None

    def _own_checkpoint(self) -> str | None:
        """A file the reference run's own saves named (torch.save, safetensors, DCP: logged at every rung), or
        None."""
        try:
            log = read_checkpoint_log(self.config.out / REFERENCE_RUN)
        except TraceError:
            return None
        return next((path for io in log if io.op == "save" for path in io.paths), None)

    # -- the rungs -----------------------------------------------------------------------------------------

    def run(self, *, report: str = "") -> LocateResult:
        """Run the ladder; `report` is where the HTML report will be (the result names it)."""
        answer = self._ladder()
        notes = []
        narrowed = any(stage.rung in ("module", "op", "kernel") for stage in self.stages)
        if (narrowed and self.resume == "no-contract" and self.config.checkpoints and answer.steps <= self.every
                and imports_detrace(list(self.config.command))):
            notes.append(short_run(answer.steps, self.every))
        elif narrowed and self.resume == "no-contract" and (own := self._own_checkpoint()) is not None:
            notes.append(f"CMD saves checkpoints of its own ({own}), which do not follow the resume contract "
                         "(detrace.TrainState, docs/resume.md), so every narrow run re-ran it from step 0; "
                         "`detrace check-resume --native` proves whether its own resume is exact")
        elif narrowed and self.resume == "no-contract":
            notes.append("CMD wrote no checkpoint, so every narrow run re-ran it from step 0: on long runs, "
                         "the resume contract (detrace.TrainState, docs/resume.md) lets locate resume them "
                         "from a checkpoint next to the divergence")
        elif narrowed and self.resume == "inexact":
            notes.append(next(s.note for s in self.stages if s.rung == "resume"))
        notes += self.apart
        if answer.culprit is not None and (said := prediction(self.config.out / REFERENCE_RUN, answer.culprit.name)):
            notes.append(said)
        cost = Cost(per_run=tuple(spent.record(answer.steps) for spent in self.spent),
                    seconds=sum(spent.seconds for spent in self.spent),
                    checkpoint_every=self.every if self.checkpoints else None, resume=self.resume)
        return LocateResult(verdict=answer.verdict, message=answer.message, command=tuple(self.config.command),
                            out=self.config.out, steps=answer.steps, culprit=answer.culprit,
                            culprit_records=tuple(answer.culprit_records), replay=answer.replay,
                            stages=tuple(stage.record() for stage in self.stages), report=report,
                            notes=tuple(notes), cost=cost)

    def _ladder(self) -> Answer:
        result = Answer()
        broad = StageRun(rung="semantic", steps="all", ranks="all")
        self.stages.append(broad)
        first_pair = self._pair(broad, "semantic", "a", "b")
        result.steps = recorded_steps(Path(broad.runs[0]))
        from detrace.state.contract import saved_versions  # imports torch: not at the CLI's start

        self.checkpoints = saved_versions(self.config.out / CHECKPOINTS / REFERENCE_RUN)
        if self.checkpoints:
            self.resume = "unused"
        self.apart = apart_notes(first_pair)
        if first_pair.verdict == "identical" or first_pair.first is None:
            # A race that strikes at random steps can spare one pair: a third run, compared with the first,
            # before the verdict is "deterministic".
            self.planned += 1
            third = self._run(broad, f"{len(self.stages)}-semantic-c", rung="semantic")
            first_pair = self._compare(broad, "semantic", Path(broad.runs[0]), third)
        if first_pair.verdict == "identical" or first_pair.first is None:
            over = f"over {result.steps} step{'s' * (result.steps != 1)}"
            broad.note = f"the three runs are bit-identical {over}"
            self.progress.rung(broad.record())
            result.verdict = "deterministic"
            result.message = f"every recorded bit of three runs is identical {over}"
            if first_pair.unclosed:  # a torn trace holds part of its last step: the verdict covers only that part
                result.message += (f"; but the traces end inside a step (step {result.steps - 1}): CMD never "
                                   "closed them (os._exit, a signal), so that step was compared only in part")
            return result
        first = first_pair.first
        broad.found = Finding.of(first)
        if first.stop is not None or first.phase == "final":
            # Nothing differs inside the steps both runs recorded: the rungs below would rerun them in vain.
            broad.note = first.stop or f"every step matched and the final state differs ({first.name})"
            self.progress.rung(broad.record())
            result.verdict = "nondeterministic"
            result.culprit = broad.found if first.stop is None else None
            result.message = (f"two runs of CMD do not cover the same steps: {first.stop}; what decides where CMD "
                              "stops (a clock, a file, an unseeded draw) is outside the recorded steps"
                              if first.stop is not None else
                              f"every step of two runs matched, and the state they ended with differs (first: "
                              f"{first.name}): what changed it ran after the last optimizer step, where the rungs "
                              "record nothing (an unseeded draw, an average or a quantisation after the training?)")
            return result
        step = first_divergent_step(first_pair)
        step = first.step if step is None else step
        origin_ranks = first_pair.origin_ranks or [first.rank]
        window = {"steps": str(step), "ranks": ranks_spec(origin_ranks)}
        broad.note = f"the runs part at {broad.found.where()}; origin rank(s) {window['ranks']}"
        self.progress.rung(broad.record())
        result.culprit = broad.found
        self._prove_resume(step)

        rungs: tuple[Rung, ...] = ("module", "op")
        for rung in rungs:
            stage = StageRun(rung=rung, steps=window["steps"], ranks=window["ranks"])
            self._place(stage)
            self.stages.append(stage)
            found = self._narrow(stage, rung)
            if found is None:
                stage.note = (f"{len(stage.runs)} runs at the {rung} rung (recording steps 0-{stage.steps}, then every "
                              f"step) on rank(s) {window['ranks']} did not differ: the nondeterminism did not recur")
            elif rung == "op" and not found.origin:
                stage.note = (f"the first op that differs ({found.where()}) already had differing inputs, and no "
                              "op of that step had equal inputs and a differing output")
            else:
                stage.note = f"first {'origin' if found.origin else 'divergence'} at {found.where()}"
                self.progress.rung(stage.record())
                result.culprit = found
                window["steps"] = stage.steps  # the op rung records the step the module rung confirmed
                continue
            self.progress.rung(stage.record())
            result.message = (f"two runs part at step {step} on rank(s) {window['ranks']}, but the {rung}-rung "
                              f"reruns could not pin it down: {stage.note}")
            if found is None and rung == "module":
                # Not one rerun parts again: what parted the first pair happened once. Say what that means.
                result.message = (f"two runs part at step {step} on rank(s) {window['ranks']}, but the second arm "
                                  f"does not reproduce it: {len(stage.runs)} reruns at the module rung agree with "
                                  "each other. A one-time event parted them: a transient hardware fault (a flipped "
                                  "bit) or a race too rare to recur; `detrace recheck RUN --step "
                                  f"{step}` re-executes the step on this and other devices to tell which")
            return result

        op_stage = self.stages[-1]
        culprit = op_stage.found
        assert culprit is not None
        result.culprit_records = call_records(op_stage.runs[-2], op_stage.runs[-1], culprit)
        result.verdict = "nondeterministic"
        where = f" in {scope_label(culprit.module)}" if culprit.module is not None else ""
        result.message = (f"culprit: {culprit.name}{where}, {culprit.phase} of step {culprit.step} on rank "
                          f"{culprit.rank}")
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
        stage = StageRun(rung="resume", steps=f"{proof_from + 1}-{last}", ranks="all", start=proof_from,
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
        self.progress.rung(stage.record())

    def _kernel(self, culprit: Finding) -> ReplayResult | None:
        stage = StageRun(rung="kernel", steps=str(culprit.step), ranks=str(culprit.rank))
        self._place(stage)
        self.stages.append(stage)
        # No rank= key: the run's rank window already limits it to that rank, and a single process learns its
        # rank only at the end of its first step. module= is always given ("" for none) to pin the occurrence.
        selector = (f"step={culprit.step},phase={culprit.phase},name={culprit.name},"
                    f"occurrence={culprit.occurrence},module={culprit.module or ''}")
        run = self._run(stage, f"{len(self.stages)}-capture", rung="op", capture=selector)
        captures = [path for rank, _, path in capture_paths(run) if rank == culprit.rank]
        if not captures:
            stage.note = f"the capture run recorded no call matching {selector} on rank {culprit.rank}"
            self.progress.rung(stage.record())
            return None
        from detrace.investigate.replay import (
            replay_file,  # executes ops: torch, imported in the one process that replays
        )

        # The capture was made just now by the CMD locate runs (code the user already runs), so its kernel's code
        # is trusted; the hash check still makes sure it is the file that run compiled.
        replayed = replay_file(captures[0], self.config.replay, trust_code=True)
        stage.note = (f"replayed {replayed.base.repeats} times: " + (
            f"nondeterministic, up to {replayed.base.differing_elements} elements differ by up to "
            f"{replayed.base.max_ulp} ULP; fixed by {', '.join(replayed.fixed_by) or 'no switch tried'}"
            if replayed.nondeterministic else "deterministic in isolation"))
        self.progress.rung(stage.record())
        return replayed
