"""Compiled programs (`torch.compile`) at every rung: no rung changes what Dynamo traces or Inductor generates
(traced and untraced runs end with the same parameter bits), compiled regions and Inductor's kernels are records,
and `locate` names the racing kernel inside a compiled backward (its deterministic verdict is checked in process:
two traced runs of the deterministic program record the same bits, tests/unit/test_locate_logic.py the verdict).

Inductor compiles are slow on 2 cores: the model is tiny and every test compiles the same few graphs, which
Inductor's on-disk cache (shared by the processes of a session) then serves.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from _tools import load_script
from torch._dynamo.utils import counters

import detrace
from detrace.analyze import diff
from detrace.errors import TraceError
from detrace.investigate.locate import LocateConfig, locate
from detrace.investigate.replay import ReplayConfig, replay
from detrace.record.rungs.compiled import REGION, aten_ops
from detrace.tracefile import Capture, read_rank
from detrace.tracefile.capture import CODE_HASH
from detrace.tracefile.integrity import file_sha256

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_compiled.py"
SMALL = {"steps": 2, "tokens": 4096}
"""A run of the example small enough for the in-process tests (the race needs the default size)."""


@pytest.fixture
def fresh_dynamo() -> Iterator[ModuleType]:
    """The example, with Dynamo's compiled code dropped before and after (each run compiles its own regions, from
    Inductor's cache), and the global settings the example changes put back."""
    import torch._dynamo

    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch._dynamo.reset()
    yield load_script(EXAMPLE)
    torch._dynamo.reset()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


def _rows(run: Path) -> list[dict]:
    return read_rank(run, 0).table.to_pylist()


def _traced_as_untraced(program: Callable[[], Any], run: Path, rung: str) -> dict[str, int]:
    """Run `program` untraced, then traced at `rung` into `run` (Dynamo's compiled code dropped in between), assert
    both return the same, and that Dynamo compiled the same frames and graphs both times (its `counters`, which
    torch._dynamo.reset() keeps, cleared before each run); returns those counts."""
    counters.clear()
    untraced = program()
    graphs = dict(counters["stats"])
    torch._dynamo.reset()
    counters.clear()
    with detrace.trace(run, rung=rung):
        traced = program()
    assert torch.equal(traced, untraced) if isinstance(traced, torch.Tensor) else traced == untraced
    assert dict(counters["stats"]) == graphs
    return graphs


def test_kernel_names_give_the_aten_ops_they_were_lowered_from() -> None:
    assert aten_ops("cpp_fused_expand_index_put_new_zeros_sum_1") == [
        "aten.expand", "aten.index_put", "aten.new_zeros", "aten.sum"]
    assert aten_ops("cpp_fused_add_index_3") == ["aten.add", "aten.index"]
    assert aten_ops("triton_poi_fused_scatter_add_0") == ["aten.scatter_add"]
    assert aten_ops("cpp_fused_0") == []


def test_replaying_a_kernel_whose_compiled_code_is_gone_says_so(tmp_path: Path) -> None:
    capture = Capture(op="inductor.cpp_fused_index_put_0", args=[torch.zeros(4)], kwargs={}, outputs=[],
                      meta={"kernel": "cpp_fused_index_put_0", "code": str(tmp_path / "gone.py"), "writes": [0]})
    with pytest.raises(TraceError, match="is gone"):
        replay(capture, trust_code=True)
    (tmp_path / "other.py").write_text("call = None\n")
    capture.meta["code"] = str(tmp_path / "other.py")
    capture.meta[CODE_HASH] = file_sha256(tmp_path / "other.py")
    with pytest.raises(TraceError, match="holds no kernel cpp_fused_index_put_0"):
        replay(capture, trust_code=True)


FAKE_OUTPUT_CODE = """
import torch

class _AsyncCompile:
    def cpp_pybinding(self, types, source):
        def kernel(in_out_ptr0, in_ptr0):
            in_out_ptr0.copy_(in_ptr0 * 2)  # written before it is read, as Inductor's reused buffers are
        return kernel

async_compile = _AsyncCompile()
_garbage = iter(range(1, 100))

def empty_strided_cpu(size, stride, dtype):
    # uninitialized memory: other contents at each allocation, as a busy machine's allocator leaves them
    return torch.full(size, float(next(_garbage)), dtype=dtype)

cpp_fused_mul_0 = async_compile.cpp_pybinding(['float*', 'const float*'], r'''
extern "C"  void  kernel(float* in_out_ptr0,
                       const float* in_ptr0)
{
    auto out_ptr0 = in_out_ptr0;
}
''')

def call(args):
    (x,) = args
    buf0 = empty_strided_cpu((4,), (1,), torch.float32)
    cpp_fused_mul_0(buf0, x)
    return (buf0,)
"""
"""An output code module the way Inductor writes one (the names the op rung reads: `cpp_pybinding`, `kernel`'s
pointer parameters, `empty_strided_cpu`, `call`), whose kernel writes an uninitialized `in_out_ptr` buffer."""


def test_a_kernels_uninitialized_in_out_buffer_is_not_recorded_as_garbage(tmp_path: Path) -> None:
    # Found on a busy machine: two op-rung runs of the compiled example differed at step 0's first forward kernel,
    # in an input that was memory Inductor had just allocated uninitialized, and locate said inconclusive.
    from detrace.record.rungs.compiled import instrument

    code = tmp_path / "fake_output_code.py"
    code.write_text(FAKE_OUTPUT_CODE)
    module = load_script(code)
    instrument(module)
    x = torch.arange(4.0)
    with detrace.trace(tmp_path / "run", rung="op"):
        results = [module.call([x])[0] for _ in range(2)]
    assert all(torch.equal(result, x * 2) for result in results)  # what the program computes is unchanged
    kernel = [row for row in _rows(tmp_path / "run") if row["name"] == "inductor.cpp_fused_mul_0"]
    inputs = [row["digest"] for row in kernel if row["role"] == "input" and row["index"] == 0]
    assert len(inputs) == 2 and inputs[0] == inputs[1], kernel
    assert module.empty_strided_cpu((2,), (1,), torch.float32).tolist() != [0.0, 0.0]  # untraced: left as it is


@pytest.mark.slow
def test_every_rung_records_a_compiled_model_and_keeps_its_bits(fresh_dynamo: ModuleType, tmp_path: Path) -> None:
    example = fresh_dynamo
    untraced = example.train(deterministic=True, **SMALL)
    for rung in ("semantic", "module", "op", "again"):
        torch._dynamo.reset()
        with detrace.trace(tmp_path / rung, rung="semantic" if rung == "again" else rung):
            assert example.train(deterministic=True, **SMALL) == untraced, rung
        if rung == "again":
            # Two traced runs of the deterministic compiled program, each compiling its own regions, record the
            # same bits: what `detrace locate` compares before it says "deterministic".
            assert diff(tmp_path / "semantic", tmp_path / "again").verdict == "identical"
            continue
        rows = _rows(tmp_path / rung)
        regions = {(r["phase"], r["role"]) for r in rows if r["name"] == REGION and r["step"] == 1}
        # The whole model is one graph, owned by the root module: forward and AOTAutograd's backward.
        assert regions == {("forward", "input"), ("forward", "output"), ("backward", "grad_output"),
                           ("backward", "grad_input")}, rung
        assert {r["module"] for r in rows if r["name"] == REGION} == {""}
        kernels = [r for r in rows if r["name"].startswith("inductor.")]
        if rung != "op":
            assert not kernels
            continue
        assert {r["phase"] for r in kernels} == {"forward", "backward"}
        assert {r["module"] for r in kernels} == {""}
        extras = [json.loads(r["extra"]) for r in kernels]
        assert all(e["kernel"] == r["name"].removeprefix("inductor.") for e, r in zip(extras, kernels, strict=True))
        # Deterministic mode: the gather's backward is ATen's deterministic index_put, called by the compiled
        # code and seen by the dispatch mode, next to Inductor's own kernels.
        assert any(r["name"].startswith("aten.index_put") and r["phase"] == "backward" for r in rows)


@pytest.mark.slow
@pytest.mark.parametrize("variant", [{"compile": "blocks", "fullgraph": True}, {"graph_break": True}],
                         ids=["per-block-fullgraph", "graph-breaks"])
def test_the_module_rung_keeps_per_block_and_broken_graphs_bits(fresh_dynamo: ModuleType, tmp_path: Path,
                                                                variant: dict) -> None:
    # The same bits, and Dynamo compiled the same graphs: the tracer's wrapper of every module call is no frame of
    # Dynamo's (were it one, the graph breaks would cut the model elsewhere, and on an AVX-512 CPU Inductor's kernels
    # round otherwise).
    _traced_as_untraced(functools.partial(fresh_dynamo.train, deterministic=True, **SMALL, **variant),
                        tmp_path / "run", "module")
    rows = [r for r in _rows(tmp_path / "run") if r["step"] == 1]
    forward = {(r["module"], r["occurrence"], json.loads(r["extra"])["compile_id"]) for r in rows
               if r["name"] == REGION and r["phase"] == "forward"}
    backward = {(r["module"], r["occurrence"]) for r in rows if r["name"] == REGION and r["phase"] == "backward"}
    if variant.get("compile") == "blocks":
        # One graph per block, under the block's own name (the compile wrapper looked through).
        assert {(m, o) for m, o, _ in forward} == {("blocks.0", 0), ("blocks.1", 0)}
        assert backward == {("blocks.0", 0), ("blocks.1", 0)}
        assert {r["module"] for r in rows if r["rung"] == "module"} >= {"blocks.0", "blocks.1"}
    else:
        # Each block's graph break splits the model's forward into several graphs, each a region of its own,
        # with a backward of its own.
        assert len(forward) >= 3 and len({m for m, _ in backward}) == len({m for m, *_ in forward}), (forward, backward)
        assert len(backward) == len(forward), (forward, backward)
        # Dynamo gives up on the model's forward (a graph break in its loop) and runs it eagerly, compiling each
        # block's frames: the blocks are module calls the rung records, though Dynamo watches the code calling them.
        assert {r["module"] for r in rows if r["rung"] == "module"} >= {"blocks.0", "blocks.1", "head"}


def _small_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 1))


def _parameter_bits(model: torch.nn.Module) -> str:
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


def _compiled_step_loop(*, optimizer: bool, forward_backward: bool) -> str:
    """A small loop that compiles its optimizer step (`torch.compile(opt.step)`, PyTorch's recipe) or its forward
    and backward as one function; returns a hash of the parameters after 3 steps."""
    model = _small_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = torch.compile(opt.step) if optimizer else opt.step

    def loss_and_grads(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
        loss.backward()
        return loss

    run = torch.compile(loss_and_grads) if forward_backward else loss_and_grads
    data = torch.Generator().manual_seed(0)
    for _ in range(3):
        run(torch.randn(64, 16, generator=data), torch.randn(64, generator=data))
        step()
        opt.zero_grad()
    return _parameter_bits(model)


@pytest.mark.parametrize("compiled", [{"optimizer": True, "forward_backward": False},
                                      {"optimizer": False, "forward_backward": True}],
                         ids=["optimizer-step", "forward-and-backward"])
def test_hooks_called_from_compiled_code_run_eagerly(fresh_dynamo: ModuleType, tmp_path: Path,
                                                     compiled: dict) -> None:
    # The tracer's optimizer hooks and its torch.autograd.backward run inside these compiled functions: Dynamo
    # must not trace them (it would compile the recording code, or stop the program failing to), and the graphs
    # and bits stay the untraced program's.
    graphs = _traced_as_untraced(functools.partial(_compiled_step_loop, **compiled), tmp_path / "run", "semantic")
    assert graphs["unique_graphs"] >= 1
    rows = _rows(tmp_path / "run")
    for step in range(3):
        recorded = {(r["phase"], r["name"], r["role"]) for r in rows if r["step"] == step}
        assert {("forward", "loss", "metric"), ("optimizer", "grad_norm", "metric"), ("optimizer", "0.weight", "grad"),
                ("optimizer", "2.bias", "param"), ("optimizer", "2.bias", "state")} <= recorded, step


def _accumulating_loop() -> str:
    """Gradient accumulation in a compiled function that Dynamo gives up on (a graph break in its loop) and runs
    eagerly, watching the frames it calls: the model's among them. Returns a hash of the parameters."""
    model = _small_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    @torch.compile
    def accumulate(xs: list[torch.Tensor], ys: list[torch.Tensor]) -> None:
        for x, y in zip(xs, ys, strict=True):
            loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
            torch._dynamo.graph_break()
            loss.backward()

    data = torch.Generator().manual_seed(0)
    for _ in range(2):
        accumulate([torch.randn(64, 16, generator=data) for _ in range(2)], [torch.randn(64, generator=data)] * 2)
        opt.step()
        opt.zero_grad()
    return _parameter_bits(model)


def test_a_model_called_from_a_compiled_function_run_eagerly_is_recorded_eagerly(fresh_dynamo: ModuleType,
                                                                                  tmp_path: Path) -> None:
    # The batch recorder's wrapper runs as Dynamo's frame; the recording code it calls must not be compiled (it
    # was, and its graphs were recorded as the program's compiled regions).
    _traced_as_untraced(_accumulating_loop, tmp_path / "run", "semantic")
    rows = _rows(tmp_path / "run")
    assert not [r for r in rows if r["name"] == REGION]
    assert [(r["step"], r["occurrence"]) for r in rows if r["name"] == "batch"] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_a_collective_in_a_compiled_function_stays_in_its_graph(fresh_dynamo: ModuleType, tmp_path: Path,
                                                                free_port: Callable[[], int]) -> None:
    # Dynamo turns `dist.all_reduce` in a compiled function into a functional collective in the graph; through the
    # tracer's wrapper it must still (it graph-broke around the wrapper, and compiled the recording code). The
    # compiled code's call is recorded by the functional rung. One rank of gloo, in this process.
    import torch.distributed as dist

    def run() -> torch.Tensor:
        torch.manual_seed(0)
        layer = torch.nn.Linear(8, 8)

        @torch.compile
        def step(x: torch.Tensor) -> torch.Tensor:
            y = layer(x)
            dist.all_reduce(y)
            return y * 2

        return step(torch.randn(4, 8))

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert _traced_as_untraced(run, tmp_path / "run", "semantic")["unique_graphs"] == 1
    finally:
        dist.destroy_process_group()
    rows = _rows(tmp_path / "run")
    collectives = [r for r in rows if r["phase"] == "collective"]
    assert {r["name"] for r in collectives} == {"all_reduce_"}
    assert {r["role"] for r in collectives} == {"input", "output"}
    assert all(json.loads(r["extra"])["functional"] for r in collectives)


@pytest.mark.slow
@pytest.mark.race
def test_locate_names_the_racing_kernel_of_a_compiled_backward(tmp_path: Path) -> None:
    # The README's command: two steps, so that each run gives the race two chances to strike (with one, a pair
    # under load sometimes did not part: about one run in fifteen repeats another's bits in a step).
    result = locate(LocateConfig(command=(sys.executable, str(EXAMPLE), "--steps", "2"), out=tmp_path / "ladder",
                                 replay=ReplayConfig(repeats=10, min_seconds=1.0)))
    assert result.verdict == "nondeterministic", result.message
    culprit = result.culprit
    assert culprit is not None and culprit.phase == "backward" and culprit.origin
    assert culprit.name.startswith("inductor.cpp_fused_")
    assert any(op in culprit.name for op in ("index_put", "scatter_add", "index_add")), culprit.name
    assert culprit.module == ""
    assert result.replay is not None and result.replay.nondeterministic
    assert result.replay.meta[CODE_HASH] == file_sha256(Path(result.replay.meta["code"]))
    assert any(op in result.replay.meta["aten"] for op in ("aten.index_put", "aten.scatter_add", "aten.index_add"))
    assert "torch.use_deterministic_algorithms(True) before torch.compile" in result.replay.advice[0]
