"""Every command of the README's tour runs, in order, and does what the tour says it does: sections 1-3 (the race
found, compared, located and reported) in one test, which runs alone on the machine, sections 4-5 (deterministic)
in another.

The commands are read from the README itself (the ```bash block under "## A tour"), so the test fails when the
README drifts: a command that is not listed in EXPECTED below, or one that no longer exits as expected. The README's
set-up command (`detrace locate`) is run as written by tests/e2e/test_locate_e2e.py, which checks what the README
says of it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from detrace.cli import main

ROOT = Path(__file__).parents[2]

pytestmark = pytest.mark.slow

# Each tour command, as written in the README (continuation lines joined), and the exit codes that show what the
# tour claims. The example's MoE race strikes in nearly every backward, so "is it deterministic?" answers no.
EXPECTED: dict[str, set[int]] = {
    "detrace check -- python examples/plain_moe_train.py --steps 3 --threads 8": {1},
    "detrace run --out runs/a --rung op -- python examples/plain_moe_train.py --steps 2 --threads 8": {0},
    "detrace run --out runs/b --rung op -- python examples/plain_moe_train.py --steps 2 --threads 8": {0},
    "detrace diff runs/a runs/b": {1},
    "detrace locate -- python examples/plain_moe_train.py --steps 4 --threads 8": {1},
    "detrace report detrace-runs/locate-latest": {0},
    "python examples/plain_moe_train.py --steps 3 --threads 8 --deterministic": {0},
    "detrace check-resume --at 2 -- python -m detrace.workload.train --preset tiny --steps 4 --deterministic": {0},
    "detrace run --out runs/ddp --rung semantic -- torchrun --standalone --nproc-per-node 2 "
    "-m detrace.workload.train --preset tiny --steps 3 --parallel ddp": {0},
}
THROUGH_THE_CONSOLE_SCRIPT = "detrace diff runs/a runs/b"
"""The tour command run through bash and the installed `detrace` console script. The other `detrace` commands call
the function the script calls (`detrace.cli.main`, with the same arguments) in this process: each fresh
interpreter that imports torch costs seconds. Every command they start (CMD, torchrun) is a real process."""


def tour_commands(readme: str) -> list[str]:
    """The commands of the tour block, continuation lines joined, comments and blank lines left out."""
    section = readme.split("\n## A tour", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "the README's tour has no ```bash block"
    text = re.sub(r"\\\n\s*", "", block.group(1))
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_tour_lists_only_known_commands() -> None:
    commands = tour_commands((ROOT / "README.md").read_text())
    assert commands == list(EXPECTED), "the README's tour changed: update EXPECTED with what each command shows"


RACING = 6
"""The tour's first commands (sections 1-3) find, compare and locate the example's race: they run alone on the
machine (the `race` mark); the rest (sections 4-5) are deterministic and share it with other tests."""


@pytest.mark.race
def test_the_tours_race_is_found_compared_and_located(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    commands = tour_commands((ROOT / "README.md").read_text())[:RACING]
    assert commands[-1].startswith("detrace report") and THROUGH_THE_CONSOLE_SCRIPT in commands
    _run(commands, tmp_path, monkeypatch, capsys)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["a", "b"]


def test_the_tours_deterministic_commands_run_as_it_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    commands = tour_commands((ROOT / "README.md").read_text())[RACING:]
    assert "--deterministic" in commands[0]
    _run(commands, tmp_path, monkeypatch, capsys)
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["ddp"]


def _run(commands: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
         capsys: pytest.CaptureFixture[str]) -> None:
    """Run tour commands in order in an empty directory (the examples linked in), as the README writes them."""
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    for command in commands:
        argv = shlex.split(command)
        if argv[0] == "detrace" and command != THROUGH_THE_CONSOLE_SCRIPT:
            capsys.readouterr()
            code = main(argv[1:])
            printed = capsys.readouterr()
            out, err = printed.out, printed.err
        else:
            done = subprocess.run(["bash", "-c", command], capture_output=True, text=True,
                                  timeout=1200)  # a guard: the whole tour takes minutes
            code, out, err = done.returncode, done.stdout, done.stderr
        assert code in EXPECTED[command], f"{command!r} exited {code}:\n{out[-2000:]}\n{err[-2000:]}"
        if command.startswith("detrace check --"):
            # a real race, no injected fault: the MoE's index_put strikes in nearly every backward
            assert out.startswith("run 2 differs from run 1") and "first divergence: rank 0, step " in out, out
        if command.startswith("detrace check-resume"):
            assert out.startswith(
                "exact: two continuous runs agree, and resuming after step 2 changed no bit; the negative control "
                "(skip-rng) diverged as it must, first divergence: rank 0, step 2, "), out
        if command == THROUGH_THE_CONSOLE_SCRIPT:
            assert out.startswith("diverged: "), out
            # the README quotes what it printed: the same lines, but for what the race decides
            quoted = (ROOT / "README.md").read_text().split("`detrace diff runs/a runs/b` printed")[1]
            assert _racing(out) == _racing(quoted.split("```text\n")[1].split("```")[0]), out


def _racing(printed: str) -> str:
    """A diff's output without what the race decides: the digests, and the step and call where it first struck."""
    printed = re.sub(r"digest [0-9a-f]{16} vs [0-9a-f]{16}", "digest X vs Y", printed)
    return re.sub(r"step \d+, (.*) call #\d+\)", r"step S, \1 call #C)", printed)
