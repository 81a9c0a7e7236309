"""The user scripts of docs/topology.md (examples/topology/), each checked by the real `detrace check-topology`
(torchrun jobs): the same bits at every layout they name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from detrace.cli import main as cli

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "topology"


def _check(capsys: pytest.CaptureFixture[str], tmp_path: Path, *args: str) -> tuple[int, dict[str, object]]:
    code = cli(["check-topology", "--json", "--out", str(tmp_path / "out"), "--timeout", "300", *args])
    captured = capsys.readouterr()
    assert captured.out.strip(), captured.err
    return code, json.loads(captured.out.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_data_parallel_script_gives_the_same_bits_at_worlds_1_and_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _check(capsys, tmp_path, "--worlds", "1,2", "--", sys.executable, str(EXAMPLES / "dp.py"))
    assert code == 0, report
    assert report["steps"] == 3 and report["tensors"] == 4  # every parameter after every step, by name


@pytest.mark.slow
def test_the_fsdp_script_gives_the_same_bits_at_one_and_two_shards(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # fsdp1 runs fully_shard at one process, where it never calls the reduce-scatter: the recipe's tree must still
    # sum every microbatch (it kept the last one's gradient only), so fsdp1 and fsdp2 differed at the final params
    code, report = _check(capsys, tmp_path, "--layouts", "fsdp1,fsdp2", "--", sys.executable,
                          str(EXAMPLES / "fsdp.py"))
    assert code == 0, report
    # the script prints nothing: every parameter is compared after every step through the tracer's records of the
    # shards (their parts of each parameter's global fingerprint, added up by check-topology)
    assert report["steps"] == 3 and report["tensors"] == 6
    assert report["final_params"] == {"layout fsdp1": None, "layout fsdp2": None}


@pytest.mark.slow
def test_the_expert_parallel_script_gives_the_same_bits_on_one_and_two_expert_ranks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, report = _check(capsys, tmp_path, "--layouts", "ep1,ep2", "--", sys.executable, str(EXAMPLES / "expert.py"))
    assert code == 0, report
    # the script prints nothing: every parameter after every step, the experts (DTensors sharded over ep) through
    # their shards' parts, the router and the dense layers as replicas every rank holds whole
    assert report["steps"] == 3 and report["tensors"] == 7
    assert report["final_params"] == {"layout ep1": None, "layout ep2": None}


@pytest.mark.slow
def test_the_expert_parallel_script_with_the_ordinary_all_to_all_differs_on_two_expert_ranks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the control: each local expert's weight gradient is one GEMM over both ranks' tokens, added up by autograd
    code, report = _check(capsys, tmp_path, "--layouts", "ep1,ep2", "--", sys.executable, str(EXAMPLES / "expert.py"),
                          "--plain")
    assert code == 1 and report["identical"] is False, report
    first = report["first"]
    assert isinstance(first, dict) and first["run"] == "layout ep2" and first["step"] == 0, report
    # every parameter is compared after every step, the first that differs named (by hand: head.weight, the experts'
    # outputs reaching the dense layers)
    assert first["kind"] == "param" and first["name"] in ("head.weight", "head.bias", "inp.weight", "inp.bias",
                                                          "moe.router.weight", "moe.w1", "moe.w2"), report


@pytest.mark.slow
def test_the_moe_dropin_script_gives_the_same_bits_on_one_and_two_expert_ranks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # torchtitan's all-to-all MoE with detrace's ExpertParallel, parallelize_module and fully_shard: the experts
    # (DTensors sharded over ep) and the dense layers (fully_shard over every rank) compared after every step
    code, report = _check(capsys, tmp_path, "--layouts", "ep1,ep2", "--", sys.executable,
                          str(EXAMPLES / "moe_dropin.py"), "--api", "detrace", "--steps", "2")
    assert code == 0, report
    assert report["steps"] == 2 and report["tensors"] == 27
