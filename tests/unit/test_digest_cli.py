"""`detrace fingerprint`: the demo, torch.save and safetensors files, and its errors."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from detrace.cli import main
from detrace.digest import fingerprint


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["fingerprint", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def write_safetensors(path, tensors: dict[str, torch.Tensor]) -> None:
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.int64: "I64", torch.uint8: "U8"}
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


@pytest.mark.skipif(not hasattr(torch, "hash_tensor"), reason="the demo compares with torch.hash_tensor")
def test_demo_shows_what_hash_tensor_misses(capsys):
    code, out, _ = run(capsys)
    assert code == 0
    lines = {line.split("  ")[0].strip(): line for line in out.splitlines() if line.strip()}
    for change in ("adjacent swap (x[2] <-> x[3])", "permutation (reversed)", "equal change at two positions"):
        row = next(line for key, line in lines.items() if key.startswith(change))
        assert row.count("changed") == 1 and row.rstrip().endswith("SAME")
    ulp = next(line for key, line in lines.items() if key.startswith("one element"))
    assert ulp.count("changed") == 2


def test_torch_file(tmp_path, capsys):
    state = {"layer": {"weight": torch.randn(3, 4), "bias": torch.zeros(4)}, "step": 7,
             "extra": [torch.ones(2, dtype=torch.bfloat16), torch.tensor(3.0)]}
    path = tmp_path / "model.pt"
    torch.save(state, path)
    code, out, err = run(capsys, str(path))
    assert code == 0
    rows = [line.split() for line in out.splitlines()]
    assert [row[-1] for row in rows] == ["layer.weight", "layer.bias", "extra.0", "extra.1"]
    assert rows[0][:3] == [fingerprint(state["layer"]["weight"]).hex, "float32", "3x4"]
    assert "4 tensors" in err and "skipped 1 non-tensor" in err
    code, out, _ = run(capsys, str(path), "--json", "--chunks", "2")
    records = [json.loads(line) for line in out.splitlines()]
    assert records[1]["chunks"] == [f"{c:016x}" for c in fingerprint(torch.zeros(4), chunks=2).chunks]
    assert records[0]["digest"] == fingerprint(state["layer"]["weight"]).hex
    assert records[3]["chunks"] is None and records[3]["digest"] == fingerprint(torch.tensor(3.0)).hex


def test_safetensors_file(tmp_path, capsys):
    tensors = {"a": torch.randn(5, 2), "b": torch.arange(6).reshape(2, 3), "c": torch.randn(3).bfloat16(),
               "empty": torch.zeros(0, dtype=torch.uint8)}
    path = tmp_path / "weights.safetensors"
    write_safetensors(path, tensors)
    code, out, _ = run(capsys, str(path), "--json")
    assert code == 0
    got = {r["name"]: r["digest"] for r in map(json.loads, out.splitlines())}
    assert got == {name: fingerprint(t).hex for name, t in tensors.items()}
    assert {r["scheme"] for r in map(json.loads, out.splitlines())} == {"detrace-fp1"}


def test_json_names_the_scheme_that_the_variable_picks(tmp_path, capsys, monkeypatch):
    path = tmp_path / "weights.safetensors"
    tensor = torch.randn(5, 2)
    write_safetensors(path, {"a": tensor})
    monkeypatch.setenv("DETRACE_FINGERPRINT_SCHEME", "fp2")
    code, out, _ = run(capsys, str(path), "--json")
    record = json.loads(out)
    assert code == 0 and record["scheme"] == "detrace-fp2"
    assert record["digest"] == fingerprint(tensor, scheme="fp2").hex != fingerprint(tensor, scheme="fp1").hex


def test_the_scheme_flag_overrides_the_variable_for_files_chunks_and_the_demo(tmp_path, capsys, monkeypatch):
    path = tmp_path / "weights.safetensors"
    tensors = {"a": torch.randn(5, 2), "b": torch.randn(300).bfloat16()}
    write_safetensors(path, tensors)
    monkeypatch.setenv("DETRACE_FINGERPRINT_SCHEME", "fp1")
    code, out, _ = run(capsys, str(path), "--scheme", "fp2", "--json", "--chunks", "2")
    records = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and {r["scheme"] for r in records} == {"detrace-fp2"}
    for record, tensor in zip(records, tensors.values(), strict=True):
        expected = fingerprint(tensor, chunks=2, scheme="fp2")
        assert record["digest"] == expected.hex != fingerprint(tensor, scheme="fp1").hex
        assert record["chunks"] == [f"{c:016x}" for c in expected.chunks]
    monkeypatch.setenv("DETRACE_FINGERPRINT_SCHEME", "fp2")
    code, out, _ = run(capsys, str(path), "--scheme", "fp1")
    assert code == 0 and out.split()[0] == fingerprint(tensors["a"], scheme="fp1").hex
    code, out, _ = run(capsys, "--scheme", "fp2")
    assert code == 0 and fingerprint(torch.arange(1.0, 9.0), scheme="fp2").hex in out
    code, _, err = run(capsys, str(path), "--scheme", "fp3")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "fp3" in err


def test_errors_exit_2_with_one_line(tmp_path, capsys):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    truncated = tmp_path / "cut.pt"
    torch.save({"w": torch.randn(100)}, truncated)
    truncated.write_bytes(truncated.read_bytes()[:200])
    bad_header = tmp_path / "bad.safetensors"
    bad_header.write_bytes(struct.pack("<Q", 5) + b"{nope")
    bad_shape = tmp_path / "shape.safetensors"
    write_safetensors(bad_shape, {"a": torch.randn(5, 2)})
    bad_shape.write_bytes(bad_shape.read_bytes().replace(b"[5, 2]", b"[5, 3]"))
    cases = [[str(tmp_path / "missing.pt")], [str(garbage)], [str(truncated)], [str(bad_header)], [str(bad_shape)],
             [str(garbage), "--chunks", "0"], ["--json"], ["--bogus"]]
    for argv in cases:
        code, _, err = run(capsys, *argv)
        assert code == 2, argv
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, (argv, err)


def test_a_header_length_past_the_end_and_a_dim_no_tensor_has_are_errors(tmp_path, capsys):
    huge = tmp_path / "huge.safetensors"
    huge.write_bytes(struct.pack("<Q", 2**63 - 1) + b"{}")  # "0 tensors", exit 0 before
    code, _, err = run(capsys, str(huge))
    assert code == 2 and "its header length 9223372036854775807 runs past the end of the file" in err
    weights = tmp_path / "w.safetensors"
    write_safetensors(weights, {"a": torch.randn(6, 2), "s": torch.randn(3)})
    code, _, err = run(capsys, str(weights), "--chunks", "3", "--dim", "99")  # the chunks were dropped silently
    assert code == 2 and "--dim 99 is a dimension of no tensor" in err and len(err.strip().splitlines()) == 1
    code, out, _ = run(capsys, str(weights), "--chunks", "3", "--dim", "1", "--json")
    assert code == 0 and [r["chunks"] is not None for r in map(json.loads, out.splitlines())] == [True, False]


def test_a_fifo_is_not_a_regular_file_and_no_missing_one(tmp_path, capsys):
    fifo = tmp_path / "weights.pt"
    os.mkfifo(fifo)
    assert main(["fingerprint", str(fifo)]) == 2  # never opened: a FIFO would block the read
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a regular file (a FIFO" in err and "no such file" not in err
    assert main(["fingerprint", str(tmp_path / "gone.pt")]) == 2
    assert "no such file" in capsys.readouterr().err
