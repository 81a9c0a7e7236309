"""`TrainState`: everything a bit-exact resume needs, saved and loaded as one checkpoint.

It also implements the environment contract (`detrace.state.contract`) by which `detrace check-resume`,
`detrace locate` or a job scheduler make an unmodified training script stop, save and resume.

A training loop needs two calls: `start = state.resume_if_requested()` before it, and
`if state.end_of_step(step): break` after each optimizer step.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Iterator, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any

import torch

from detrace import _events
from detrace._compat import unhooked_step
from detrace.defects.arming import arm_from_env
from detrace.errors import CheckpointError, UsageError
from detrace.state import rng
from detrace.state.buckets import pin_layout
from detrace.state.contract import (
    CONTROLS,
    batches_to_skip,
    check_checkpoint_dir,
    checkpoint_dir,
    every_requested,
    refuse_restore_part_without_resume,
    restore_part_requested,
    resume_requested,
    resume_source,
    state_of,
    stop_requested,
)


class TrainState:
    """The model, optimizer, LR scheduler, grad scaler, every RNG, the data position and the step.

    Args:
        model: the module being trained; plain, DDP-wrapped or sharded with FSDP2 (`fully_shard`).
        optimizer: its optimizer, if any.
        scheduler: an LR scheduler (anything with `state_dict`/`load_state_dict`).
        scaler: a `torch.amp.GradScaler`.
        data: the data position: a `ResumableLoader`, `ResumableSampler`, torchdata `StatefulDataLoader`,
            or anything else with `state_dict`/`load_state_dict`. Saved per rank.
        generators: explicit `torch.Generator`s the training draws from (beside the global ones).
        extra: a dict of further per-rank state: objects with `state_dict`/`load_state_dict`, tensors
            (restored in place), or JSON values (replaced in this dict on load).
        elastic: every rank holds the same own state (RNG, data position, extra), and a part of one global model
            and optimizer state, each value by the same name on every rank that holds it: data parallelism whose
            ranks all read the global batch and draw alike (`InvariantDataParallel`, a `ResumableSampler` with
            num_replicas=1), FSDP, tensor-parallel chunks named by global index, pipeline stages, experts. A
            checkpoint then resumes on any mesh (any world size), every rank loading rank 0's own state and the
            names it holds of the global state (DCP reshards the tensors; the optimizer's state is saved by
            parameter name, torch's flattened form); saving checks that the ranks agree.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        data: Any = None,
        generators: Sequence[torch.Generator] = (),
        extra: MutableMapping[str, Any] | None = None,
        elastic: bool = False,
    ) -> None:
        _check_parts(model, optimizer, generators, extra)
        for name, value in (("scheduler", scheduler), ("scaler", scaler), ("data", data)):
            if value is not None and not is_stateful(value):
                hint = ("; wrap the dataset in detrace.state.ResumableLoader (or use torchdata's "
                        "StatefulDataLoader), which keeps the data position" if name == "data" else "")
                raise UsageError(f"TrainState's {name} needs state_dict() and load_state_dict(), which "
                                 f"{type(value).__name__} lacks{hint}")
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.data = data
        self.generators = tuple(generators)
        self.extra = extra if extra is not None else {}
        self.elastic = elastic
        self._step = 0
        self._uncounted = 0
        """Optimizer steps taken since the step count was last set: a save in between would be named after the
        wrong step."""
        if optimizer is not None:
            optimizer.register_step_post_hook(self._count_optimizer_step)
        # A resumed process must reduce gradients in the DDP bucket layout the continuous run uses.
        pin_layout(model)
        give_own_generator(data)
        arm_from_env()  # a contract-following script is guarded (DETRACE_GUARD) without detrace run, as under it
        check_checkpoint_dir()

    @property
    def step(self) -> int:
        """Completed optimizer steps: set by `end_of_step`, `load`, `save(step=...)` or by assigning it."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UsageError(f"TrainState's step must be a number of completed steps (0 or more), not {value!r}")
        self._step = value
        self._uncounted = 0

    def _count_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._uncounted += 1

    def save(self, path: str | os.PathLike[str], *, keep: int = 1, step: int | None = None) -> Path:
        """Write a checkpoint of the current state under `path` (collective); returns the version directory.

        Atomic: until it returns, `path` still designates the previous checkpoint. Keeps the `keep` most
        recent versions. `step`: the number of completed optimizer steps, when `end_of_step` has not counted the
        last one yet; a save after an optimizer step that nothing counted is refused (it would resume one step off).
        """
        from detrace.state import checkpoint  # see _shared: DCP is imported when a checkpoint is written or read

        if step is not None:
            self.step = step
        elif self._uncounted:
            raise UsageError(
                f"this checkpoint would be named after step {self.step}, but the optimizer stepped "
                f"{self._uncounted} more time{'s' if self._uncounted > 1 else ''} since, so a resume from it would "
                f"run that step again: call state.end_of_step(step) before saving (before accelerator.save_state "
                f"too), or give the step, state.save(path, step=step)")

        with _events.checkpoint_io():
            return checkpoint.write(Path(path), step=self.step, shared=self._shared(), local=self._local(),
                                    keep=keep, elastic=self.elastic)

    def load(self, path: str | os.PathLike[str], *, control: str | None = None) -> int:
        """Verify the checkpoint at `path` against its manifest, restore everything, return the step.

        `control` names a negative control (see CONTROLS): a deliberately wrong restore that leaves one part out.
        """
        if control is not None and control not in CONTROLS:
            raise UsageError(f"{control!r} is not a known negative control ({', '.join(CONTROLS)})")
        return self._load(Path(path), control=control)

    def resume_if_requested(self) -> int:
        """Load from DETRACE_RESUME_FROM when it is set, else from DETRACE_CKPT_DIR when DETRACE_RESUME=1;
        the step to continue from (0 otherwise)."""
        resume, control = resume_requested()
        # A bad DETRACE_STOP_AT or DETRACE_CKPT_EVERY is refused now, not after the first step has run.
        if stop_requested() is not None or every_requested() is not None:
            checkpoint_dir()
        source = resume_source()
        if source is not None:
            start = self._load(source, control=control)
        elif resume:
            start = self._load(checkpoint_dir(), control=control)
        else:
            refuse_restore_part_without_resume()
            start = 0
        self._skip_data(start, first=True)
        return start

    def end_of_step(self, step: int) -> bool:
        """Record that optimizer step `step` (counted from 1) completed; at DETRACE_STOP_AT, save and
        return True so that the loop stops. After every DETRACE_CKPT_EVERY-th step, save and go on."""
        self.step = step
        stop = stop_requested()
        every = every_requested()
        periodic = every is not None and step % every == 0
        if step == stop or periodic:
            # Periodic checkpoints keep every version: a later run may resume from any of them (detrace
            # locate resumes its narrow rungs from the last one before a divergence).
            self.save(checkpoint_dir(), keep=sys.maxsize if every is not None else 1)
        if step != stop:
            self._skip_data(step, first=False)
        return step == stop

    def _skip_data(self, step: int, *, first: bool) -> None:
        """Apply the contract's data controls (DETRACE_SKIP_STEPS, DETRACE_DATA_SHIFT) before global step `step`:
        the data object drops the batches they name."""
        count = batches_to_skip(step, first=first)
        if not count:
            return
        skip = getattr(self.data, "skip_batches", None)
        if not callable(skip):
            raise UsageError("DETRACE_SKIP_STEPS and DETRACE_DATA_SHIFT need TrainState's data to skip batches: a "
                             "ResumableLoader, or anything with skip_batches(count)")
        skip(count)

    def _shared(self) -> dict[str, Any]:
        """Model, optimizer, scheduler and scaler state as this rank holds it: replicated (DDP), sharded
        (FSDP2), or this rank's own part of the model (a pipeline stage)."""
        # torch.distributed.checkpoint is imported here, not with this module: its import takes a third of a second
        # even where Dynamo already loaded DTensor (over a second where not), which every process that builds a
        # TrainState and never saves or loads would pay.
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.optimizer is None:
            shared: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        else:
            try:
                with _unobserved_optimizer_steps(self.optimizer):
                    model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=self._options())
            except NotImplementedError as err:  # the flattened form takes tensors, numbers and dicts only
                raise CheckpointError(
                    f"an elastic TrainState keeps the optimizer's state by parameter name (torch's flattened form), "
                    f"which {type(self.optimizer).__name__}'s state does not fit ({err}): save it without elastic=True"
                ) from None
            shared = {"model": model_state, "optimizer": optimizer_state}
        if self.scheduler is not None:
            shared["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            shared["scaler"] = self.scaler.state_dict()
        return shared

    def _options(self) -> Any:
        """The state_dict helpers' options: an elastic state keeps the optimizer's state flattened, each value under
        its parameter's name (`state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`), so that a rank's state is a part of
        the global one whatever parameters it holds; torch's nested form lists each param group's parameters, which
        differ by rank on a tensor-parallel or pipeline mesh."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(flatten_optimizer_state_dict=self.elastic)

    def _local(self) -> dict[str, Any]:
        """This rank's own state."""
        local: dict[str, Any] = {"rng": rng.capture(self.generators)}
        if self.data is not None:
            local["data"] = self.data.state_dict()
        local["extra"] = {
            name: value.state_dict() if is_stateful(value) else value for name, value in self.extra.items()
        }
        return local

    def _load(self, path: Path, *, control: str | None) -> int:
        with _events.checkpoint_io(), _events.restoring():
            return self._restore(path, control=control)

    def _restore(self, path: Path, *, control: str | None) -> int:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict  # see _shared

        from detrace.state import checkpoint

        # The state control is checked before anything loads: a refused load leaves the state as it was.
        part = restore_part_requested()
        if part is not None and part[0] in ("lr", "moments") and self.optimizer is None:
            raise UsageError(f"DETRACE_RESTORE_PART={part[0]} needs an optimizer, and this TrainState has none")
        template = self._shared()
        # The skip-model control keeps the model this process has: a copy, since the read fills the template's
        # tensors (the parameters' own storage, for a plain model) in place.
        kept = {name: value.detach().clone() if isinstance(value, torch.Tensor) else value
                for name, value in template["model"].items()} if control == "skip-model" else None
        loaded = checkpoint.read(path, shared=template, check=self._check_fits, elastic=self.elastic)
        shared, local = loaded.shared, loaded.local
        model_state = kept if kept is not None else shared["model"]
        if self.optimizer is None:
            set_model_state_dict(self.model, model_state)
        else:
            with _unobserved_optimizer_steps(self.optimizer):
                set_state_dict(
                    self.model, self.optimizer,
                    model_state_dict=model_state, optim_state_dict=shared["optimizer"], options=self._options(),
                )
            if control == "skip-optimizer":
                # As a fresh optimizer has it: no per-parameter state, built again at the next step. The param
                # groups (learning rate, weight decay) are still restored: they are the scheduler's to get wrong.
                self.optimizer.state.clear()
        if self.scheduler is not None:
            self.scheduler.load_state_dict(shared["scheduler"])
        if self.scaler is not None:
            self.scaler.load_state_dict(shared["scaler"])
        if part is not None:
            self._restore_part(*part)
        if self.data is not None and control != "skip-data":
            self.data.load_state_dict(local["data"])
        self._load_extra(local["extra"])
        # RNG last: nothing above may draw from a generator after it is restored.
        if control != "skip-rng":
            rng.restore(local["rng"], self.generators)
        self.step = loaded.step
        _events.restored(loaded.step)
        return loaded.step

    def _restore_part(self, part: str, path: Path) -> None:
        """The state control DETRACE_RESTORE_PART: over the state just loaded, `part` (lr, moments, weights) from
        the checkpoint at `path`, the rest kept. The read fills its template in place, so it reads into copies of
        the live tensors, and the part is then set from them as a load sets it."""
        from torch.distributed.checkpoint.state_dict import (
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )
        from torch.distributed.tensor import DTensor

        from detrace.state import checkpoint, tree

        skeleton, tensors = tree.split(self._shared(), "")
        if any(isinstance(tensor, DTensor) for tensor in tensors.values()):
            raise CheckpointError("DETRACE_RESTORE_PART cannot restore one part of a sharded state (DTensors): "
                                  "only a replicated or single-process one")
        copies = tree.join(skeleton, {key: tensor.detach().clone() for key, tensor in tensors.items()})
        other = checkpoint.read(state_of(path), shared=copies, check=self._check_fits, elastic=self.elastic).shared
        if part == "weights":
            set_model_state_dict(self.model, other["model"])
            return
        assert self.optimizer is not None  # _restore checked it
        with _unobserved_optimizer_steps(self.optimizer):
            live = get_optimizer_state_dict(self.model, self.optimizer, options=self._options())
            groups = (other["optimizer"], live) if part == "lr" else (live, other["optimizer"])
            set_optimizer_state_dict(self.model, self.optimizer, _mixed(*groups, elastic=self.elastic),
                                     options=self._options())
        if part == "lr" and self.scheduler is not None:
            self.scheduler.load_state_dict(other["scheduler"])

    def _check_fits(self, directory: Path, shared: Mapping[str, Any], local: Mapping[str, Any]) -> None:
        """Refuse a checkpoint whose parts are not those of this TrainState (before anything is loaded)."""
        parts = ("optimizer", "scheduler", "scaler")
        have = sorted({"model", *(part for part in parts if getattr(self, part) is not None)})
        if sorted(shared) != have:
            saved = ", ".join(sorted(shared))
            raise CheckpointError(f"{directory} holds {saved}; this TrainState has {', '.join(have)}")
        if ("data" in local) != (self.data is not None):
            raise CheckpointError(f"{directory} and this TrainState disagree on whether there is data state")
        if set(local["extra"]) != set(self.extra):
            theirs, mine = sorted(local["extra"]), sorted(self.extra)
            raise CheckpointError(f"{directory} holds extra state {theirs}, this TrainState has {mine}")
        saved_generators = len(local["rng"]["generators"])
        if saved_generators != len(self.generators):
            raise CheckpointError(
                f"{directory} holds {saved_generators} explicit generators, "
                f"this TrainState was given {len(self.generators)}"
            )

    def _load_extra(self, saved: Mapping[str, Any]) -> None:
        for name, value in saved.items():
            current = self.extra[name]
            if is_stateful(current):
                current.load_state_dict(value)
            elif isinstance(current, torch.Tensor):
                with torch.no_grad():
                    current.copy_(value)
            else:
                self.extra[name] = value


def _mixed(groups: dict[str, Any], state: dict[str, Any], *, elastic: bool) -> dict[str, Any]:
    """An optimizer state dict with the param groups (learning rates) of `groups` and the per-parameter state
    (moments) of `state`; flattened (`TrainState._options`) when `elastic`."""
    if not elastic:
        return {"state": state["state"], "param_groups": groups["param_groups"]}
    return {**{key: value for key, value in groups.items() if key.startswith("param_groups.")},
            **{key: value for key, value in state.items() if key.startswith("state.")}}


def _check_parts(model: Any, optimizer: Any, generators: Any, extra: Any) -> None:
    """Refuse, at construction, what the first save would fail on inside torch after the steps before it ran."""
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"TrainState's model must be a torch.nn.Module, not {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(f"TrainState's optimizer must be a torch.optim.Optimizer, not {type(optimizer).__name__}")
    if isinstance(generators, (str, bytes)) or not isinstance(generators, Sequence):
        raise UsageError(f"TrainState's generators must be a sequence of torch.Generator, not "
                         f"{type(generators).__name__}")
    for index, generator in enumerate(generators):
        if not isinstance(generator, torch.Generator):
            raise UsageError(f"TrainState's generators must be torch.Generators, and item {index} is a "
                             f"{type(generator).__name__}")
    if extra is not None and (not isinstance(extra, MutableMapping) or not all(isinstance(key, str) for key in extra)):
        raise UsageError(f"TrainState's extra must be a dict of named state (str keys), not {type(extra).__name__}"
                         if not isinstance(extra, MutableMapping) else "TrainState's extra must have str keys")


def give_own_generator(data: Any) -> None:
    """A DataLoader (torchdata's StatefulDataLoader) without a generator draws each new iterator's base seed from
    the global torch RNG: a resumed process starts its iterator after the RNG states are restored, where the run
    that never stopped drew nothing, and every later draw (dropout) would shift by one. It gets a generator of its
    own, seeded from the process's initial seed (the same in the run that never stopped and in the resumed one)."""
    # type(), not isinstance: accelerate's DataLoader adapter claims the class of the loader it wraps.
    if issubclass(type(data), torch.utils.data.DataLoader) and data.generator is None:
        data.generator = torch.Generator().manual_seed(torch.initial_seed())


def is_stateful(value: Any) -> bool:
    """`value` saves and restores itself (`state_dict` / `load_state_dict`)."""
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


@contextlib.contextmanager
def _unobserved_optimizer_steps(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Within this block, `optimizer.step()` runs without the optimizer step hooks (global and its own).

    Why: torch.distributed.checkpoint.state_dict initialises the state of an optimizer that has not stepped
    yet by calling `optimizer.step()` with zero gradients and a zero learning rate (on load into a fresh
    process, and on a save before the first step). That is no training step, but anything that counts steps
    with the optimizer hooks would count it: detrace's tracer would end its step 0 there and record the
    load's own collectives in step 1 (`detrace check-resume --at 1` then saw a resumed run differ), and an
    LR scheduler's wrapper would take it for the loop's first step. Torch wraps every optimizer class's
    `step` once in the function that runs the hooks (marked `hooked`, the original kept in `__wrapped__`);
    an instance attribute that calls the original shadows the class's (and any instance-level wrapper,
    such as an LR scheduler's) for the duration, and is removed again afterwards. Nothing in the tracer
    needs to know: no hook fires, so no clock moves.
    """
    unhooked = unhooked_step(type(optimizer))
    if unhooked is None:  # a torch that wraps differently: leave step alone rather than guess
        yield
        return
    missing = object()
    own = optimizer.__dict__.get("step", missing)
    # mypy, ignored below: on purpose: an instance attribute shadows the class's step for the block
    optimizer.step = types.MethodType(unhooked, optimizer)  # type: ignore[method-assign]
    try:
        yield
    finally:
        if own is missing:
            del optimizer.__dict__["step"]
        else:
            optimizer.__dict__["step"] = own
