"""`detrace ablate --step S --run RUN -- CMD`: reproduce the loss spike at step S bit for bit, then change one thing
at a time to isolate its cause.

1. Baseline: CMD resumed from the last checkpoint C before S (the resume contract's DETRACE_RESUME_FROM) runs
   through S plus a few steps, traced at the metrics and semantic rungs. It must reproduce the original traced
   run RUN over steps C+1..S bit for bit (every record RUN has there), or nothing can be isolated: the verdict is
   then "not-reproducible" (exit 2). A baseline whose metric at S is under the spike threshold is "no-spike"
   (exit 0): nothing to isolate.
2. Variants, each resumed from a checkpoint and changing one thing (the data controls: docs/resume.md):
   - skip-batches: the batches of steps S-w..S are skipped (DETRACE_SKIP_STEPS; by default from C);
   - state-only: the batch of step S alone is skipped: the state at S is the baseline's, the data is other
     (resumed from the checkpoint after S steps when the run saved one, else from C);
   - data-from-earlier: resumed from the checkpoint C' before C, fed the batches steps C..S saw
     (DETRACE_DATA_SHIFT=C-C'): the batch of S arrives at step S-(C-C'), in another state;
   - user variants: NAME=--extra args (appended to CMD) or NAME=ENV:K=V[,K=V] (an environment change).
   A variant whose run fails is unavailable (its reason kept); the verdict is given from the others.
3. Per variant: the metric at (its) S against the baseline, whether it still spikes by the same threshold (the
   original run's median + k x MAD over the window before S), and where its trace first departs from the
   baseline's (`detrace.diff`: step, phase, module, op).
4. The summary: data (the spike needs the batches: skipping them removes it, and they spike in another state too),
   state (it survives other data, and the batches do not spike in another state), both (each removal removes
   it), setting (only a user variant removes it), or undetermined.
5. For a data or both verdict, the sample: the baseline's trace holds the dataset indices of S's batch (where the
   program's sampler is detrace's: the framework integrations); replays from C that drop half the candidates
   (DETRACE_DROP_SAMPLES) bisect them down to the one sample whose absence removes the spike, in about
   log2(batch) replays, the last one dropping that sample alone.
6. For a state verdict, the part: three replays from C with the baseline's data, each taking one part of the state
   from the checkpoint C' before C (DETRACE_RESTORE_PART: the learning rate, the optimizer's moments, the weights)
   and the rest from C. The verdict names the part(s) whose earlier version removes the spike, or says that none
   alone does.

The function that runs CMD is a parameter (`Launch`): the decision logic is tested on synthetic traces.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shlex
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from detrace.analyze import diff
from detrace.analyze.metrics import metric_series, same_bits
from detrace.analyze.pairs import same_over
from detrace.errors import CommandFailed, TraceError, UsageError
from detrace.investigate.spikes import (
    DEFAULT_METRIC,
    SpikeRule,
    checkpoint_before,
    checkpoints_of,
    series_of,
    spiked,
)
from detrace.tracefile import open_run, read_rank
from detrace.verdicts import ABLATE, AblateCause, AblateVerdict

SCHEMA = "detrace.ablate/1"
BUILTINS = ("skip-batches", "state-only", "data-from-earlier")
DEFAULT_AFTER = 2
"""Steps each replay runs past S."""

Launch = Callable[[Sequence[str], Path, Mapping[str, str]], float]
"""Runs CMD traced (metrics and semantic rungs) into a run directory with extra environment; returns the seconds
it took. Raises CommandFailed when CMD fails."""


def launcher(timeout: float | None = None) -> Launch:
    """The real launcher: `detrace.launch.launcher.run_traced` (torchrun included), quiet; a nonzero exit fails."""
    from detrace.launch.launcher import run_traced

    def launch(cmd: Sequence[str], out: Path, env: Mapping[str, str]) -> float:
        result = run_traced(list(cmd), out, rung="semantic", env=dict(env), timeout=timeout, quiet=True)
        if result.returncode != 0:
            raise CommandFailed(f"CMD exited with status {result.returncode} in {out.name} (kept in {out}); the end "
                                f"of its output: {result.output_tail.strip()[-600:]}")
        return result.elapsed

    return launch


@dataclass(frozen=True, kw_only=True)
class Variant:
    """One run of the ablation: where it starts and the one thing it changes."""

    name: str
    """baseline, a built-in's name, or the user's NAME."""
    change: str
    """What it changes, in words."""
    start: int
    """Completed steps of the checkpoint it resumes from (0: a fresh start)."""
    resume_from: str | None
    """That checkpoint's path (DETRACE_RESUME_FROM); None for a fresh start."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment it adds (the data controls, a user's ENV:K=V)."""
    args: tuple[str, ...] = ()
    """Arguments appended to CMD."""
    shift: int = 0
    """Its step that sees the batch of the baseline's S is S - shift."""


def parse_variant(spec: str) -> tuple[str, dict[str, str], tuple[str, ...]]:
    """NAME=--extra args or NAME=ENV:K=V[,K=V...] -> (name, env, args)."""
    name, sep, body = spec.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name) or not body.strip():
        raise UsageError(f"--variant {spec!r} must be NAME=--extra args or NAME=ENV:K=V")
    if name in ("baseline", *BUILTINS):
        raise UsageError(f"--variant {name!r} is the name of a built-in run; choose another")
    if body.startswith("ENV:"):
        env = {}
        for item in body[4:].split(","):
            key, eq, value = item.partition("=")
            if not eq or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key.strip()):
                raise UsageError(f"--variant {spec!r}: {item!r} is not K=V")
            env[key.strip()] = value
        from detrace.state.contract import CHECKPOINT_VARIABLES

        # ablate points these at each run's own scratch checkpoints: a variant's would save into (or resume from)
        # another run's, the original's included.
        taken = sorted(set(env) & set(CHECKPOINT_VARIABLES))
        if taken:
            raise UsageError(f"--variant {name!r} sets {taken[0]}, which ablate sets for each run itself (on "
                             "checkpoints of the run's own, never the original run's); leave it out")
        return name, env, ()
    try:
        return name, {}, tuple(shlex.split(body))
    except ValueError as err:  # an unterminated quote
        raise UsageError(f"--variant {spec!r}: its arguments do not parse as a shell would ({err})") from None


@dataclass(frozen=True, kw_only=True)
class AblateConfig:
    """One `detrace ablate`."""

    command: tuple[str, ...]
    """CMD, as the original run was started (without `detrace run`)."""
    run: Path
    """The original traced run (its run.json names its checkpoint directory)."""
    step: int
    """S: the global step of the spike."""
    out: Path
    """Directory for every run, ablate.json and report.html."""
    metric: str = DEFAULT_METRIC
    """The metric that spikes."""
    rule: SpikeRule = field(default_factory=SpikeRule)
    """The spike threshold: median + k x MAD of the original run's window before S."""
    window: int | None = None
    """w: skip-batches skips the batches of steps S-w..S (from C at the earliest). None: from C (w = S - C), the
    window every program accepts (the framework integrations apply the data controls where a run starts)."""
    after: int = DEFAULT_AFTER
    """Steps each replay runs past S."""
    checkpoint: Path | None = None
    """--from: the checkpoint C (else the last one before S that the run saved)."""
    checkpoints: Path | None = None
    """The original run's checkpoint directory (else the one its run.json names)."""
    variants: tuple[str, ...] = ()
    """User variants, NAME=SPEC."""
    builtins: bool = True
    """Run the built-in variants."""

    def __post_init__(self) -> None:
        if not self.command:
            raise UsageError("ablate needs the training command after '--'")
        if self.step < 1:
            raise UsageError(f"--step must be a global step of at least 1, not {self.step}")
        if (self.window is not None and self.window < 0) or self.after < 0:
            raise UsageError("--window and --after must be 0 or more")
        names = [parse_variant(spec)[0] for spec in self.variants]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise UsageError(f"--variant {', '.join(twice)} given twice: each variant needs a name of its own")


@dataclass(frozen=True, kw_only=True)
class Departure:
    """Where a variant's trace first departs from the baseline's (the diff's first record)."""

    step: int
    phase: str
    module: str | None
    name: str
    rank: int

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "phase": self.phase, "module": self.module, "name": self.name, "rank": self.rank}

    def where(self) -> str:
        return f"step {self.step}, {self.phase} {self.name}" + (f" in {self.module}" if self.module else "")


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """One variant's evidence."""

    variant: Variant
    run: Path
    at: int
    """Its step that sees the baseline's S batch: S - shift."""
    value: float | None
    """The metric there (None: the run did not record it)."""
    spiked: bool
    """value > the threshold, or value not finite."""
    departure: Departure | None
    """The first record that differs from the baseline (None: identical, or not compared since it starts
    elsewhere)."""
    series: dict[int, float]
    """Its metric by step."""
    seconds: float
    steps: int
    """Steps it executed."""
    unavailable: str | None = None
    """Why the variant could not run (its run failed: a data control the program refuses, a crash); None when
    it ran. The verdict is given from the others."""

    def to_json(self, baseline: float) -> dict[str, Any]:
        v = self.variant
        return {"name": v.name, "change": v.change, "start": v.start, "env": v.env, "args": list(v.args),
                "run": str(self.run), "at": self.at, "value": self.value, "spiked": self.spiked,
                "unavailable": self.unavailable,
                "effect": None if self.value is None else self.value - baseline,
                "departure": self.departure.to_json() if self.departure else None,
                "seconds": round(self.seconds, 3), "steps": self.steps, "series": _series_json(self.series)}


@dataclass(frozen=True, kw_only=True)
class Samples:
    """The bisection of the batch of S: which of its samples the spike needs."""

    step: int
    """S."""
    indices: tuple[int, ...]
    """The dataset indices of S's batch on the metric's rank, in the order trained (micro-batches one after the
    other); empty when the program recorded none."""
    culprit: int | None
    """The dataset index whose absence alone removes the spike; None when the bisection named none."""
    replays: tuple[Outcome, ...]
    """Its replays, each dropping some of the samples (DETRACE_DROP_SAMPLES), in the order run."""
    note: str
    """What it found, or why it stopped, as a clause."""

    def to_json(self, baseline: float) -> dict[str, Any]:
        return {"step": self.step, "indices": list(self.indices), "culprit": self.culprit,
                "position": None if self.culprit is None else self.indices.index(self.culprit),
                "note": self.note, "replays": [o.to_json(baseline) for o in self.replays]}


@dataclass(frozen=True, kw_only=True)
class Split:
    """The split of a state verdict: which part of the state at C carries the spike."""

    earlier: int
    """C': completed steps of the checkpoint the parts come from (0: there was none, and nothing ran)."""
    replays: tuple[Outcome, ...]
    """One replay from C per part (`RESTORE_PARTS`), that part from C', in the order run."""
    parts: tuple[str, ...]
    """The parts whose version at C' removes the spike."""
    note: str
    """What it found, or why it could not run, as a clause."""

    def to_json(self, baseline: float) -> dict[str, Any]:
        return {"earlier": self.earlier, "parts": list(self.parts), "note": self.note,
                "replays": [o.to_json(baseline) for o in self.replays]}


def batch_samples(run: Path, rank: int, step: int) -> tuple[int, ...]:
    """The dataset indices of the samples one rank trained on at `step`, as its trace's batch rung recorded them
    (the "samples" records, micro-batch after micro-batch); empty when it recorded none."""
    table = read_rank(run, rank).table.select(["step", "phase", "name", "extra"]).to_pylist()
    found: list[int] = []
    for row in table:
        if row["step"] == step and row["phase"] == "data" and row["name"] == "samples" and row["extra"]:
            found += json.loads(row["extra"])["samples"]
    return tuple(found)


def _series_json(series: Mapping[int, float]) -> dict[str, float]:
    return {str(step): value for step, value in sorted(series.items())}


@dataclass(frozen=True, kw_only=True)
class AblateResult:
    """What `detrace ablate` found."""

    verdict: AblateVerdict
    cause: AblateCause | None
    summary: str
    """One sentence."""
    config: AblateConfig
    checkpoint: int
    """C."""
    threshold: float | None
    original: dict[int, float]
    """The original run's metric by step."""
    baseline: Outcome | None
    outcomes: tuple[Outcome, ...] = ()
    """The variants, ranked by their effect on the spike (the largest fall of the metric at S first)."""
    samples: Samples | None = None
    """The bisection of S's batch (a data or both verdict)."""
    split: Split | None = None
    """Which part of the state carries the spike (a state verdict)."""

    @property
    def exit_code(self) -> int:
        return ABLATE[self.verdict]

    @property
    def runs(self) -> list[Outcome]:
        """Every run ablate made."""
        return (([self.baseline] if self.baseline else []) + list(self.outcomes)
                + (list(self.samples.replays) if self.samples else [])
                + (list(self.split.replays) if self.split else []))

    @property
    def seconds(self) -> float:
        return sum(o.seconds for o in self.runs)

    @property
    def steps(self) -> int:
        return sum(o.steps for o in self.runs)

    def to_json(self) -> dict[str, Any]:
        base = self.baseline
        value = base.value if base and base.value is not None else float("nan")
        return {"schema": SCHEMA, "verdict": self.verdict, "exit_code": self.exit_code, "cause": self.cause,
                "summary": self.summary, "step": self.config.step, "metric": self.config.metric,
                "run": str(self.config.run), "command": list(self.config.command), "checkpoint": self.checkpoint,
                "threshold": self.threshold, "k": self.config.rule.k, "window": self.config.rule.window,
                "original": self.original.get(self.config.step),
                "baseline": None if base is None else {"run": str(base.run), "value": base.value,
                                                       "spiked": base.spiked, "seconds": round(base.seconds, 3),
                                                       "steps": base.steps, "series": _series_json(base.series)},
                "original_series": _series_json({t: v for t, v in self.original.items()
                                                 if abs(t - self.config.step) <= 2 * self.config.rule.window}),
                "variants": [o.to_json(value) for o in self.outcomes],
                "samples": None if self.samples is None else self.samples.to_json(value),
                "split": None if self.split is None else self.split.to_json(value),
                "cost": {"runs": len(self.runs), "steps": self.steps, "seconds": round(self.seconds, 3)}}


def _checkpoint_step(path: Path) -> int:
    """The completed steps of a checkpoint named as the resume contract's layouts name them."""
    from detrace.state.contract import LAYOUTS

    for layout in LAYOUTS:
        match = layout.pattern.fullmatch(path.name)
        if match:
            return int(match.group(1))
    raise UsageError(f"--from {path}: not a checkpoint of the resume contract (step-0000000K, checkpoint-K or "
                     "step-0000000K.ckpt)")


def plan(config: AblateConfig, versions: Mapping[int, Path]) -> tuple[int, list[Variant]]:
    """C and the runs: the baseline first, then the variants."""
    s = config.step
    if config.checkpoint is not None:
        c, c_path = _checkpoint_step(config.checkpoint), str(config.checkpoint)
        if c >= s:
            raise UsageError(f"--from {config.checkpoint} holds {c} completed steps: it must be before step {s}")
    else:
        found = checkpoint_before(versions, s)
        if found is None:
            raise UsageError(f"the run saved no checkpoint before step {s}: run it with DETRACE_CKPT_DIR and "
                             "DETRACE_CKPT_EVERY (docs/resume.md), or name one with --from")
        c, c_path = found, str(versions[found])
    runs = [Variant(name="baseline", change=f"none: resumed from the checkpoint after {c} steps", start=c,
                    resume_from=c_path)]
    if config.builtins:
        low = c if config.window is None else max(c, s - config.window)
        runs.append(Variant(name="skip-batches", change=f"skips the batches of steps {low}-{s}", start=c,
                            resume_from=c_path, env={"DETRACE_SKIP_STEPS": f"{low}-{s}"}))
        # From the checkpoint after S steps where there is one: the state at S exactly, and the skip applies where
        # the run starts (the framework integrations skip batches only there).
        at, at_path = (s, str(versions[s])) if s in versions else (c, c_path)
        runs.append(Variant(name="state-only", change=f"the baseline's state at step {s}, the next batch instead "
                            "of its own", start=at, resume_from=at_path, env={"DETRACE_SKIP_STEPS": f"{s}-{s}"}))
        earlier = max((v for v in versions if v < c), default=0)
        if c > 0:
            runs.append(Variant(name="data-from-earlier",
                                change=f"the batches of steps {c}-{s} fed from the state at step {earlier}",
                                start=earlier, resume_from=str(versions[earlier]) if earlier else None,
                                env={"DETRACE_DATA_SHIFT": str(c - earlier)}, shift=c - earlier))
    for spec in config.variants:
        name, env, args = parse_variant(spec)
        change = " ".join(args) if args else ", ".join(f"{k}={v}" for k, v in env.items())
        runs.append(Variant(name=name, change=change, start=c, resume_from=c_path, env=env, args=args))
    return c, runs


def _departure(baseline: Path, run: Path) -> Departure | None:
    result = diff(baseline, run)
    if result.verdict == "incomparable":
        raise TraceError(f"{run} cannot be compared with the baseline: {result.reason}")
    first = result.first
    if first is None or first.stop is not None:
        return None  # a variant stops where its plan says (a shifted one earlier): where it stops is no departure
    return Departure(step=first.step, phase=first.phase, module=first.module, name=first.name, rank=first.rank)


def reproduces(original: Path, baseline: Path, first: int, last: int) -> str | None:
    """Whether the baseline has the original run's records bit for bit over steps first..last: None when it does,
    else where it first differs. The baseline records the metrics and semantic rungs: an original traced at the
    semantic rung is held to every record, any other to its metrics."""
    info = open_run(original)
    if info.header.rung == "semantic":
        return same_over(original, baseline, first, last)
    differences = []
    for rank in info.ranks:
        theirs, ours = metric_series(original, rank), metric_series(baseline, rank)
        for name, values in sorted(theirs.items()):
            for step in range(first, last + 1):
                if step in values and not same_bits(ours.get(name, {}).get(step), values[step]):
                    differences.append((step, rank, name, ours.get(name, {}).get(step), values[step]))
    if not differences:
        return None
    step, rank, name, got, want = min(differences, key=lambda d: d[:3])  # the earliest step first
    return f"rank {rank}, step {step}: {name} {got!r} against {want!r}"


def ablate(config: AblateConfig, launch: Launch, progress: Callable[[str], None] = lambda line: None
           ) -> AblateResult:
    """Run the ablation of `config` with `launch`; see the module docstring."""
    s = config.step
    rank, original = series_of(config.run, config.metric)
    if s not in original:  # before any run: a step the run never reached cannot be replayed
        last = max(original, default=None)
        raise UsageError(f"the original run recorded no {config.metric} at step {s}"
                         + (f" (its last step is {last})" if last is not None and s > last else ""))
    versions = checkpoints_of(config.run, config.checkpoints)
    c, runs = plan(config, versions)
    threshold = config.rule.threshold([original[t] for t in sorted(original) if t < s])
    if threshold is None:
        raise UsageError(f"the original run recorded too few steps of {config.metric} before step {s} for a "
                         f"threshold (median + k x MAD needs at least 4)")
    stop = s + config.after + 1  # DETRACE_STOP_AT counts completed steps: global step s + after is the last

    def execute(variant: Variant) -> Outcome:
        out = config.out / variant.name
        scratch = config.out / "checkpoints" / variant.name
        env = {"DETRACE_CKPT_DIR": str(scratch), "DETRACE_STOP_AT": str(stop - variant.shift), **variant.env}
        if variant.resume_from is not None:
            env["DETRACE_RESUME_FROM"] = variant.resume_from
        progress(f"run {variant.name}: {variant.change}")
        began = time.perf_counter()
        at = s - variant.shift
        steps = stop - variant.shift - variant.start
        try:
            seconds = launch([*config.command, *variant.args], out, env)
            series = metric_series(out, rank).get(config.metric, {}) if rank in open_run(out).ranks else {}
        except (CommandFailed, TraceError) as err:
            if variant.name == "baseline":
                raise
            # The error's last line: the program's own sentence (a refused data control), not its traceback.
            reason = f"{str(err).strip().splitlines()[-1]} (its run: {out})"
            progress(f"{variant.name} is unavailable: {reason}")
            return Outcome(variant=variant, run=out, at=at, value=None, spiked=False, departure=None, series={},
                           seconds=time.perf_counter() - began, steps=steps, unavailable=reason)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)  # the stop's save: nothing resumes from it
        value = series.get(at)
        return Outcome(variant=variant, run=out, at=at, value=value,
                       spiked=value is not None and spiked(value, threshold), departure=None, series=series,
                       seconds=seconds, steps=steps)

    baseline = execute(runs[0])
    difference = reproduces(config.run, baseline.run, c + 1, s)
    common: dict[str, Any] = {"config": config, "checkpoint": c, "threshold": threshold, "original": original}
    if difference is not None:
        return AblateResult(verdict="not-reproducible", cause=None, baseline=baseline, **common,
                            summary=f"not reproducible: the replay from the checkpoint after {c} steps differs from "
                                    f"the original run ({difference}), so nothing can be isolated on it")
    if baseline.value is None or not baseline.spiked:
        shown = "nothing" if baseline.value is None else f"{baseline.value:.6g}"
        return AblateResult(verdict="no-spike", cause=None, baseline=baseline, **common,
                            summary=f"no spike: the replay reproduces the original run, and its {config.metric} at "
                                    f"step {s} is {shown}, under the threshold {threshold:.6g}")
    outcomes = []
    for variant in runs[1:]:
        outcome = execute(variant)
        if variant.start >= c and outcome.unavailable is None:  # an earlier start departs where it starts
            outcome = dataclasses.replace(outcome, departure=_departure(baseline.run, outcome.run))
        outcomes.append(outcome)
    # A variant that recorded nothing, or a NaN (which sorts nowhere), ranks last.
    ranked = sorted(outcomes, key=lambda o: float("inf") if o.value is None or math.isnan(o.value) else o.value)
    cause, summary = judge(config, c, outcomes)
    samples = None
    if cause in ("data", "both"):
        samples = bisect(s, rank, batch_samples(baseline.run, rank, s), baseline, execute, progress)
        cause, summary = judge(config, c, outcomes, samples.note)
    parts = None
    if cause == "state":
        parts = split(c, versions, baseline, execute, progress)
        cause, summary = judge(config, c, outcomes, parts.note)
    return AblateResult(verdict="isolated", cause=cause, summary=summary, baseline=baseline,
                        outcomes=tuple(ranked), samples=samples, split=parts, **common)


def split(c: int, versions: Mapping[int, Path], baseline: Outcome, execute: Callable[[Variant], Outcome],
          progress: Callable[[str], None]) -> Split:
    """Which part of the state at C carries the spike: one replay from C per part of `RESTORE_PARTS`, that part
    taken from the checkpoint C' before C (DETRACE_RESTORE_PART), the rest and the data the baseline's. A replay
    that computed the baseline's very bits is no evidence about its part (the part is the same at C' and C, or the
    program does not apply the control), and a part is named only from replays that departed."""
    from detrace.state.contract import ENV_RESTORE_PART, RESTORE_PARTS

    earlier = max((v for v in versions if v < c), default=0)
    if not earlier:
        return Split(earlier=0, replays=(), parts=(),
                     note=f"which part of the state carries it is not split: the run saved no checkpoint before the "
                          f"one after {c} steps to take a part from")
    progress(f"split the state at step {c}: {len(RESTORE_PARTS)} replays, each with one part from the checkpoint "
             f"after {earlier} steps")
    replays = []
    for part, what in RESTORE_PARTS.items():
        variant = dataclasses.replace(
            baseline.variant, name=f"restore-{part}", change=f"{what} from the checkpoint after {earlier} steps",
            env={ENV_RESTORE_PART: f"{part}:{versions[earlier]}"})
        outcome = execute(variant)
        if outcome.unavailable is None:
            outcome = dataclasses.replace(outcome, departure=_departure(baseline.run, outcome.run))
        replays.append(outcome)
    ran = [o for o in replays if o.unavailable is None]
    same = [o.variant.name for o in ran if o.departure is None]
    departed = [o for o in ran if o.departure is not None]
    named = tuple(o.variant.name.removeprefix("restore-") for o in departed if o.value is not None and not o.spiked)
    after = f"from the checkpoint after {earlier} steps"
    if named:
        note = (f"the state's part that carries it: {' and '.join(named)} ({after}, the rest from the one after {c} "
                f"steps, {'removes' if len(named) == 1 else 'each removes'} the spike)")
    elif not ran:
        note = (f"which part of the state carries it could not be split: no replay with one part {after} could run "
                "(ablate.json says why)")
    elif not departed:
        note = "which part of the state carries it could not be split"
    else:
        note = (f"no part of the state alone carries it: {', '.join(o.variant.name for o in departed)} "
                f"({'that part' if len(departed) == 1 else 'each part'} {after}) still "
                f"spike{'s' * (len(departed) == 1)}")
    if same:
        note += (f"; {', '.join(same)} computed the baseline's very bits (that part is the same in both checkpoints, "
                 f"or the program does not apply {ENV_RESTORE_PART}: TrainState and detrace's integrations do), so "
                 "it is no evidence about its part")
    unavailable = [o.variant.name for o in replays if o.unavailable is not None]
    if unavailable and ran:
        note += f"; {', '.join(unavailable)} could not run (ablate.json says why)"
    return Split(earlier=earlier, replays=tuple(replays), parts=named, note=note)


def bisect(s: int, rank: int, indices: tuple[int, ...], baseline: Outcome, execute: Callable[[Variant], Outcome],
           progress: Callable[[str], None]) -> Samples:
    """Which sample of S's batch the spike needs: replays from the baseline's checkpoint, each dropping half of the
    candidates left (DETRACE_DROP_SAMPLES): a replay without the spike keeps the half it dropped, one with it the
    other half. The one left is confirmed by a replay that drops it alone (unless one already did). A replay
    that did not drop what it was asked to (the program ignores the control, or trained those samples before S as
    well) stops the bisection: its evidence would not be about S's batch."""
    if not indices:
        return Samples(step=s, indices=(), culprit=None, replays=(),
                       note=f"the trace names no sample of step {s}'s batch (the tracer records the dataset indices "
                            "of a map-style DataLoader's batches, not an IterableDataset's), so no sample is named")
    candidates = list(dict.fromkeys(indices))
    replays: list[Outcome] = []

    def drop(dropped: list[int]) -> Outcome | str:
        """A replay without `dropped`, or why its evidence does not count."""
        name = f"drop-{len(replays) + 1}"
        variant = dataclasses.replace(
            baseline.variant, name=name, change=f"drops {_indices(dropped)} from step {s}'s batch",
            env={"DETRACE_DROP_SAMPLES": ",".join(map(str, dropped))})
        outcome = execute(variant)
        if outcome.unavailable is None:
            outcome = dataclasses.replace(outcome, departure=_departure(baseline.run, outcome.run))
        replays.append(outcome)
        if outcome.unavailable is not None:
            return f"{name} could not run ({outcome.unavailable})"
        got = batch_samples(outcome.run, rank, s)
        if outcome.departure is None or outcome.departure.step != s or not got or set(got) & set(dropped):
            return (f"{name} did not drop {_indices(dropped)} from step {s}'s batch alone (the program ignores "
                    f"DETRACE_DROP_SAMPLES, or trained those samples before step {s} too), so no sample is named")
        return outcome

    confirmed = False
    while len(candidates) > 1 or not confirmed:
        half = candidates[: max(1, len(candidates) // 2)]
        progress(f"bisect the batch of step {s}: drop {_indices(half)} of {len(candidates)} candidates")
        outcome = drop(half)
        if isinstance(outcome, str):
            return Samples(step=s, indices=indices, culprit=None, replays=tuple(replays), note=outcome)
        removed = outcome.value is not None and not outcome.spiked
        if len(candidates) == 1 and not removed:
            return Samples(step=s, indices=indices, culprit=None, replays=tuple(replays),
                           note=f"no single sample of step {s}'s batch carries the spike alone (dropping "
                                f"{_indices(candidates)}, the last candidate, leaves it): several do, together")
        candidates = half if removed else candidates[len(half):]
        confirmed = removed and len(candidates) == 1
    (culprit,) = candidates
    return Samples(step=s, indices=indices, culprit=culprit, replays=tuple(replays),
                   note=f"the sample is dataset index {culprit}, sample {indices.index(culprit) + 1} of the "
                        f"{len(indices)} of step {s}'s batch (on rank {rank}): without it alone the spike is gone "
                        f"({len(replays)} bisecting replays of the batch {_indices(indices)})")


def _indices(indices: Sequence[int]) -> str:
    return ("sample " if len(indices) == 1 else "samples ") + ",".join(map(str, indices))


def judge(config: AblateConfig, c: int, outcomes: Sequence[Outcome], sample: str | None = None
          ) -> tuple[AblateCause, str]:
    """What the variants' evidence points to, in one sentence (then the bisection's `sample` clause or the split's,
    what could not run, and a user variant that changed nothing)."""
    ran = [o for o in outcomes if o.unavailable is None]
    if outcomes and not ran:
        return "undetermined", (f"undetermined: no variant could run from the checkpoint after {c} steps "
                                f"({', '.join(o.variant.name for o in outcomes)}: ablate.json says why), so nothing "
                                "tells the spike's cause apart")
    cause, summary = _cause(config, c, ran)
    if sample is not None:
        summary += f"; {sample}"
    same = [o.variant.name for o in outcomes if o.variant.name not in BUILTINS and o.unavailable is None
            and o.departure is None and o.variant.start >= c]
    if same:
        summary += (f"; {', '.join(same)} computed the baseline's very bits: nothing it changes reaches the "
                    f"computation after the checkpoint (a setting the checkpoint after {c} steps already holds, "
                    "restored with the optimizer's or scheduler's state, or one read only at the start), so it "
                    "cannot remove the spike from there")
    unavailable = [o.variant.name for o in outcomes if o.unavailable is not None]
    if unavailable:
        summary += (f"; {', '.join(unavailable)} could not run (ablate.json says why), the verdict comes from the "
                    "others")
    return cause, summary


def _cause(config: AblateConfig, c: int, outcomes: Sequence[Outcome]) -> tuple[AblateCause, str]:
    by_name = {o.variant.name: o for o in outcomes}
    skip, earlier, only = (by_name.get(name) for name in ("skip-batches", "data-from-earlier", "state-only"))
    removed_by_users = [o.variant.name for o in outcomes
                        if o.variant.name not in BUILTINS and o.value is not None and not o.spiked]
    s = config.step
    data_matters = skip is not None and skip.value is not None and not skip.spiked
    state_matters = earlier is not None and earlier.value is not None and not earlier.spiked
    skipped = skip.variant.env["DETRACE_SKIP_STEPS"] if skip is not None else ""
    from_state = f"from the state at step {earlier.variant.start}" if earlier is not None else ""
    also = ""
    if removed_by_users:
        also = f"; {', '.join(removed_by_users)} also remove{'s' * (len(removed_by_users) == 1)} it"
    if data_matters and state_matters:
        return "both", (f"both: skipping the batches of steps {skipped} removes the spike, and the same batches "
                        f"{from_state} do not spike: it needs that data and that state together{also}")
    if data_matters:
        alone = ("" if only is None else f"; with the batch of step {s} replaced, the same state does not spike"
                 if not only.spiked else "")
        tail = f"; the same batches {from_state} also spike" if earlier is not None else ""
        return "data", f"data: skipping the batches of steps {skipped} removes the spike{tail}{alone}{also}"
    if state_matters:
        return "state", (f"state: the spike survives without the batches of steps {skipped}, and the same batches "
                         f"{from_state} do not spike{also}")
    if removed_by_users:
        return "setting", (f"setting: no change of data or state removes the spike at step {s}, but "
                           f"{', '.join(removed_by_users)} do{'es' * (len(removed_by_users) == 1)}")
    return "undetermined", f"undetermined: the spike at step {s} survives every variant (checkpoint {c})"

