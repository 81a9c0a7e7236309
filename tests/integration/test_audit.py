"""detrace audit: the op catalog and its judging, the Inductor kernel scanner, the live-object checks and the
report, in process; the probe in process on small models and on each real case (slow). The real `detrace
audit` of a torchrun job is in tests/e2e/test_audit_e2e.py.

The Inductor sources in tests/support/data/inductor/ are output code Inductor generated on this machine (torch 2.13,
CPU) for one graph, the gather `(table[idx] * 2).sum(-1)` of a 16x16 parameter and its backward:
- gather_backward_cpp.txt: the default CPU backend (C++), TORCHINDUCTOR_CACHE_DIR kept after a run;
- gather_backward_triton.txt: the same graph with `torch._inductor.config.cpu_backend = "triton"` and
  `torch.utils._triton.triton_hash_with_backend` patched to a constant (Triton finds no CPU driver here, so
  Inductor wrote the module and failed to load it; the source is what it generates for a GPU, device aside).
"""

from __future__ import annotations

import json
import random
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import pytest
import torch
from audit_cases import CASES, Case
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler

import detrace
from detrace import record as tracing
from detrace._compat import pop_mode, push_mode
from detrace.cli import audit as audit_cli
from detrace.errors import CommandFailed, TraceError, UsageError
from detrace.investigate.audit import judge, probe
from detrace.investigate.audit.catalog import BY_OP, ENTRIES, OpEntry
from detrace.investigate.audit.kernels import scan
from detrace.investigate.audit.records import ENV_AUDIT, SCHEMA, Hazard, merge, rank_file
from detrace.investigate.audit.report import Launch, audit_command, prediction, read_ranks
from detrace.investigate.audit.seeding import SeedWatch
from detrace.launch.launcher import LaunchResult
from detrace.recipe import Finding
from detrace.state.sample_keys import SampleKeys

DATA = Path(__file__).parents[1] / "support" / "data" / "inductor"
INDEX_PUT = BY_OP["index_put_"]


# -- the catalog and judging one call -----------------------------------------------------------------------------

def test_every_catalog_entry_is_an_aten_op_with_the_arguments_it_names() -> None:
    for entry in ENTRIES:
        packet = getattr(torch.ops.aten, entry.op)
        arguments = {a.name for overload in packet.overloads() for a in getattr(packet, overload)._schema.arguments}
        for name in filter(None, (entry.indices, entry.raises_without)):
            assert name in arguments, (entry.op, name)
        needed = {"weights": "weights", "mode-max": "mode", "src-tensor": "src", "with-indices": "dim",
                  "floating": "self", "quantized": "self"}
        if entry.condition in needed:
            assert needed[entry.condition] in arguments, (entry.op, entry.condition)


def _documented() -> list[tuple[str, str]]:
    """(name, its whole bullet) for every operation the installed torch's torch.use_deterministic_algorithms
    documentation lists as nondeterministic (both its lists: made deterministic, and raising)."""
    doc = torch.use_deterministic_algorithms.__doc__ or ""
    section = doc[doc.index("The following normally-nondeterministic"):doc.index("In addition, several")]
    bullets = re.split(r"\n\s*\* ", section)[1:]
    found = []
    for bullet in bullets:
        match = re.match(r":(?:class|func):`([\w.]+)`", bullet)
        assert match, bullet
        found.append((match.group(1), " ".join(bullet.split())))
    return found


def test_every_op_torchs_documentation_lists_is_in_the_catalog_with_the_devices_it_races_on() -> None:
    documented = _documented()
    assert len(documented) >= 40  # the parse found the lists (torch 2.13 has 47 bullets)
    covering: dict[str, set[str]] = {}
    for entry in ENTRIES:
        for name in entry.documented:
            covering.setdefault(name, set()).update(entry.devices)
    for name, bullet in documented:
        assert name in covering, f"torch documents {name} as nondeterministic; no catalog entry covers it"
        # A bullet that names the CPU, or no device at all, races on the CPU: the catalog says so.
        if "CPU" in bullet or "CUDA" not in bullet:
            assert "cpu" in covering[name], bullet
    assert {name for name, _ in documented} <= set(covering)


def test_a_catalog_entry_refuses_indices_without_a_way_to_read_them() -> None:
    with pytest.raises(ValueError, match="go together"):
        OpEntry(op="index_add", devices=("cuda",), indices="index", source="torch-alert", why="atomics")


def test_repeated_counts_destinations_hit_twice() -> None:
    rows = torch.tensor([0, 1, 1, 3, 3, 3])
    assert judge.repeated([rows], "index-list") == (3, 6)
    # two index tensors: a destination is a (row, column) pair
    assert judge.repeated([torch.tensor([0, 0, 1]), torch.tensor([2, 2, 2])], "index-list") == (1, 3)
    assert judge.repeated([None, torch.tensor([1, 2])], "index-list") == (0, 2)
    assert judge.repeated([torch.tensor([True, False, True])], "index-list") == (0, 0)
    assert judge.repeated(torch.tensor([[4, 4], [5, 6]]), "flat") == (1, 4)
    # scatter along dim 1: the same index in two lines is two destinations
    assert judge.repeated(torch.tensor([[0, 1], [0, 1]]), "along-dim", dim=1) == (0, 4)
    assert judge.repeated(torch.tensor([[0, 0], [1, 1]]), "along-dim", dim=1) == (2, 4)
    # max_unpool2d's planes: the last 2 dimensions
    assert judge.repeated(torch.tensor([[[[0, 1]], [[0, 1]]]]), "planes", spatial=2) == (0, 4)


def _judged(op: str, device: str = "cpu", threads: int = 2, **arguments: object) -> tuple[str, str, str] | None:
    return judge.judge_op(BY_OP[op], device=device, arguments=arguments, deterministic=False, threads=threads)


def test_index_accumulation_is_certain_on_cpu_at_two_threads_only_when_indices_repeat() -> None:
    repeats = {"indices": [torch.tensor([0, 0, 1])], "accumulate": True}
    certainty, why, fixer = _judged("index_put_", **repeats) or ("", "", "")
    assert certainty == "certain" and "1 of its 3 indices repeat" in why and "2 threads" in why
    assert fixer == "deterministic"  # detrace.ops' kernels route it on CUDA only
    certainty, why, _ = _judged("index_put_", threads=1, **repeats) or ("", "", "")
    assert certainty == "possible" and "this run used 1" in why
    assert _judged("index_put_", indices=[torch.tensor([0, 1, 2])], accumulate=True) is None
    assert judge.judge_op(INDEX_PUT, device="cpu", arguments=repeats, deterministic=True, threads=2) is None


def test_index_writes_that_race_on_the_cpu_without_accumulating_are_certain() -> None:
    # Measured: 2 threads, 200,000 writes into 50 rows: 12 to 15 different results in 20 runs of each.
    assert (_judged("index_put_", indices=[torch.tensor([0, 0, 1])], accumulate=False) or ("",))[0] == "certain"
    assert (_judged("index_copy_", index=torch.tensor([3, 3]), dim=0) or ("",))[0] == "certain"
    assert _judged("index_copy_", index=torch.tensor([3, 4]), dim=0) is None
    certainty, _, fixer = _judged("put_", index=torch.tensor([1, 1]), accumulate=False) or ("", "", "")
    assert (certainty, fixer) == ("certain", "code")  # torch raises for it under use_deterministic_algorithms
    # max_unpool: the same index in two planes is two destinations
    assert _judged("max_unpool2d", indices=torch.tensor([[[[0, 1]]], [[[0, 1]]]])) is None
    assert (_judged("max_unpool2d", indices=torch.tensor([[[[0, 0]]]])) or ("",))[0] == "certain"


def test_a_cuda_only_race_seen_on_the_cpu_is_possible_and_says_where_it_strikes() -> None:
    scatter = {"index": torch.tensor([[0, 0]]), "dim": 1}
    certainty, why, fixer = _judged("scatter_add", **scatter) or ("", "", "")
    assert certainty == "possible" and why.startswith("on CUDA it adds values with atomic adds")
    assert "this CPU run's kernel does not race" in why and fixer == "kernels"  # detrace.ops routes it on CUDA
    assert (_judged("scatter_add", device="cuda", threads=1, **scatter) or ("",))[0] == "certain"
    assert _judged("scatter_add", index=torch.tensor([[0, 1]]), dim=1) is None  # no destination shared
    assert (_judged("histc", self=torch.ones(3)) or ("", "", ""))[::2] == ("possible", "code")
    # torch's conditions: a floating cumsum, bincount with weights, median with its indices
    assert _judged("cumsum", self=torch.ones(3, dtype=torch.long), dim=0) is None
    assert _judged("cumsum", self=torch.ones(3), dim=0) is not None
    assert _judged("bincount", self=torch.ones(3, dtype=torch.long), weights=None) is None
    assert _judged("median", self=torch.ones(3)) is None
    assert _judged("median", self=torch.ones(3), dim=0) is not None


# -- the kernel scanner -------------------------------------------------------------------------------------------

def test_scanner_names_the_atomic_kernel_of_generated_cpp_with_its_aten_ops() -> None:
    [kernel] = scan((DATA / "gather_backward_cpp.txt").read_text())
    assert kernel.name == "cpp_fused_expand_index_put_mul_new_zeros_unsqueeze_0"
    assert kernel.backend == "cpp" and kernel.device == "cpu" and kernel.atomics == ("atomic_add_vec",)
    assert "aten.index_put" in kernel.aten and not kernel.split_reduction


def test_scanner_finds_tl_atomic_add_in_triton_and_skips_kernels_without_atomics() -> None:
    source = (DATA / "gather_backward_triton.txt").read_text()
    assert "triton_poi_fused_new_zeros_0 = async_compile.triton(" in source  # a kernel with no atomic
    [kernel] = scan(source)
    assert kernel.name == "triton_poi_fused_expand_index_put_mul_new_zeros_unsqueeze_1"
    assert kernel.backend == "triton" and kernel.device == "cuda" and kernel.atomics == ("tl.atomic_add",)
    assert "aten.index_put" in kernel.aten


def test_scanner_calls_a_reduction_with_atomics_a_split_reduction() -> None:
    source = ("triton_red_fused_sum_0 = async_compile.triton('triton_red_fused_sum_0', '''\n"
              "def triton_red_fused_sum_0(in_ptr0, out_ptr0):\n    tl.atomic_add(out_ptr0, tmp3, None)\n"
              "    tl.atomic_max(out_ptr0 + 1, tmp3, None)\n''', device_str='cuda')\n")
    [kernel] = scan(source)
    assert kernel.split_reduction and kernel.atomics == ("tl.atomic_add", "tl.atomic_max")
    assert kernel.aten == ("aten.sum",)


# -- records, settings, parallelism, data -----------------------------------------------------------------------

def _hazard(**fields: object) -> Hazard:
    base: dict[str, object] = {"kind": "op", "certainty": "certain", "subject": "aten.index_put_.default",
                               "what": "w", "fix": "f", "fixed_by": "deterministic"}
    return Hazard(**{**base, **fields})  # type: ignore[arg-type]


def test_hazards_merge_across_ranks_and_calls_certain_first() -> None:
    merged = merge([_hazard(kind="setting", certainty="possible", subject="s", ranks=(0,)),
                    _hazard(ranks=(1,), step=3, count=2), _hazard(ranks=(0,), step=2)])
    assert [h.certainty for h in merged] == ["certain", "possible"]
    assert merged[0].ranks == (0, 1) and merged[0].count == 3 and merged[0].step == 2
    assert Hazard.from_json(merged[0].to_json()) == merged[0]
    with pytest.raises(ValueError, match="unknown certainty"):
        _hazard(certainty="likely")


def test_doctors_findings_become_possible_hazards_and_ok_ones_vanish() -> None:
    findings = [Finding(name="a", value="1", status="ok", detail="fine"),
                Finding(name="torch.use_deterministic_algorithms", value="False", status="pending", detail="d"),
                Finding(name="OMP_NUM_THREADS", value="<unset>", status="risk", detail="r")]
    hazards = judge.settings_hazards(findings)
    assert [(h.subject, h.certainty, h.fixed_by) for h in hazards] == [
        ("torch.use_deterministic_algorithms = False", "possible", "deterministic"),
        ("OMP_NUM_THREADS = <unset>", "possible", "code")]


def test_ddp_bucket_rebuild_and_the_world_size_order_are_possible() -> None:
    rebuilds = SimpleNamespace(module=nn.Linear(2, 2), find_unused_parameters=False, static_graph=False)
    keeps = SimpleNamespace(module=nn.Linear(2, 2), find_unused_parameters=True, static_graph=False)
    hazards = judge.parallel_hazards([rebuilds, keeps], world_size=2, rank=1)
    assert [(h.subject, h.certainty) for h in hazards] == [
        ("DistributedDataParallel #0 (Linear)", "possible"), ("DistributedDataParallel #0 (Linear)", "possible"),
        ("DistributedDataParallel #1 (Linear)", "possible")]
    assert "InvariantDataParallel" in hazards[1].fix and hazards[0].ranks == (1,)
    assert judge.parallel_hazards([keeps], world_size=1, rank=0) == []


def test_nccl_protocol_and_nvls_are_possible_hazards_on_nccl_only() -> None:
    environ = {"NCCL_PROTO": "LL128"}
    assert [h.subject for h in judge.communication_hazards(environ, "nccl", 8, 0)] == [
        "NCCL_PROTO = LL128", "NCCL_NVLS_ENABLE = <unset>"]
    assert judge.communication_hazards({"NCCL_PROTO": "Simple", "NCCL_NVLS_ENABLE": "0"}, "nccl", 8, 0) == []
    assert judge.communication_hazards(environ, "gloo", 8, 0) == []


class _Squares(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        return i * i


class _Stream(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        return iter(range(4))


def test_data_hazards_of_unseeded_workers_stateless_samplers_and_streams() -> None:
    unseeded = DataLoader(_Squares(), shuffle=True, num_workers=2)
    seeded = DataLoader(_Squares(), num_workers=2, generator=torch.Generator().manual_seed(0))
    stream = DataLoader(_Stream())
    # the keys detrace's Lightning/HF integrations install: their epoch and skip are restored by the integration
    keyed = DataLoader(_Squares(), sampler=SampleKeys(RandomSampler(_Squares()), seed=0))
    subjects = [h.subject for h in judge.data_hazards([unseeded, seeded, stream, keyed], ["crop"])]
    assert subjects == ["DataLoader #0 (_Squares)", "DataLoader #0 (_Squares) sampler RandomSampler",
                        "DataLoader #2 (_Stream)", "collate_fn crop"]


def test_a_collate_fn_that_draws_from_a_global_rng_is_seen() -> None:
    seen: list[str] = []

    def crop(batch: list[int]) -> list[int]:
        return batch[random.randint(0, 1):]

    def stack(batch: list[int]) -> torch.Tensor:
        return torch.tensor(batch)

    probe._WatchedCollate(stack, seen.append)([1, 2])
    assert seen == []
    probe._WatchedCollate(crop, seen.append)([1, 2])
    assert seen == ["test_a_collate_fn_that_draws_from_a_global_rng_is_seen.<locals>.crop"]


# -- the report and the command, with a launch seam ---------------------------------------------------------------

def _launch_writing(ranks: dict[int, list[Hazard]], returncode: int = 0) -> Launch:
    def launch(cmd: list[str], out: Path, **options: object) -> LaunchResult:
        assert options["rung"] == "module" and options["env"] == {ENV_AUDIT: "2"}
        assert options["steps"] == "0-1"
        for rank, hazards in ranks.items():
            path = rank_file(Path(out), rank)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"schema": SCHEMA, "rank": rank, "world_size": len(ranks), "steps": 2,
                                        "hazards": [h.to_json() for h in hazards]}))
        return LaunchResult(returncode=returncode, out=Path(out), command=tuple(cmd), elapsed=0.1,
                            output_tail="Traceback ...\nValueError: boom\n")
    return launch


def test_audit_merges_the_ranks_and_exits_1_on_a_certain_hazard(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    launch = _launch_writing({0: [_hazard(ranks=(0,), step=1, phase="backward")],
                              1: [_hazard(ranks=(1,), step=0, phase="backward")]})
    code = audit_cli.main(["--out", str(tmp_path / "a"), "--json", "--", "python", "train.py"],
                          launch=launch)
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["schema"] == "detrace.audit/1" and report["verdict"] == "hazards"
    assert report["ranks"] == [0, 1] and report["possible"] == []
    [hazard] = report["certain"]
    assert (hazard["ranks"], hazard["count"], hazard["step"]) == ([0, 1], 2, 0)


def test_audit_with_only_possible_hazards_exits_0_and_says_what_fixes_them(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    launch = _launch_writing({0: [_hazard(certainty="possible", kind="data", subject="DataLoader #0 (X)",
                                          fixed_by="code", ranks=(0,))]})
    code = audit_cli.main(["--out", str(tmp_path / "a"), "--", "python", "train.py"],
                          launch=launch)
    out = capsys.readouterr().out
    assert code == 0
    assert "possible hazards (1):" in out and "[data] DataLoader #0 (X)" in out
    assert "needing a code change: 1" in out
    assert out.strip().endswith("detrace audit: 0 certain hazards, 1 possible (1 rank, 2 steps audited, "
                                f"{tmp_path / 'a'})")


def test_a_command_that_fails_before_any_rank_wrote_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(CommandFailed, match=r"exited with code 1 before any rank wrote its audit .*boom"):
        audit_command(["python", "x.py"], out=tmp_path / "a", launch=_launch_writing({}, returncode=1))
    with pytest.raises(UsageError, match="at least 1"):
        audit_command(["python", "x.py"], out=tmp_path / "a", steps=0, launch=_launch_writing({}))


def test_a_failed_command_keeps_what_its_ranks_wrote_with_a_note(tmp_path: Path) -> None:
    report = audit_command(["python", "x.py"], out=tmp_path / "a", launch=_launch_writing({0: []}, returncode=3))
    assert report.notes == ("CMD exited with code 3: the audit covers what ran before",)


def test_an_audit_file_of_another_schema_is_refused(tmp_path: Path) -> None:
    path = rank_file(tmp_path, 0)
    path.parent.mkdir()
    path.write_text(json.dumps({"schema": "detrace.audit/0", "rank": 0}))
    with pytest.raises(TraceError, match=r"not an audit file of schema detrace\.audit/1"):
        read_ranks(tmp_path)


def test_audit_without_a_command_reports_this_processs_settings(capsys: pytest.CaptureFixture[str]) -> None:
    torch.use_deterministic_algorithms(False)
    assert audit_cli.main([]) == 0  # settings are possible hazards
    out = capsys.readouterr().out
    assert "[setting] torch.use_deterministic_algorithms = False" in out and "(settings only)" in out


# -- the probe in process -----------------------------------------------------------------------------------------

@contextmanager
def _audited(out: Path, steps: int = 1) -> Iterator[probe.AuditProbe]:
    """The probe as `detrace audit` arms it, in this process."""
    with detrace.trace(out, rung="module", steps=f"0-{steps - 1}"):
        undo = probe.install(tracing.active(), steps)  # type: ignore[arg-type]
        try:
            yield undo[0].__self__  # type: ignore[attr-defined]  # the bound AuditProbe.close
        finally:
            for step in undo:
                step()


class _Gather(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 8))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.table[idx].sum()


def _train_gather(steps: int) -> None:
    model = nn.Sequential(_Gather())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.tensor([1, 1, 1, 2, 5, 5])).backward()
        opt.step()


def test_the_probe_places_the_gather_backward_at_its_step_phase_and_module(tmp_path: Path) -> None:
    torch.set_num_threads(2)
    with _audited(tmp_path / "run"):
        _train_gather(steps=2)  # the second step is not audited
    hazards, ranks, steps = read_ranks(tmp_path / "run")
    [op] = [h for h in hazards if h.kind == "op"]
    assert ranks == [0] and steps == 1
    assert (op.subject, op.certainty, op.step, op.phase, op.module, op.count) == (
        "aten.index_put.default", "certain", 0, "backward", "0", 1)
    assert "3 of its 6 indices repeat" in op.what
    assert any(h.subject.startswith("torch.use_deterministic_algorithms") for h in hazards)
    assert "torch._dynamo" in sys.modules and not any(h.subject.startswith("torch.compile") for h in hazards)


def test_the_probe_sees_nothing_to_fix_under_the_recipe(tmp_path: Path) -> None:
    torch.set_num_threads(2)
    with _audited(tmp_path / "run"):
        detrace.deterministic(0)  # as a script calls it: after the probe was armed, at the process's start
        _train_gather(steps=1)
    hazards, _, _ = read_ranks(tmp_path / "run")
    assert [h for h in hazards if h.kind in ("op", "kernel") or h.fixed_by == "deterministic"] == []


def test_the_probe_scans_loaded_output_code_and_notes_where_it_first_runs(tmp_path: Path) -> None:
    torch.set_num_threads(2)
    ran, idle = ModuleType("ran"), ModuleType("idle")  # as Inductor loads them: the source file, and `call`
    for module in (ran, idle):
        module.__file__ = str(DATA / "gather_backward_cpp.txt")
        module.call = lambda args: args  # type: ignore[attr-defined]

    class CallsTheKernels(torch.autograd.Function):  # a compiled backward, as AOTAutograd runs it
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return x * 1

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            ran.call([grad])  # type: ignore[attr-defined]
            return grad

    with _audited(tmp_path / "run") as active:
        active.loaded(ran)
        active.loaded(idle)
        CallsTheKernels.apply(torch.ones(2, requires_grad=True)).sum().backward()
    hazards, _, _ = read_ranks(tmp_path / "run")
    kernels = [h for h in hazards if h.kind == "kernel"]
    assert [(h.certainty, h.subject, h.step, h.phase) for h in kernels] == [
        ("certain", "cpp_fused_expand_index_put_mul_new_zeros_unsqueeze_0", 0, "backward"),
        ("possible", "cpp_fused_expand_index_put_mul_new_zeros_unsqueeze_0", None, None)]
    assert "aten.index_put" in kernels[0].aten and "loaded but not run" in kernels[1].what
    assert "deterministic mode off" in kernels[0].what


# -- each real case, the probe in process (slow) -------------------------------------------------------------
# The audit of a real `detrace locate` ladder's first run (the probe armed in a real process by DETRACE_AUDIT) is
# checked in tests/e2e/test_locate_e2e.py; the reference trainer's own cases run the probe here, in process.

@pytest.mark.slow
def test_the_reference_trainers_moe_backward_index_put_is_certain(tmp_path: Path) -> None:
    from detrace.workload.train import main as train

    with _audited(tmp_path / "run", steps=2):
        assert train(["--preset", "tiny", "--dispatch", "index", "--threads", "2", "--steps", "2"]) == 0
    hazards, _, _ = read_ranks(tmp_path / "run")
    [op] = [h for h in hazards if h.kind == "op" and h.certainty == "certain"]
    assert op.subject == "aten.index_put.default" and op.phase == "backward"
    assert op.module is not None and op.module.endswith(".moe") and op.step == 0
    assert "indices repeat an earlier one" in op.what


@pytest.mark.slow
def test_the_reference_trainer_with_fixed_dispatch_under_the_recipe_is_clean(tmp_path: Path) -> None:
    from detrace.workload.train import main as train

    with _audited(tmp_path / "run", steps=2):
        assert train(["--preset", "tiny", "--dispatch", "fixed", "--deterministic", "--threads", "2",
                      "--steps", "2"]) == 0
    hazards, _, _ = read_ranks(tmp_path / "run")
    assert [h for h in hazards if h.certainty == "certain" or h.fixed_by != "code"] == []


@pytest.mark.slow
def test_the_compiled_examples_atomic_backward_kernel_is_named_with_its_aten_ops(tmp_path: Path) -> None:
    import torch._dynamo
    from _tools import load_script

    module = load_script(Path(__file__).resolve().parents[2] / "examples" / "train_compiled.py")
    torch._dynamo.reset()
    try:
        with _audited(tmp_path / "run", steps=2):
            module.train(steps=2)  # its default threads: the kernels the CI warm-up compiled
    finally:
        torch._dynamo.reset()
    hazards, _, _ = read_ranks(tmp_path / "run")
    [kernel] = [h for h in hazards if h.kind == "kernel"]
    assert kernel.certainty == "certain" and kernel.phase == "backward" and kernel.subject.startswith("cpp_fused_")
    assert "aten.index_put" in kernel.aten and "atomic_add" in kernel.what
    assert "torch.use_deterministic_algorithms was off and Inductor's deterministic mode off" in kernel.what


@pytest.mark.slow
def test_hf_mixtrals_batched_mm_experts_accumulate_with_repeated_indices(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                        num_experts_per_tok=2, max_position_embeddings=128)
    config._experts_implementation = "batched_mm"
    torch.set_num_threads(2)
    with _audited(tmp_path / "run"):
        torch.manual_seed(0)
        model = transformers.MixtralForCausalLM(config)
        ids = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids).loss.backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    hazards, _, _ = read_ranks(tmp_path / "run")
    [op] = [h for h in hazards if h.kind == "op"]
    assert (op.subject, op.certainty, op.phase, op.module) == (
        "aten.index_put.default", "certain", "backward", "model.layers.0.mlp.experts")


def test_locate_is_told_whether_the_audit_of_its_first_run_predicted_the_culprit(tmp_path: Path) -> None:
    run = tmp_path / "1-semantic-a"
    path = rank_file(run, 0)
    path.parent.mkdir(parents=True)
    kernel = _hazard(kind="kernel", subject="cpp_fused_index_put_0", ranks=(0,), step=0, phase="backward")
    path.write_text(json.dumps({"schema": SCHEMA, "rank": 0, "steps": 2, "hazards": [
        _hazard(ranks=(0,), step=0, phase="backward").to_json(), kernel.to_json()]}))
    said = prediction(run, "aten.index_put_.default")
    assert said is not None and said.startswith("the audit of the first run predicted it: a certain hazard at "
                                                "rank 0, step 0, backward")
    assert (prediction(run, "inductor.cpp_fused_index_put_0") or "").startswith("the audit of the first run predicted")
    assert prediction(run, "aten.mm.default") == ("the audit of the first run did not predict it; it found 2 certain "
                                                  "hazards: aten.index_put_.default, cpp_fused_index_put_0")
    assert prediction(tmp_path / "unaudited", "aten.mm.default") is None


def test_a_command_that_cannot_start_is_one_sentence_and_exit_2(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from detrace.cli import main

    assert main(["audit", "--out", str(tmp_path / "a"), "--", "detrace-no-such-command"]) == 2
    assert capsys.readouterr().err == "detrace audit: error: command not found: detrace-no-such-command\n"


# -- where a script's hazards are, and what it ran (the cases of docs/audit.md's table, in process) ----------------

class _NanoGPT(nn.Module):
    """nanoGPT's own forward indexes its token table (`wte.weight[idx]`) in the root module."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.wpe = nn.Embedding(6, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return (self.wte.weight[idx] + self.wpe(torch.arange(idx.shape[0]))).sum()


def test_a_race_in_the_root_modules_forward_is_placed_in_the_root(tmp_path: Path) -> None:
    torch.set_num_threads(2)
    with _audited(tmp_path / "run"):
        torch.manual_seed(0)
        model = _NanoGPT()
        model(torch.tensor([1, 1, 1, 2, 5, 5])).backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    [op] = [h for h in read_ranks(tmp_path / "run")[0] if h.kind == "op"]
    assert (op.certainty, op.phase, op.module) == ("certain", "backward", "")
    assert op.place == "rank 0, step 0, backward, the root module"


def test_training_in_a_thread_is_audited(tmp_path: Path) -> None:
    torch.set_num_threads(2)
    with _audited(tmp_path / "run"):
        torch.manual_seed(0)
        worker = threading.Thread(target=_train_gather, args=(1,))
        worker.start()
        worker.join()
    hazards, _, steps = read_ranks(tmp_path / "run")
    [op] = [h for h in hazards if h.kind == "op"]
    assert (op.subject, op.certainty, steps) == ("aten.index_put.default", "certain", 1)


def test_the_audit_says_how_many_steps_ran_and_nothing_audited_is_an_error(tmp_path: Path) -> None:
    with _audited(tmp_path / "run", steps=3):
        torch.manual_seed(0)
        _train_gather(steps=1)  # a 1-step script audited with --steps 3
    assert read_ranks(tmp_path / "run")[2] == 1

    def crashes_before_its_first_step(cmd: list[str], out: Path, **options: object) -> LaunchResult:
        path = rank_file(Path(out), 0)
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"schema": SCHEMA, "rank": 0, "world_size": 1, "steps": 0, "hazards": []}))
        return LaunchResult(returncode=1, out=Path(out), command=tuple(cmd), elapsed=0.1, output_tail="boom\n")

    with pytest.raises(CommandFailed, match=r"^nothing audited: python crashed \(exit code 1\) before its first "
                                            r"optimizer step"):
        audit_command(["python", "x.py"], out=tmp_path / "a", steps=99, launch=crashes_before_its_first_step)

    def three_steps(cmd: list[str], out: Path, **options: object) -> LaunchResult:
        path = rank_file(Path(out), 0)
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps({"schema": SCHEMA, "rank": 0, "world_size": 1, "steps": 3, "hazards": []}))
        return LaunchResult(returncode=0, out=Path(out), command=tuple(cmd), elapsed=0.1, output_tail="")

    report = audit_command(["python", "x.py"], out=tmp_path / "b", steps=99, launch=three_steps)
    assert report.steps == 3 and report.notes == ("CMD ran 3 steps of the 99 asked for",)


def test_a_run_that_never_seeds_the_rngs_it_draws_from_is_certain(tmp_path: Path) -> None:
    with _audited(tmp_path / "unseeded"):
        model = nn.Linear(4, 4)  # initial weights from the unseeded generator
        random.random(), np.random.rand()
        model(torch.ones(4)).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    certain = {h.subject for h in read_ranks(tmp_path / "unseeded")[0] if h.certainty == "certain"}
    assert certain == {"torch's default generator never seeded", "Python's random never seeded",
                       "numpy's global RNG never seeded"}
    saved = torch.random.get_rng_state(), random.getstate(), np.random.get_state()
    for how in ("seeded", "restored"):
        with _audited(tmp_path / how):
            if how == "seeded":
                detrace.deterministic(0)  # seeds torch, random and numpy
            else:  # a resumed run restores the states it saved
                torch.set_rng_state(saved[0]), random.setstate(saved[1]), np.random.set_state(saved[2])
            model = nn.Linear(4, 4)
            random.random(), np.random.rand()
            model(torch.ones(4)).sum().backward()
            torch.optim.SGD(model.parameters(), lr=0.1).step()
        assert [h for h in read_ranks(tmp_path / how)[0] if h.certainty == "certain"] == [], how


class _Noisy(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(2)  # an augmentation drawn in the worker


def test_dataloader_workers_that_draw_from_an_unseeded_base_seed_are_certain(tmp_path: Path) -> None:
    def train(seed: int | None) -> list[Hazard]:
        out = tmp_path / f"seed-{seed}"
        with _audited(out):
            if seed is not None:
                torch.manual_seed(seed)
            weight = nn.Parameter(torch.zeros(2))
            loader = DataLoader(_Noisy(), batch_size=2, num_workers=1)  # alive when the audit is written
            for batch in loader:
                (weight * batch).sum().backward()
                torch.optim.SGD([weight], lr=0.1).step()
                break
        return [h for h in read_ranks(out)[0] if h.kind == "data"]

    [unseeded] = train(None)
    assert unseeded.certainty == "certain" and "never seeds" in unseeded.what
    [seeded] = train(0)  # a restart still draws another base seed
    assert seeded.certainty == "possible" and "not reseeded" not in seeded.what  # torch reseeds numpy in workers


def test_ddp_whose_layout_detrace_pinned_is_not_reported_and_set_num_threads_is_a_thread_count(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        for pin in (True, False):  # every live DDP is judged: the pinned one first, which stays silent later too
            out = tmp_path / f"pin-{pin}"
            with _audited(out):
                torch.manual_seed(0)
                torch.set_num_threads(2)
                model = DistributedDataParallel(nn.Linear(4, 4))
                if pin:
                    detrace.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
                model(torch.ones(4)).sum().backward()
                torch.optim.SGD(model.parameters(), lr=0.1).step()
            hazards = read_ranks(out)[0]
            rebuilds = [h.certainty for h in hazards if "rebuilds its gradient buckets" in h.what]
            assert rebuilds == ([] if pin else ["possible"])  # it strikes on a resume
            assert not any(h.subject.startswith("OMP_NUM_THREADS") for h in hazards)
    finally:
        dist.destroy_process_group()


def _audit_source(source: str) -> list[Hazard]:
    """The op and seeding hazards of a script run in this process (1 step, fewer indices): the op probe's mode
    and the seed watch, without a tracer (their place is not asked for)."""
    found: list[Hazard] = []
    stub = SimpleNamespace(watching=True, place=dict, saw=found.append)
    seeds = SeedWatch()
    undo = seeds.install()
    push_mode(probe._OpProbe(stub))  # type: ignore[arg-type]
    try:
        exec(compile(source.replace("range(6)", "range(1)").replace("200000", "4000"), "<case>", "exec"),
             {"__name__": "__case__"})
    finally:
        pop_mode()
        for step in reversed(undo):
            step()
        torch.use_deterministic_algorithms(False)
    return found + seeds.hazards()


@pytest.mark.parametrize("case", [c for c in CASES if "threading" not in c.source], ids=lambda c: c.name)
def test_the_audit_of_each_script_of_the_table_agrees_with_what_check_observed(case: Case) -> None:
    hazards = _audit_source(case.source)
    certain = [h.subject for h in hazards if h.certainty == "certain"]
    assert bool(certain) == case.observed, certain
    if "CUDA only" in case.name:
        assert any(h.kind == "op" and h.certainty == "possible" and "on CUDA" in h.what for h in hazards)
