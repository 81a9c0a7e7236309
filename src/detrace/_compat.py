"""Every private PyTorch API detrace relies on, in one place.

Each entry says why detrace needs it and what public API would replace it. tests/unit/test_compat.py pins each one's
behaviour at the tested torch version, so a torch release that moves or changes one fails that test, by name,
rather than a user's run. Nothing else in detrace reaches into torch's private modules or attributes.

The package accepts any torch from the lowest it supports up (pyproject.toml caps nothing: a cap would make pip
downgrade a user's torch, or refuse to install, the day a new release comes out). A release outside
`CHECKED_TORCH` is flagged by `detrace doctor` in one line; an entry that such a release removed raises
`MissingTorchAPI`, one sentence naming it, at the call that needs it: never a silent wrong result.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import CodeType
from typing import Any

import torch

# torch._ops.OpOverload: the type of an ATen op overload (`aten.add.Tensor`), which the op rung names and describes
# from its schema. Public replacement: torch.library's OpOverload type, if it is ever exported.
from torch._ops import OpOverload
from torch.utils import _python_dispatch

# torch.utils._pytree: flattening nested containers into tensor leaves in torch's own order (the order the records
# and captured calls use). Public replacement: none yet (a public torch.utils.pytree, were it added).
from torch.utils import _pytree as pytree

from detrace.errors import DetraceError, UsageError

CHECKED_TORCH = ("2.10", "2.11", "2.12", "2.13")
"""The torch releases (major.minor) every entry of this module was checked against: tests/unit/test_compat.py passed
under each (2.13 in CI, 2.10 in CI's lowest-torch step, 2.11 and 2.12 by hand on 2026-12-01)."""


class MissingTorchAPI(DetraceError):
    """A private torch API detrace needs is absent from the installed torch (a release outside CHECKED_TORCH)."""


def torch_release() -> str:
    """The installed torch's major.minor release, as CHECKED_TORCH spells them."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def release_checked() -> bool:
    """Whether this module's entries were checked against the installed torch's release."""
    return torch_release() in CHECKED_TORCH


def _private(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Turn the AttributeError or ImportError of a private API that a torch release removed into one sentence that
    names it (`name`) and the releases it was checked on."""

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return function(*args, **kwargs)
            except (AttributeError, ImportError) as err:
                if release_checked():
                    raise
                raise MissingTorchAPI(
                    f"torch {torch.__version__} has no {name} ({err}), which detrace needs; detrace was checked on "
                    f"torch {', '.join(CHECKED_TORCH)}: use one of those, or a detrace release that supports yours"
                ) from err

        return call

    return decorate



TorchDispatchMode = _python_dispatch.TorchDispatchMode
"""The base class of the op rung's recorder (and of FakeTensorMode): it sees every ATen call below autograd.
Importable only from torch.utils._python_dispatch. Replace with: its public home, if it gets one."""

__all__ = [
    "CHECKED_TORCH",
    "DDP_BUILTIN_HOOK_REGISTRAR",
    "PIPELINE_STAGE_MODULE",
    "MissingTorchAPI",
    "OpOverload",
    "TorchDispatchMode",
    "all_to_all_single_autograd",
    "autograd_sequence_number",
    "backwards_in_microbatch_order",
    "current_autograd_node",
    "current_dispatch_mode",
    "current_graph_task_id",
    "dataloader_iterator_sampler",
    "dataset_fetchers",
    "default_group",
    "disable_dispatch",
    "disable_torch_function_subclass",
    "dtensor_local_box",
    "dtensor_rng_states",
    "dynamo_imported",
    "dynamo_skips",
    "functional_collectives",
    "inductor_code_cache",
    "inductor_config",
    "inductor_imported",
    "initialize_pipeline_stage",
    "is_functorch_wrapped",
    "mark_dynamic",
    "op_name",
    "op_schema",
    "pin_ddp_bucket_order",
    "pipeline_backward_orders",
    "pipeline_stage_base",
    "pop_mode",
    "push_mode",
    "pytree",
    "queue_backward_callback",
    "quiet_dispatch_modes",
    "reducing_pipeline_stage",
    "release_checked",
    "replace_call",
    "resolve_group",
    "root_mesh",
    "run_exit_handlers",
    "torch_release",
    "tracing_tensors",
    "unhooked_step",
    "wait_collective",
    "without_data",
    "wrap_compiled_graphs",
    "wrap_dataloader_next",
    "wrap_dataloader_next_index",
    "wrap_optimizer_state_init",
    "wrap_output_code",
]


@_private("torch.utils._python_dispatch._push_mode")
def push_mode(mode: Any) -> None:
    """Put a dispatch mode on top of the mode stack, outside any `with` block.

    Why: the op rung goes on and off the stack between steps, and a step ends in an optimizer hook, not at the end
    of a block. Replace with: none public (`with mode:` only)."""
    _python_dispatch._push_mode(mode)


@_private("torch.utils._python_dispatch._pop_mode")
def pop_mode() -> Any:
    """Take the top dispatch mode off the stack (the counterpart of `push_mode`)."""
    return _python_dispatch._pop_mode()


@_private("torch.utils._python_dispatch._get_current_dispatch_mode")
def current_dispatch_mode() -> Any:
    """The dispatch mode on top of the stack, or None: the op rung pops itself only when it is still on top (a mode
    the program pushed later keeps it underneath). Replace with: none public."""
    return _python_dispatch._get_current_dispatch_mode()


@_private("torch.distributed.distributed_c10d._get_default_group")
def default_group() -> Any:
    """The default process group (the one `group=None` means).

    Why: collective records name their group by its global ranks, and `group=None` has to be resolved to the real
    group object first. Replace with: `dist.group.WORLD` once it is guaranteed to be the group object itself."""
    return torch.distributed.distributed_c10d._get_default_group()


@_private("torch.distributed.distributed_c10d._resolve_process_group")
def resolve_group(name: str) -> Any:
    """The process group a functional collective names by string (its `group_name` argument).

    Why: functional collectives take the group's registered name, and records use its ranks. Replace with: a public
    name -> group lookup in torch.distributed (none exists)."""
    # torch annotates the name as GroupName, a NewType of str; functional collectives pass it as a plain str.
    return torch.distributed.distributed_c10d._resolve_process_group(name)  # type: ignore[arg-type]


@_private("torch.ops._c10d_functional")
def functional_collectives() -> Any:
    """The op namespace of functional collectives, `torch.ops._c10d_functional`, its ops registered.

    Why: DTensor, expert parallelism's all_to_all_single_autograd and compiled code run their collectives through
    these ops, never through `torch.distributed.all_reduce` and friends, so the semantic rung records them here.
    Replace with: a public namespace for them (torch.distributed._functional_collectives is private too)."""
    import torch.distributed._functional_collectives  # importing it registers the ops

    return torch.ops._c10d_functional


def replace_call(obj: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Make calls of `obj` (an op overload) go through `wrap(run)`, `run` being its own call; returns the undo.

    Why: compiled code calls functional collectives through their OpOverload object (`....all_reduce.default`),
    and code compares overloads by identity and keys tables by them, so the object must stay in place: only its
    class can change (OpOverload is a Python class whose instances allow `__class__` assignment). Replace with: a
    torch.library hook around an existing op's every call, if torch ever offers one."""
    cls = type(obj)
    call = wrap(functools.partial(cls.__call__, obj))
    obj.__class__ = type(cls.__name__, (cls,), {
        "__call__": lambda self, /, *args, **kwargs: call(*args, **kwargs), "__module__": cls.__module__})

    def undo() -> None:
        obj.__class__ = cls

    return undo


@_private("torch.autograd.Variable._execution_engine.queue_callback")
def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run `callback` when the current backward ends (called from within a backward).

    Why: DDP's buckets complete in any order and are recorded together once the backward is over, after the
    reducer's own final callback. DDP itself uses this. Replace with: a public end-of-backward hook
    (torch.autograd.graph has none for the whole graph task)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


@_private("torch._C._current_graph_task_id")
def current_graph_task_id() -> int:
    """The id of the backward (autograd graph task) running on this thread; -1 outside a backward.

    Why: a DDP bucket hook must know which backward it belongs to, to record the previous one's buckets when a
    backward failed before its end. Replace with: nothing public; torch.autograd.graph exposes no task id."""
    return torch._C._current_graph_task_id()


def current_autograd_node() -> Any:
    """The autograd node (a `torch.autograd.graph.Node`) whose backward runs now on this thread; None outside one.

    Why: an op run in the backward belongs to the module whose forward created the node running it (a custom
    autograd.Function's included); the module rung tags nodes with their module (`Node.metadata`, public) and
    the op rung reads the tag of the running node. Replace with: nothing public; torch.autograd.graph exposes no
    current node."""
    return torch._C._current_autograd_node()


def autograd_sequence_number(node: Any) -> int:
    """The sequence number of an autograd node: a counter taken when the node was created, so that a node created
    earlier on a thread has a smaller one (AccumulateGrad has the largest integer).

    Why: the module rung reuses an inner module's walk of the autograd graph only when none of the outer call's
    input nodes can lie inside it, and a node created before every node of that walk cannot. Replace with: nothing
    public; `Node` exposes no creation order."""
    return int(node._sequence_nr())


DDP_BUILTIN_HOOK_REGISTRAR = "_register_builtin_comm_hook"
"""DistributedDataParallel's method registering a built-in C++ comm hook. Why: detrace wraps it to learn that a
bucket reduction runs in C++ and cannot be recorded (instead of replacing the user's hook). Replace with: a public
way to ask a DDP module which comm hook it has."""


@_private("torch._C._DisableTorchDispatch")
def disable_dispatch() -> AbstractContextManager[Any]:
    """Run plain tensor ops below every Python dispatch mode and subclass (a raw copy).

    Why: the tracer copies small tensors' bits for later hashing; the op rung's own mode (or a program's) must not
    record or alter those copies. Replace with: none public (`torch.utils._python_dispatch` is private too)."""
    return torch._C._DisableTorchDispatch()


def quiet_dispatch_modes() -> AbstractContextManager[Any]:
    """Take the active Python dispatch modes off the stack for the block (nothing when there are none).

    Why: fingerprinting observes tensors; a FakeTensorMode or the op rung must not see or fake its ops. Checking the
    stack's length first keeps the common case (no mode) free. Replace with: none public. On a torch without it,
    nothing is taken off (an active dispatch mode then sees our ops)."""
    disable = getattr(_python_dispatch, "_disable_current_modes", None)
    return disable() if disable is not None and torch._C._len_torch_dispatch_stack() else _NO_MODES


_NO_MODES = contextlib.nullcontext()  # reusable: one object, not one per fingerprint


def is_functorch_wrapped(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a functorch (vmap/grad) wrapper, which has no single logical value to fingerprint.

    Why: a clear refusal instead of a fingerprint of one batch element. Replace with: torch.func's own check, if
    exported. False on a torch without it."""
    try:  # not contextlib.suppress: this runs on every fingerprint, and its object costs a third of a microsecond
        return bool(torch._C._functorch.is_functorch_wrapped_tensor(tensor))
    except (AttributeError, RuntimeError):
        return False


@_private("torch._C.DisableTorchFunctionSubclass")
def disable_torch_function_subclass() -> AbstractContextManager[Any]:
    """Treat tensor subclasses as plain tensors in the block (no `__torch_function__`).

    Why: detaching a subclass tensor to fingerprint it must not run the subclass's Python code. Documented in
    "Extending torch" but under `torch._C`. Replace with: its public alias, if one appears."""
    return torch._C.DisableTorchFunctionSubclass()


@_private("torch._dynamo.mark_dynamic")
def mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Tell torch.compile that `tensor`'s size at `dim` varies, so one compiled fingerprint kernel serves all sizes.

    Why: without it each new tensor size recompiles the hash kernel. Replace with: `torch.compiler`'s public
    spelling of it, once there is one."""
    torch._dynamo.mark_dynamic(tensor, dim)


def unhooked_step(optimizer_cls: type) -> Callable[..., Any] | None:
    """The `step` of an optimizer class without the global and per-optimizer step hooks; None if torch wraps it
    differently.

    Why: torch.distributed.checkpoint initialises a fresh optimizer's state by calling `step()`, which is no
    training step and must not move the tracer's step clock. Torch wraps every optimizer class's step once in
    the function that runs the hooks, marked `hooked`, the original kept in `__wrapped__`. Replace with: a public
    way to step without hooks (none)."""
    step = getattr(optimizer_cls, "step", None)
    return getattr(step, "__wrapped__", None) if getattr(step, "hooked", False) else None


def wrap_optimizer_state_init(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None] | None:
    """Make torch.distributed.checkpoint.state_dict's `_init_optim_state(optimizer)` run as `wrap(original)`, once
    the program imported that module; returns the undo, or None when it is not imported (or has no such function).

    Why: its state-dict helpers (`get_state_dict`, `set_state_dict`, `get_optimizer_state_dict`...) initialise a
    fresh optimizer's state by calling `optimizer.step()` with zero gradients and a zero learning rate, which fires
    the global optimizer step hooks: the tracer must run it as checkpoint work, not count it as a training step.
    The helpers call it by its module-level name. Replace with: a public marker of that step (none)."""
    module: Any = sys.modules.get("torch.distributed.checkpoint.state_dict")
    original = getattr(module, "_init_optim_state", None)
    if module is None or not callable(original):
        return None
    module._init_optim_state = functools.wraps(original)(wrap(original))

    def undo() -> None:
        module._init_optim_state = original

    return undo


def pin_ddp_bucket_order(ddp: Any) -> None:
    """Make a DDP module rebuild its gradient buckets in parameter order at its next forward with grad enabled,
    instead of in the order its first backward made the gradients ready; a no-op once it has rebuilt them, or
    once a backward has started recording its ready order.

    Why: DDP (without find_unused_parameters) rebuilds its buckets once, after a process's first iteration. A
    resumed process would run its first step on the initial layout while the continuous run is on the rebuilt
    one, and a bucket's all-reduce sums in another order in another layout. Pushing every parameter before the
    first backward gives every process one layout from its first step on; DDP's own Join hook does the same.
    Replace with: a public DDP option to fix the bucket layout (none)."""
    ddp.reducer._push_all_rebuilt_params()


@_private("torch.distributed.tensor._utils.compute_local_shape_and_global_offset")
def dtensor_local_box(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, offset in the global tensor) of this rank's shard of a DTensor whose placements are all Shard or
    Replicate: the box of the global tensor that `to_local()` holds.

    Why: `detrace.fingerprint` of a DTensor adds each rank's rows at their global positions, without gathering.
    Replace with: a public DTensor API for the local shard's offset (none)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(shape), tuple(offset)


def dtensor_rng_states() -> dict[str, torch.Tensor] | None:
    """The named states of the DTensor (tensor-parallel) RNG tracker, when it keeps its own.

    Why: a checkpoint must restore every random stream. Recent torch trackers keep no state of their own: they
    offset the device generator. Older ones hold `rng_states`, a dict of name -> state tensor. Looked up only if
    DTensor's random module is already imported, so that a run without DTensor pays nothing. Replace with: a
    public DTensor RNG state API."""
    module = sys.modules.get("torch.distributed.tensor._random")
    tracker = getattr(module, "_rng_tracker", None)
    states = getattr(tracker, "rng_states", None)
    return states if isinstance(states, dict) and states else None


@_private("atexit._run_exitfuncs")
def run_exit_handlers() -> None:
    """Run the `atexit` handlers now (each once: they are unregistered as they run).

    Why: a distributed process may have to end with os._exit (see detrace._exit), which skips them; a tracer's
    last write is one. Replace with: nothing public in the standard library."""
    atexit._run_exitfuncs()


def op_schema(op: Any) -> Any:
    """The `torch._C.FunctionSchema` of an ATen op overload (its arguments, returns and their alias annotations).

    Why: the op rung, replay and the audit read which arguments an op writes (`Tensor(a!)`) and which outputs are
    views. Replace with: `OpOverload`'s public schema accessor, if one is added (`_schema` is the attribute)."""
    return op._schema


def op_name(op: Any) -> str:
    """An op overload's full name as records spell it: `aten.index_put.default` (namespace, op, overload).

    Why: `OpOverload.name()` drops the namespace prefix's dot form this trace format uses. Replace with: a public
    accessor of the op and overload names (`_opname`, `_overloadname` are the attributes)."""
    return f"{op.namespace}.{op._opname}.{op._overloadname}"


def dynamo_imported() -> bool:
    """Whether torch._dynamo is imported in this process (a program that compiles, or imports torch.optim).

    Why: detrace hooks compiled code only once Dynamo is there, and never imports it itself (a second of start-up).
    Replace with: a public query of torch.compile's state (none)."""
    return "torch._dynamo" in sys.modules


def inductor_config() -> Any:
    """torch._inductor.config if Inductor is imported in this process, else None (importing it costs a second).

    Why: the recipe sets and doctor and audit read Inductor's options (`deterministic`, `max_autotune`,
    `coordinate_descent_tuning`), which only exist as that config module. Replace with: public Inductor options
    (torch.compile's `options=` is per call, not per process)."""
    return sys.modules.get("torch._inductor.config")


def inductor_imported() -> bool:
    """Whether Inductor's code cache is imported (a program that has compiled or is compiling)."""
    return "torch._inductor.codecache" in sys.modules


@_private("torch._dynamo.eval_frame.skip_code")
def dynamo_skips(code: CodeType) -> None:
    """Have Dynamo run every frame of `code` as it is, and compile the frames it calls, as it would without it.

    Why: the batch recorder wraps `nn.Module.__call__`; were Dynamo to compile the wrapper's frame, its graphs would
    begin and break elsewhere than in the untraced program (and Inductor fuse, and round, otherwise). Replace with:
    none public (`torch.compiler.disable(recursive=False)` skips a wrapper frame of its own, then compiles ours,
    and a call to it inside a compiled region is a graph break)."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(code)


def without_data(tensor: torch.Tensor) -> bool:
    """Whether `tensor` holds no data to record: a meta tensor, a FakeTensor or FunctionalTensor (a graph being
    traced), a functorch (vmap/grad) wrapper, or any tensor while a FakeTensorMode is active (the tracer's own ops
    on it would be faked too).

    Why: programs run models on such tensors on purpose (litgpt counts FLOPs with a forward and backward on meta
    tensors; torch.compile traces with fake ones), and reading their storage raises. Replace with: a public
    "has storage" query (none). A torch without these names: only the meta check."""
    if tensor.is_meta or is_functorch_wrapped(tensor):
        return True
    try:
        from torch._subclasses import FakeTensor
        from torch._subclasses.functional_tensor import FunctionalTensor

        key = torch._C._TorchDispatchModeKey.FAKE
        return isinstance(tensor, (FakeTensor, FunctionalTensor)) or torch._C._get_dispatch_mode(key) is not None
    except (ImportError, AttributeError):
        return False


@_private("torch._subclasses.FakeTensor, torch._subclasses.functional_tensor.FunctionalTensor")
def tracing_tensors(values: tuple[Any, ...]) -> bool:
    """Whether any of `values` is a tensor of a graph being traced (a FakeTensor or a FunctionalTensor: no data).

    Why: AOTAutograd traces a compiled graph's functional collectives through `torch.ops._c10d_functional`, which
    the semantic rung wraps; at torch 2.10 `torch.compiler.is_compiling()` is False there, and recording would
    read the storage of a tensor that has none. Replace with: a public query of make_fx tracing."""
    from torch._subclasses import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return any(isinstance(value, (FakeTensor, FunctionalTensor)) for value in values)


@_private("torch._dynamo.output_graph.OutputGraph.call_user_compiler")
def wrap_compiled_graphs(wrap: Callable[[Any, Any, str], Any]) -> Callable[[], None]:
    """Pass every graph Dynamo compiles through `wrap(compiled, owner, compile_id)`, owner being the `self` of the
    frame Dynamo traced (a module's forward) or None; returns the undo.

    Why: the compiled rung records compiled regions, named after their owner module, and their compile id. Dynamo
    offers no public callback on a backend's result. Replace with: a public `torch.compile` backend wrapper hook."""
    from torch._dynamo.output_graph import OutputGraph

    original = OutputGraph.call_user_compiler

    def call_user_compiler(graph: Any, gm: Any, example_inputs: Any) -> Any:
        compiled = original(graph, gm, example_inputs)
        owner = graph.root_tx.f_locals.get("self") if graph.root_tx is not None else None
        return wrap(compiled, owner, str(graph.dynamo_compile_id))

    setattr(OutputGraph, "call_user_compiler", call_user_compiler)  # noqa: B010  # a method replaced on the class

    def undo() -> None:
        setattr(OutputGraph, "call_user_compiler", original)  # noqa: B010

    return undo


@_private("torch._inductor.codecache.PyCodeCache.load_by_key_path")
def wrap_output_code(seen: Callable[[Any], None]) -> Callable[[], None]:
    """Call `seen(module)` on every Inductor output-code module as it loads (fresh compile or cache hit); returns
    the undo.

    Why: the op rung instruments each generated kernel, and the audit scans its source; Inductor has no public
    callback on output code. Imports Inductor (call it once the program compiles). Replace with: a public Inductor
    callback on output code, if one is added."""
    cache = inductor_code_cache()
    load = cache.__dict__["load_by_key_path"]

    def load_by_key_path(cls: Any, *args: Any, **kwargs: Any) -> Any:
        module = load.__func__(cls, *args, **kwargs)
        seen(module)
        return module

    cache.load_by_key_path = classmethod(load_by_key_path)

    def undo() -> None:
        cache.load_by_key_path = load

    return undo


def all_to_all_single_autograd() -> Callable[..., Any]:
    """torch.distributed._functional_collectives.all_to_all_single_autograd: an all-to-all whose backward is the
    reverse all-to-all (the reference workload's expert parallelism).

    Why: the public `torch.distributed.nn` all_to_all has no single-tensor form with split sizes. Replace with:
    its public home, if it gets one."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd as all_to_all

    return all_to_all


@_private("torch.distributed.device_mesh.DeviceMesh._get_root_mesh")
def root_mesh(mesh: Any) -> Any:
    """The mesh that `mesh` was sliced from (`mesh` itself when it was made whole): `detrace.parallel`'s
    ExpertParallel reads the replicas of its experts from the root's other dimension.

    Why: a sliced DeviceMesh has no public link to its parent. Replace with: its public home, if it gets one."""
    return mesh._get_root_mesh()


def wait_collective(tensor: torch.Tensor) -> torch.Tensor:
    """torch.distributed._functional_collectives.wait_tensor: a functional collective's output, waited once, as a
    plain tensor (the same memory; autograd passes its gradient through).

    Why: the output is a lazily waited tensor subclass that its views keep, so every op on a view goes through its
    Python dispatch; `clone()` would also unwrap it, at the cost of a copy. Replace with: its public home, if it
    gets one."""
    from torch.distributed._functional_collectives import wait_tensor

    return wait_tensor(tensor)


@_private("torch.distributed.pipelining.schedules.PipelineScheduleSingle._initialize_stage")
def initialize_pipeline_stage(schedule: Any, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any) -> None:
    """Set a single-stage pipeline schedule's stage up now (the shape vote over p2p between the stages, then the
    buffers), which `schedule.step` otherwise does at its first call.

    Why: done before training, every process makes it before its first step, so the first step of a resumed process
    makes the same calls as that step of a run that never stopped (`detrace check-resume`). Replace with: a public
    way to set a schedule up ahead of its first step, if torch adds one."""
    initialize = schedule._initialize_stage
    # torch 2.10 sets a stage up from its first microbatch's inputs alone; later versions take the target too.
    if "target" in inspect.signature(initialize).parameters:
        initialize(args, kwargs, target)
    else:
        initialize(args, kwargs)


PIPELINE_STAGE_MODULE = "torch.distributed.pipelining.stage"
"""The module of `pipeline_stage_base`: the tracer wraps the class once it is imported."""


@_private("torch.distributed.pipelining.stage._PipelineStageBase")
def pipeline_stage_base() -> Any:
    """The base class of torch.distributed.pipelining's stages, whose `backward_one_chunk(bwd_chunk_id, loss=None,
    full_backward=True, last_backward=False)` runs a microbatch's backward (with `full_backward=False`, its input
    step through `torch.autograd.grad`) and `backward_weight_one_chunk(bwd_chunk_id, last_backward=False)` its
    weight step.

    Why: a zero-bubble schedule's split backward never calls `torch.autograd.backward`, where the tracer sees a
    backward and its loss; its two steps are these methods of the private base class of `PipelineStage`. Replace
    with: a public hook on a stage's backward, if torch adds one."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    return _PipelineStageBase


@_private("torch.distributed.pipelining.schedules._ComputationType")
def pipeline_backward_orders(schedule: Any) -> dict[int, tuple[list[int], bool]]:
    """For each stage this rank holds in a multi-stage schedule (ScheduleInterleaved1F1B, ScheduleLoopedBFS, the
    zero-bubble ones): the microbatches of the actions that give its parameters their gradients (a full backward, or
    a split backward's weight step), in the order this rank runs them, and whether its backward is split.

    Why: a stage's gradients are summed in the tree by microbatch, and which microbatch each one is follows from the
    schedule's actions (`pipeline_order_with_comms`, of the private `_Action` and `_ComputationType`). Replace with:
    a public view of a schedule's actions, if torch adds one."""
    from torch.distributed.pipelining.schedules import _ComputationType

    gives = (_ComputationType.FULL_BACKWARD, _ComputationType.BACKWARD_WEIGHT)
    orders: dict[int, tuple[list[int], bool]] = {stage.stage_index: ([], False) for stage in schedule._stages}
    for action in schedule.pipeline_order_with_comms[schedule.rank]:
        for one in (action.sub_actions or (action,)) if action is not None else ():
            if one.stage_index not in orders:
                continue
            order, split = orders[one.stage_index]
            if one.computation_type in gives:
                order.append(one.microbatch_index)
            orders[one.stage_index] = (order, split or one.computation_type == _ComputationType.BACKWARD_INPUT)
    return orders


@_private("torch.distributed.pipelining.schedules._PipelineScheduleRuntime._prepare_schedule_with_comms")
def backwards_in_microbatch_order(schedule: Any) -> None:
    """Make a multi-stage schedule run each stage's full backwards in microbatch order 0..M-1, in the slots its own
    order gives them, and lower it again with its communication (every rank does the same for every rank's order).

    Why: ScheduleLoopedBFS runs a stage's backwards M-1..0, so a rank's k-th loss (recorded at its backward) would be
    microbatch M-1-k, where `check-topology` reads microbatch k; its breadth-first shape is the same either way (a
    stage's backwards wait only for the next stage's of the same microbatch). Its actions are the private `_Action`
    and `_ComputationType`, lowered by a private method. Replace with: a public way to give a schedule its order."""
    from torch.distributed.pipelining.schedules import _Action, _ComputationType

    for actions in schedule.pipeline_order.values():
        slots: dict[int, list[int]] = {}
        for i, action in enumerate(actions):
            if action is not None and action.computation_type == _ComputationType.FULL_BACKWARD:
                slots.setdefault(action.stage_index, []).append(i)
        for stage, positions in slots.items():
            for microbatch, i in enumerate(positions):
                actions[i] = _Action(stage, _ComputationType.FULL_BACKWARD, microbatch)
    schedule._prepare_schedule_with_comms(schedule.pipeline_order)


@_private("torch.distributed.pipelining._backward.stage_backward")
def reducing_pipeline_stage(before_backward: Callable[[], None], **stage: Any) -> Any:
    """A `PipelineStage(**stage)` whose fully_shard stage reduce-scatters every microbatch's gradients as that
    microbatch's backward ends (gradient sync on), after `before_backward()`, and does nothing after the last one.

    Why: PipelineStage turns an FSDP stage's gradient sync off for every microbatch and reduce-scatters once after the
    last (`perform_reduce_grad`): fully_shard's own accumulation, in the order the backwards run, which detrace's
    fixed-order reduce-scatter (`detrace.parallel.fsdp`) replaces. It has no option for that; this overrides the two
    methods the schedules call (`backward_maybe_with_nosync`, `perform_reduce_grad`) and calls torch's private
    `stage_backward` for the full backward that GPipe and 1F1B run. Replace with: a PipelineStage option that reduces
    every microbatch, if torch adds one."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining._backward import stage_backward

    class _ReducingStage(PipelineStage):
        def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict[str, Any],
                                       last_backward: bool = False) -> tuple[Any, None]:
            if backward_type != "full":  # a zero-bubble schedule's split backward: not one of GPipe or 1F1B
                raise UsageError(f"a pipeline schedule ran a {backward_type!r} backward on a reducing FSDP "
                                      "stage, which takes the full backward of GPipe and 1F1B only")
            if isinstance(self.submod, FSDPModule):  # as torch's stage: keep the parameters unsharded until the last
                self.submod.set_reshard_after_backward(last_backward)  # backward (no all-gather per microbatch)
            before_backward()
            return stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"],
                                  bwd_kwargs["input_values"]), None

        def perform_reduce_grad(self, grad_scale_factor: int) -> None:
            # every microbatch was reduced as its backward ended; the schedule must not scale (scale_grads=False)
            if grad_scale_factor != 1:
                raise UsageError("a reducing FSDP pipeline stage takes scale_grads=False")

    return _ReducingStage(**stage)


def inductor_code_cache() -> Any:
    """torch._inductor.codecache.PyCodeCache: the loader of Inductor's output code modules (fresh compile or
    cache hit), whose `load_by_key_path` the audit wraps to scan each module's kernels.

    Why: there is no public hook on compiled-code loading. Imports Inductor (call it only once the program
    compiles). Replace with: a public Inductor callback on output code, if one is added."""
    from torch._inductor.codecache import PyCodeCache

    return PyCodeCache


def dataset_fetchers() -> tuple[type, ...]:
    """The classes whose `fetch` calls a DataLoader's `collate_fn` (map-style and iterable datasets), in the main
    process and in workers.

    Why: the audit watches collate_fn for random draws without replacing the user's DataLoader. Replace with:
    nothing public (DataLoader hands collate_fn to these private fetchers)."""
    from torch.utils.data._utils import fetch

    return fetch._MapDatasetFetcher, fetch._IterableDatasetFetcher


@_private("torch.utils.data.dataloader._BaseDataLoaderIter._index_sampler")
def dataloader_iterator_sampler(iterator: Any) -> Any:
    """The batch sampler (or sampler) a DataLoader's iterator draws its indices from: the same object for every
    epoch's iterator of one DataLoader; None when the iterator has none.

    Why: the batch rung tells a validation loader's batch from the training loader's next epoch. Replace with:
    nothing public (the iterator keeps no reference to its DataLoader)."""
    return getattr(iterator, "_index_sampler", None)


def _wrap_dataloader_iterator(name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
                              ) -> Callable[[], None]:
    """Replace the method `name` of DataLoader iterators (their private base class's) by `wrap(method)`; returns
    the undo."""
    from torch.utils.data import dataloader

    owner = dataloader._BaseDataLoaderIter
    original = owner.__dict__[name]
    setattr(owner, name, wrap(original))
    return lambda: setattr(owner, name, original)


@_private("torch.utils.data.dataloader._BaseDataLoaderIter.__next__")
def wrap_dataloader_next(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Replace `__next__` of a DataLoader's iterator (the batch it hands the loop) by `wrap(method)`; returns the
    undo.

    Why: the batch rung tells the batches a loop drew and dropped (`itertools.islice` past the batches trained
    before a resume) from the one it trains on. Replace with: nothing public (the iterator's class is private)."""
    return _wrap_dataloader_iterator("__next__", wrap)


@_private("torch.utils.data.dataloader._BaseDataLoaderIter._next_index")
def wrap_dataloader_next_index(wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[[], None]:
    """Replace the method a DataLoader's iterator calls, in the main process, for the dataset indices of each batch
    it loads or sends to a worker (in the order the batches reach the loop, unless the loader was built with
    `in_order=False`) by `wrap(method)`; returns the undo.

    Why: the batch rung records which samples each training step took from any DataLoader, without replacing the
    user's sampler. Replace with: nothing public (the batch sampler's iterator is private to the DataLoader's)."""
    return _wrap_dataloader_iterator("_next_index", wrap)
