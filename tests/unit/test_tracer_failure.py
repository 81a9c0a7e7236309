"""Whose failure a crash was (detrace.launch.failure): a traceback that ends in detrace's own code is detrace's,
one that only passes through detrace's wrappers on its way into torch is the program's."""

from __future__ import annotations

import importlib.util
import sysconfig
from pathlib import Path

import pytest

import detrace
from detrace.launch.failure import refusal, tracebacks, tracer_failure

DETRACE = Path(detrace.__file__).resolve().parent
_spec = importlib.util.find_spec("torch")
assert _spec is not None and _spec.submodule_search_locations
TORCH = Path(next(iter(_spec.submodule_search_locations)))


def _frame(path: Path | str, line: int, function: str, source: str) -> str:
    return f'  File "{path}", line {line}, in {function}\n    {source}\n'


USER = _frame("/home/me/train.py", 9, "<module>", "loss.backward()")
INTO_TORCH = _frame(TORCH / "_tensor.py", 623, "backward", "torch.autograd.backward(")
WRAPPER = (_frame(DETRACE / "record" / "opaque.py", 58, "__call__", "return self.call(*args, **kwargs)")
           + _frame(DETRACE / "record" / "rungs" / "metrics.py", 70, "backward",
                    "return original_backward(tensors, grad_tensors, *args, **kwargs)"))
IN_TORCH = _frame(TORCH / "autograd" / "__init__.py", 364, "backward", "_engine_run_backward(")
RECORDING = (_frame(DETRACE / "record" / "session.py", 315, "flush", "batch = to_batch(records)")
             + _frame(DETRACE / "record" / "records.py", 89, "to_batch", 'exact = torch.stack([...])'))
HEAD = "Traceback (most recent call last):\n"


def test_an_exception_raised_in_detraces_recording_code_is_detraces() -> None:
    output = HEAD + USER + INTO_TORCH + WRAPPER + RECORDING + "NotImplementedError: Cannot copy out of meta tensor\n"
    said = tracer_failure(output)
    assert said is not None and said.startswith(
        "detrace failed, not CMD: NotImplementedError: Cannot copy out of meta tensor was raised in detrace's own "
        "code (detrace/record/records.py, line 89, in to_batch)")


def test_through_torch_under_detraces_dispatch_mode_it_is_still_detraces() -> None:
    """The op rung's mode runs torch's op for detrace's own copy: the frame that decides is the recording one."""
    dispatch = _frame(DETRACE / "record" / "rungs" / "op.py", 133, "__torch_dispatch__", "return func(*args, **kwargs)")
    output = HEAD + USER + RECORDING + dispatch + _frame(TORCH / "_ops.py", 875, "__call__", "return self._op()") \
        + "NotImplementedError: Cannot copy out of meta tensor\n"
    assert "detrace/record/records.py, line 89" in (tracer_failure(output) or "")


@pytest.mark.parametrize("output", [
    HEAD + USER + INTO_TORCH + WRAPPER + IN_TORCH + "RuntimeError: Trying to backward through the graph a second time",
    HEAD + USER + "ValueError: the user's own bug\n",
    "no traceback at all\n",
    HEAD + _frame(TORCH / "distributed" / "run.py", 10, "main", "run(args)") + "ChildFailedError: train.py FAILED\n",
])
def test_the_programs_own_failures_are_not_detraces(output: str) -> None:
    assert tracer_failure(output) is None


def test_torchruns_own_traceback_after_a_worker_is_passed_over() -> None:
    worker = HEAD + USER + RECORDING + "RuntimeError: boom\n"
    launcher = HEAD + _frame(TORCH / "distributed" / "run.py", 10, "main", "run(args)") + "ChildFailedError: x\n"
    assert "detrace failed, not CMD: RuntimeError: boom" in (tracer_failure(worker + launcher) or "")


def test_a_tail_that_begins_inside_a_traceback_still_counts() -> None:
    cut = (HEAD + USER + INTO_TORCH + WRAPPER + RECORDING)[40:] + "RuntimeError: boom\n"
    [(frames, error)] = tracebacks(cut)
    assert error == "RuntimeError: boom" and frames[-1].function == "to_batch"
    assert tracer_failure(cut) is not None


def test_a_refusal_detrace_raises_on_purpose_is_not_called_its_bug() -> None:
    """DETRACE_CKPT_EVERY=0 or a DETRACE_RESTORE_PART in a run that does not resume is refused by the contract's
    UsageError, raised in detrace's code on purpose: "detrace failed ... a bug of detrace's" sent the user to report
    their own input."""
    contract = _frame(DETRACE / "state" / "train_state.py", 165, "resume_if_requested", "raise UsageError(")
    output = HEAD + USER + contract + "detrace.errors.UsageError: DETRACE_CKPT_EVERY must be a step number\n"
    assert tracer_failure(output) is None
    assert tracer_failure(HEAD + USER + RECORDING + "detrace.errors_x.Boom: no\n") is not None


def test_a_refusal_is_read_from_the_last_traceback_that_decides() -> None:
    """`detrace run` says a refusal ended CMD (not "nothing was recorded... the tracer starts in each process")."""
    contract = _frame(DETRACE / "state" / "contract.py", 173, "_step_variable", "raise UsageError(")
    refused = HEAD + USER + contract + "detrace.errors.UsageError: DETRACE_CKPT_EVERY must be a step number\n"
    assert refusal(refused) == "DETRACE_CKPT_EVERY must be a step number"
    launcher = HEAD + _frame(TORCH / "distributed" / "run.py", 10, "main", "run(args)") + "ChildFailedError: x\n"
    assert refusal(refused + launcher) == "DETRACE_CKPT_EVERY must be a step number"  # torchrun's passed over
    # torchrun's traceback as it prints it starts in its console script (venv/bin/torchrun): passed over too
    script = _frame(Path(sysconfig.get_paths()["scripts"]) / "torchrun", 8, "<module>", "sys.exit(main())")
    console = HEAD + script + launcher.removeprefix(HEAD)
    assert refusal(refused + console) == "DETRACE_CKPT_EVERY must be a step number"
    assert "RuntimeError: boom" in (tracer_failure(HEAD + USER + RECORDING + "RuntimeError: boom\n" + console) or "")
    # A later traceback of the program's own, or detrace's failure, is what ended CMD: no refusal.
    assert refusal(refused + HEAD + USER + "ValueError: the user's own bug\n") is None
    assert refusal(HEAD + USER + RECORDING + "RuntimeError: boom\n") is None
    assert refusal("no traceback at all\n") is None
