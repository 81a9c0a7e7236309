"""A scripted CMD for `detrace locate`'s launch seam: each run writes, through the real writer, the synthetic trace
(tests/support/_synthetic.py) that a real run at the rung asked for would have written, with a known answer. The
ladder's narrowing, retries, fallbacks, messages and exit codes are then checked in process, in milliseconds."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from _synthetic import Fault, SyntheticRun, rank_table, write_table

from detrace.launch.launcher import LaunchResult

RUN = SyntheticRun(ranks=2, steps=4, ops=8)
RUNGS = {"semantic": ("metrics", "semantic"), "module": ("metrics", "semantic"), "op": ("metrics", "semantic", "op")}
"""The synthetic records each rung keeps (the synthetic loop's module-rung records are its semantic ones)."""
RACE = Fault(rank=1, step=2, op=3)  # an injected fault, named as such: one backward op's output bits on rank 1


class Scripted:
    """A command whose runs write the records of `run` at the rung asked for; the runs named in `faulted` (by their
    ladder name, e.g. "1-semantic-b") show the fault `race`.

    `second_arm`: every second arm of a pair (b, d) shows the fault, a race that recurs. `fail_rung`: every run at
    that rung exits with status 5 and writes nothing (INJECTED FAULT: a rung that breaks the program).
    `resume_fault`: a run that resumes from a checkpoint (DETRACE_RESUME_FROM) shows this fault (INJECTED FAULT: a
    resume that is not exact), and `resume_faults` maps a run name to a fault of its own instead. With
    `checkpoints`, a run asked for periodic checkpoints (DETRACE_CKPT_EVERY) saves a real `TrainState` version
    after every K-th step, up to DETRACE_STOP_AT, as a CMD that follows the resume contract does.
    """

    def __init__(self, faulted: set[str] | None = None, *, second_arm: bool = False, run: SyntheticRun = RUN,
                 race: Fault = RACE, fail_rung: str | None = None, checkpoints: bool = False,
                 resume_fault: Fault | None = None, resume_faults: dict[str, Fault] | None = None) -> None:
        self.faulted = faulted or set()
        self.second_arm = second_arm
        self.run, self.race, self.fail_rung = run, race, fail_rung
        self.checkpoints, self.resume_fault, self.resume_faults = checkpoints, resume_fault, resume_faults or {}
        self.runs: list[str] = []
        self.envs: dict[str, dict[str, str]] = {}
        """Each run's environment, as the ladder gave it."""

    def __call__(self, cmd: list[str], out: Path, *, rung: str, env: dict[str, str] | None = None,
                 **_: object) -> LaunchResult:
        name = Path(out).name
        env = dict(env or {})
        self.runs.append(name)
        self.envs[name] = env
        if rung == self.fail_rung:
            return LaunchResult(returncode=5, out=out, command=tuple(cmd), elapsed=0.01, output_tail="")
        fault = self.race if name in self.faulted or (self.second_arm and name[-2:] in ("-b", "-d")) else None
        if "DETRACE_RESUME_FROM" in env:
            fault = self.resume_faults.get(name, self.resume_fault)
        for rank in range(self.run.ranks):
            table = rank_table(self.run, rank, fault)
            table = table.filter(pc.is_in(table["rung"], value_set=pa.array(RUNGS[rung])))
            write_table(out, rank, table, world_size=self.run.ranks)
        if self.checkpoints and "DETRACE_CKPT_EVERY" in env:
            self._save(env)
        return LaunchResult(returncode=0, out=out, command=tuple(cmd), elapsed=0.01, output_tail="")

    def _save(self, env: dict[str, str]) -> None:
        import torch  # a real TrainState version: what `saved_versions` finds in a run's checkpoint directory

        from detrace import TrainState
        from detrace.state import ResumableSampler

        every, last = int(env["DETRACE_CKPT_EVERY"]), int(env.get("DETRACE_STOP_AT", self.run.steps))
        model = torch.nn.Linear(2, 2)
        state = TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                           data=ResumableSampler(4))
        for step in range(every, last + 1, every):
            state.step = step
            state.save(Path(env["DETRACE_CKPT_DIR"]), keep=self.run.steps)
