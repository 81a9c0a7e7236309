"""What one `detrace ablate` is asked to do (`AblateConfig`, the user's variants) and the runs it plans from it:
the baseline, then the variants (`plan`)."""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from detrace.errors import UsageError
from detrace.investigate.spikes import DEFAULT_METRIC, SpikeRule, checkpoint_before

BUILTINS = ("skip-batches", "state-only", "data-from-earlier")
DEFAULT_AFTER = 2
"""Steps each replay runs past S."""


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
