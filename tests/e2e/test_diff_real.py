"""The diff on real traces recorded by the tracer: real CPU nondeterminism, deterministic mode, an injected
fault (named as such), and a 2-rank DDP run on gloo in which only rank 1 runs a nondeterministic op.

The nondeterministic op is the backward of `table[idx]` with repeated indices: `aten.index_put` with
accumulate=True, whose CPU kernel adds from several threads in whatever order they run. Two threads on a machine
busy with other work often run one after the other, in the same order, and the call then agrees with itself: the
runs use more threads than the machine has cores (`RACING_THREADS`), whose order the operating system varies, and
take three steps (three calls, one of which is all the race needs).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from _tools import RACING_THREADS
from torch import nn

import detrace
from detrace.analyze import DiffResult, diff
from detrace.cli import main

# Only the tests whose runs must race hold the machine alone (`race`); the deterministic ones share it.
pytestmark = pytest.mark.slow

ROWS, WIDTH = 8192, 16


class Gather(nn.Module):
    """An embedding table read with advanced indexing: its backward is index_put(accumulate=True)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(0)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table[idx]


class Net(nn.Module):
    def __init__(self, rows: int) -> None:
        super().__init__()
        self.gather = Gather(rows)
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # tanh between the two modules: when gather's output fed fc directly, the tracer's backward module scope
        # lost "gather" whenever fc's grad_input hook fired after gather's grad_output hook (reported to its owner).
        return ((self.fc(torch.tanh(self.gather(idx))) - target) ** 2).mean()


def inject_fault_perturb_parameter(model: nn.Module, name: str) -> None:
    """Injected fault: add 1e-3 to every element of one parameter, in place, between two steps.

    It writes through a NumPy view of the parameter's memory, so no PyTorch op runs and the tracer sees nothing:
    like silent memory corruption, the change shows only where the parameter is next read.
    """
    model.get_parameter(name).detach().numpy()[...] += 1e-3


@pytest.fixture(autouse=True)
def racing_threads() -> Iterator[None]:
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(RACING_THREADS)
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def train(out: Path, *, steps: int, rows: int = ROWS, indices: int = 1 << 16, rung: str = "op",
          fault: Callable[[nn.Module, int], None] | None = None) -> Path:
    """Train `Net` for `steps` SGD steps under the tracer; `fault(model, step)` runs before each step's forward."""
    torch.manual_seed(0)
    model = Net(rows)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(1)
    idx = torch.randint(0, rows, (indices,), generator=data)  # many repeats: each row is read ~indices/rows times
    target = torch.randn(indices, WIDTH, generator=data)
    with detrace.trace(out, rung=rung):
        for step in range(steps):
            if fault is not None:
                fault(model, step)
            optimizer.zero_grad()
            model(idx, target).backward()
            optimizer.step()
    return out


def two_diverged_runs(make: Callable[[Path], Path], tmp_path: Path) -> tuple[Path, Path, DiffResult]:
    """Two real runs, which the race (random repeated rows, at nearly every call) makes differ."""
    a, b = make(tmp_path / "a"), make(tmp_path / "b")
    result = diff(a, b)
    assert result.verdict == "diverged", "two real runs agreed bit for bit: the op showed no nondeterminism"
    return a, b, result


@pytest.mark.race
def test_nondeterministic_backward_op_is_named_as_the_origin(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    a, b, result = two_diverged_runs(lambda out: train(out, steps=3), tmp_path)
    first = result.first
    assert first is not None and result.origin_ranks == [0]
    assert first.phase == "backward" and first.name.startswith("aten.index_put") and first.origin
    assert first.module == "gather" and first.kind == "numeric"
    assert first.detail["outputs"] == [f"output float32[{ROWS}, {WIDTH}]"]
    assert main(["diff", str(a), str(b)]) == 1
    assert f"backward in gather: {first.name}" in capsys.readouterr().out


def test_deterministic_algorithms_make_the_runs_identical(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.use_deterministic_algorithms(True)
    a, b = train(tmp_path / "a", steps=1), train(tmp_path / "b", steps=1)
    assert main(["diff", str(a), str(b)]) == 0
    assert capsys.readouterr().out.startswith("identical: 1 ranks,")


def test_perturbed_parameter_shows_at_its_step_in_its_consumer(tmp_path: Path) -> None:
    def perturb_at_3(model: nn.Module, step: int) -> None:
        if step == 3:
            inject_fault_perturb_parameter(model, "fc.weight")

    small = {"steps": 5, "rows": 64, "indices": 256}  # too small for the kernel to use threads: deterministic
    result = diff(train(tmp_path / "a", **small), train(tmp_path / "b", fault=perturb_at_3, **small))
    first = result.first
    assert first is not None and first.step == 3 and first.phase == "forward"
    # The first differing record is fc's matmul reading the weight; walking back names the module whose
    # inputs were equal and whose output differs: fc, the parameter's consumer.
    assert first.module == "fc" and first.origin and first.rung == "module"
    assert "fc aten." in first.detail["receiver"]["label"]


DDP_SCRIPT = textwrap.dedent('''
    import os, sys
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    from torch import nn
    import detrace
    from detrace._exit import leave

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8192, 16)
            self.fc = nn.Linear(16, 16)

        def forward(self, idx):
            return self.fc(self.embed.weight[idx])

    def worker(rank, outs, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(int(os.environ["RACING_THREADS"]))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        for out in outs.split(","):  # the same run again in the same processes: two runs, one start
            torch.manual_seed(0)
            data = torch.Generator().manual_seed(1 + rank)
            # rank 1 reads rows with many repeats (nondeterministic backward); rank 0 reads each row once
            idx = (torch.randint(0, 8192, (1 << 18,), generator=data) if rank == 1
                   else torch.randperm(8192, generator=data))
            target = torch.randn(len(idx), 16, generator=data)
            with detrace.trace(out, rung="semantic"):
                model = nn.parallel.DistributedDataParallel(Net())
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for _ in range(2):
                    optimizer.zero_grad()
                    ((model(idx) - target) ** 2).mean().backward()
                    optimizer.step()
            dist.barrier()
        dist.destroy_process_group()
        leave(0)  # gloo's threads outlive the group: no interpreter finalization to race with

    if __name__ == "__main__":
        mp.spawn(worker, args=(sys.argv[1], int(sys.argv[2])), nprocs=2)
''')


@pytest.mark.race
def test_ddp_origin_rank_and_receiver_via_the_gradient_all_reduce(tmp_path: Path,
                                                                   free_port: Callable[[], int]) -> None:
    script = tmp_path / "ddp_train.py"
    script.write_text(DDP_SCRIPT)
    a, b = tmp_path / "a", tmp_path / "b"
    subprocess.run([sys.executable, str(script), f"{a},{b}", str(free_port())], check=True, timeout=300,
                   env={**os.environ, "RACING_THREADS": str(RACING_THREADS)})
    result = diff(a, b)
    assert result.verdict == "diverged", "two real runs agreed bit for bit: the op showed no nondeterminism"
    assert result.origin_ranks == [1]
    rank0, rank1 = result.ranks
    assert rank1.cause == "origin" and rank1.first is not None and rank1.first.phase == "collective"
    assert rank0.cause == "receiver" and rank0.via is not None and rank0.via.startswith("all_reduce#")
    assert rank0.via.endswith("group 0,1")
    assert rank0.first is not None and rank0.first.role == "output" and rank0.first.step == rank1.first.step
