"""`detrace locate`: bad input, broken commands, deterministic commands, and an honest "inconclusive".

The end-to-end ladders on real nondeterminism are in test_locate_e2e.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from detrace.cli import main
from detrace.errors import TraceError, UsageError
from detrace.ladder import LADDER_FILE, LOCATE_FILE, load_ladder
from detrace.locate import BASE_RUNS, MAX_RUNS, LocateConfig, default_command, default_out

# A small training loop that gathers rows with repeated indices (backward: an accumulating index_put whose two
# threads race). `--deterministic` turns on torch.use_deterministic_algorithms, `--small` makes every run cheap,
# `--lr=X` is an intentional change and `--pool` races in the forward too (detrace compare);
# DETRACE_TEST_FAULT_FILE enables the one injected fault of these tests, named as such below.
SCRIPT = '''
import os, sys
from pathlib import Path
import torch
from torch import nn

torch.set_num_threads(2)
torch.use_deterministic_algorithms("--deterministic" in sys.argv)
torch.manual_seed(0)
# large enough for the two threads to race at almost every call (~0.1 s a call)
ROWS, COPIES = (1024, 4096) if "--small" in sys.argv else (8192, 131072)


class Gather(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("idx", torch.randint(0, ROWS, (COPIES,), generator=torch.Generator().manual_seed(1)))
        # a weight per copy: equal addends would sum to the same bits in any order
        self.register_buffer("scale", torch.rand(COPIES, 1, generator=torch.Generator().manual_seed(3)))

    def forward(self, x):
        rows = x[self.idx] * self.scale
        if "--pool" in sys.argv:  # sum the copies back per row: the forward races too, so the loss varies
            return torch.zeros_like(x).index_put((self.idx,), rows, accumulate=True)
        return rows


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.gather, self.out = nn.Linear(16, 16), Gather(), nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.out(self.gather(self.inp(x))))


model = Net()
lr = float(next((a.split("=")[1] for a in sys.argv if a.startswith("--lr=")), 0.01))
opt = torch.optim.SGD(model.parameters(), lr=lr)
data = torch.randn(ROWS, 16, generator=torch.Generator().manual_seed(2))

fault = os.environ.get("DETRACE_TEST_FAULT_FILE")
run = 0
if fault:
    run = int(Path(fault).read_text() or 0) + 1 if Path(fault).exists() else 1
    Path(fault).write_text(str(run))
for step in range(int(sys.argv[1])):
    if fault and run == 2 and step == 1:
        with torch.no_grad():  # INJECTED FAULT: the second run of the ladder perturbs one weight at step 1
            model.inp.weight[0, 0] += 1e-3
    out = model(data)
    # --pool: a float64 loss keeps the last bits that a float32 mean over 131072 values would round away
    (out.double() if "--pool" in sys.argv else out).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
print("trained", flush=True)
'''


def write_script(folder: Path) -> Path:
    path = folder / "train_gather.py"
    path.write_text(SCRIPT)
    return path


def locate_cli(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """`python -m detrace locate ARGS` in a fresh process, as a user runs it."""
    return subprocess.run([sys.executable, "-m", "detrace", "locate", *args], capture_output=True, text=True,
                          cwd=cwd, env={**os.environ, **(env or {})}, timeout=timeout, check=False)


def test_config_checks() -> None:
    with pytest.raises(UsageError, match="needs a command"):
        LocateConfig(command=(), out=Path("x"))
    with pytest.raises(UsageError, match="--timeout"):
        LocateConfig(command=("true",), out=Path("x"), timeout=0)
    with pytest.raises(UsageError, match="at most once"):
        LocateConfig(command=("true",), out=Path("x"), retries=2)


def test_run_budget_is_stated() -> None:
    assert (BASE_RUNS, MAX_RUNS) == (7, 14)


def test_default_command_is_the_index_dispatch_on_two_threads() -> None:
    command = default_command()
    assert command[:3] == [sys.executable, "-m", "detrace.examples.train"]
    assert command[command.index("--dispatch") + 1] == "index"
    assert command[command.index("--threads") + 1] == "2"


def test_default_out_is_fresh(tmp_path: Path) -> None:
    first = default_out(tmp_path)
    first.mkdir(parents=True)
    second = default_out(tmp_path)
    assert first.parent == tmp_path / "detrace-runs" and first.name.startswith("locate-")
    assert second != first and not second.exists()


def test_command_not_installed(tmp_path: Path) -> None:
    done = locate_cli("--out", str(tmp_path / "out"), "--", "detrace-no-such-command-xyz", "--flag")
    assert done.returncode == 2
    assert "command not found: detrace-no-such-command-xyz" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_command_failing_on_its_first_run_shows_its_output(tmp_path: Path) -> None:
    done = locate_cli("--out", str(tmp_path / "out"), "--", sys.executable, "-c",
                      "import sys; print('boom: no data at /nowhere', file=sys.stderr); sys.exit(3)")
    assert done.returncode == 2
    assert "CMD exited with status 3 in run 1-semantic-a" in done.stderr
    assert "boom: no data at /nowhere" in done.stderr  # the tail of CMD's own output
    assert "Traceback" not in done.stderr
    # the failed run is kept for inspection
    assert (tmp_path / "out" / "1-semantic-a" / "run.json").exists()


def test_hanging_command_ends_at_the_timeout(tmp_path: Path) -> None:
    done = locate_cli("--out", str(tmp_path / "out"), "--timeout", "3", "--", sys.executable, "-c",
                      "import time; time.sleep(60)", timeout=60)
    assert done.returncode == 2
    assert "run 1-semantic-a of the ladder failed" in done.stderr and "timeout of 3 seconds" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--timeout", "-1", "--", "true"], "--timeout must be a positive number"),
        (["--timeout", "soon", "--", "true"], "invalid float value"),
        (["--repeats", "1", "--", "true"], "at least 2 repeats"),
        (["python", "train.py"], "unrecognized arguments"),
    ],
)
def test_bad_options_are_one_sentence(tmp_path: Path, args: list[str], message: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["locate", "--out", str(tmp_path / "o"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("detrace locate: error:")


def test_out_must_be_empty_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    assert main(["locate", "--out", str(tmp_path), "--", "true"]) == 2
    assert "is not empty" in capsys.readouterr().err


def test_not_a_locate_directory(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="not a locate directory"):
        load_ladder(tmp_path)


@pytest.fixture(scope="module")
def deterministic(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    folder = tmp_path_factory.mktemp("locate-deterministic")
    script = write_script(folder)
    out = folder / "out"
    done = locate_cli("--json", "--out", str(out), "--", sys.executable, str(script), "2", "--deterministic",
                      "--small")
    return done, out


def test_deterministic_command_exits_0_with_the_verdict(
        deterministic: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    done, out = deterministic
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert list(payload) == ["schema", "verdict", "culprit", "replay", "runs", "report", "cost"]
    assert payload["schema"] == "detrace.locate/1" and payload["verdict"] == "deterministic"
    assert payload["culprit"] is None and payload["replay"] is None
    assert payload["runs"] == [str(out / name) for name in ("1-semantic-a", "1-semantic-b", "1-semantic-c")]
    assert all(Path(run, "rank-00000.arrow").exists() for run in payload["runs"])
    assert Path(payload["report"]).exists()
    assert json.loads((out / LOCATE_FILE).read_text()) == payload
    ladder = load_ladder(out)
    assert "over 2 steps" in ladder.stages[0].note
    assert "rung 1 (metrics + semantic) the three runs are bit-identical over 2 steps" in " ".join(
        done.stderr.split())


def test_deterministic_human_summary(tmp_path: Path) -> None:
    script = write_script(tmp_path)
    done = locate_cli("--out", str(tmp_path / "out"), "--", sys.executable, str(script), "1", "--small",
                      "--deterministic")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("deterministic over 1 step:")
    assert "runs     3 (of at most 14)" in done.stdout


def test_divergence_that_does_not_recur_is_inconclusive(tmp_path: Path) -> None:
    # The injected fault perturbs the second run only: the broad pair parts at step 1, but no narrower rerun
    # can reproduce it. The ladder retries the module pair once, then says what it knows instead of guessing.
    script = write_script(tmp_path)
    out = tmp_path / "out"
    done = locate_cli("--json", "--out", str(out), "--", sys.executable, str(script), "2", "--small",
                      "--deterministic", env={"DETRACE_TEST_FAULT_FILE": str(tmp_path / "runs.txt")})
    assert done.returncode == 2, done.stderr
    payload = json.loads(done.stdout)
    assert payload["verdict"] == "inconclusive" and payload["replay"] is None
    assert payload["culprit"]["step"] == 1 and payload["culprit"]["rank"] == 0
    assert [Path(r).name for r in payload["runs"]] == ["1-semantic-a", "1-semantic-b", "2-module-a", "2-module-b",
                                                       "2-module-c", "2-module-d"]
    ladder = load_ladder(out)
    assert "the second arm does not reproduce it: 4 reruns at the module rung agree" in ladder.message
    assert "transient hardware fault" in ladder.message and "detrace recheck RUN --step 1" in ladder.message
    assert "did not recur" in ladder.stages[-1].note
    assert (out / LADDER_FILE).exists() and Path(payload["report"]).exists()
