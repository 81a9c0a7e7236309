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
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from detrace.compare import DiffResult, Divergence, diff, first_divergent_step, first_origin
from detrace.compare.classify import IDENTITY, INPUT_ROLES, OUTPUT_ROLES, content_mask
from detrace.errors import CommandFailed, TraceError, UsageError
from detrace.replay import ReplayConfig, ReplayResult, list_captures, replay_file
from detrace.tracefile import open_run, read_rank, write_json_atomic
from detrace.tracing.launch import run_traced

LOCATE_SCHEMA = "detrace.locate/1"
LADDER_SCHEMA = "detrace.ladder/1"
LOCATE_FILE = "locate.json"
"""The `detrace.locate/1` object, as `detrace locate --json` prints it."""
LADDER_FILE = "ladder.json"
"""Everything the rungs established (stages, diffs, the culprit's records, every replay arm): the report's input."""
REPORT_FILE = "report.html"

BASE_RUNS = 7
"""Runs of a ladder whose every narrower pair reproduces the divergence: 2 + 2 + 2 + 1."""
MAX_RUNS = 12
"""Runs at most: a third broad run when the first pair is identical, and each narrow pair once more."""

DEFAULT_STEPS = 8
"""Steps of the embedded default workload: its race strikes at a random step (on an idle machine, in roughly one
step in five), so eight steps make a pair that never parts unlikely; a step costs a fraction of a second."""
DEFAULT_BATCH = 32
"""Sequences per step of the embedded default (the preset has 8): 32 x 32 tokens routed to 4 experts each make
the MoE backward's accumulating index_put (4096 rows into 1024) long enough for its two threads to overlap, so
the race recurs in the ladder's narrower reruns."""


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

    def __post_init__(self) -> None:
        if not self.command:
            raise UsageError("locate needs a command to run")
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
    """semantic | module | op | kernel."""
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

    def to_json(self) -> dict[str, Any]:
        return {"rung": self.rung, "steps": self.steps, "ranks": self.ranks, "runs": self.runs,
                "diff": self.diff, "found": self.found, "note": self.note}


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

    @property
    def runs(self) -> list[str]:
        return [run for stage in self.stages for run in stage.runs]

    @property
    def exit_code(self) -> int:
        return {"deterministic": 0, "nondeterministic": 1}.get(self.verdict, 2)

    def to_json(self) -> dict[str, Any]:
        """The `detrace.locate/1` object (docs/locate.md shows one)."""
        culprit = None if self.culprit is None else {k: self.culprit[k] for k in
                                                      ("rank", "step", "phase", "module", "name", "origin")}
        return {"schema": LOCATE_SCHEMA, "verdict": self.verdict, "culprit": culprit,
                "replay": None if self.replay is None else self.replay.summary(),
                "runs": self.runs, "report": self.report}

    def ladder_json(self) -> dict[str, Any]:
        """`detrace.ladder/1`: everything `detrace report` draws."""
        return {"schema": LADDER_SCHEMA, "verdict": self.verdict, "message": self.message,
                "command": self.command, "steps": self.steps, "culprit": self.culprit,
                "culprit_records": self.culprit_records,
                "replay": None if self.replay is None else self.replay.to_json(),
                "stages": [s.to_json() for s in self.stages], "runs": self.runs, "report": self.report}


class Progress:
    """What the ladder tells its caller while it works; the CLI renders it with rich, the API stays silent."""

    def run_started(self, name: str, planned: int) -> None:
        """A run of CMD begins; `planned` is the number of runs the ladder now expects in total."""

    def run_finished(self, name: str, elapsed: float) -> None:
        """That run ended (successfully)."""

    def rung(self, stage: Stage) -> None:
        """A rung reached its conclusion (`stage.note`)."""


def _ranks_spec(ranks: list[int]) -> str:
    return ",".join(str(r) for r in sorted(set(ranks)))


def _where(d: dict[str, Any]) -> str:
    return (f"step {d['step']}, rank {d['rank']}: {d['phase']} {d['name']}"
            + (f" in {d['module']}" if d["module"] else "") + f" ({d['role']})")


def _windows(stage: Stage) -> str:
    """The tracer's step window for one run of a stage: every rung records every step up to the stage's step S.

    Nondeterminism is random: a narrower pair may part at an earlier step than the broad pair did. Recording
    the stage's rung from step 0 on means that wherever the pair parts, it parts inside the detailed window, and
    no module or op in S is mistaken for an origin because its parameters already differed at an unrecorded step.
    """
    return "all" if stage.steps == "all" or stage.wide else f"0-{stage.steps}"


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

    # -- running CMD ---------------------------------------------------------------------------------------

    def _run(self, stage: Stage, name: str, *, rung: str, capture: str | None = None) -> Path:
        out = self.config.out / name
        self.progress.run_started(name, self.planned)
        stage.runs.append(str(out))
        # The capture run is not compared with anything: it fingerprints nothing (max_numel 0), which halves
        # its cost, and only copies the one call it captures.
        max_numel = 0 if capture else self.config.max_numel if rung in ("module", "op") else None
        try:
            result = run_traced(list(self.config.command), out, rung=rung, steps=_windows(stage), ranks=stage.ranks,
                                max_numel=max_numel, capture=capture, env=self.config.env,
                                timeout=self.config.timeout, quiet=True)
        except CommandFailed as err:
            raise RunFailed(f"run {name} of the ladder failed: {err}") from None
        if result.returncode != 0:
            raise RunFailed(f"CMD exited with status {result.returncode} in run {name} of the ladder (kept in "
                            f"{out}); a command that fails on its own cannot be located", result.output_tail)
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
                return found
        return None

    # -- the rungs -----------------------------------------------------------------------------------------

    def run(self) -> LocateResult:
        cfg = self.config
        result = LocateResult(verdict="inconclusive", message="", command=list(cfg.command), out=cfg.out)
        result.stages = self.stages

        broad = Stage(rung="semantic", steps="all", ranks="all")
        self.stages.append(broad)
        first_pair = self._pair(broad, "semantic", "a", "b")
        result.steps = _recorded_steps(Path(broad.runs[0]))
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
        window = {"steps": str(step), "ranks": _ranks_spec(origin_ranks)}
        broad.note = f"the runs part at {_where(broad.found)}; origin rank(s) {window['ranks']}"
        self.progress.rung(broad)
        result.culprit = broad.found

        for rung in ("module", "op"):
            stage = Stage(rung=rung, **window)
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

    def _kernel(self, culprit: dict[str, Any]) -> ReplayResult | None:
        stage = Stage(rung="kernel", steps=str(culprit["step"]), ranks=str(culprit["rank"]))
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


def aligned_records(run_a: str | Path, run_b: str | Path, rank: int) -> tuple[pa.Table, np.ndarray, int, int]:
    """One rank's records of two runs matched by identity (the A side of each pair, in A's order), whether each
    pair carries the same bits (`detrace.compare.classify.content_mask`), and how many records of A and of B
    found no partner. Positional alignment and resynchronisation are the diff's business; this is the
    order-free view that per-step counts and the search for an origin call need.
    """
    ta, tb = read_rank(run_a, rank).table, read_rank(run_b, rank).table

    def keys(table: pa.Table, position: str) -> pa.Table:
        columns = {name: table[name] for name in IDENTITY}
        # a join never matches null with null: records outside any module get ""
        columns["module"] = pc.fill_null(table["module"], "")
        columns[position] = pa.array(np.arange(table.num_rows, dtype=np.int64))
        return pa.table(columns)

    joined = keys(ta, "_a").join(keys(tb, "_b"), keys=list(IDENTITY), join_type="inner").sort_by("_a")
    a = ta.take(joined["_a"]).combine_chunks()
    b = tb.take(joined["_b"]).combine_chunks()
    if a.num_rows == 0:
        return a, np.zeros(0, dtype=bool), ta.num_rows, tb.num_rows
    equal = content_mask(a.to_batches()[0], b.to_batches()[0])
    return a, equal, ta.num_rows - a.num_rows, tb.num_rows - b.num_rows


def first_origin_call(run_a: str | Path, run_b: str | Path, rank: int) -> dict[str, Any] | None:
    """The first op call, in A's execution order, whose input records all match and an output record differs.

    The diff names the first *record* that differs and walks back from it; when that record is an input whose
    difference went nowhere (the uninitialised memory an in-place fill such as `uniform_` overwrites: inputs
    differ, outputs equal), it finds no origin. This search skips such absorbed differences.
    """
    table, equal, _, _ = aligned_records(run_a, run_b, rank)
    if not table.num_rows:
        return None
    rows = table.select(["seq", "event", "rung", "role"]).to_pylist()
    inputs_differ: set[int] = set()
    for row, same in zip(rows, equal.tolist(), strict=True):
        if not same and row["role"] in INPUT_ROLES:
            inputs_differ.add(row["event"])
    for i, (row, same) in enumerate(zip(rows, equal.tolist(), strict=True)):
        if (not same and row["rung"] == "op" and row["role"] in OUTPUT_ROLES
                and row["event"] not in inputs_differ):
            found = table.slice(i, 1).to_pylist()[0]
            keep = ("rank", "step", "seq", "rung", "phase", "name", "module", "role", "occurrence", "index", "event")
            return {**{k: found.get(k) for k in keep}, "rank": rank, "kind": "numeric", "origin": True,
                    "detail": {}}
    return None


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
