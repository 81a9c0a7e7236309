"""The tracer in library form (`with detrace.trace(...)`): rungs, step clock, windows, names, no side effects."""

from __future__ import annotations

import gc
import hashlib
import json
import subprocess
import sys
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

import detrace
from detrace.errors import TraceError, UsageError
from detrace.ops.formats import MXFP8Tensor, mxfp8_encode
from detrace.record import set_step
from detrace.record.config import CaptureSelector, TraceConfig, parse_steps_option
from detrace.record.rungs.op import op_info
from detrace.report.terminal import diff_lines
from detrace.tracefile import load_capture, open_run, read_rank


class Net(nn.Module):
    """Small, but with what the rungs must handle: in-place ops, both checkpoint kinds, an embedding.

    checkpoint is looked up at call time, as the library form needs (see tracing/rungs/semantic/recompute.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.block = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=False)
        h = torch.utils.checkpoint.checkpoint(torch.tanh, h, use_reentrant=True)
        out = self.head(h).mean(1)
        out.add_(1.0)
        return out


def train(steps: int = 3, *, metric: bool = False) -> tuple[Net, list[float]]:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 11, (4, 5), generator=gen)
        loss = net(tokens).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if metric:
            detrace.metric("lr", opt.param_groups[0]["lr"])
    return net, losses


def params_digest(net: nn.Module) -> str:
    h = hashlib.sha256()
    for p in net.parameters():
        h.update(p.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def rows(run: Path, rank: int = 0) -> list[dict]:
    return read_rank(run, rank).table.to_pylist()


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.mark.parametrize("rung", ["metrics", "semantic", "module", "op"])
def test_tracing_changes_no_bit(tmp_path: Path, rung: str) -> None:
    untraced, _ = train()
    with detrace.trace(tmp_path / rung, rung=rung):
        traced, _ = train()
    assert params_digest(traced) == params_digest(untraced)
    trace = read_rank(tmp_path / rung, 0)
    assert trace.complete
    assert set(trace.table.column("rung").to_pylist()) == set(("metrics", "semantic", "module", "op")[
        : ("metrics", "semantic", "module", "op").index(rung) + 1])


def test_metrics_are_exact_and_stepped(tmp_path: Path) -> None:
    with detrace.trace(tmp_path / "m"):
        _, losses = train(metric=True)
    records = rows(tmp_path / "m")
    loss = [r for r in records if r["name"] == "loss"]
    assert [r["value"] for r in loss] == losses  # float32 -> float64: exact
    assert [r["step"] for r in loss] == [0, 1, 2]
    assert all(r["role"] == "metric" and r["rung"] == "metrics" for r in records)
    norms = [r for r in records if r["name"] == "grad_norm"]
    assert [r["step"] for r in norms] == [0, 1, 2] and all(r["phase"] == "optimizer" for r in norms)
    # detrace.metric after optimizer.step(): the step's trailing work, so it belongs to that step
    assert [(r["step"], r["value"]) for r in records if r["name"] == "lr"] == [(0, 0.01), (1, 0.01), (2, 0.01)]
    assert [r["seq"] for r in records] == list(range(len(records)))


def test_a_loss_given_no_gradient_in_a_list_is_a_loss(tmp_path: Path) -> None:
    # a pipeline schedule's last stage: torch.autograd.backward([loss], grad_tensors=[None]); a non-loss root with
    # its gradient (an earlier stage's output) is not one
    w = torch.ones(3, requires_grad=True)
    with detrace.trace(tmp_path / "p"):
        torch.autograd.backward([(w * 2).sum()], grad_tensors=[None])
        torch.autograd.backward([(w * 3).sum().reshape(1)], grad_tensors=[torch.ones(1)])
        torch.autograd.backward((w * 4).sum())
    assert [r["value"] for r in rows(tmp_path / "p") if r["name"] == "loss"] == [6.0, 12.0]


def test_grad_norm_is_the_norm_before_clipping(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    totals = []
    with detrace.trace(tmp_path / "c"):
        for clip in ("clip_grad_norm_", "clip_grads_with_norm_", None):
            (model(torch.ones(8)) * 100).sum().backward()
            if clip == "clip_grad_norm_":
                totals.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
            elif clip:  # accelerate's way (so the HF Trainer's): the norm, then the scaling by it
                total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
                torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, total)
                totals.append(float(total))
            opt.step()
            opt.zero_grad()
    norms = [(r["step"], r["value"]) for r in rows(tmp_path / "c") if r["name"] == "grad_norm"]
    # steps 0 and 1 clipped to 1.0: their grad_norm is the total before clipping, once; step 2 the optimizer's
    assert [step for step, _ in norms] == [0, 1, 2] and [v for _, v in norms[:2]] == totals and min(totals) > 10


def test_step_without_optimizer_and_set_step(tmp_path: Path) -> None:
    with detrace.trace(tmp_path / "s"):
        for i in range(3):
            detrace.metric("x", float(i))
            detrace.step()
        set_step(10)
        detrace.metric("x", torch.tensor(0.5, dtype=torch.bfloat16))
    records = rows(tmp_path / "s")
    assert [(r["step"], r["value"], r["dtype"]) for r in records] == [
        (0, 0.0, "float64"), (1, 1.0, "float64"), (2, 2.0, "float64"), (10, 0.5, "bfloat16")]


def test_api_is_inert_without_a_tracer() -> None:
    detrace.step()
    detrace.metric("x", 1.0)
    set_step(3)
    with pytest.raises(UsageError):
        set_step(-1)


def test_semantic_rung_records_optimizer_and_recompute(tmp_path: Path) -> None:
    with detrace.trace(tmp_path / "s", rung="semantic"):
        net, _ = train(steps=2)
    records = [r for r in rows(tmp_path / "s") if r["rung"] == "semantic"]
    names = {n for n, _ in net.named_parameters()}
    optimizer = [r for r in records if r["phase"] == "optimizer"]
    assert {r["name"] for r in optimizer} == names
    by_role = {role: [r for r in optimizer if r["role"] == role and r["step"] == 0] for role in ("grad", "param")}
    assert len(by_role["grad"]) == len(by_role["param"]) == len(names)
    states = [r for r in optimizer if r["role"] == "state" and r["name"] == "head.weight" and r["step"] == 0]
    assert json.loads(states[0]["extra"]) == {"state": ["exp_avg", "exp_avg_sq", "step"]} and len(states) == 3
    recompute = [r for r in records if r["phase"] == "recompute"]
    assert len(recompute) == 2 * 2  # two checkpoints, two steps, one output each
    assert all(json.loads(r["extra"]) == {"matches_forward": True} for r in recompute)
    forward = [r for r in records if r["name"] == "checkpoint" and r["phase"] == "forward"]
    # backward recomputes in reverse order
    assert sorted(r["digest"] for r in forward) == sorted(r["digest"] for r in recompute)


def test_module_rung_names_and_scopes(tmp_path: Path) -> None:
    with detrace.trace(tmp_path / "m", rung="op"):
        train(steps=1)
    records = rows(tmp_path / "m")
    modules = {(r["module"], r["name"]) for r in records if r["rung"] == "module"}
    assert {("", "Net"), ("embed", "Embedding"), ("block.0", "Linear"), ("head", "Linear")} <= modules
    grads = {(r["module"], r["role"]) for r in records if r["rung"] == "module" and r["phase"] == "backward"}
    assert ("head", "grad_output") in grads and ("head", "grad_input") in grads
    # ops know their innermost module, in forward and in backward; the recompute has its own phase
    ops = {(r["phase"], r["module"], r["name"]) for r in records if r["rung"] == "op"}
    assert ("forward", "head", "aten.addmm.default") in ops or ("forward", "head", "aten.mm.default") in ops
    assert ("backward", "embed", "aten.embedding_dense_backward.default") in ops
    assert ("recompute", "block.0", "aten.addmm.default") in ops
    assert any(phase == "optimizer" for phase, _, _ in ops)
    # calls share their event; inputs come before outputs
    by_event: dict[int, list[dict]] = {}
    for r in records:
        by_event.setdefault(r["event"], []).append(r)
    assert all(group[0]["seq"] == event for event, group in by_event.items())


def test_op_rung_rule(tmp_path: Path) -> None:
    with detrace.trace(tmp_path / "o", rung="op"):
        x = torch.arange(6.0).reshape(2, 3)  # factory without tensor inputs: skipped
        y = x.t()  # view: skipped
        z = y.clone()
        z.add_(1)  # in-place: the mutated tensor is recorded
        torch.randn(2, generator=torch.Generator().manual_seed(0))  # seeded factory: recorded
        torch.empty_like(z)  # uninitialised memory: skipped
        detrace.step()
    records = rows(tmp_path / "o")
    calls = [(r["name"], r["role"]) for r in records]
    assert ("aten.clone.default", "input") in calls and ("aten.clone.default", "output") in calls
    assert ("aten.add_.Tensor", "mutated") in calls and ("aten.add_.Tensor", "output") not in calls
    # digests are of the bits at record time, although z was changed in place before they were computed
    by_call = {(r["name"], r["role"]): r["digest"] for r in records}
    assert by_call["aten.clone.default", "output"] == detrace.fingerprint(x.t().contiguous()).digest
    assert by_call["aten.add_.Tensor", "mutated"] == detrace.fingerprint(z).digest
    assert ("aten.randn.generator", "output") in calls
    names = {r["name"] for r in records}
    assert not names & {"aten.arange.start", "aten.t.default", "aten.transpose.int", "aten.view.default",
                        "aten.empty_like.default", "aten.empty.memory_format"}
    assert op_info(torch.ops.aten.view.default).skip and op_info(torch.ops.c10d.allreduce_.default).skip
    assert not op_info(torch.ops.aten.index_put_.default).skip


def test_windows_and_max_numel(tmp_path: Path) -> None:
    with detrace.trace(tmp_path / "w", rung="op", steps={"op": "1", "module": "1"}, max_numel=20):
        train(steps=3)
    records = rows(tmp_path / "w")
    assert {r["step"] for r in records if r["rung"] in ("op", "module")} == {1}
    assert {r["step"] for r in records if r["rung"] == "semantic"} == {0, 1, 2}
    big = [r for r in records if r["numel"] > 20]
    small = [r for r in records if r["numel"] <= 20 and r["rung"] != "metrics"]
    assert big and all(r["digest"] is None and r["shape"] for r in big)
    assert small and all(r["digest"] is not None for r in small)
    # The diff cannot vouch for the bits it was not given: it says how many records it could not verify.
    with detrace.trace(tmp_path / "w2", rung="op", steps={"op": "1", "module": "1"}, max_numel=20):
        train(steps=3)
    result = detrace.diff(tmp_path / "w", tmp_path / "w2")
    assert result.verdict == "identical" and result.compared.unverified == len(big)
    assert diff_lines(result)[1].startswith(f"not verified: {len(big):,} records carry no digest")


def test_rank_outside_window_writes_nothing(tmp_path: Path) -> None:
    with detrace.trace(tmp_path / "r", ranks="1-3"):
        train(steps=1)
    assert not (tmp_path / "r").exists() or not list((tmp_path / "r").iterdir())


def test_existing_trace_refused_unless_forced(tmp_path: Path) -> None:
    with detrace.trace(tmp_path / "t"):
        train(steps=1)
    with pytest.raises(TraceError, match="already holds a trace"), detrace.trace(tmp_path / "t"):
        pass
    with detrace.trace(tmp_path / "t", force=True):
        train(steps=2)
    assert read_rank(tmp_path / "t", 0).last_step == 1
    info = open_run(tmp_path / "t")
    assert info.header.rung == "metrics" and info.world_size == 1


def test_no_tensor_kept_alive(tmp_path: Path) -> None:
    seen: list[weakref.ref[torch.Tensor]] = []
    hook = nn.modules.module.register_module_forward_hook(lambda m, a, out: seen.append(weakref.ref(out)))
    try:
        with detrace.trace(tmp_path / "k", rung="op"):
            train(steps=2)
            gc.collect()
            assert seen and all(ref() is None for ref in seen)
    finally:
        hook.remove()


def test_capture_saves_the_selected_call(tmp_path: Path) -> None:
    spec = "step=1,phase=backward,name=aten.embedding_dense_backward.default,occurrence=0"
    with detrace.trace(tmp_path / "c", rung="op", capture=spec):
        train(steps=2)
    (path,) = (tmp_path / "c" / "capture").iterdir()
    capture = load_capture(path)
    assert capture.op == "aten.embedding_dense_backward.default"
    assert capture.meta["step"] == 1 and capture.meta["module"] == "embed" and capture.meta["threads"] == 1
    event = capture.meta["seq"]
    assert path.name == f"rank-00000-seq{event:08d}.safetensors"
    (out_record,) = [r for r in rows(tmp_path / "c") if r["event"] == event and r["role"] == "output"]
    assert list(capture.outputs[0].shape) == out_record["shape"]


def test_bad_configuration() -> None:
    with pytest.raises(UsageError, match="unknown rung"):
        TraceConfig(out=Path("x"), rung="kernel")
    with pytest.raises(UsageError, match="malformed SPEC"):
        TraceConfig(out=Path("x"), steps="3-1")
    with pytest.raises(UsageError, match="needs --rung op"):
        TraceConfig(out=Path("x"), capture="name=aten.mm.default")
    with pytest.raises(UsageError, match="malformed capture selector"):
        CaptureSelector.parse("name=aten.mm.default,step=x")
    with pytest.raises(UsageError, match="no name"):
        CaptureSelector.parse("step=1")
    assert parse_steps_option(["2-4", "op=3"]) == {"metrics": "2-4", "semantic": "2-4", "module": "2-4", "op": "3"}
    config = TraceConfig(out=Path("x"), rung="op", steps={"op": "3"}, capture="name=aten.mm.default,rank=1")
    assert TraceConfig.from_env({"DETRACE_TRACE": config.to_env()}) == config


def test_two_optimizers_share_a_step(tmp_path: Path) -> None:
    a, b = nn.Linear(3, 1), nn.Linear(3, 1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.Adam(b.parameters())
    with detrace.trace(tmp_path / "two"):
        for _ in range(3):
            (a(torch.ones(2, 3)).sum() + b(torch.ones(2, 3)).sum()).backward()
            opt_a.step()
            opt_b.step()
    records = rows(tmp_path / "two")
    assert [r["step"] for r in records if r["name"] == "loss"] == [0, 1, 2]
    assert [(r["step"], r["occurrence"]) for r in records if r["name"] == "grad_norm"] == [
        (0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]



class Gather(nn.Module):
    """A table read with advanced indexing: its backward is aten.index_put with accumulate=True."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(6, 4))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table[idx]


class GatherThenLinear(nn.Module):
    """`gather`'s output feeds `fc` directly: the same tensor carries gather's grad_output hook and fc's
    grad_input hook, which fire in that order, so fc's backward ends after gather's has begun."""

    def __init__(self) -> None:
        super().__init__()
        self.gather = Gather()
        self.fc = nn.Linear(4, 2)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc(self.gather(idx))


def test_backward_ops_know_their_module_when_scopes_overlap(tmp_path: Path) -> None:
    torch.manual_seed(0)
    net = GatherThenLinear()
    with detrace.trace(tmp_path / "b", rung="op"):
        net(torch.tensor([0, 3, 3, 5])).sum().backward()
        detrace.step()
    backward = [(r["module"], r["name"]) for r in rows(tmp_path / "b") if r["phase"] == "backward"
                and r["rung"] == "op"]
    index_put = {module for module, name in backward if name.startswith("aten.index_put")}
    assert index_put == {"gather"}, backward
    assert {module for module, name in backward if name == "aten.mm.default"} == {"fc"}


class Quantize(nn.Module):
    def forward(self, x: torch.Tensor) -> MXFP8Tensor:
        return mxfp8_encode(x)


class Dequantize(nn.Module):
    def forward(self, q: MXFP8Tensor) -> torch.Tensor:
        return q.dequantize()


def test_quantized_tensors_are_recorded_by_component(tmp_path: Path) -> None:
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    with detrace.trace(tmp_path / "q", rung="module"):
        q = Quantize()(x)
        Dequantize()(q)
        detrace.step()
    records = rows(tmp_path / "q")
    for name, role in (("Quantize", "output"), ("Dequantize", "input")):
        call = [r for r in records if r["name"] == name and r["role"] in (role, "component")]
        # the object (its digest covers every component), then one record per component
        assert [(r["role"], r["index"], r["dtype"]) for r in call] == [
            (role, 0, "mxfp8_e4m3"), ("component", 0, "float8_e4m3fn"), ("component", 1, "float8_e8m0fnu")]
        assert call[0]["digest"] == detrace.fingerprint(q).digest and call[0]["shape"] == [4, 64]
        assert [json.loads(r["extra"]) for r in call[1:]] == [
            {"component": part, "of": role, "index": 0} for part in ("data", "scales")]
        assert [r["digest"] for r in call[1:]] == [detrace.fingerprint(q.data).digest,
                                                    detrace.fingerprint(q.scales).digest]


class DataSGD(torch.optim.Optimizer):
    """Plain SGD written the old way: through `.data`, which bumps no version counter."""

    def __init__(self, params: object) -> None:
        super().__init__(params, {})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.abs()  # an op reading p: the op rung records (and could reuse) its fingerprint
                p.data.sub_(0.5 * p.grad)


def test_optimizer_outputs_are_fingerprinted_after_writes_behind_the_version_counter(tmp_path: Path) -> None:
    net = nn.Linear(3, 2)
    optimizer = DataSGD(net.parameters())
    with detrace.trace(tmp_path / "d", rung="op"):
        net(torch.ones(4, 3)).sum().backward()
        optimizer.step()
    params = {r["name"]: r["digest"] for r in rows(tmp_path / "d") if r["role"] == "param"}
    assert params == {name: detrace.fingerprint(p).digest for name, p in net.named_parameters()}


FUNCTIONAL = """
import sys
import torch
import torch.distributed as dist
import detrace
from detrace._exit import leave

rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + port, rank=rank, world_size=2)
import torch.distributed._functional_collectives  # registers the ops
ops, group = torch.ops._c10d_functional, dist.group.WORLD.group_name
for rung in ("semantic", "op"):  # op: its dispatch mode calls the overload again, inside the recorded call
    with detrace.trace(f"{out}/{rung}/{rank}", rung=rung):
        x = torch.arange(4.0) + rank
        a = ops.wait_tensor(ops.all_reduce(x, "sum", group))  # the op packet
        b = ops.wait_tensor.default(ops.all_reduce.default(x * 2, "sum", group))  # the overload, as compiled code
        c = ops.wait_tensor.default(ops.all_gather_into_tensor.default(x, 2, group))
        detrace.step()
    print(rung, a.tolist(), b.tolist(), c.tolist(), flush=True)
# the overloads are themselves again: the tracer swapped their class only while it ran
print("restored", type(ops.all_reduce.default) is torch._ops.OpOverload, flush=True)
dist.barrier()
dist.destroy_process_group()
leave(0)
"""


def test_functional_collectives_through_the_overload_are_recorded_once(tmp_path: Path,
                                                                      free_port: Callable[[], int]) -> None:
    import subprocess
    import sys

    script = tmp_path / "functional.py"
    script.write_text(FUNCTIONAL)
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), port, str(tmp_path)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for rank in (0, 1)]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outputs
    for output in outputs:
        for rung in ("semantic", "op"):  # the values, unchanged
            assert f"{rung} [1.0, 3.0, 5.0, 7.0] [2.0, 6.0, 10.0, 14.0] [0.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0, 4.0]" \
                in output
        assert "restored True" in output
    for rung in ("semantic", "op"):
        traces = [[r for r in rows(tmp_path / rung / str(rank), rank) if r["extra"] == '{"functional": true}']
                  for rank in (0, 1)]
        for trace in traces:
            assert [(r["name"], r["occurrence"], r["group_seq"], r["role"]) for r in trace] == [
                ("all_reduce", 0, 0, "input"), ("all_reduce", 0, 0, "output"),
                ("all_reduce", 1, 1, "input"), ("all_reduce", 1, 1, "output"),
                ("all_gather_into_tensor", 0, 2, "input"), ("all_gather_into_tensor", 0, 2, "output")]
        outputs_digests = [[r["digest"] for r in trace if r["role"] == "output"] for trace in traces]
        assert outputs_digests[0] == outputs_digests[1]  # every rank gets the same bits


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_tensors_never_break_the_op_rung(tmp_path: Path, layout: torch.layout) -> None:
    parts = [torch.arange(6.0).reshape(2, 3), torch.arange(12.0).reshape(4, 3)]
    with warnings.catch_warnings():  # torch's "prototype stage" warning, shown once per process (not ours)
        warnings.simplefilter("ignore", UserWarning)
        nested = torch.nested.nested_tensor(parts, layout=layout)
    with detrace.trace(tmp_path / "run", rung="op"):
        doubled = nested * 2
        detrace.step()
    assert [t.tolist() for t in doubled.unbind()] == [(p * 2).tolist() for p in parts]
    rows = read_rank(tmp_path / "run", 0).table.to_pylist()
    [out] = [r for r in rows if r["name"] == "aten.mul.Tensor" and r["role"] == "output"]
    # what is recorded of a nested tensor: its packed elements, fingerprinted
    assert out["numel"] == 18 and out["digest"] is not None


def test_a_step_0_that_never_ends_is_flushed_every_4096_records(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """F4: the flush every 4096 records holds from the first record: a single process killed in step 0 (no
    optimizer step ever ends it) keeps all but what came after its last flush."""
    from detrace.record.session import _RANK_VARIABLES

    for variable in _RANK_VARIABLES:  # a single process: nothing marks it as a future rank
        monkeypatch.delenv(variable, raising=False)
    with detrace.trace(tmp_path / "run", rung="op"):
        x = torch.zeros(4)
        for _ in range(4500):  # ~9,000 op records, all in step 0
            x = x + 1
        trace = read_rank(tmp_path / "run", 0)  # the file as a SIGKILL now would leave it
    assert trace.table.num_rows >= 9000 - 4096 and not trace.complete
    assert set(trace.table.column("step").to_pylist()) == {0}


def test_a_traced_process_never_imports_pandas(tmp_path: Path) -> None:
    # pyarrow.array imports pandas whenever it is installed (0.3-0.6 s in every traced process): the tracer builds its
    # columns without it (detrace.tracefile.columns)
    pytest.importorskip("pandas")
    code = ("import sys, torch, detrace\n"
            f"with detrace.trace({str(tmp_path / 'run')!r}, rung='op'):\n"
            "    w = torch.ones(3, requires_grad=True); (w * 2).sum().backward(); detrace.metric('loss', 1.5)\n"
            "print('pandas' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False" and read_rank(tmp_path / "run", 0).table.num_rows > 0


def test_a_trace_names_its_fingerprint_scheme_and_records_its_digests(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """DETRACE_FINGERPRINT_SCHEME=fp2: the header says detrace-fp2 and every digest is fp2's; a bad value refuses
    the tracer at start in one sentence."""
    from detrace.digest import fingerprint

    monkeypatch.setenv("DETRACE_FINGERPRINT_SCHEME", "fp2")
    with detrace.trace(tmp_path / "fp2", rung="semantic"):
        net, _ = train(steps=1)
    trace = read_rank(tmp_path / "fp2", 0)
    assert trace.header.fingerprint == open_run(tmp_path / "fp2").header.fingerprint == "detrace-fp2"
    params = {row["name"]: row["digest"] for row in trace.table.to_pylist() if row["role"] == "param"}
    assert params == {name: fingerprint(p, scheme="fp2").digest for name, p in net.named_parameters()}
    monkeypatch.setenv("DETRACE_FINGERPRINT_SCHEME", "fp3")
    with pytest.raises(UsageError, match="DETRACE_FINGERPRINT_SCHEME='fp3' is not one of fp1, fp2"):
        detrace.trace(tmp_path / "bad", rung="semantic").__enter__()
