"""The validation matrix: every configuration of the reference workload through detrace's own verification
commands. `detrace validate` or `python -m detrace.investigate.validate`.

For each configuration it runs, as subprocesses, exactly what a user would type:

- `detrace check --runs 2 -- <train ... --deterministic>`: run-to-run bit-identical with the recipe;
- `detrace check-resume --at K -- <train ... --deterministic>`: exact resume (with its negative control);
- `detrace check --runs 3 -- <train ... --no-deterministic>`, only where the configuration has a
  nondeterministic path (the "index" MoE dispatch with 2+ threads per process): detrace must see it diverge;

and prints one table row per configuration: config | run-to-run bit-identical | exact resume |
nondeterminism detected without recipe | time. Exit 0 when every cell is as expected, 1 when one is not.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from detrace.errors import DetraceError
from detrace.workload import RACING_THREADS


@dataclass(frozen=True, kw_only=True)
class Config:
    """One row of the matrix."""

    name: str
    """Row label, also the --only key."""
    nproc: int
    """Processes (torchrun when > 1)."""
    args: tuple[str, ...]
    """Trainer options besides --steps and the recipe switch."""
    threads: int
    """torch threads per process; the "index" dispatch is nondeterministic on CPU only with 2 or more."""
    topology: bool = False
    """One world size of the dp-invariant workload: the runs of every such row must also match each other."""

    @property
    def nondeterministic_path(self) -> bool:
        return self.threads >= 2 and "fixed" not in self.args

    def command(self, *, steps: int, deterministic: bool) -> list[str]:
        launcher = [sys.executable]
        if self.nproc > 1:
            launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.nproc}"]
        recipe = "--deterministic" if deterministic else "--no-deterministic"
        train = ["-m", "detrace.workload.train", "--steps", str(steps), "--threads", str(self.threads)]
        return [*launcher, *train, *self.args, recipe]


CONFIGS: tuple[Config, ...] = (
    Config(name="single index", nproc=1, args=("--dispatch", "index"), threads=RACING_THREADS),
    Config(name="single fixed", nproc=1, args=("--dispatch", "fixed"), threads=RACING_THREADS),
    Config(name="single recompute", nproc=1, args=("--recompute",), threads=RACING_THREADS),
    Config(name="single mxfp8", nproc=1, args=("--quant", "mxfp8"), threads=RACING_THREADS),
    Config(name="single nvfp4", nproc=1, args=("--quant", "nvfp4"), threads=RACING_THREADS),
    Config(name="ddp x2", nproc=2, args=("--parallel", "ddp"), threads=2),
    Config(name="fsdp x2", nproc=2, args=("--parallel", "fsdp"), threads=1),
    Config(name="tp x2", nproc=2, args=("--parallel", "tp"), threads=1),
    Config(name="ep x2", nproc=2, args=("--parallel", "ep"), threads=1),
    Config(name="pp x2", nproc=2, args=("--parallel", "pp"), threads=1),
    Config(name="dp-ep x4", nproc=4, args=("--parallel", "dp-ep"), threads=1),
    Config(name="pp-dp x4", nproc=4, args=("--parallel", "pp-dp"), threads=1),
    *(Config(name=f"dp-invariant x{n}", nproc=n, args=("--parallel", "dp-invariant", "--microbatches", "4",
                                                       "--dispatch", "fixed"), threads=1, topology=True)
      for n in (1, 2, 4)),
)
FAST = ("single index",)  # what CI runs (tests/e2e/test_validate.py)


# A line of a failed training command's output that names the cause: a one-sentence error or an exception.
CAUSE = re.compile(r"(^|: )error: |^[\w.]*(Error|Exception): ")


@dataclass(frozen=True)
class Cell:
    """One verdict: `ok` is whether it is what the matrix expects (None: not applicable)."""

    text: str
    ok: bool | None


def _detrace(args: list[str], *, timeout: float, log: Path) -> tuple[int, dict[str, object] | None, str]:
    """Run `python -m detrace ARGS` (a --json command); (exit code, its JSON or None, why it failed in one
    line). Its whole stderr goes to `log`, which a red cell's reader will want."""
    proc = subprocess.run([sys.executable, "-m", "detrace", *args], capture_output=True, text=True, timeout=timeout)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stderr)
    try:
        report = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else None
    except json.JSONDecodeError:
        report = None
    return proc.returncode, report, _reason(proc.stderr) or f"exit {proc.returncode}"


def _reason(stderr: str) -> str:
    """Why a verification command failed, in one line: detrace's own error sentence, joined to the first error
    line of the training command's output that it quotes (the trainer's one-sentence error, or a Python
    exception), which names the cause where detrace's sentence only says which run failed."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    own = next((i for i, line in enumerate(lines) if line.startswith("detrace ") and ": error: " in line), None)
    if own is None:
        return lines[-1] if lines else ""
    head = lines[own].split(": error: ", 1)[1].split("; its output ends with", 1)[0]
    causes = [line for line in lines[own + 1 :] if CAUSE.search(line)]
    # A rank that failed because a peer crashed (gloo: "caused by a remote worker ...") is not the cause.
    cause = next((line for line in causes if "remote worker" not in line), causes[0] if causes else "")
    return f"{head}: {cause}" if cause else head


def _where(report: dict[str, Any] | None) -> str:
    """' (KIND) at step S rank R PHASE NAME' of the first divergence in a check or check-resume JSON report,
    if it has one. S is detrace's step clock: 0 is the first optimizer step (the trainer prints it as step 1).
    KIND is "numeric" (same call, other bits) or "structural" (the sequence of calls changed)."""
    diffs = report.get("diffs") if report else None
    firsts = [d["first"] for d in diffs or [] if isinstance(d, dict) and d.get("first")]
    if not firsts:
        first = report.get("first") if report else None  # check-resume names the divergence of its verdict
        firsts = [first] if isinstance(first, dict) else []
    if not firsts:
        return ""
    f = firsts[0]
    return f" ({f.get('kind')}) at step {f.get('step')} rank {f.get('rank')} {f.get('phase')} {f.get('name')}"


def _check(cfg: Config, *, steps: int, deterministic: bool, out: Path, timeout: float) -> Cell:
    # Two runs, with or without the recipe: the MoE dispatch's race strikes in nearly every backward (its
    # experts take their tokens in priority order), so two runs without the recipe part at the first step.
    command = cfg.command(steps=steps, deterministic=deterministic)
    runs = 2
    code, report, why = _detrace(
        ["check", "--json", "--runs", str(runs), "--out", str(out), "--timeout", str(timeout), "--", *command],
        timeout=timeout * (runs + 1),
        log=out.with_suffix(".log"),
    )
    if report is None or code not in (0, 1):  # a verdict always comes with its JSON; without it the command failed
        return Cell(f"error: {why}", False)
    if code == 0:
        return Cell("identical" if deterministic else "NOT detected (runs identical)", deterministic)
    return Cell(("diverged" if deterministic else "detected") + _where(report), not deterministic)


def _resume(cfg: Config, *, steps: int, at: int, out: Path, timeout: float) -> Cell:
    command = cfg.command(steps=steps, deterministic=True)
    code, report, why = _detrace(
        ["check-resume", "--json", "--at", str(at), "--out", str(out), "--timeout", str(timeout), "--", *command],
        timeout=timeout * 6,
        log=out.with_suffix(".log"),
    )
    verdict = str(report.get("verdict", "")) if report else ""
    if code == 0 and verdict == "exact":
        return Cell(f"exact (at {at})", True)
    if code == 1 and verdict == "resume-changed-the-run":
        return Cell(f"diverged{_where(report)}", False)
    if code == 3 and verdict == "nondeterministic":
        return Cell(f"nondeterministic, resume not judged{_where(report)}", False)
    if verdict == "inconclusive":
        return Cell("unproven: the negative control (resume without RNG state) did not diverge either", False)
    return Cell(f"error: {why}".replace(f"{out}/", ""), False)  # paths relative to this check's directory


def validate(
    configs: Sequence[Config],
    *,
    steps: int,
    at: int,
    out: Path,
    timeout: float,
    progress: Callable[[str], None] = lambda line: None,
) -> list[tuple[Config, Cell, Cell, Cell, float]]:
    """Run the matrix; one (config, run-to-run, resume, detection, seconds) per configuration."""
    rows = []
    for cfg in configs:
        progress(f"{cfg.name}: running")
        began = time.monotonic()
        slug = cfg.name.replace(" ", "-")
        same = _check(cfg, steps=steps, deterministic=True, out=out / slug / "check", timeout=timeout)
        resume = _resume(cfg, steps=steps, at=at, out=out / slug / "resume", timeout=timeout)
        if cfg.nondeterministic_path:
            found = _check(cfg, steps=steps, deterministic=False, out=out / slug / "no-recipe", timeout=timeout)
        else:
            found = Cell("n/a (no nondeterministic path)", None)
        rows.append((cfg, same, resume, found, time.monotonic() - began))
    worlds = {cfg.nproc: out / cfg.name.replace(" ", "-") / "check" / "run-0" for cfg in configs if cfg.topology}
    if len(worlds) > 1:
        rows.append(_topology_row(worlds))
    return rows


def _topology_row(worlds: dict[int, Path]) -> tuple[Config, Cell, Cell, Cell, float]:
    """The dp-invariant rows' first runs compared with each other, record by record
    (`detrace.investigate.check_topology`)."""
    from detrace.investigate.check_topology import compare_runs

    began = time.monotonic()
    name = "dp-invariant " + " = ".join(f"x{n}" for n in worlds)
    row = Config(name=name, nproc=max(worlds), args=(), threads=1)
    try:
        first, steps, _ = compare_runs(worlds)
    except DetraceError as err:
        same = Cell(f"error: {err}", False)
    else:
        same = Cell(f"identical across world sizes ({steps} steps)", True) if first is None else \
            Cell(f"diverged: {first.sentence(f'world {next(iter(worlds))}')}", False)
    return row, same, Cell("n/a (see the rows above)", None), Cell("n/a", None), time.monotonic() - began


def table(rows: Sequence[tuple[Config, Cell, Cell, Cell, float]]) -> str:
    """A Markdown table (readable in a terminal, pasteable into the README)."""
    header = ("config", "run-to-run bit-identical", "exact resume", "nondeterminism detected without recipe", "time")
    body = [
        (cfg.name, *(("" if c.ok is not False else "✗ ") + c.text for c in cells), f"{secs:.0f} s")
        for cfg, *cells, secs in rows
    ]
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    lines = ["| " + " | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) + " |" for r in [header, *body]]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)
