"""Fault injection, a test and demo tool: flip one bit of a parameter, a gradient or an activation.

    DETRACE_FAULT="bitflip:step=S,rank=R,tensor=NAME,bit=B[,index=I][,repeat]"

It is inert unless `DETRACE_FAULT` is set. It exists to show what detrace's defect detection catches (the
replica guard, `detrace recheck`, `detrace locate`); it never runs in a real job.

- `tensor=NAME`: a parameter's qualified name (`layers.0.attn.qkv.weight`, DDP's and torch.compile's prefixes
  looked through) flips the parameter as optimizer step S begins, so the update of step S starts from the flipped
  value; `NAME.grad` flips its gradient at the same moment; `MODULE.output` flips the first tensor that module's
  forward returns in step S (`output` alone: that of the first outermost module call of step S, a forward not
  nested in another module's forward).
- `bit=B` is the bit of the element's pattern (0 = least significant) and `index=I` the flat element
  (default 0): one element, one bit.
- Without `repeat`, the fault is transient: it strikes once, on rank R, at step S, in the first execution of that
  step. A re-execution of the step (`detrace recheck` sets DETRACE_REEXEC=1) does not meet it again, as a cosmic-ray
  flip does not recur.
- With `repeat`, the fault is persistent and belongs to hardware, not to a rank: it strikes at every step from S
  on, in whichever process runs on device R. A process's device is its CUDA device index on a GPU; on a CPU it
  is `DETRACE_DEVICE_ID` when set, else the rank plus `DETRACE_DEVICE_SHIFT` (0 by default). So re-executing
  rank R's step on another device (recheck shifts the devices) does not carry the fault along.

A fault that can never strike is said on stderr, once, as soon as the process can tell: at its first optimizer
step for a tensor no optimizer holds (or a module that does not exist) and for a rank outside the job; at its exit
for a step past the last one it ran.

Steps are global steps: a process resumed from a checkpoint counts on from the optimizer's restored step count
(`state["step"]` of Adam, AdamW, SGD with momentum...), or from `DETRACE_STEP_OFFSET` for optimizers without one.
"""

from __future__ import annotations

import atexit
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from detrace._numbers import parse_count
from detrace.errors import UsageError

ENV_FAULT = "DETRACE_FAULT"
ENV_REEXEC = "DETRACE_REEXEC"
ENV_DEVICE_ID = "DETRACE_DEVICE_ID"
ENV_DEVICE_SHIFT = "DETRACE_DEVICE_SHIFT"
ENV_STEP_OFFSET = "DETRACE_STEP_OFFSET"

_KEYS = ("step", "rank", "tensor", "bit", "index", "repeat")
_INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MAX_BITS = 8 * max(_INT_VIEWS)


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """One injected bit flip, parsed from `DETRACE_FAULT`."""

    step: int
    """The global step (0-based) at which it strikes (and from which on, with `repeat`)."""
    rank: int
    """The rank it strikes (transient), or the device it lives on (`repeat`)."""
    tensor: str
    """A parameter name, `NAME.grad`, or `MODULE.output` (see the module docstring)."""
    bit: int
    """The bit of the element's pattern, 0 being the least significant."""
    index: int = 0
    """The flat index of the element."""
    repeat: bool = False
    """Persistent (every step from `step` on, on device `rank`) instead of once."""

    def __post_init__(self) -> None:
        if min(self.step, self.rank, self.bit, self.index) < 0:
            raise UsageError(f"{ENV_FAULT}: step, rank, bit and index must be non-negative")
        if self.bit >= _MAX_BITS:
            raise UsageError(f"{ENV_FAULT}: bit {self.bit} is outside every element (the widest has {_MAX_BITS} bits, "
                             f"0-{_MAX_BITS - 1})")
        if not self.tensor:
            raise UsageError(f"{ENV_FAULT} needs tensor=NAME (a parameter, NAME.grad or MODULE.output)")

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        kind, sep, rest = text.partition(":")
        if kind.strip() != "bitflip" or not sep:
            raise UsageError(f"{ENV_FAULT}={text!r} is not a fault: expected "
                             "bitflip:step=S,rank=R,tensor=NAME,bit=B[,index=I][,repeat]")
        values: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in rest.split(","))):
            key, has_value, value = item.partition("=")
            if key not in _KEYS:
                raise UsageError(f"{ENV_FAULT}: unknown key {key!r}; the keys are {', '.join(_KEYS)}")
            if key == "repeat":
                if has_value:
                    raise UsageError(f"{ENV_FAULT}: repeat takes no value")
                values["repeat"] = True
            elif key == "tensor":
                values[key] = value.strip()
            elif (number := parse_count(value)) is not None:
                values[key] = number
            else:
                raise UsageError(f"{ENV_FAULT}: {key} must be a non-negative integer, not {value!r}")
        missing = [key for key in ("step", "rank", "tensor", "bit") if key not in values]
        if missing:
            raise UsageError(f"{ENV_FAULT}={text!r} lacks {', '.join(missing)}")
        return cls(**values)


def process_rank() -> int:
    """This process's rank: the default group's once it exists, else torchrun's RANK, else 0."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0") or 0)


def device_id() -> int:
    """The (simulated on CPU) physical device this process runs on; see the module docstring."""
    explicit = os.environ.get(ENV_DEVICE_ID)
    if explicit is not None:
        return int(explicit)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return process_rank() + int(os.environ.get(ENV_DEVICE_SHIFT, "0") or 0)


def global_step(optimizer: torch.optim.Optimizer, completed: int) -> int:
    """The 0-based global step of the optimizer step now running, `completed` steps having run in this process
    before it. An optimizer that counts its steps per parameter (Adam, AdamW, SGD with momentum after its first
    step...) knows it across restarts; otherwise DETRACE_STEP_OFFSET (0) is added to the process's own count."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if step is not None:
                return int(step)  # read before the update: the number of steps already taken
    return int(os.environ.get(ENV_STEP_OFFSET, "0") or 0) + completed


def named_tensors() -> tuple[dict[int, str], dict[str, nn.Module]]:
    """id(parameter) -> qualified name, and qualified name -> module, over every live root module."""
    from detrace.record.names import named_modules, parameter_names, roots

    modules = {name: module for root in roots() for name, module in named_modules(root)}
    return parameter_names(), modules


def flip_bit(tensor: torch.Tensor, *, index: int, bit: int) -> None:
    """Flip bit `bit` of element `index` of `tensor`, in place (the local shard of a DTensor)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    data = local.detach().view(-1)
    if index >= data.numel():
        raise UsageError(f"{ENV_FAULT}: index {index} is outside a tensor of {data.numel()} elements")
    words = data.view(_INT_VIEWS[data.element_size()])
    if bit >= 8 * data.element_size():
        raise UsageError(f"{ENV_FAULT}: bit {bit} is outside a {data.element_size()}-byte element")
    with torch.no_grad():
        value = int(words[index].item())
        flipped = value ^ (1 << bit)
        width = 8 * data.element_size()
        if flipped >= 1 << (width - 1) and words.dtype != torch.uint8:  # back to the signed range of the view
            flipped -= 1 << width
        words[index] = flipped


class FaultInjector:
    """Applies one `FaultSpec` through global optimizer and module hooks."""

    def __init__(self, spec: FaultSpec) -> None:
        self.spec = spec
        self.completed = 0
        """Optimizer steps completed in this process."""
        self.step: int | None = None
        """The global step running now (known from its optimizer step's start)."""
        self.upcoming: int | None = None
        """The global step the next forward belongs to (known once an optimizer step has ended)."""
        self.struck: list[int] = []
        """Global steps at which the fault struck in this process."""
        self._undo: list[Callable[[], None]] = []
        self._module: weakref.ref[nn.Module] | None = None
        """The activation's module, found once (a scan of every live module)."""
        self._depth = 0
        """Module forwards running now (`output` alone: a forward that ends at depth 0 is an outermost call)."""
        self._checked = False
        """Whether the first optimizer step checked that the fault can strike at all."""
        self._misfit = False
        """Whether the flip did not fit its tensor (a bit past its elements, an index past its end): said once."""

    @property
    def activation(self) -> str | None:
        """The qualified name of the module whose output the fault flips ("" for the outermost), or None."""
        if self.spec.tensor == "output":
            return ""
        target, _, attribute = self.spec.tensor.rpartition(".")
        return target if attribute == "output" else None

    def install(self) -> None:
        self._undo = [register_optimizer_step_pre_hook(self._pre).remove,
                      register_optimizer_step_post_hook(self._post).remove]
        if self.activation == "":
            # "the outermost module" is a call, not a module: a process holds many root modules (a model, its
            # loss, an EMA copy, the modules of earlier models not yet collected), so count nesting instead
            self._undo += [nn.modules.module.register_module_forward_pre_hook(self._enter).remove,
                           nn.modules.module.register_module_forward_hook(self._leave, always_call=True).remove]
        elif self.activation is not None:  # a global forward hook only when an activation is the target
            self._undo.append(nn.modules.module.register_module_forward_hook(self._forward).remove)

    def remove(self) -> None:
        for undo in self._undo:
            undo()
        self._undo = []

    def _strikes(self, step: int) -> bool:
        spec = self.spec
        if spec.repeat:
            return step >= spec.step and device_id() == spec.rank
        return (step == spec.step and process_rank() == spec.rank and os.environ.get(ENV_REEXEC) != "1"
                and step not in self.struck)

    def _never(self, why: str) -> None:
        print(f"detrace: {ENV_FAULT} {why}: it can never strike", file=sys.stderr)

    def _check_once(self, optimizer: torch.optim.Optimizer) -> None:
        """At the first optimizer step, when the model and the job are known: can the fault strike at all?"""
        self._checked = True
        spec = self.spec
        world = (torch.distributed.get_world_size() if torch.distributed.is_available()
                 and torch.distributed.is_initialized() else int(os.environ.get("WORLD_SIZE", "1") or 1))
        if not spec.repeat and spec.rank >= world:
            self._never(f"strikes rank {spec.rank}, and the job has {world} rank{'s' * (world != 1)}")
        names, modules = named_tensors()
        if self.activation:
            if self.activation not in modules:
                self._never(f"flips the output of module {self.activation}, which this program does not hold")
        elif self.activation is None:
            held = {names.get(id(p)) for group in optimizer.param_groups for p in group["params"]}
            if spec.tensor not in held and spec.tensor.removesuffix(".grad") not in held:
                self._never(f"names tensor {spec.tensor}, which is no parameter of the optimizer")

    def report_at_exit(self) -> None:
        """At the process's end: a fault for this process that never struck because its step never came."""
        spec = self.spec
        last = None if self.upcoming is None else self.upcoming - 1
        mine = device_id() == spec.rank if spec.repeat else process_rank() == spec.rank
        if mine and not self.struck and last is not None and last < spec.step and os.environ.get(ENV_REEXEC) != "1":
            self._never(f"strikes at step {spec.step}, and this process's last step was {last}")

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.step = global_step(optimizer, self.completed)
        if not self._checked:
            self._check_once(optimizer)
        if self.activation is not None or not self._strikes(self.step):
            return
        target, _, attribute = self.spec.tensor.rpartition(".")
        names, _ = named_tensors()
        for group in optimizer.param_groups:
            for param in group["params"]:
                name = names.get(id(param))
                if name == self.spec.tensor:
                    self._flip(param, self.step)
                elif attribute == "grad" and name == target and param.grad is not None:
                    self._flip(param.grad, self.step)

    def _post(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.completed += 1
        self.upcoming = (self.step if self.step is not None else 0) + 1

    def _forward_step(self) -> int:
        # A forward runs before its step's optimizer step: its step is the one after the last optimizer step
        # (before the first optimizer step of this process, the offset it was resumed at).
        return self.upcoming if self.upcoming is not None else int(os.environ.get(ENV_STEP_OFFSET, "0") or 0)

    def _enter(self, module: nn.Module, args: Any) -> None:
        self._depth += 1

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        self._depth -= 1
        step = self._forward_step()
        if (self._depth == 0 and isinstance(output, torch.Tensor) and step not in self.struck
                and self._strikes(step)):
            self._flip(output, step)  # once per step, also with `repeat`: the step's first outermost call

    def _forward(self, module: nn.Module, args: Any, output: Any) -> None:
        step = self._forward_step()
        if not isinstance(output, torch.Tensor) or not self._strikes(step):
            return
        if self._module is None or self._module() is None:
            found = named_tensors()[1].get(self.spec.tensor.rpartition(".")[0])
            self._module = weakref.ref(found) if found is not None else None
        if self._module is not None and self._module() is module:
            self._flip(output, step)

    def _flip(self, tensor: torch.Tensor, step: int) -> None:
        if self._misfit:
            return
        try:
            flip_bit(tensor, index=self.spec.index, bit=self.spec.bit)
        except UsageError as err:  # the element is narrower, or the tensor smaller: said once, the training runs on
            self._misfit = True
            self._never(str(err).removeprefix(f"{ENV_FAULT}: "))
            return
        self.struck.append(step)


_injector: FaultInjector | None = None


def arm_from_env() -> FaultInjector | None:
    """Install the fault named by DETRACE_FAULT (once per process); None when it is not set."""
    global _injector
    text = os.environ.get(ENV_FAULT)
    if not text or _injector is not None:
        return _injector
    _injector = FaultInjector(FaultSpec.parse(text))
    _injector.install()
    atexit.register(_injector.report_at_exit)
    return _injector
