"""detrace._compat: each private torch API detrace relies on still does what detrace needs, at this torch.

A torch release that moves or changes one fails its test here, by name, instead of a user's run."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.optimizer import register_optimizer_step_pre_hook

from detrace import _compat
from detrace.errors import UsageError


def test_torch_release_was_checked() -> None:
    assert _compat.release_checked(), (
        f"torch {torch.__version__}: detrace._compat was checked against {_compat.CHECKED_TORCH} only; run this file, "
        f"check each entry against the new release, then add {_compat.torch_release()!r} to CHECKED_TORCH")


def test_a_private_api_missing_from_an_unchecked_release_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a release outside CHECKED_TORCH, a shim whose private API is gone raises one sentence naming it; on a
    checked release the same AttributeError stays a bug of ours (re-raised as is)."""
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    with pytest.raises(AttributeError):
        _compat.current_graph_task_id()
    monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")
    assert not _compat.release_checked()
    with pytest.raises(_compat.MissingTorchAPI, match=r"torch 2\.99\.0\+cpu has no torch\._C\._current_graph_task_id"):
        _compat.current_graph_task_id()


def test_doctor_flags_an_unchecked_torch_release(monkeypatch: pytest.MonkeyPatch) -> None:
    from detrace.recipe.doctor import audit

    (checked,) = [finding for finding in audit() if finding.name == "torch"]
    assert checked.status == "ok"
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    (unchecked,) = [finding for finding in audit() if finding.name == "torch"]
    assert unchecked.status == "risk" and "checked on torch 2.10" in unchecked.detail


class _Seen(_compat.TorchDispatchMode):
    """Records the names of the ops it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_push_and_pop_a_mode_without_a_with_block() -> None:
    mode = _Seen()
    _compat.push_mode(mode)
    try:
        assert _compat.current_dispatch_mode() is mode
        torch.ones(2).neg()
    finally:
        _compat.pop_mode()
    assert _compat.current_dispatch_mode() is None
    torch.ones(2).abs()
    assert "neg" in mode.ops and "abs" not in mode.ops


def test_disable_dispatch_hides_ops_from_modes() -> None:
    with _Seen() as mode:
        with _compat.disable_dispatch():
            torch.ones(2).neg()
        torch.ones(2).abs()
    assert "neg" not in mode.ops and "abs" in mode.ops


def test_quiet_dispatch_modes_hides_ops_from_active_modes() -> None:
    with _Seen() as mode:
        with _compat.quiet_dispatch_modes():
            torch.ones(2).neg()
        torch.ones(2).abs()
    assert "neg" not in mode.ops and "abs" in mode.ops
    with _compat.quiet_dispatch_modes():  # no mode on the stack: nothing to take off
        assert torch.ones(2).neg().sum().item() == -2


def test_op_overload_type() -> None:
    assert isinstance(torch.ops.aten.neg.default, _compat.OpOverload)
    assert torch.ops.aten.neg.default._schema.name == "aten::neg"


def test_replace_call_keeps_the_overload_object_in_place() -> None:
    overload = torch.ops.aten.neg.default
    calls: list[int] = []

    def wrap(run: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return run(*args, **kwargs)

        return call

    undo = _compat.replace_call(overload, wrap)
    try:
        assert torch.ops.aten.neg.default is overload and isinstance(overload, _compat.OpOverload)
        assert overload(torch.ones(2)).tolist() == [-1.0, -1.0] and calls == [1]
    finally:
        undo()
    assert type(overload) is _compat.OpOverload
    overload(torch.ones(2))
    assert calls == [1]


def test_functional_collectives_namespace() -> None:
    ops = _compat.functional_collectives()
    for name in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                 "wait_tensor"):
        assert isinstance(getattr(ops, name).default, _compat.OpOverload), name
    assert [a.name for a in ops.all_reduce.default._schema.arguments] == ["input", "reduce_op", "group_name"]


def test_backward_task_id_and_end_of_backward_callback() -> None:
    seen: dict[str, Any] = {"ended": False}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            seen["task"] = _compat.current_graph_task_id()
            _compat.queue_backward_callback(lambda: seen.update(ended=True, in_task=_compat.current_graph_task_id()))
            assert not seen["ended"]
            return grad

    assert _compat.current_graph_task_id() == -1
    x = torch.ones(2, requires_grad=True)
    Probe.apply(x).sum().backward()
    assert seen["task"] >= 0 and seen["ended"] and seen["in_task"] == seen["task"]


def test_current_autograd_node_is_the_node_running_its_backward() -> None:
    seen: list[Any] = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            seen.append(_compat.current_autograd_node())
            return grad

    assert _compat.current_autograd_node() is None
    y = Probe.apply(torch.ones(2, requires_grad=True))
    y.grad_fn.metadata["owner"] = "probe"
    y.sum().backward()
    assert seen[0] is y.grad_fn and seen[0].metadata == {"owner": "probe"}


def test_autograd_sequence_numbers_grow_in_creation_order() -> None:
    x = torch.ones(2, requires_grad=True)
    a = x * 2
    b = a.sin()
    c = (b + a).grad_fn
    numbers = [_compat.autograd_sequence_number(t.grad_fn) for t in (a, b)] + [_compat.autograd_sequence_number(c)]
    assert numbers == sorted(numbers) and len(set(numbers)) == 3


def test_ddp_builtin_hook_registrar() -> None:
    registrar = getattr(DDP, _compat.DDP_BUILTIN_HOOK_REGISTRAR)
    assert callable(registrar)
    assert list(inspect.signature(registrar).parameters) == ["self", "comm_hook_type"]


def test_process_groups(tmp_path: Path) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        group = _compat.default_group()
        assert isinstance(group, dist.ProcessGroup) and dist.get_process_group_ranks(group) == [0]
        assert _compat.resolve_group(group.group_name) is group
    finally:
        dist.destroy_process_group()


def test_pin_ddp_bucket_order_rebuilds_at_the_next_forward(tmp_path: Path) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        ddp = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)), bucket_cap_mb=0.01)
        assert len(ddp.reducer._get_zeros_like_grad_buckets()) == 1
        _compat.pin_ddp_bucket_order(ddp)
        ddp(torch.ones(2, 64))
        assert ddp._has_rebuilt_buckets and len(ddp.reducer._get_zeros_like_grad_buckets()) > 1
    finally:
        dist.destroy_process_group()


def test_is_functorch_wrapped() -> None:
    inside: list[bool] = []

    def probe(t: torch.Tensor) -> torch.Tensor:
        inside.append(_compat.is_functorch_wrapped(t))
        return t

    torch.func.vmap(probe)(torch.ones(3, 2))
    assert inside == [True] and not _compat.is_functorch_wrapped(torch.ones(2))


def test_disable_torch_function_subclass() -> None:
    calls: list[str] = []

    class Sub(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            calls.append(func.__name__)
            return super().__torch_function__(func, types, args, kwargs or {})

    t = torch.ones(2).as_subclass(Sub)
    with _compat.disable_torch_function_subclass():
        detached = t.detach()
    assert calls == [] and type(detached) is torch.Tensor
    t.detach()
    assert calls == ["detach"]


def test_mark_dynamic() -> None:
    t = torch.ones(4, 2)
    _compat.mark_dynamic(t, 0)
    assert 0 in t._dynamo_dynamic_indices


def test_unhooked_step_runs_no_step_hooks() -> None:
    fired: list[str] = []
    param = torch.nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    optimizer = torch.optim.SGD([param], lr=0.5)
    handles = [register_optimizer_step_pre_hook(lambda *a: fired.append("global")),
               optimizer.register_step_pre_hook(lambda *a: fired.append("own"))]
    try:
        unhooked = _compat.unhooked_step(torch.optim.SGD)
        assert unhooked is not None
        unhooked(optimizer)
        assert fired == [] and param.tolist() == [0.5, 0.5]
        optimizer.step()
        assert fired == ["global", "own"]
    finally:
        for handle in handles:
            handle.remove()
    assert _compat.unhooked_step(type("Plain", (), {"step": lambda self: None})) is None


def test_wrap_optimizer_state_init_sees_the_zero_lr_step_of_get_state_dict() -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    inside: list[bool] = []
    fired: list[bool] = []
    handle = register_optimizer_step_pre_hook(lambda *a: fired.append(bool(inside)))

    def wrap(original: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            inside.append(True)
            try:
                return original(*args, **kwargs)
            finally:
                inside.pop()

        return run

    undo = _compat.wrap_optimizer_state_init(wrap)
    assert undo is not None
    try:
        get_state_dict(model, optimizer)  # a fresh optimizer: torch steps it once, with zero gradients and lr 0
    finally:
        undo()
        handle.remove()
    assert fired == [True] and optimizer.param_groups[0]["lr"] == 0.5


def test_without_data() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = torch.ones(2)
    assert not _compat.without_data(real) and _compat.without_data(torch.ones(2, device="meta"))
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(real)
        assert _compat.without_data(fake) and _compat.without_data(real)  # the tracer's own ops would be faked too
    assert _compat.without_data(fake) and not _compat.without_data(real)
    assert torch.func.vmap(lambda t: torch.tensor(_compat.without_data(t)))(torch.ones(2, 3)).all()


def test_dtensor_rng_tracker() -> None:
    import torch.distributed.tensor._random as dtensor_random

    assert hasattr(dtensor_random, "_rng_tracker")
    # This torch's tracker keeps no named states of its own (it offsets the device generator).
    assert _compat.dtensor_rng_states() is None


def test_run_exit_handlers_then_leave() -> None:
    program = "import atexit; from detrace._exit import leave; atexit.register(print, 'handler ran'); leave(3)"
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3 and result.stdout == "handler ran\n", result.stderr[-2000:]


def test_pytree_leaves_in_torch_order() -> None:
    a, b, c = torch.ones(1), torch.zeros(1), torch.ones(2)
    leaves = _compat.pytree.tree_leaves({"y": [a, (b, 3)], "x": c})
    assert [id(t) for t in leaves if isinstance(t, torch.Tensor)] == [id(a), id(b), id(c)]


def test_inductor_code_cache_loads_output_code_by_key_and_path() -> None:
    cache = _compat.inductor_code_cache()
    assert isinstance(inspect.getattr_static(cache, "load_by_key_path"), classmethod)
    assert list(inspect.signature(cache.load_by_key_path).parameters)[:2] == ["key", "path"]


def test_dataset_fetchers_call_collate_fn_in_fetch() -> None:
    for fetcher in _compat.dataset_fetchers():
        assert "self.collate_fn(" in inspect.getsource(fetcher.fetch)


def test_op_schema_and_name_describe_an_overload() -> None:
    op = torch.ops.aten.index_put_.default
    schema = _compat.op_schema(op)
    assert _compat.op_name(op) == "aten.index_put_.default"
    assert schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write
    assert [a.name for a in schema.arguments][:3] == ["self", "indices", "values"]


def test_inductor_config_and_import_state() -> None:
    # what a program that compiles has imported (this test's worker may have run nothing that did)
    import torch._dynamo
    import torch._inductor.codecache  # noqa: F401

    assert _compat.dynamo_imported() and _compat.inductor_imported()
    config = _compat.inductor_config()
    assert config is sys.modules["torch._inductor.config"]
    for option in ("deterministic", "max_autotune", "coordinate_descent_tuning"):
        assert isinstance(getattr(config, option), bool)


def test_wrap_compiled_graphs_sees_each_graph_with_its_compile_id() -> None:
    # The owner is the traced frame's `self`; at torch 2.13 compiling a module traces its call wrapper, whose locals
    # hold no `self`, so the owner is None there and the compiled rung names regions by scope instead.
    seen: list[tuple[object, str]] = []

    def wrap(compiled: Any, owner: Any, compile_id: str) -> Any:
        seen.append((owner, compile_id))
        return compiled

    model = torch.nn.Linear(4, 4)
    undo = _compat.wrap_compiled_graphs(wrap)
    try:
        torch._dynamo.reset()
        out = torch.compile(model, backend="eager")(torch.ones(2, 4))
    finally:
        undo()
        torch._dynamo.reset()
    assert torch.equal(out, model(torch.ones(2, 4)))
    assert [compile_id for _, compile_id in seen] == ["0/0"] and seen[0][0] in (None, model)
    from torch._dynamo.output_graph import OutputGraph

    assert "wrap" not in repr(OutputGraph.call_user_compiler)  # undone


def test_dynamo_skips_runs_a_frame_as_it_is_and_compiles_the_frames_it_calls() -> None:
    # What the batch recorder's wrapper of nn.Module.__call__ relies on: Dynamo compiles the call inside it, as if
    # the wrapper were not there (the graph's placeholder is named after the inner frame's argument).
    def inner(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    def outer(y: torch.Tensor) -> torch.Tensor:
        return inner(y)

    placeholders: list[list[str]] = []

    def backend(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        placeholders.append([n.name for n in gm.graph.nodes if n.op == "placeholder"])
        return gm.forward

    _compat.dynamo_skips(outer.__code__)
    torch._dynamo.reset()
    try:
        assert torch.equal(torch.compile(outer, backend=backend)(torch.ones(3)), torch.full((3,), 3.0))
    finally:
        torch._dynamo.reset()
    assert placeholders == [["l_x_"]]


def test_tracing_tensors_tells_fake_and_functional_tensors_from_real_ones() -> None:
    from torch._subclasses import FakeTensorMode
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    with FakeTensorMode() as mode:
        fake = torch.ones(2)
    assert _compat.tracing_tensors((fake, "sum", "0")) and not _compat.tracing_tensors((torch.ones(2), "sum"))
    with mode, FunctionalTensorMode():
        functional = torch.ones(2) + 1
    assert _compat.tracing_tensors((functional,))


def test_wrap_output_code_is_undone() -> None:
    cache = _compat.inductor_code_cache()
    before = inspect.getattr_static(cache, "load_by_key_path")
    undo = _compat.wrap_output_code(lambda module: None)
    assert inspect.getattr_static(cache, "load_by_key_path") is not before
    undo()
    assert inspect.getattr_static(cache, "load_by_key_path") is before


def test_all_to_all_single_autograd() -> None:
    all_to_all = _compat.all_to_all_single_autograd()
    assert callable(all_to_all)
    assert list(inspect.signature(all_to_all).parameters)[1:4] == ["output_split_sizes", "input_split_sizes", "group"]


def test_wait_collective_gives_a_plain_tensor_whose_views_are_plain_and_keeps_the_gradient(tmp_path: Path) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        x = torch.arange(6.0).view(3, 2).requires_grad_()
        sent = _compat.all_to_all_single_autograd()(x, [3], [3], dist.group.WORLD)
        assert type(sent) is not torch.Tensor  # the lazily waited subclass
        waited = _compat.wait_collective(sent)
        assert type(waited) is torch.Tensor and torch.equal(waited, x.detach())
        assert type(waited[1:]) is torch.Tensor  # a view of the subclass would be the subclass again
        (waited * torch.tensor([[1.0, 2.0]])).sum().backward()
        assert torch.equal(x.grad, torch.tensor([[1.0, 2.0]]).expand(3, 2))  # type: ignore[arg-type]
    finally:
        dist.destroy_process_group()


def test_initialize_pipeline_stage(tmp_path: Path) -> None:
    """A schedule's stage set up ahead of its first step: the step then finds it set up, and runs."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        model = torch.nn.Linear(4, 4)
        x = torch.ones(2, 4)
        stage = PipelineStage(model, 0, 1, torch.device("cpu"), input_args=x[:1], output_args=x[:1])
        schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, y: (out - y).square().sum())
        assert not schedule._stage_forward_initialized
        _compat.initialize_pipeline_stage(schedule, (x[:1],), {}, x[:1])
        assert schedule._stage_forward_initialized and schedule._stage_backward_initialized
        schedule.step(x, target=x, losses=[])
        assert model.weight.grad is not None
    finally:
        dist.destroy_process_group()


def test_reducing_pipeline_stage(tmp_path: Path) -> None:
    """A stage whose every microbatch's backward starts from cleared gradients (`before_backward`), so each lands
    alone (under fully_shard: each reduce-scatters and is assigned, not added to the last, whose +0 + -0 is +0), and
    whose end of step adds nothing. torch's stage accumulates them. (fully_shard's reduce-scatter itself is skipped
    at world 1: the pp2xfsdp2 job of tests/e2e/test_topology.py runs it.)"""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])

    def where(model: torch.nn.Module) -> dict[str, Any]:
        return {"submodule": model, "stage_index": 0, "num_stages": 1, "device": torch.device("cpu"),
                "input_args": x[:1], "output_args": torch.zeros(1, 1)}  # a fresh output: strides (1, 1)

    try:
        def landed(reducing: bool) -> tuple[list[torch.Tensor], int]:
            model = torch.nn.Linear(2, 1, bias=False)
            seen: list[torch.Tensor] = []
            model.weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
            clears = []

            def clear() -> None:
                clears.append(1)
                model.weight.grad = None

            stage = _compat.reducing_pipeline_stage(clear, **where(model)) if reducing else \
                PipelineStage(**where(model))
            schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=lambda out, y: out.sum(), scale_grads=False)
            schedule.step(x, target=x[:, :1], losses=[])
            return seen, len(clears)

        seen, clears = landed(reducing=True)
        assert clears == 2 and [g.tolist() for g in seen] == [[[1.0, 0.0]], [[0.0, 1.0]]]
        seen, clears = landed(reducing=False)  # torch's: the second lands on the first
        assert clears == 0 and [g.tolist() for g in seen] == [[[1.0, 0.0]], [[1.0, 1.0]]]
        with pytest.raises(UsageError, match="scale_grads=False"):
            _compat.reducing_pipeline_stage(lambda: None, **where(torch.nn.Linear(2, 1))).perform_reduce_grad(2)
    finally:
        dist.destroy_process_group()


def test_dtensor_local_box(tmp_path: Path) -> None:
    # the box of the global tensor that a DTensor's local shard holds, read through torch's private helper (uneven
    # Shard(0) at one rank: the whole tensor; the helper's signature is pinned by the call)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        dt = distribute_tensor(torch.ones(5, 3), init_device_mesh("cpu", (1,)), [Shard(1)])
        assert _compat.dtensor_local_box(dt) == ((5, 3), (0, 0))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("wrapper", "seen_as"), [("wrap_dataloader_next_index", list),
                                                   ("wrap_dataloader_next", lambda batch: batch.tolist())])
def test_wrap_dataloader_iterator_sees_each_batch_and_undoes(wrapper: str, seen_as: Any) -> None:
    """wrap_dataloader_next_index sees each batch's dataset indices as the iterator draws them, wrap_dataloader_next
    each batch handed to the loop; after the undo, neither sees anything."""
    seen: list[list[int]] = []

    def wrap(original):  # type: ignore[no-untyped-def]
        def step(iterator):  # type: ignore[no-untyped-def]
            value = original(iterator)
            seen.append(seen_as(value))
            return value
        return step

    loader = torch.utils.data.DataLoader(list(range(5)), batch_size=2)
    undo = getattr(_compat, wrapper)(wrap)
    try:
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4]]
    finally:
        undo()
    assert seen == [[0, 1], [2, 3], [4]]
    list(loader)
    assert len(seen) == 3


def test_dataloader_iterator_sampler_is_the_loaders_for_every_epoch() -> None:
    loader = torch.utils.data.DataLoader(list(range(5)), batch_size=2, shuffle=True)
    first, second = iter(loader), iter(loader)
    assert _compat.dataloader_iterator_sampler(first) is _compat.dataloader_iterator_sampler(second)
    assert _compat.dataloader_iterator_sampler(first) is loader.batch_sampler


def test_pipeline_stage_base_holds_the_two_backward_steps_of_every_stage() -> None:
    from torch.distributed.pipelining import PipelineStage

    stage = _compat.pipeline_stage_base()
    assert issubclass(PipelineStage, stage)
    assert {"bwd_chunk_id", "loss", "full_backward"} <= set(inspect.signature(stage.backward_one_chunk).parameters)
    assert "bwd_chunk_id" in inspect.signature(stage.backward_weight_one_chunk).parameters
