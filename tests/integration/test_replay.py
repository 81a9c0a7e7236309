"""The kernel rung: replay of captured op calls, on real CPU nondeterminism (no injected fault)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from detrace.cli import main
from detrace.errors import UntrustedCode
from detrace.investigate.replay import (
    FIX_DETERMINISTIC,
    FIX_ONE_THREAD,
    ReplayConfig,
    _ulp,
    find_capture,
    list_captures,
    replay,
    replay_file,
)
from detrace.record.capture import Capturer, PendingCapture
from detrace.record.records import Call
from detrace.tracefile import load_capture, save_capture
from detrace.tracefile.capture import CAPTURE_VERSION, CODE_HASH
from detrace.tracefile.integrity import file_sha256

# Big enough that the accumulating CPU kernel splits across 2 threads, and long enough (~0.1 s a call) that the
# two threads overlap in time even on a loaded machine, where a short call often runs its threads one after the
# other (measured: 16 of 20 calls differ at a load average of 10 on 2 cores).
ROWS, TARGETS, INDICES, WIDTH = 1 << 16, 1 << 13, 1 << 17, 16


def _index_put_capture(run: Path, *, seq: int = 7, rank: int = 0) -> Path:
    g = torch.Generator().manual_seed(0)
    x = torch.zeros(ROWS, WIDTH)
    idx = torch.randint(0, TARGETS, (INDICES,), generator=g)
    values = torch.randn(INDICES, WIDTH, generator=g)
    out = torch.ops.aten.index_put_.default(x.clone(), [idx], values, True)
    meta = {"rank": rank, "step": 1, "phase": "backward", "module": "gather", "name": "aten.index_put_.default",
            "occurrence": 0, "seq": seq, "threads": 2, "deterministic": False}
    return save_capture(run / "capture" / f"rank-{rank:05d}-seq{seq:08d}.safetensors", op="aten.index_put_.default",
                        args=[x, [idx], values, True], kwargs={}, outputs=[out], meta=meta)


def _mm_capture(run: Path, seq: int = 9) -> Path:
    a = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    b = torch.randn(32, 16, generator=torch.Generator().manual_seed(2))
    return save_capture(run / "capture" / f"rank-00000-seq{seq:08d}.safetensors", op="aten.mm.default",
                        args=[a, b], kwargs={}, outputs=[a @ b],
                        meta={"rank": 0, "step": 0, "phase": "forward", "seq": seq, "threads": 2,
                              "deterministic": False})


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("replay-run")
    _index_put_capture(run)
    _mm_capture(run)
    return run


@pytest.mark.race
def test_accumulating_index_put_is_nondeterministic_and_fixed_by_both_switches(run_dir: Path) -> None:
    result = replay_file(find_capture(run_dir, "7"), ReplayConfig(repeats=8))
    assert result.nondeterministic
    assert result.base.threads == 2 and not result.base.deterministic
    assert result.base.differing_elements > 0 and result.base.max_ulp > 0
    assert FIX_DETERMINISTIC in result.fixed_by and FIX_ONE_THREAD in result.fixed_by
    arms = {(a.threads, a.deterministic): a for a in result.arms}
    assert set(arms) == {(1, False), (1, True), (2, False), (2, True)}
    assert arms[(2, True)].distinct == 1 and arms[(1, False)].distinct == 1
    summary = result.summary()
    assert list(summary) == ["nondeterministic", "repeats", "differing_elements", "max_ulp", "fixed_by"]
    assert summary["repeats"] >= 8


def test_in_place_op_starts_from_the_captured_inputs_each_time(run_dir: Path) -> None:
    # index_put_ writes into its first argument: were it reused, the single-thread arm would accumulate twice and
    # never reproduce the traced call's bits.
    capture = load_capture(find_capture(run_dir, "7"))
    result = replay(capture, ReplayConfig(repeats=3, min_seconds=0, threads=(1,)))
    one = next(a for a in result.arms if a.threads == 1 and not a.deterministic)
    assert one.distinct == 1
    assert torch.equal(capture.args[0], torch.zeros(ROWS, WIDTH))


def test_deterministic_op_reports_no_fix(run_dir: Path) -> None:
    result = replay_file(find_capture(run_dir, "9"), ReplayConfig(repeats=4, min_seconds=0))
    assert not result.nondeterministic and result.fixed_by == []
    assert all(a.distinct == 1 and a.matches_capture for a in result.arms)


def test_ulp_distance_is_exact_across_signs_and_widths() -> None:
    one = torch.tensor([1.0], dtype=torch.float32)
    assert _ulp(one, torch.nextafter(one, torch.tensor([2.0]))) == (1, 1)
    tiny = torch.tensor([1e-45], dtype=torch.float32)  # the smallest positive subnormal: 1 ULP above +0
    assert _ulp(tiny, -tiny) == (1, 2)
    assert _ulp(torch.tensor([0.0]), torch.tensor([-0.0])) == (1, 0)
    big = torch.tensor([1.0], dtype=torch.float64)
    assert _ulp(big, big + 2 * torch.finfo(torch.float64).eps) == (1, 2)
    assert _ulp(torch.tensor([1.0], dtype=torch.bfloat16), torch.tensor([1.0078125], dtype=torch.bfloat16)) == (1, 1)
    assert _ulp(torch.tensor([3, 5]), torch.tensor([3, 9])) == (1, 4)


@pytest.mark.race
def test_cli_exit_codes_and_json(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(run_dir), "--event", "9", "--repeats", "3", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["schema"] == "detrace.replay/1" and payload["nondeterministic"] is False
    assert payload["op"] == "aten.mm.default"
    path = find_capture(run_dir, "7")
    assert main(["replay", str(run_dir), "--event", str(path), "--threads", "2", "--repeats", "5"]) == 1
    out = capsys.readouterr().out
    assert "nondeterministic" in out and FIX_DETERMINISTIC in out


def test_captures_are_listed_in_rank_and_seq_order(run_dir: Path) -> None:
    assert [p.name for p in list_captures(run_dir)] == ["rank-00000-seq00000007.safetensors",
                                                        "rank-00000-seq00000009.safetensors"]
    assert list_captures(run_dir / "nowhere") == []


@pytest.mark.parametrize(
    "args,message",
    [
        (["--event", "3"], "holds no capture of event 3"),
        (["--event", "seven"], "seq number or a capture file path"),
        (["--event", "nope.safetensors"], "does not exist"),
        (["--event", "9", "--repeats", "1"], "at least 2 repeats"),
        (["--event", "9", "--threads", "two"], "comma-separated integers"),
        (["--event", "9", "--threads", "0"], "positive integers"),
    ],
)
def test_bad_input_is_one_sentence(run_dir: Path, args: list[str], message: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(run_dir), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_missing_capture_folder_and_ambiguous_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", str(tmp_path), "--event", "1"]) == 2
    assert "holds no capture" in capsys.readouterr().err
    _mm_capture(tmp_path, seq=4)
    other = tmp_path / "capture" / "rank-00001-seq00000004.safetensors"
    other.write_bytes((tmp_path / "capture" / "rank-00000-seq00000004.safetensors").read_bytes())
    assert main(["replay", str(tmp_path), "--event", "4"]) == 2
    assert "pick one with --rank" in capsys.readouterr().err
    assert main(["replay", str(tmp_path), "--event", "4", "--rank", "1", "--repeats", "2"]) == 0


def test_corrupt_capture_is_a_trace_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "capture" / "rank-00000-seq00000001.safetensors"
    bad.parent.mkdir()
    bad.write_bytes(b"not a safetensors file")
    assert main(["replay", str(tmp_path), "--event", "1"]) == 2
    assert "not a readable detrace capture" in capsys.readouterr().err


def _planted_capture(run: Path, marker: Path, *, record_hash: bool = True) -> tuple[Path, Path]:
    """A capture of a 'compiled kernel' whose output code is a planted .py that writes `marker` when imported."""
    code = run / "planted.py"
    code.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                    "def cpp_fused_index_put_0(out):\n    out.add_(1)\n")
    meta = {"rank": 0, "step": 0, "phase": "forward", "seq": 5, "threads": 1, "deterministic": False,
            "kernel": "cpp_fused_index_put_0", "code": str(code), "writes": [0]}
    if record_hash:
        meta[CODE_HASH] = file_sha256(code)
    path = save_capture(run / "capture" / "rank-00000-seq00000005.safetensors", op="inductor.cpp_fused_index_put_0",
                        args=[torch.zeros(4)], kwargs={}, outputs=[torch.ones(4)], meta=meta)
    return path, code


def test_code_named_in_a_capture_never_runs_without_trust_code(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "marker"
    _planted_capture(tmp_path, marker)
    assert main(["replay", str(tmp_path), "--event", "5", "--repeats", "2"]) == 2
    err = capsys.readouterr().err
    assert "would execute the Python file" in err and "--trust-code" in err and err.count("\n") == 1
    assert not marker.exists()
    with pytest.raises(UntrustedCode):
        replay_file(find_capture(tmp_path, "5"))
    assert not marker.exists()


def test_trusted_code_runs_only_when_its_recorded_hash_matches(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    marker = tmp_path / "marker"
    _, code = _planted_capture(tmp_path, marker, record_hash=False)
    assert main(["replay", str(tmp_path), "--event", "5", "--trust-code", "--repeats", "2"]) == 2
    assert "records no SHA-256" in capsys.readouterr().err and not marker.exists()
    _, code = _planted_capture(tmp_path, marker)
    code.write_text(code.read_text() + "# changed after the capture\n")
    assert main(["replay", str(tmp_path), "--event", "5", "--trust-code", "--repeats", "2"]) == 2
    err = capsys.readouterr().err
    assert "SHA-256 differs" in err and err.count("\n") == 1 and not marker.exists()
    _planted_capture(tmp_path, marker)
    assert main(["replay", str(tmp_path), "--event", "5", "--trust-code", "--repeats", "2"]) == 0
    assert marker.read_text() == "ran"


@pytest.mark.parametrize(("body", "words"), [
    ("raise AttributeError('boom')\n", "fails as it loads: AttributeError: boom"),
    ("cpp_fused_index_put_0 = 42\n", "names no function"),
    ("def cpp_fused_index_put_0(out):\n    return out.no_such_method()\n", "cannot be replayed on its captured"),
])
def test_a_crafted_kernel_file_with_a_matching_hash_is_one_sentence(tmp_path: Path, body: str, words: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # --trust-code and a matching hash run the code; what it does wrong is no verdict (exit 1 said nondeterministic)
    _, code = _planted_capture(tmp_path, tmp_path / "marker")
    code.write_text(body)
    capture = tmp_path / "capture" / "rank-00000-seq00000005.safetensors"
    meta = load_capture(capture).meta
    save_capture(capture, op="inductor.cpp_fused_index_put_0", args=[torch.zeros(4)], kwargs={},
                 outputs=[torch.ones(4)], meta={**meta, CODE_HASH: file_sha256(code)})
    assert main(["replay", str(tmp_path), "--event", "5", "--trust-code", "--repeats", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err and "Traceback" not in err


def test_the_tracer_records_the_hash_of_the_code_it_captures(tmp_path: Path) -> None:
    code = tmp_path / "output_code.py"
    code.write_text("def k(out):\n    pass\n")
    tracer = SimpleNamespace(rank=0, config=SimpleNamespace(out=tmp_path), own=contextlib.nullcontext)
    call = Call(rung="op", phase="forward", name="inductor.k", module=None, occurrence=0, step=0, event=3)
    Capturer(tracer).after(PendingCapture(call=call, args=(torch.zeros(2),), kwargs={}), [torch.zeros(2)],
                           meta={"kernel": "k", "code": str(code), "writes": [0]})
    assert load_capture(find_capture(tmp_path, "3")).meta[CODE_HASH] == file_sha256(code)


def test_a_call_of_the_wrong_shape_is_one_sentence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "capture" / "rank-00000-seq00000001.safetensors"
    path.parent.mkdir()
    header = {"schema": CAPTURE_VERSION, "op": "aten.mm.default", "call": {"args": [3], "kwargs": {}},
              "outputs": [], "layout": {}, "meta": {}}
    save_file({"x": torch.zeros(1, dtype=torch.uint8)}, str(path), metadata={"detrace": json.dumps(header)})
    assert main(["replay", str(tmp_path), "--event", "1"]) == 2
    err = capsys.readouterr().err
    assert "not a readable detrace capture" in err and "{\"args\"" not in err and err.count("\n") == 1
