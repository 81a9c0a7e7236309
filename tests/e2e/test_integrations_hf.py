"""DetraceCallback on a real transformers Trainer (tiny GPT-2 from a config, dropout, a random augmentation in
the dataset): a run with 2 DataLoader workers resumed exactly from its periodic checkpoints (in a fresh process,
and without workers), `detrace ablate` through the callback, a flipped bit refused by tensor name, the tracer fed,
and the contract's errors. A stream with state_dict goes on from its position instead of HF's replay (in process;
an HF `datasets` stream with 2 workers: tests/integration/test_streams.py). HF alone changing the run:
tests/e2e/test_hf_resume.py; `detrace check-resume`'s verdict on a Trainer with the callback, under torchrun:
tests/e2e/test_hf_ddp_resume.py."""

from __future__ import annotations

import functools
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from _integrations import periodic_checkpoints_resume_exactly
from _tools import flip_one_bit, load_script

import detrace
from detrace.cli import main
from detrace.errors import CheckpointCorrupted, CheckpointError, UsageError
from detrace.tracefile import read_rank

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parents[2] / "examples" / "hf_train.py"
AT = 2  # mid-epoch: 6 batches of 4 samples, 2 per optimizer step, so 3 steps per epoch
SPIKE = ("--spike", "4")  # a planted loss spike at step 5, for ablate: every run of the example here has it


@functools.cache
def example() -> ModuleType:
    """examples/hf_train.py as a module, loaded by the first test that needs it: it imports transformers' Trainer
    and GPT-2 (about 3 s), which every pytest worker would otherwise pay at collection."""
    return load_script(SCRIPT)


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str], dict[int, Path], str]:
    """Read-only. What `detrace locate` and `detrace ablate` ask of a script, on the example with 2 DataLoader
    workers: traced (`detrace run`) with DETRACE_CKPT_EVERY=2, it keeps HF's checkpoint-2, -4 and -6 and trains to its
    end; resumed from checkpoint-2 in a fresh process (DETRACE_RESUME_FROM), it ends with that run's bits. The
    traced run, its command, the checkpoints by step, and the continuous run's final parameters."""
    tmp_path = tmp_path_factory.mktemp("periodic")
    versions, continuous = periodic_checkpoints_resume_exactly(SCRIPT, tmp_path, workers=2,
                                                               traced=tmp_path / "original", extra=SPIKE)
    assert versions[4].name == "checkpoint-4"
    command = [sys.executable, str(SCRIPT), "--workers", "2", *SPIKE]
    return tmp_path / "original", command, versions, continuous


def test_the_callback_resumes_exactly_from_any_periodic_checkpoint(
        original: tuple[Path, list[str], dict[int, Path], str]) -> None:
    # DETRACE_CKPT_EVERY and DETRACE_RESUME_FROM: the callback keeps HF's checkpoint-N of every K-th step, and a run
    # resumed from one, with the workers' augmentation, ends with the continuous run's bits (checked in the
    # fixture); `detrace locate` finds them in the traced run and starts its narrow runs from one of them.
    run, _, versions, _ = original
    assert (run / "run.json").is_file() and all((path / "detrace").is_dir() for path in versions.values())


def test_resume_without_workers_is_exact_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             original: tuple[Path, list[str], dict[int, Path], str]) -> None:
    # Each sample's augmentation has its own seed: resumed with 0 workers (in this process) from the checkpoint of
    # the run with 2, the run ends with the bits of the continuous 2-worker run.
    _, _, versions, continuous = original
    monkeypatch.setenv("DETRACE_RESUME_FROM", str(versions[AT]))
    trainer = _trainer(tmp_path, steps=6, spike=4)
    trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    assert example().parameters_digest(trainer) == continuous


def test_ablate_runs_the_baseline_and_a_variant_through_the_callback(
        tmp_path: Path, original: tuple[Path, list[str], dict[int, Path], str],
        capsys: pytest.CaptureFixture[str]) -> None:
    """`detrace ablate` on the traced periodic run, at its planted spike: the baseline replays it from checkpoint-4
    bit for bit through step 5 and spikes there, and a data shift of one step (the callback skips one step's
    samples) changes the run from step 4 on."""
    run, command, _, _ = original
    capsys.readouterr()
    code = main(["ablate", "--step", "5", "--run", str(run), "--k", "1", "--trail", "5", "--after", "0",
                 "--no-builtins", "--variant", "shifted=ENV:DETRACE_DATA_SHIFT=1", "--out", str(tmp_path / "ablate"),
                 "--json", "--", *command])
    result = json.loads(capsys.readouterr().out)
    assert code == 1 and result["checkpoint"] == 4, result
    assert result["baseline"]["value"] == result["original"] and result["baseline"]["spiked"]
    (variant,) = result["variants"]
    assert variant["name"] == "shifted" and variant["value"] != result["baseline"]["value"], variant
    assert variant["departure"]["step"] == 4  # the batch the callback skipped changes the step it resumes at


def test_a_data_shift_past_the_end_of_the_epoch_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, original: tuple[Path, list[str], dict[int, Path], str]
) -> None:
    # Resumed after step 2 of an epoch of 3, a shift of one step leaves the epoch no batch: the Trainer would stop
    # there, short of the steps a variant must run. Refused before any step.
    monkeypatch.setenv("DETRACE_RESUME_FROM", str(original[2][AT]))
    monkeypatch.setenv("DETRACE_DATA_SHIFT", "1")
    trainer = _trainer(tmp_path)
    with pytest.raises(UsageError, match=r"^the resume contract's data controls skip 8 samples from step 2, past the "
                                         r"end of its epoch \(8 samples left\), where the transformers Trainer would "
                                         r"stop training: resume from a checkpoint earlier in the epoch, or skip fewer "
                                         r"steps$"):
        trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)


def _trainer(tmp_path: Path, *, plain: bool = False, steps: int = 4, spike: int | None = None) -> Any:
    torch.set_num_threads(1)
    return example().make_trainer(steps=steps, workers=0, plain=plain, output_dir=str(tmp_path / "out"), spike=spike)


def test_a_flipped_bit_is_refused_naming_the_tensor(tmp_path: Path,
                                                    original: tuple[Path, list[str], dict[int, Path], str]) -> None:
    checkpoint = tmp_path / "checkpoint-2"
    shutil.copytree(original[2][AT], checkpoint)
    trainer = _trainer(tmp_path)
    weight = trainer.model.transformer.h[0].mlp.c_fc.weight
    from safetensors.torch import load_file

    saved = load_file(checkpoint / "model.safetensors")["transformer.h.0.mlp.c_fc.weight"]
    flip_one_bit(next((checkpoint / "detrace").glob("step-*")), saved)
    before = weight.detach().clone()
    with pytest.raises(CheckpointCorrupted, match=r"tensor 'model\.transformer\.h\.0\.mlp\.c_fc\.weight' does not "
                                                  "match its fingerprint"):
        trainer.args.resume_from_checkpoint = str(checkpoint)  # HF's idiom, which tells the callback where
        trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    # HF had loaded its own copy of the weights; detrace's state was refused before it touched anything.
    assert torch.equal(weight.detach(), saved) and not torch.equal(weight.detach(), before)


def test_the_tracer_gets_global_steps_and_hf_metrics(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, steps=3)
    with detrace.trace(tmp_path / "trace"):
        trainer.train()
    records = read_rank(tmp_path / "trace", 0).table.to_pylist()
    logged = {(entry["step"], name): entry[name] for entry in trainer.state.log_history
              for name in ("loss", "grad_norm", "learning_rate") if name in entry}
    traced = {(r["step"] + 1, r["name"].removeprefix("hf/")): r["value"] for r in records
              if r["name"].startswith("hf/")}
    # HF logs its step N (N optimizer steps done) after the optimizer step: the trailing work of global step N-1.
    assert traced == logged and {step for step, _ in traced} == {1, 2, 3}


def test_contract_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DETRACE_CKPT_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("DETRACE_RESUME", "1")
    with pytest.raises(CheckpointError, match="holds no HF checkpoint-N"):
        _trainer(tmp_path)
    monkeypatch.setenv("DETRACE_RESUME", "yes")
    with pytest.raises(UsageError, match="DETRACE_RESUME must be 1 or 0"):
        _trainer(tmp_path)
    monkeypatch.delenv("DETRACE_RESUME")
    monkeypatch.setenv("DETRACE_STOP_AT", "ten")
    with pytest.raises(UsageError, match="DETRACE_STOP_AT must be a step number"):
        _trainer(tmp_path)
    monkeypatch.delenv("DETRACE_STOP_AT")
    monkeypatch.setenv("DETRACE_CKPT_EVERY", "0")
    with pytest.raises(UsageError, match="DETRACE_CKPT_EVERY must be a step number of at least 1"):
        _trainer(tmp_path)
    monkeypatch.delenv("DETRACE_CKPT_EVERY")
    monkeypatch.setenv("DETRACE_RESUME_FROM", str(tmp_path / "empty"))
    with pytest.raises(CheckpointError, match="is neither an HF checkpoint-N nor a directory that holds one"):
        _trainer(tmp_path)


def test_restore_part_in_a_run_that_does_not_resume_is_refused(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The callback ignored DETRACE_RESTORE_PART without a word when the Trainer started from step 0: the run trained
    on with none of the part it asked for. It is refused as TrainState's loop refuses it, before the first step."""
    monkeypatch.setenv("DETRACE_RESTORE_PART", f"weights:{tmp_path}")
    trainer = _trainer(tmp_path, steps=1)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(UsageError, match=r"^DETRACE_RESTORE_PART=weights:.* takes a part of the state from a "
                                         r"checkpoint when the run resumes, and this run does not \(DETRACE_RESUME "
                                         r"is not 1 and DETRACE_RESUME_FROM is not set\)$"):
        trainer.train()
    assert all(torch.equal(p.detach(), b) for p, b in zip(trainer.model.parameters(), before, strict=True))


def test_resume_needs_detrace_state_and_the_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A checkpoint HF wrote alone has no detrace state: resuming it with the callback is refused.
    monkeypatch.setenv("DETRACE_CKPT_DIR", str(tmp_path / "ckpt"))
    monkeypatch.setenv("DETRACE_STOP_AT", "1")
    _trainer(tmp_path, plain=True).train()
    monkeypatch.delenv("DETRACE_STOP_AT")
    with pytest.raises(CheckpointError, match=r"no detrace state in .*: was the checkpoint written with Detrace"):
        _trainer(tmp_path).train(resume_from_checkpoint=str(tmp_path / "ckpt" / "checkpoint-1"))
    # DETRACE_RESUME=1 names the checkpoint in args.resume_from_checkpoint; a script must hand it to train().
    monkeypatch.setenv("DETRACE_RESUME", "1")
    with pytest.raises(UsageError, match=r"pass the checkpoint on, as in trainer\.train\(resume_from_checkpoint="):
        _trainer(tmp_path).train()


def test_an_iterable_dataset_trains_with_one_warning(tmp_path: Path) -> None:
    """The callback never breaks a run it cannot make exact: a torch IterableDataset is left alone, with one warning,
    and the continuous run trains to its last step."""
    from transformers import Trainer

    from detrace.integrations._seeding import _warn_unindexed
    from detrace.integrations.hf import DetraceCallback

    _warn_unindexed.cache_clear()  # once per process: whichever test ran before

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            while True:
                tokens = torch.randint(0, example().VOCAB, (example().LENGTH,))
                yield {"input_ids": tokens, "labels": tokens}

    trainer = _trainer(tmp_path, steps=2)
    streaming = Trainer(model=trainer.model, args=trainer.args, train_dataset=Stream(),
                        callbacks=[DetraceCallback()])
    with pytest.warns(RuntimeWarning, match="leaves this IterableDataset's data alone") as warned:
        streaming.train()
    assert streaming.state.global_step == 2
    (message,) = [str(warning.message) for warning in warned if "IterableDataset" in str(warning.message)]
    assert message.endswith("; a stream with state_dict() and load_state_dict() (such as HF datasets' "
                            "IterableDataset) resumes where it stopped, with torchdata installed")


def test_importing_the_integration_registers_the_detrace_experts() -> None:
    from transformers.integrations.moe import ExpertsInterface

    import detrace.integrations.hf  # noqa: F401  (the import registers them)

    assert "detrace" in ExpertsInterface().valid_keys()


def test_a_masked_lm_collator_resumes_exactly_with_0_and_2_workers(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """DataCollatorForLanguageModeling draws its masks from the RNG of the process that collates: the callback seeds
    each batch's collate_fn from its samples' seeds, so a run stopped after step 2 and resumed (with 2 workers, or
    with none) ends with the bits of the continuous 2-worker run."""
    from tokenizers import Tokenizer, models
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        DataCollatorForLanguageModeling,
        PreTrainedTokenizerFast,
        Trainer,
        TrainingArguments,
    )

    from detrace.integrations.hf import DetraceCallback

    words = {"[PAD]": 0, "[UNK]": 1, "[MASK]": 2, **{f"w{i}": i + 3 for i in range(29)}}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="[UNK]")),
                                        pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]")
    texts = torch.randint(3, len(words), (24, 8), generator=torch.Generator().manual_seed(1))

    class Texts(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(texts)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            return {"input_ids": texts[index]}

    def final_parameters(workers: int, **contract: str) -> list[torch.Tensor]:
        for name in ("DETRACE_CKPT_DIR", "DETRACE_STOP_AT", "DETRACE_RESUME"):
            monkeypatch.delenv(name, raising=False)
        for name, value in contract.items():
            monkeypatch.setenv(name, value)
        torch.manual_seed(0)
        model = BertForMaskedLM(BertConfig(vocab_size=len(words), hidden_size=16, num_hidden_layers=1,
                                           num_attention_heads=2, intermediate_size=32, max_position_embeddings=8))
        args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, per_device_train_batch_size=4,
                                 learning_rate=1e-2, save_strategy="no", dataloader_num_workers=workers,
                                 report_to="none", disable_tqdm=True, seed=0, use_cpu=True)
        trainer = Trainer(model=model, args=args, train_dataset=Texts(), callbacks=[DetraceCallback()],
                          data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3))
        trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
        return [value.clone() for value in trainer.model.state_dict().values()]

    torch.set_num_threads(1)
    continuous = final_parameters(2)
    ckpt = str(tmp_path / "ckpt")
    final_parameters(2, DETRACE_CKPT_DIR=ckpt, DETRACE_STOP_AT="2")
    for workers in (2, 0):
        resumed = final_parameters(workers, DETRACE_CKPT_DIR=ckpt, DETRACE_RESUME="1")
        assert all(torch.equal(a, b) for a, b in zip(resumed, continuous, strict=True)), f"{workers} workers"


def test_a_resumed_stream_goes_on_from_its_position_without_replaying(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """HF alone fast-forwards a resumed stream by reading it again from its start; a stream with state_dict is read
    from where the checkpoint says it was (the rows after the 16 that steps 0 and 1 trained on), and the run ends
    with the continuous run's parameters."""
    from transformers import Trainer

    from detrace.integrations.hf import DetraceCallback

    rows = example().NoisyTokens(48).tokens

    class Rows(torch.utils.data.IterableDataset):
        def __init__(self) -> None:
            self.next = 0
            self.read: list[int] = []

        def __iter__(self):  # type: ignore[no-untyped-def]
            while self.next < len(rows):
                self.read.append(self.next)
                self.next += 1
                yield {"input_ids": rows[self.read[-1]], "labels": rows[self.read[-1]]}

        def state_dict(self) -> dict[str, int]:
            return {"next": self.next}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.next = state["next"]

    def run(**contract: str) -> tuple[str, list[int]]:
        for name in ("DETRACE_CKPT_DIR", "DETRACE_STOP_AT", "DETRACE_RESUME"):
            monkeypatch.delenv(name, raising=False)
        for name, value in contract.items():
            monkeypatch.setenv(name, value)
        base = _trainer(tmp_path)
        stream = Rows()
        trainer = Trainer(model=base.model, args=base.args, train_dataset=stream, callbacks=[DetraceCallback()])
        trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
        return example().parameters_digest(trainer), stream.read

    continuous, _ = run()
    ckpt = str(tmp_path / "ckpt")
    run(DETRACE_CKPT_DIR=ckpt, DETRACE_STOP_AT="2")
    resumed, read = run(DETRACE_CKPT_DIR=ckpt, DETRACE_RESUME="1")
    assert read[0] == 16 and resumed == continuous


def test_hfs_own_resume_of_the_example_after_step_4_changes_the_run(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """What examples/hf_train.py and the README say of the example without the callback (`--plain`: HF's own
    checkpoint and resume under the same contract): stopped after step 4, mid-epoch, and resumed, it ends with
    other parameters than the uninterrupted run, so `check-resume --at 4` cannot say `exact`."""
    torch.set_num_threads(1)  # as the example's main() runs (the conftest restores the count)

    def final(**contract: str) -> str:
        for name in ("DETRACE_CKPT_DIR", "DETRACE_STOP_AT", "DETRACE_RESUME"):
            monkeypatch.delenv(name, raising=False)
        for name, value in contract.items():
            monkeypatch.setenv(name, value)
        trainer = example().make_trainer(steps=6, workers=0, plain=True, output_dir=str(tmp_path / "scratch"))
        trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
        return str(example().parameters_digest(trainer))

    continuous = final()
    checkpoints = str(tmp_path / "checkpoints")
    final(DETRACE_CKPT_DIR=checkpoints, DETRACE_STOP_AT="4")
    assert final(DETRACE_CKPT_DIR=checkpoints, DETRACE_RESUME="1") != continuous
