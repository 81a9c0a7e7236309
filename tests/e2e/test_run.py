"""`detrace run` and `run_traced`: scripts, modules, torchrun, mp.spawn, crashes, SIGKILL, bad input."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyarrow as pa
import pytest

import detrace
from detrace.cli import main as cli
from detrace.errors import CommandFailed, TraceError, UsageError
from detrace.launch.launcher import run_traced, shared_stdin
from detrace.tracefile import open_run, read_rank

SUPPORT = Path(__file__).parents[1] / "support"
PY = sys.executable

TRAIN = """
import os, sys, torch
import detrace
from torch import nn
torch.set_num_threads(1)
steps = int(os.environ.get("STEPS", "3"))
crash = int(os.environ.get("CRASH_AT", "-1"))

def main():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for i in range(steps):
        if i == crash:
            raise SystemExit(3)
        loss = net(torch.randn(5, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        detrace.metric("lr", 0.1)
        print(f"step {i}", flush=True)

if os.environ.get("LIBRARY_OUT"):
    with detrace.trace(os.environ["LIBRARY_OUT"], rung=os.environ.get("RUNG", "metrics")):
        main()
else:
    main()
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    return path


@pytest.mark.slow
def test_python_script_by_the_cli_over_an_existing_trace_records_what_the_library_form_records(
        tmp_path: Path, script: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    with detrace.trace(run):  # an existing trace, made here: one process less to start
        detrace.metric("x", 1.0)
        detrace.step()
    with pytest.raises(TraceError, match="already holds a trace"):
        run_traced([PY, str(script)], run, quiet=True, timeout=120)
    assert cli(["run", "--out", str(run), "--rung", "op", "--force", "--", PY, str(script)]) == 0
    captured = capsys.readouterr()
    assert "step 2" in captured.out and "trace of 1 rank at rung op written to" in captured.err
    info = open_run(run)
    assert info.ranks == (0,) and info.world_size == 1
    header = json.loads((run / "run.json").read_text())
    assert header["command"] == [PY, str(script)] and header["rung"] == "op"
    assert header["versions"]["torch"] and header["determinism"] is not None
    assert header["windows"]["steps"]["op"] == "all" and header["status"] == "finished"
    trace = read_rank(run, 0)
    assert trace.complete and trace.header.rank == 0 and (trace.header.pid or 0) > 0
    assert pa.ipc.open_file(run / "rank-00000.arrow").read_all().equals(trace.table)
    assert sorted({r["step"] for r in trace.table.to_pylist() if r["name"] == "loss"}) == [0, 1, 2]
    # 3 steps, 0-2: the "lr" logged after each optimizer step is that step's trailing work
    assert trace.last_step == 2
    # the library form (detrace.trace in the script) records the launcher's records
    library = subprocess.run([PY, str(script)], env={**os.environ, "LIBRARY_OUT": str(tmp_path / "library"),
                                                     "RUNG": "op"}, capture_output=True, timeout=300)
    assert library.returncode == 0, library.stderr
    assert trace.table.num_rows > 100
    assert trace.table.equals(read_rank(tmp_path / "library", 0).table)


@pytest.mark.slow
def test_a_python_module_that_crashes_keeps_its_trace_readable(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text(TRAIN)
    result = run_traced([PY, "-m", "pkg"], tmp_path / "run", quiet=True, timeout=120,
                        env={"PYTHONPATH": str(tmp_path), "CRASH_AT": "2"})
    assert result.returncode == 3
    trace = read_rank(tmp_path / "run", 0)
    assert trace.complete
    assert [r["step"] for r in trace.table.to_pylist() if r["name"] == "loss"] == [0, 1]


def _children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def test_sigkill_leaves_complete_batches(tmp_path: Path, script: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen([PY, "-m", "detrace", "run", "--out", str(out), "--", PY, str(script)],
                            env={**os.environ, "STEPS": "100000"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    for line in proc.stdout:
        if line.startswith("step 20") or time.monotonic() > deadline:
            break
    # SIGKILL the traced program itself (the launcher runs it in a session of its own): m4, CMD's SIGKILL is
    # the launcher's exit code 137
    for child in _children(proc.pid):
        os.kill(child, signal.SIGKILL)
    try:
        assert proc.wait(timeout=120) == 137
    finally:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
    trace = read_rank(out, 0)  # never raises on a torn tail
    assert not trace.complete and trace.rank == 0
    assert trace.last_complete_step >= 19
    steps = [r["step"] for r in trace.table.to_pylist() if r["name"] == "loss"]
    assert steps == list(range(len(steps)))


SLEEPER = """
import os, subprocess, sys, time
if sys.argv[1:] != ["worker"]:  # CMD starts a worker in a session of its own, as torchrun does
    subprocess.Popen([sys.executable, __file__, "worker"], start_new_session=True)
with open(os.environ["PIDS"], "a") as f:
    f.write(f"{os.getpid()}\\n")
while True:
    time.sleep(0.1)
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has ended (its new parent may be slow to reap it)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc")
def test_sigkill_of_the_launcher_kills_the_command_tree(tmp_path: Path) -> None:
    script, pids = tmp_path / "sleeper.py", tmp_path / "pids"
    script.write_text(SLEEPER)
    proc = subprocess.Popen([PY, "-m", "detrace", "run", "--out", str(tmp_path / "run"), "--", PY, str(script)],
                            env={**os.environ, "PIDS": str(pids)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    started: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(started) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            started = [int(line) for line in pids.read_text().split()] if pids.exists() else []
        assert len(started) == 2 and all(map(_alive, started))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 5
        while any(map(_alive, started)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, started))  # CMD and its worker in another session
    finally:
        for pid in [proc.pid, *started]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def test_timeout_kills_the_process_group(tmp_path: Path, script: Path) -> None:
    with pytest.raises(CommandFailed, match="timeout of 3 seconds"):
        run_traced([PY, str(script)], tmp_path / "run", quiet=True, timeout=3, env={"STEPS": "10000000"})
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "timeout"


@pytest.mark.parametrize(("argv", "message"), [
    (["--rung", "kernel", "--", PY, "-c", "pass"], "unknown rung 'kernel'"),
    (["--steps", "5-2", "--", PY, "-c", "pass"], "malformed SPEC '5-2'"),
    (["--ranks", "x", "--", PY, "-c", "pass"], "malformed SPEC 'x'"),
    (["--steps", "kernel=3", "--", PY, "-c", "pass"], "unknown rung 'kernel'"),
    (["--capture", "name=aten.mm.default", "--", PY, "-c", "pass"], "needs --rung op"),
    (["--max-numel", "lots", "--", PY, "-c", "pass"], "invalid int value"),
    (["--timeout", "0", "--", PY, "-c", "pass"], "'0' is not a positive, finite number of seconds"),
    (["--timeout", "nan", "--", PY, "-c", "pass"], "'nan' is not a positive, finite number of seconds"),
    (["--timeout", "inf", "--", PY, "-c", "pass"], "'inf' is not a positive, finite number of seconds"),
    ([], "no command to run"),
    ([PY, "-c", "pass"], "unrecognized arguments"),
    (["--", "no-such-command-detrace"], "command not found: no-such-command-detrace"),
])
def test_bad_input_is_one_sentence(tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                   message: str) -> None:
    code = cli(["run", "--out", str(tmp_path / "run"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert err.startswith("detrace run: error: ") and err.count("\n") == 1


def test_unwritable_output_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("")
    assert cli(["run", "--out", str(tmp_path / "file" / "run"), "--", PY, "-c", "pass"]) == 2
    err = capsys.readouterr().err
    assert "cannot write to output directory" in err and "Traceback" not in err
    assert cli(["run", "--out", str(tmp_path / "file"), "--", PY, "-c", "pass"]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_cmds_exit_code_and_no_records_no_rank_file(tmp_path: Path) -> None:
    code = "import torch; torch.ones(3) + 1; raise SystemExit(7)"
    assert cli(["run", "--out", str(tmp_path / "crash"), "--", PY, "-c", code]) == 7
    assert not list((tmp_path / "crash").glob("rank-*"))  # torch ran, but no record: no rank file


@pytest.mark.slow
def test_a_program_that_imports_detrace_before_torch_is_traced(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 36: `python -m detrace.examples.train` (the trainer's old name) imports detrace._compat, which imports
    torch; arming the tracer right then met detrace._compat half-made (a circular import), and nothing was traced."""
    out = tmp_path / "a"
    assert cli(["run", "--out", str(out), "--", PY, "-m", "detrace.examples.train", "--steps", "1"]) == 0
    err = capsys.readouterr().err
    assert "not started" not in err and f"trace of 1 rank at rung metrics written to {out}" in err, err
    assert open_run(out).ranks == (0,)


def _final_lines(output: str) -> list[str]:
    return sorted(re.findall(r"final \d [0-9a-f]{64}", output))  # the ranks' lines may interleave


@pytest.mark.slow
def test_torchrun_two_ranks_ddp_fsdp2(tmp_path: Path, free_port: Callable[[], int]) -> None:
    command = ["torchrun", "--nproc-per-node", "2", "--master-port", str(free_port()), str(SUPPORT / "_dist_train.py")]
    env = {**os.environ, "TRAIN_STEPS": "2"}
    untraced = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert untraced.returncode == 0, untraced.stderr[-2000:]
    command[4] = str(free_port())
    traced = run_traced(command, tmp_path / "run", rung="semantic", quiet=True, timeout=240,
                        env={"TRAIN_STEPS": "2"})
    assert traced.returncode == 0, traced.output_tail
    assert _final_lines(traced.output_tail) == _final_lines(untraced.stdout)  # bit-identical parameters
    info = open_run(tmp_path / "run")
    assert info.ranks == (0, 1) and info.world_size == 2  # the torchrun agent wrote nothing
    for rank in (0, 1):
        trace = read_rank(tmp_path / "run", rank)
        assert trace.complete and trace.footer is not None and trace.footer.groups == ("0,1",)
        records = trace.table.to_pylist()
        buckets = [r for r in records if r["extra"] and "ddp_bucket" in r["extra"]]
        assert {r["role"] for r in buckets} == {"input", "output"} and {r["step"] for r in buckets} == {0, 1}
        assert {r["phase"] for r in buckets} == {"collective"}  # the diff's receiver walk goes through it
        names = {r["name"] for r in records if r["phase"] in ("collective", "p2p")}
        assert {"all_reduce", "all_gather_single", "reduce_scatter_single"} <= names
        assert ("send" if rank == 0 else "recv") in names
        collectives = [r for r in records if r["phase"] == "collective"]
        assert all(r["group"] == "0,1" and r["group_seq"] is not None for r in collectives)
        # each call is recorded once: the DDP bucket's own all_reduce is not recorded again inside it
        plain = [r for r in records if r["name"] == "all_reduce" and r["extra"] is None and r["role"] == "input"]
        assert [r["step"] for r in plain] == [0, 1]  # the explicit one after each optimizer step: its trailing work
        # functional collectives, at completion: all_to_all forward and backward, DTensor's all-gather
        functional = [(r["step"], r["name"], r["role"]) for r in records
                      if r["extra"] and json.loads(r["extra"]).get("functional")]
        for step in (0, 1):
            assert functional.count((step, "all_to_all_single", "output")) == 2
            assert (step, "all_to_all_single", "input") in functional
            assert (step, "all_gather_into_tensor", "output") in functional
    traces = [read_rank(tmp_path / "run", rank).table.to_pylist() for rank in (0, 1)]
    for name in ("ddp_bucket", "all_gather_into_tensor"):
        # an all-reduce and an all-gather give every rank the same bits
        outputs = [[r["digest"] for r in trace if r["role"] == "output" and r["extra"]
                    and name in (r["name"], *json.loads(r["extra"]))] for trace in traces]
        assert outputs[0] == outputs[1] and outputs[0]


@pytest.mark.slow
def test_mp_spawn_discovers_ranks_and_only_the_ranks_asked_for_write(tmp_path: Path,
                                                                     free_port: Callable[[], int]) -> None:
    result = run_traced([PY, str(SUPPORT / "_dist_train.py"), "spawn", str(free_port())], tmp_path / "run",
                        rung="semantic", ranks="1", quiet=True, timeout=240, env={"TRAIN_STEPS": "1"})
    assert result.returncode == 0, result.output_tail
    info = open_run(tmp_path / "run")
    # the spawned child that joined as rank 1 wrote rank 1's trace; rank 0, outside --ranks, is not missing
    assert info.ranks == (1,) and info.world_size == 2 and info.missing_ranks == ()
    assert read_rank(tmp_path / "run", 1).header.world_size == 2


@pytest.mark.slow
def test_dataloader_workers_record_nothing(tmp_path: Path) -> None:
    script = tmp_path / "loader.py"
    script.write_text(textwrap.dedent("""
        import torch
        from torch.utils.data import DataLoader, Dataset
        class Data(Dataset):
            def __len__(self): return 8
            def __getitem__(self, i): return torch.full((3,), float(i)).sin()
        if __name__ == "__main__":
            net = torch.nn.Linear(3, 1)
            opt = torch.optim.SGD(net.parameters(), lr=0.1)
            for ctx in ("fork", "spawn"):
                for x in DataLoader(Data(), batch_size=4, num_workers=1, multiprocessing_context=ctx):
                    net(x).sum().backward(); opt.step()
    """))
    result = run_traced([PY, str(script)], tmp_path / "run", rung="op", quiet=True, timeout=180)
    assert result.returncode == 0, result.output_tail
    assert [p.name for p in sorted((tmp_path / "run").glob("rank-*"))] == ["rank-00000.arrow", "rank-00000.json"]
    names = {r["name"] for r in read_rank(tmp_path / "run", 0).table.to_pylist()}
    assert "aten.sin.default" not in names  # the dataset ran in the workers only
    assert "aten.addmm.default" in names


def test_run_traced_rejects_an_empty_command(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        run_traced([], tmp_path / "run")


DDP_BUCKETS = """
import hashlib, os, subprocess, sys, threading
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from detrace._exit import leave

import detrace

torch.set_num_threads(1)
rank = int(os.environ.get("RANK", "0"))
peer = subprocess.Popen([sys.executable, __file__], env={**os.environ, "RANK": "1"}) if rank == 0 else None
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=rank, world_size=2)

def reversed_completion(state, bucket):
    # The default hook's two steps (the same bits), but bucket i completes only after bucket i + 1: the
    # completion order is the reverse of the index order.
    buffer = bucket.buffer()
    buffer.mul_(1.0 / dist.get_world_size())
    dist.all_reduce(buffer)
    future = torch.futures.Future()
    threading.Timer(0.03 * (8 - bucket.index()), future.set_result, args=(buffer,)).start()
    return future

for hook in ("default", "reversed"):  # two traced runs, one after the other in the same two processes
    with detrace.trace(os.path.join(os.environ["OUT"], hook), rung="semantic"):
        torch.manual_seed(0)
        ddp = DDP(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]), bucket_cap_mb=0.004)
        if hook == "reversed":
            ddp.register_comm_hook(None, reversed_completion)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        for _ in range(3):
            ddp(torch.randn(4, 32, generator=gen)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in ddp.parameters())).hexdigest()
    print(f"final {hook} {rank} {digest}", flush=True)
    dist.barrier()
dist.destroy_process_group()
if peer is not None:
    peer.wait()
leave(0)
"""


def test_ddp_buckets_are_recorded_in_index_order(tmp_path: Path, free_port: Callable[[], int]) -> None:
    script = tmp_path / "buckets.py"
    script.write_text(DDP_BUCKETS)
    # the same program, its buckets completing in two different orders: traced by detrace.trace in the script
    done = subprocess.run([PY, str(script)], env={**os.environ, "PORT": str(free_port()), "OUT": str(tmp_path)},
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    runs = {hook: [read_rank(tmp_path / hook, rank).table.to_pylist() for rank in (0, 1)]
            for hook in ("default", "reversed")}
    finals = [sorted(re.findall(rf"final {hook} (\d [0-9a-f]{{64}})", done.stdout)) for hook in ("default", "reversed")]
    assert finals[0] == finals[1] and len(finals[0]) == 2  # the two hooks compute the same bits
    for rank in (0, 1):
        sequences = []
        for hook in ("default", "reversed"):
            buckets = [r for r in runs[hook][rank] if r["extra"] and "ddp_bucket" in r["extra"]]
            for step in (1, 2):  # DDP's first backward uses one bucket, then rebuilds them by the given cap
                indices = [json.loads(r["extra"])["ddp_bucket"] for r in buckets if r["step"] == step]
                assert indices == [i for i in range(4) for _ in "io"]  # each bucket's input, then its output
            sequences.append([(r["step"], r["name"], r["occurrence"], r["role"], r["extra"], r["collectives"],
                               r["digest"]) for r in buckets])
        assert sequences[0] == sequences[1]


def test_an_uncapturable_argument_never_breaks_the_program(tmp_path: Path) -> None:
    """F8: a torch.Generator cannot be captured; the program still runs to its end and the run says why."""
    code = ("import torch; g = torch.Generator().manual_seed(1); x = torch.randn(3, generator=g); "
            "print('went on', tuple(x.shape))")
    result = run_traced([PY, "-c", code], tmp_path / "run", rung="op", capture="name=aten.randn.generator",
                        quiet=True, timeout=120)
    assert result.returncode == 0 and "went on (3,)" in result.output_tail
    assert "cannot capture aten.randn.generator" in result.output_tail
    (note,) = (tmp_path / "run" / "capture").glob("*.impossible.json")
    recorded = json.loads(note.read_text())
    assert recorded["op"] == "aten.randn.generator" and "Generator" in recorded["reason"]
    assert not list((tmp_path / "run" / "capture").glob("*.safetensors"))


def test_a_failed_start_leaves_the_directory_usable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """m1: `detrace run --out r -- /nonexistent/cmd` left run.json saying "running", and r was then refused."""
    out = tmp_path / "r"
    assert cli(["run", "--out", str(out), "--", str(tmp_path / "nonexistent")]) == 2
    assert "command not found" in capsys.readouterr().err
    assert not (out / "run.json").exists()
    assert cli(["run", "--out", str(out), "--", PY, "-c", "pass"]) == 0


@contextlib.contextmanager
def _stdin_from(read_end: int) -> Iterator[None]:
    """detrace's fd 0 taken from `read_end` for the block, with shared_stdin's one read forgotten around it."""
    saved = os.dup(0)
    os.dup2(read_end, 0)
    os.close(read_end)
    shared_stdin.cache_clear()
    try:
        yield
    finally:
        os.dup2(saved, 0)
        os.close(saved)
        shared_stdin.cache_clear()


ECHO_STDIN = "import sys; open(sys.argv[1], 'w').write(sys.stdin.read())"


def test_every_run_gets_the_same_stdin(tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    os.write(write_end, b"3\n")
    os.close(write_end)
    with _stdin_from(read_end):
        for n in (1, 2):
            result = run_traced([sys.executable, "-c", ECHO_STDIN, str(tmp_path / f"in{n}")], tmp_path / f"r{n}",
                                quiet=True)
            assert result.returncode == 0, result.output_tail
    assert (tmp_path / "in1").read_text() == (tmp_path / "in2").read_text() == "3\n"


def test_a_pipe_without_data_gives_every_run_an_empty_stdin(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    read_end, write_end = os.pipe()  # kept open and silent: reading it to its end would hang
    try:
        with _stdin_from(read_end):
            result = run_traced([sys.executable, "-c", ECHO_STDIN, str(tmp_path / "in")], tmp_path / "r", quiet=True)
    finally:
        os.close(write_end)
    assert result.returncode == 0 and (tmp_path / "in").read_text() == ""
    assert "stdin is a pipe that gave no data" in capsys.readouterr().err
