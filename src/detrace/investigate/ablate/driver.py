"""The runs of `detrace ablate`, one after the other: the baseline resumed from C, the variants, then the bisection
of S's batch (a data verdict) or the split of the state (a state verdict). The function that runs CMD is a
parameter (`Launch`)."""

from __future__ import annotations

import dataclasses
import math
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from detrace.analyze import diff
from detrace.analyze.metrics import metric_series
from detrace.errors import CommandFailed, TraceError, UsageError
from detrace.investigate.ablate.config import AblateConfig, Variant, plan
from detrace.investigate.ablate.evidence import (
    AblateResult,
    Departure,
    Outcome,
    Samples,
    Split,
    batch_samples,
    reproduces,
)
from detrace.investigate.ablate.verdict import judge
from detrace.investigate.spikes import checkpoints_of, series_of, spiked
from detrace.tracefile import open_run

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


def _departure(baseline: Path, run: Path) -> Departure | None:
    result = diff(baseline, run)
    if result.verdict == "incomparable":
        raise TraceError(f"{run} cannot be compared with the baseline: {result.reason}")
    first = result.first
    if first is None or first.stop is not None:
        return None  # a variant stops where its plan says (a shifted one earlier): where it stops is no departure
    return Departure(step=first.step, phase=first.phase, module=first.module, name=first.name, rank=first.rank)


def ablate(config: AblateConfig, launch: Launch, progress: Callable[[str], None] = lambda line: None
           ) -> AblateResult:
    """Run the ablation of `config` with `launch`; see `detrace.investigate.ablate`."""
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
