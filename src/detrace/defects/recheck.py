"""Step re-execution: was a divergence at step K a transient fault, a persistent one, or software?

`detrace recheck RUN --step K` takes a deterministic run's trace (recorded at the semantic rung at least over
step K, so that it holds every parameter and optimizer state after that step's update) and re-executes step K
twice from the checkpoint before it, each in a fresh process of RUN's command:

- on the same devices: a rank that does not reproduce its own result was hit by something that did not recur;
- on other devices (each rank's device shifted past the ones the run used): a rank whose result comes back on
  its own device but not on another carries a fault of that device.

A re-execution resumes from a checkpoint, so before it blames a device it must know that resuming reproduces the
step: when the same devices do not reproduce some rank, recheck runs the command once more, uninterrupted from
step 0 through step K (the resume proof, as `detrace locate` makes one). Resuming is exact when the re-execution
on the same devices gives the uninterrupted run's bits.

Verdicts (`detrace.verdicts.RecheckVerdict`): `clean` (both re-executions reproduce every rank), `transient` (the
same devices do not reproduce some ranks, the two re-executions agree with each other, and the resume is exact),
`persistent` (the same devices reproduce everything, other devices do not reproduce some ranks: the fault follows
the device), `inexact-resume` (the two re-executions agree with each other but not with the uninterrupted run:
resuming from the checkpoint changes the step, a software bug that `detrace check-resume` pins down, and nothing
can be said about the devices), `software-nondeterminism` (the re-executions disagree with each other or with the
uninterrupted run, or the same devices reproduce no rank at all: the program itself is not deterministic;
`detrace locate` finds why).

The command must follow the resume contract of `detrace.TrainState`. The checkpoint is `--checkpoint DIR` (a
checkpoint root or version of the run, taken at or before step K), or, by default, one made by running the
command again up to step K (K steps more).
"""

from __future__ import annotations

import shlex
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from detrace.defects.faults import ENV_DEVICE_SHIFT, ENV_REEXEC
from detrace.errors import CommandFailed, UsageError
from detrace.launch.launcher import Launcher, run_traced
from detrace.tracefile import open_run, read_rank
from detrace.tracefile.layout import prepare_out
from detrace.verdicts import RecheckVerdict

if TYPE_CHECKING:
    from detrace.state.manifest import Manifest

Results = dict[int, dict[tuple[str, str, int, int], int | None]]
"""rank -> (parameter name, role, index, occurrence) -> digest, for one step's optimizer records."""


@dataclass(frozen=True, kw_only=True)
class RecheckResult:
    """The outcome of `detrace recheck`."""

    step: int
    """The global step re-executed."""
    verdict: RecheckVerdict
    ranks: tuple[int, ...]
    """transient: the ranks not reproduced; persistent: the ranks whose result follows their device."""
    same_device: dict[int, bool]
    """Per rank: the re-execution on the same device reproduced the run's result."""
    other_device: dict[int, bool]
    """Per rank: the re-execution on another device reproduced the run's result."""
    runs: dict[str, Path]
    """The re-executions' run directories ("same", "other"), "checkpoint", and "uninterrupted" when the resume
    proof ran."""
    resume_exact: bool | None = None
    """The re-execution on the same devices gave the uninterrupted run's bits; None when no proof was needed (it
    reproduced the run, or it started at step 0 from no checkpoint)."""

    def sentence(self) -> str:
        ranks = ", ".join(map(str, self.ranks))
        if self.verdict == "clean":
            return f"clean: step {self.step} re-executed on the same and on other devices gives the run's bits"
        if self.verdict == "transient":
            return (f"transient: rank {ranks} does not reproduce its own result of step {self.step} on the same "
                    "device, and the re-executions agree with each other: a fault that did not recur")
        if self.verdict == "persistent":
            return (f"persistent on rank {ranks}: its result of step {self.step} comes back on its own device and "
                    "not on another: a fault of that device")
        if self.verdict == "inexact-resume":
            return (f"inexact resume: step {self.step} re-executed from the checkpoint gives the same bits on every "
                    "device but not those of an uninterrupted run of the command, so resuming changes the run and "
                    "no device can be judged; run 'detrace check-resume' on the command to find what the "
                    "checkpoint misses")
        return (f"software nondeterminism: the re-executions of step {self.step} do not agree with the run or "
                "with each other on any device; run 'detrace locate' on the command to find the op")

    def to_json(self) -> dict[str, object]:
        return {"schema": "detrace.recheck/1", "verdict": self.verdict, "step": self.step, "ranks": list(self.ranks),
                "same_device": {str(r): ok for r, ok in self.same_device.items()},
                "other_device": {str(r): ok for r, ok in self.other_device.items()},
                "runs": {name: str(path) for name, path in self.runs.items()}, "resume_exact": self.resume_exact}


def step_results(run_dir: Path, step: int) -> Results:
    """Every rank's optimizer records (parameters and states after the update) at `step`."""
    results: Results = {}
    for rank in open_run(run_dir).ranks:
        table = read_rank(run_dir, rank).table
        mask = pc.and_(pc.and_(pc.equal(table["step"], step), pc.equal(table["phase"], "optimizer")),
                       pc.is_in(table["role"], value_set=_ROLES))
        rows = table.filter(mask).select(["name", "role", "index", "occurrence", "digest"]).to_pylist()
        results[rank] = {(r["name"], r["role"], r["index"], r["occurrence"]): r["digest"] for r in rows}
    return results


def judge(original: Results, same: Results, other: Results,
          uninterrupted: Results | None = None) -> tuple[RecheckVerdict, tuple[int, ...]]:
    """The verdict from the run's results, the two re-executions' and, when the resume proof ran, the
    uninterrupted run's (see the module docstring)."""
    ranks = sorted(original)
    same_ok = [r for r in ranks if same.get(r) == original[r]]
    other_ok = [r for r in ranks if other.get(r) == original[r]]
    if len(same_ok) == len(ranks):
        if len(other_ok) == len(ranks):
            return "clean", ()
        return "persistent", tuple(r for r in ranks if r not in other_ok)
    missed = tuple(r for r in ranks if r not in same_ok)
    if uninterrupted is not None and same != uninterrupted:
        # Re-executed from the checkpoint, the step is not what an uninterrupted run makes of it: the resume, not a
        # device, decides, unless the re-executions cannot even agree with each other.
        return ("inexact-resume" if same == other else "software-nondeterminism"), missed
    if same != other or (len(ranks) > 1 and not same_ok):
        return "software-nondeterminism", missed
    return "transient", missed


_ROLES = pa.array(["param", "state", "buffer"])  # a buffer (running statistics) can take a flip on its own
Progress = Callable[[str], None]


def _checkpoint_step(path: Path, run_dir: Path, *, command: Sequence[str], world: int) -> int:
    """The step of the checkpoint at `path`, refused unless it is the run's own: saved by the same command (as its
    manifest names it, when a traced run saved it) at the same world size, holding the parameters the run recorded
    after the step before it."""
    from detrace.state import manifest, versions

    saved = manifest.read(versions.resolve(path))
    if saved.command is not None and list(saved.command) != list(command):
        raise UsageError(f"checkpoint {path} is not this run's: it was saved by `{shlex.join(saved.command)}`, and "
                         f"{run_dir} is a run of `{shlex.join(command)}`; give a checkpoint of this run")
    if saved.world_size != world:
        raise UsageError(f"checkpoint {path} is not this run's: it was saved by {saved.world_size} ranks, and "
                         f"{run_dir} ran {world}; give a checkpoint of this run")
    if (differs := _other_parameter(saved, run_dir)) is not None:
        # Saved outside a traced run, its manifest names no command: without this, another run's checkpoint was
        # re-executed and judged an inexact resume of this one.
        name, theirs, ours = differs
        raise UsageError(f"checkpoint {path} is not this run's: its parameter {name} ({theirs}) differs from the "
                         f"run's ({ours}, recorded in {run_dir} after step {saved.step - 1}); give a checkpoint of "
                         f"this run")
    return saved.step


def _other_parameter(saved: Manifest, run_dir: Path) -> tuple[str, str, str] | None:
    """The first parameter of the checkpoint whose digest differs from rank 0's record of it after the step before
    the checkpoint, as (name, the checkpoint's digest, the run's), or None. Only what both hold whole, in one
    fingerprint scheme, is compared: a checkpoint of step 0, a run that did not record that step at the semantic
    rung, a sharded parameter or another scheme leave nothing to compare (and the checkpoint is taken as given)."""
    info = open_run(run_dir)
    if saved.step == 0 or saved.fingerprint != info.header.fingerprint or 0 not in info.ranks:
        return None
    table = read_rank(run_dir, 0).table
    mask = pc.and_(pc.and_(pc.equal(table["step"], saved.step - 1), pc.equal(table["phase"], "optimizer")),
                   pc.equal(table["role"], "param"))
    for row in table.filter(mask).select(["name", "digest", "dtype", "shape"]).to_pylist():
        chunks = saved.tensors.get(f"model.{row['name']}", [])
        if len(chunks) != 1 or row["digest"] is None:
            continue
        (chunk,) = chunks
        if (chunk["dtype"], chunk["shape"]) == (row["dtype"], row["shape"]) and chunk["digest"] != f"{row['digest']:x}":
            return row["name"], chunk["digest"], f"{row['digest']:x}"
    return None


def recheck(run: str | Path, *, step: int, out: Path, checkpoint: Path | None = None, timeout: float | None = None,
            progress: Progress = lambda _: None, launch: Launcher = run_traced) -> RecheckResult:
    """Re-execute step `step` of RUN's command on the same and on other devices, and judge (see above).

    `launch` runs the command (`run_traced`'s signature): the seam through which tests judge synthetic runs.
    """
    run_dir = Path(run)
    if step < 0:
        raise UsageError(f"--step must be a step of the run (0 or more), not {step}")
    info = open_run(run_dir)
    command = list(info.header.command)
    if not command:
        raise UsageError(f"{run_dir} does not say which command made it (no command in its run.json); record it "
                         "with detrace run")
    original = step_results(run_dir, step)
    if not any(original.values()):
        raise UsageError(f"{run_dir} holds no optimizer records at step {step}; record the run with "
                         "'detrace run --rung semantic' over that step")
    prepare_out(out, holds="runs")
    runs = {"checkpoint": out / "checkpoint"}
    # Every process here re-executes steps the run already took: a transient fault does not strike again.
    base = {ENV_REEXEC: "1"}

    def execute(label: str, directory: Path, env: dict[str, str], *, rung: str, steps: str) -> None:
        progress(f"{label}: {directory}")
        result = launch(command, directory, rung=rung, steps=steps, env={**base, **env}, timeout=timeout, quiet=True)
        if result.returncode != 0:
            raise CommandFailed(f"{label} exited with code {result.returncode}; its output ends with:\n"
                                f"{result.output_tail.rstrip()}")

    if checkpoint is not None:
        start = _checkpoint_step(checkpoint, run_dir, command=command, world=info.world_size)
        if start > step:
            raise UsageError(f"checkpoint {checkpoint} was taken after {start} steps, past step {step}: give one "
                             f"taken at or before step {step}")
        shutil.copytree(checkpoint, runs["checkpoint"])
    elif step > 0:
        execute(f"checkpoint run (steps 0-{step - 1})", out / "prepare",
                {"DETRACE_CKPT_DIR": str(runs["checkpoint"]), "DETRACE_STOP_AT": str(step)}, rung="metrics",
                steps="all")
    world = info.world_size
    results: dict[str, Results] = {}
    for arm, shift in (("same", 0), ("other", world)):
        ckpt = out / f"checkpoint-{arm}"  # each arm saves when it stops: it writes to a copy of its own
        if runs["checkpoint"].exists():
            shutil.copytree(runs["checkpoint"], ckpt)
        env = {"DETRACE_CKPT_DIR": str(ckpt), "DETRACE_STOP_AT": str(step + 1), ENV_DEVICE_SHIFT: str(shift)}
        if runs["checkpoint"].exists():
            env["DETRACE_RESUME"] = "1"
        where = "the same devices" if shift == 0 else "other devices"
        runs[arm] = out / arm
        execute(f"step {step} on {where}", runs[arm], env, rung="semantic", steps=str(step))
        results[arm] = step_results(runs[arm], step)
    uninterrupted: Results | None = None
    if runs["checkpoint"].exists() and any(results["same"].get(r) != original[r] for r in original):
        # The resume proof: without it, a checkpoint that misses some state would pass for a device fault.
        runs["uninterrupted"] = out / "uninterrupted"
        execute(f"resume proof: steps 0-{step} uninterrupted", runs["uninterrupted"],
                {"DETRACE_CKPT_DIR": str(out / "checkpoint-uninterrupted"), "DETRACE_STOP_AT": str(step + 1)},
                rung="semantic", steps=str(step))
        uninterrupted = step_results(runs["uninterrupted"], step)
    verdict, ranks = judge(original, results["same"], results["other"], uninterrupted)
    return RecheckResult(step=step, verdict=verdict, ranks=ranks,
                         same_device={r: results["same"].get(r) == original[r] for r in sorted(original)},
                         other_device={r: results["other"].get(r) == original[r] for r in sorted(original)},
                         runs=runs, resume_exact=None if uninterrupted is None else results["same"] == uninterrupted)
