"""detrace.integrations.advice: the integration that a message about a script without the resume contract names,
read from what the script imports."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from detrace.integrations.advice import advice, framework_of


@pytest.mark.parametrize(("source", "framework"), [
    ("import lightning as L\nfrom transformers import AutoModel\n", "lightning"),
    ("import pytorch_lightning as pl\n", "lightning"),
    ("from transformers import Trainer, TrainingArguments\n", "transformers"),
    ("from transformers import Seq2SeqTrainer\nimport accelerate\n", "transformers"),
    ("from accelerate import Accelerator\nfrom transformers import AutoModelForCausalLM\n", "accelerate"),
    ("import torch\n# transformers' Trainer is not used here\n", "plain"),
])
def test_the_framework_is_read_from_the_script_imports(tmp_path: Path, source: str, framework: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(source)
    for cmd in ([sys.executable, str(script)], ["torchrun", "--nproc-per-node", "2", str(script), "--steps", "3"]):
        assert framework_of(cmd) == framework


def test_advice_names_the_one_line_to_add(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("from transformers import Trainer\n")
    assert advice([sys.executable, str(script)]) == "the Trainer callback, detrace.integrations.hf.DetraceCallback"
    # No script to read (python -c): the plain loop's answer.
    assert advice([sys.executable, "-c", "import lightning"]).startswith("detrace.TrainState")
