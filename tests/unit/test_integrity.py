"""Trace integrity: every record batch is sealed by a checksum and a chain, so a flipped bit, random bytes or a
cut batch are reported as corruption by certify and refused by diff and report, never blamed on an op."""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
from pathlib import Path

import pyarrow as pa
import pytest
from _synthetic import SyntheticRun, write_metric_run, write_run

from detrace.analyze import certify
from detrace.cli import main
from detrace.errors import TraceError
from detrace.tracefile import footer_path, rank_path, read_rank
from detrace.tracefile.schema import ARROW_SCHEMA

_END_OF_STREAM = b"\xff\xff\xff\xff\x00\x00\x00\x00"
RUN = SyntheticRun(ranks=2, steps=4, ops=4, batch_records=16)  # 84 records per rank in 6 batches


@pytest.fixture
def runs(tmp_path: Path) -> tuple[Path, Path]:
    write_run(tmp_path / "a", RUN)
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    return tmp_path / "a", tmp_path / "b"


def flip_digest_bit(run: Path, rank: int, record: int) -> None:
    """Flip the lowest bit of one record's digest, in place in the file (an injected fault)."""
    digest = read_rank(run, rank).table.column("digest")[record].as_py()
    path = rank_path(run, rank)
    data = bytearray(path.read_bytes())
    where = data.find(struct.pack("<Q", digest))
    assert where > 0 and data.find(struct.pack("<Q", digest), where + 1) < 0
    data[where] ^= 1
    path.write_bytes(bytes(data))


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(list(argv)) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    return captured.err


def test_a_flipped_digest_bit_is_corruption_not_a_divergence(runs: tuple[Path, Path],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    a, b = runs
    assert main(["diff", str(a), str(b)]) == 0
    capsys.readouterr()
    flip_digest_bit(b, 1, 40)  # record 40 lies in batch 2 (records 32-47)
    violations = certify(b).violations
    assert violations == [f"rank 1: rank-00001.arrow in {b} is corrupted in batch 2 (records 32-47, at byte 10656): "
                          "its bytes do not match its checksum; detrace does not compare, locate or report a corrupted "
                          "trace"]
    assert main(["certify", str(b)]) == 1
    capsys.readouterr()
    err = refusal(capsys, "diff", str(a), str(b))
    assert "rank-00001.arrow" in err and "batch 2 (records 32-47, at byte 10656)" in err and "aten." not in err
    err = refusal(capsys, "diff", str(a), str(b), "--json")
    assert "corrupted in batch 2" in err
    err = refusal(capsys, "report", str(b), "-o", str(b.parent / "r.html"))
    assert "corrupted in batch 2" in err and not (b.parent / "r.html").exists()


def test_random_bytes_are_corruption(runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    a, b = runs
    path = rank_path(b, 0)
    data = bytearray(path.read_bytes())
    rng = random.Random(7)
    start = len(data) // 2
    data[start:start + 64] = bytes(rng.randrange(256) for _ in range(64))
    path.write_bytes(bytes(data))
    (violation,) = certify(b).violations
    assert violation.startswith(f"rank 0: rank-00000.arrow in {b} is corrupted in batch ")
    err = refusal(capsys, "diff", str(a), str(b))
    assert "rank-00000.arrow" in err and "corrupted in batch" in err and "input[" not in err


def test_a_closed_file_cut_at_a_batch_boundary_is_corruption(runs: tuple[Path, Path]) -> None:
    _, b = runs
    path = rank_path(b, 0)
    data = path.read_bytes()
    sink = pa.BufferOutputStream()  # the same file without its last batch, rewritten with valid seals
    reader = pa.ipc.open_stream(pa.BufferReader(data[8:]))
    sealed = []
    while True:
        try:
            sealed.append(reader.read_next_batch_with_custom_metadata())
        except StopIteration:
            break
    with pa.ipc.new_file(sink, reader.schema) as writer:
        for batch, metadata in sealed[:-1]:
            writer.write_batch(batch, custom_metadata=metadata)
    path.write_bytes(sink.getvalue().to_pybytes())
    violations = certify(b).violations
    assert violations == [f"rank 0: rank-00000.arrow in {b} is corrupted in batch 5 (records from 80 on, at byte "
                          f"{path.read_bytes().rfind(_END_OF_STREAM)}): its "
                          "footer seals 6 batches, the file holds these only up to here (batches were cut or "
                          "replaced); detrace does not compare, locate or report a corrupted trace"]


def test_a_missing_footer_file_is_read_from_the_closed_arrow_file_never_a_divergence(
        runs: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    a, b = runs
    footer_path(b, 1).unlink()  # the records are all there, and the Arrow file was finished
    assert main(["diff", str(a), str(b)]) == 0  # "diverged ... [missing]" before
    out = capsys.readouterr().out
    assert out.startswith("identical: 2 ranks") and "footer file of rank 1 (rank-00001.json) is missing" in out
    assert certify(b).violations == ["rank 1: its footer file rank-00001.json is missing (the rank closed its trace: "
                                     "its Arrow file was finished, and its records were read from it)"]
    path = rank_path(b, 1)  # without its Arrow file footer too, it is a rank that never closed: as before
    path.write_bytes(path.read_bytes()[:-10])
    assert "rank 1: no footer: the rank never closed its trace" in certify(b).violations


def test_a_torn_tail_of_a_killed_rank_is_not_corruption(runs: tuple[Path, Path]) -> None:
    _, b = runs
    footer_path(b, 0).unlink()  # the rank never closed: killed
    path = rank_path(b, 0)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    violations = certify(b).violations
    assert "rank 0: the trace ends in a torn batch (the process died while writing)" in violations
    assert "rank 0: no footer: the rank never closed its trace" in violations
    assert not any("corrupted" in v for v in violations)


@pytest.mark.parametrize("cut", [1, 37, 100])
def test_a_lost_arrow_file_footer_names_the_readers_that_still_work(runs: tuple[Path, Path], cut: int,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    a, b = runs
    path = rank_path(b, 1)
    path.write_bytes(path.read_bytes()[:-cut])
    assert certify(b).violations == [
        "rank 1: rank-00001.arrow lost the end of its Arrow file footer: detrace and pyarrow.ipc.open_stream "
        "(after the file's 8-byte magic) still read every record, but pyarrow.ipc.open_file, pandas.read_feather, "
        "Polars and DuckDB cannot open it"]
    assert main(["diff", str(a), str(b)]) == 0  # every record is still there, sealed
    with pa.OSFile(str(path), "rb") as handle:  # the claim about open_stream holds
        handle.read(8)
        assert pa.ipc.open_stream(handle).read_all().num_rows == RUN.records_per_rank


@pytest.mark.parametrize(("version", "words"), [("detrace.trace/1", "older detrace"),
                                                 ("detrace.trace/3", "newer detrace")])
def test_other_format_versions_are_refused_in_one_sentence(tmp_path: Path, version: str, words: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "old"
    run.mkdir()
    metadata = {"detrace.schema": version, "detrace.header": json.dumps({"world_size": 1})}
    with pa.ipc.new_file(str(rank_path(run, 0)), ARROW_SCHEMA.with_metadata(metadata)):
        pass
    for argv in (["certify", str(run)], ["diff", str(run), str(run)], ["report", str(run)]):
        err = refusal(capsys, *argv)
        assert f"in trace format {version}" in err and words in err and "detrace.trace/2" in err


def test_every_flip_in_the_arrow_file_footer_is_caught_never_raised(tmp_path: Path) -> None:
    # The Arrow file footer (a copy of the schema with the rank header, the batch offsets) is what open_file
    # readers read, and detrace's stream reader does not: its checksum in the rank footer must catch every flip.
    run = tmp_path / "run"
    write_run(run, SyntheticRun(ranks=1, steps=2, ops=2, batch_records=16))
    path = rank_path(run, 0)
    clean = path.read_bytes()
    length = int.from_bytes(clean[-10:-6], "little")
    region = range(len(clean) - 10 - length, len(clean))
    assert certify(run).ok
    # 60 random places in the footer, its length and closing magic, and size-12 (which once raised)
    for position in sorted({*random.Random(5).sample(region, 60), *range(len(clean) - 10, len(clean)),
                            len(clean) - 12}):
        data = bytearray(clean)
        data[position] ^= 1 << (position % 8)
        path.write_bytes(bytes(data))
        violations = certify(run).violations  # ArrowNotImplementedError at size-12 before: never raised now
        assert len(violations) == 1 and "Arrow file footer" in violations[0], position
    path.write_bytes(clean)
    assert certify(run).ok


@pytest.mark.parametrize("name", ["rank-00000.arrow", "run.json", "rank-00001.json"])
def test_a_fifo_in_place_of_a_trace_file_is_refused_not_waited_on(runs: tuple[Path, Path], name: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    a, b = runs
    (b / name).unlink(missing_ok=True)
    os.mkfifo(b / name)  # opening it for reading would block until a writer comes: forever
    for argv in (["diff", str(a), str(b)], ["certify", str(b)]):
        err = refusal(capsys, *argv)
        assert f"{b / name} is not a regular file" in err


def test_a_flipped_bit_anywhere_in_a_rank_file_is_refused_or_changes_no_record(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # One bit in every seventh byte of the file, the bit turning with the byte: in the schema and its header, in a
    # batch's metadata (its body length: a malloc of 2**59 bytes once; its buffer lengths and list offsets: an
    # abort inside Arrow once), in its body, in the Arrow file footer. The reader refuses the file in one sentence
    # or gives every record as written; at a sample of the places, so does every command that reads a trace.
    a, b = tmp_path / "a", tmp_path / "b"
    write_metric_run(a, {0: 1.0, 1: 1.0, 2: 1.0}, ops=1)
    shutil.copytree(a, b)
    original = read_rank(a, 0).table
    path = rank_path(b, 0)
    clean = path.read_bytes()
    commands = [["diff", str(a), str(b)], ["spikes", str(b)], ["compare", str(a), str(a), str(b)],
                ["report", str(b), "-o", str(tmp_path / "r.html")], ["certify", str(b)]]
    intact = []
    for argv in commands:
        intact.append((main(argv), capsys.readouterr().out))
    refused = 0
    for position in range(0, len(clean), 7):
        data = bytearray(clean)
        data[position] ^= 1 << (position % 8)
        path.write_bytes(bytes(data))
        try:
            table = read_rank(b, 0).table
        except TraceError as err:
            assert "rank-00000.arrow" in str(err), position
            refused += 1
            for argv in commands[:4] if position % 401 < 7 else ():
                assert main(argv) == 2, (position, argv)
                err_text = capsys.readouterr().err
                assert err_text.count("\n") == 1 and "rank-00000.arrow" in err_text, (position, argv)
            continue
        assert table.equals(original), position  # a flip it lets through changed no record
        for argv, (code, out) in zip(commands, intact, strict=True) if position % 401 < 7 else ():
            result, captured = main(argv), capsys.readouterr()
            assert "Traceback" not in captured.err, (position, argv)
            if argv[0] == "certify" and result == 1:  # the Arrow file footer, which only certify reads
                assert "Arrow file footer" in captured.out, position
            else:
                assert (result, captured.out) == (code, out), (position, argv)
    assert refused > len(clean) // 14


@pytest.mark.parametrize("footer", [True, False])
def test_a_corrupted_length_field_is_called_corruption_not_a_cut(tmp_path: Path, footer: bool) -> None:
    """#49.12: a batch's metadata length flipped to run past the file's end was reported as "it was cut" (and, with
    the rank's footer file lost, as a torn tail): the file still ends in the Arrow footer a clean close writes, so a
    length is corrupted. A file really cut short is still called cut."""
    run = tmp_path / "run"
    write_run(run, SyntheticRun(ranks=1, steps=2, ops=2, batch_records=16))
    path = rank_path(run, 0)
    clean = path.read_bytes()
    first = 16 + int.from_bytes(clean[12:16], "little")  # after the magic and the schema message
    data = bytearray(clean)
    data[first + 4 : first + 8] = (0x7FFFFFF8).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    if not footer:
        path.with_suffix(".json").unlink()
    with pytest.raises(TraceError, match=r"corrupted in batch 0 .*: a length in its framing runs past the end of "
                                         r"the file, which still ends in the Arrow footer of a clean close: the "
                                         r"length is corrupted, the file was not cut"):
        read_rank(run, 0)
    if footer:
        path.write_bytes(clean[: first + 100])
        with pytest.raises(TraceError, match=r"the file ends inside it \(it was cut\)"):
            read_rank(run, 0)
