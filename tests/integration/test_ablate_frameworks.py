"""`detrace ablate` with its defaults on the transformers and Lightning examples with one poisoned example
(`--poison 47`, a target 1000 times off, trained at step 6 of a 12-step epoch), in process: the launcher runs the
example's Trainer in this process, traced at the semantic rung under the variant's environment, instead of a child
process (the same callback, sampler, tracer and decision logic; `detrace ablate`'s real processes on these
examples are quoted in docs/ablate.md). The verdict names the sample: dataset index 47."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from unittest import mock

import pytest
import torch
from _tools import load_script

import detrace
from detrace.errors import CommandFailed, DetraceError
from detrace.investigate.ablate import AblateConfig, ablate

EXAMPLES = Path(__file__).parents[2] / "examples"
POISON, S = 47, 6  # the seeded order of epoch 0 trains dataset index 47 at step 6 (8 samples a step)


def hf(example: ModuleType, out: Path) -> None:
    trainer = example.make_trainer(steps=9, workers=0, plain=False, output_dir=str(out / "hf"), samples=96,
                                   poison=POISON)
    trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)


def lightning(example: ModuleType, out: Path) -> None:
    example.fit(steps=9, samples=96, poison=POISON)


@pytest.mark.parametrize(("script", "train"), [("hf_train.py", hf), ("lightning_train.py", lightning)])
def test_ablate_with_its_defaults_names_the_poisoned_example(
        tmp_path: Path, script: str, train: Callable[[ModuleType, Path], None]) -> None:
    torch.set_num_threads(1)
    example = load_script(EXAMPLES / script)

    def launch(cmd: Sequence[str], out: Path, env: Mapping[str, str]) -> float:
        try:
            with mock.patch.dict(os.environ, env), detrace.trace(out, rung="semantic"):
                train(example, tmp_path)
        except DetraceError as err:  # as the real launcher reports a program that exits on it
            raise CommandFailed(f"CMD exited with status 2 in {out.name}; the end of its output: {err}") from None
        return 0.0

    checkpoints = tmp_path / "ck"
    with mock.patch.dict(os.environ, {"DETRACE_CKPT_DIR": str(checkpoints), "DETRACE_CKPT_EVERY": "4"}), \
            detrace.trace(tmp_path / "original"):
        train(example, tmp_path)
    config = AblateConfig(command=("python", script), run=tmp_path / "original", step=S, out=tmp_path / "ablate",
                          checkpoints=checkpoints)
    result = ablate(config, launch)

    assert (result.verdict, result.cause, result.checkpoint) == ("isolated", "data", 4), result.summary
    by_name = {o.variant.name: o for o in result.outcomes}
    # The callbacks skip batches only where a run starts: state-only (skip step 6 alone, from checkpoint 4) cannot
    # run, says why, and the verdict comes from skip-batches (4-6, from C) and data-from-earlier (a fresh start).
    assert "skips batches only from the step the run starts at (4)" in str(by_name["state-only"].unavailable)
    assert not by_name["skip-batches"].spiked and by_name["data-from-earlier"].spiked
    assert result.samples is not None and result.samples.culprit == POISON, result.summary
    assert POISON in result.samples.indices and len(result.samples.indices) == 8
    assert 3 <= len(result.samples.replays) <= 4  # log2(8) halvings, and the culprit confirmed alone
    assert f"the sample is dataset index {POISON}, sample " in result.summary
