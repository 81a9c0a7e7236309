"""The training program of the exact-resume tests (tests/e2e/test_resume.py in real processes,
tests/integration/test_resume_single.py in this one): a run stopped at step K and resumed continues with exactly
the bits (losses and final parameters) of the run that never stopped.

The workload has every source of randomness a resume can get wrong: dropout, a shuffling sampler with two
DataLoader workers doing random augmentation (torch, NumPy and Python RNGs), an LR scheduler and AdamW. It runs as
one process, as DDP on 2 ranks or as FSDP2 on 2 ranks (gloo).

`python tests/support/_resume_program.py --mode ddp,fsdp2 --steps 5 --out DIR` runs it (each mode in turn, in the
same 2 ranks); `run(...)` does so in a fresh process. Its top level imports no torch, so that the launcher of the
two ranks starts fast; the ranks import it.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

from _ranks import free_port

BATCH = 4
SAMPLES = 24  # one process: 6 batches an epoch; 2 ranks: 3 batches an epoch each


def train(rank: int, world: int, mode: str, steps: int, out: Path, save_at: str) -> None:
    """One rank of the training program (in a process group of `world` ranks when `world` > 1), writing
    OUT/rank{rank}.json. Saves at the steps of `save_at` (ROOT:K1,K2 -> ROOT/kK) and honours the DETRACE_*
    variables through TrainState."""
    import hashlib
    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from detrace import TrainState, deterministic
    from detrace.state import ResumableLoader, ResumableSampler

    class AugmentedData(torch.utils.data.Dataset):
        """Fixed features, augmented at load time (in the workers) with torch, NumPy and Python randomness."""

        def __init__(self) -> None:
            generator = torch.Generator().manual_seed(1234)
            self.x = torch.randn(SAMPLES, 8, generator=generator)
            self.y = torch.randn(SAMPLES, 4, generator=generator)

        def __len__(self) -> int:
            return SAMPLES

        def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
            noise = 0.1 * torch.randn(8) + float(np.random.rand()) * 0.01 + random.random() * 0.01
            return self.x[index] + noise, self.y[index]

    torch.set_num_threads(1)
    deterministic(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 4)
    )
    if mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    sampler = ResumableSampler(SAMPLES, shuffle=True, seed=7, num_replicas=world, rank=rank)
    # The ranks are spawned processes, whose DataLoader would spawn its workers too (a fresh interpreter
    # per worker and epoch, seconds each); fork them, as they are under torchrun.
    loader = ResumableLoader(
        AugmentedData(), sampler=sampler, batch_size=BATCH, num_workers=2, multiprocessing_context="fork"
    )
    state = TrainState(model=model, optimizer=optimizer, scheduler=scheduler, data=loader)
    root, _, ks = save_at.partition(":")
    save_steps = {int(k) for k in ks.split(",") if k}

    step = state.resume_if_requested()
    start, losses = step, {}
    stop = False
    while not stop:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            step += 1
            losses[step] = loss.item().hex()
            stop = state.end_of_step(step) or step == steps
            if step in save_steps:
                state.save(Path(root) / f"k{step}")
            if stop:
                break

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    digest = hashlib.sha256()
    for name in sorted(full):
        digest.update(name.encode() + full[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"start": start, "losses": losses, "params": digest.hexdigest()}))
    if world > 1:
        dist.barrier()


def distributed(rank: int, world: int, modes: list[str], steps: int, out: Path, save_at: str, port: int) -> None:
    """One rank: the program in each of `modes`, one after the other on models of their own, in one process group;
    "{mode}" in `save_at` and in the DETRACE_* variables' values stands for the mode's name, and each mode writes
    into OUT/MODE."""
    import torch.distributed as dist

    from detrace._exit import leave

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    contract = {name: value for name, value in os.environ.items() if name.startswith("DETRACE_")}
    for mode in modes:
        os.environ.update({name: value.replace("{mode}", mode) for name, value in contract.items()})
        train(rank, world, mode, steps, out / mode, save_at.replace("{mode}", mode))
        os.environ.update(contract)
    dist.destroy_process_group()
    leave(0)  # gloo's threads outlive the group: no interpreter finalization to race with


def _main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", required=True, help="single, or ddp and/or fsdp2 (comma-separated: one after the "
                        "other in the same 2 ranks)")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--save-at", default="", help="ROOT:K1,K2 saves a checkpoint into ROOT/kK at step K")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode == "single":
        train(0, 1, "single", args.steps, args.out / "single", args.save_at)
        return 0
    modes = args.mode.split(",")
    if not set(modes) <= {"ddp", "fsdp2"}:
        parser.error(f"--mode: single, or ddp and/or fsdp2, not {args.mode}")
    port = free_port()
    context = multiprocessing.get_context("spawn")
    ranks = [
        context.Process(target=distributed, args=(rank, 2, modes, args.steps, args.out, args.save_at, port))
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join()
    return max(abs(process.exitcode or 0) for process in ranks)


def run(mode: str, steps: int, out: Path, *, save_at: str = "", **env: str) -> dict[str, list[dict]]:
    """Run the training program in a fresh process (its own process group, killed whole on timeout): what each
    mode's ranks wrote, by mode."""
    command = [sys.executable, __file__, "--mode", mode, "--steps", str(steps), "--out", str(out)]
    if save_at:
        command += ["--save-at", save_at]
    environment = {key: value for key, value in os.environ.items() if not key.startswith("DETRACE_")}
    environment.update(env)
    with subprocess.Popen(
        command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    ) as process:
        try:
            output, _ = process.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
    assert process.returncode == 0, output[-3000:]
    world = 1 if mode == "single" else 2
    return {name: [json.loads((out / name / f"rank{rank}.json").read_text()) for rank in range(world)]
            for name in mode.split(",")}


def run_here(steps: int, out: Path, *, save_at: str = "", **env: str) -> list[dict]:
    """Run the training program as one process, in this one, under the contract's variables `env` alone."""
    from _environment import contract_environment

    with contract_environment(env):
        train(0, 1, "single", steps, out, save_at)
    return [json.loads((out / "rank0.json").read_text())]


def assert_same_tail(continuous: list[dict], resumed: list[dict], k: int) -> None:
    for whole, tail in zip(continuous, resumed, strict=True):
        assert tail["start"] == k
        assert tail["losses"] == {step: loss for step, loss in whole["losses"].items() if int(step) > k}
        assert tail["params"] == whole["params"]


if __name__ == "__main__":
    sys.exit(_main())
