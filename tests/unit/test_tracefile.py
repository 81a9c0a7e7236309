"""The trace format: append-only rank files, torn tails, headers and footers, and capture files."""

from __future__ import annotations

import json
import re
from dataclasses import FrozenInstanceError
from pathlib import Path
from typing import Literal

import pyarrow as pa
import pyarrow.feather as feather
import pytest
import torch

from detrace.errors import TraceError, UsageError
from detrace.tracefile import (
    ARROW_SCHEMA,
    SCHEMA_VERSION,
    RankWriter,
    footer_path,
    load_capture,
    open_run,
    rank_path,
    read_rank,
    resolve_op,
    save_capture,
)
from detrace.tracefile.layout import capture_path, capture_paths, prepare_out, rank_trace_paths, trace_files
from detrace.tracefile.metadata import StepAccount
from detrace.tracefile.reader import load_footer


def row(seq: int, step: int, **over: object) -> dict[str, object]:
    base = dict(seq=seq, step=step, rung="op", phase="forward", module="layers.0", name="aten.mm.default",
                occurrence=seq, event=seq, role="output", index=0, shape=[2, 3], dtype="float32", numel=6,
                digest=(seq * 0x9E3779B97F4A7C15) % 2**64, collectives=0)
    base.update(over)
    return base


def write(run: Path, rank: int, n: int, *, close: bool = True, batch: int = 4) -> RankWriter:
    writer = RankWriter(run, rank, header={"world_size": 2, "rung": "op"}, batch_records=batch)
    for i in range(n):
        writer.add(row(i, i // 3))
    if close:
        writer.close({"layout": {"default": [0, 1]}})
    return writer


def test_round_trip_with_every_column(tmp_path: Path) -> None:
    writer = RankWriter(tmp_path, 0, header={"world_size": 1})
    writer.add(row(0, 0, digest=2**64 - 1, chunks=[1, 2**63], value=None, extra=json.dumps({"a": 1})))
    writer.add(row(1, 0, role="metric", name="loss", value=0.1 + 0.2, digest=None, module=None))
    writer.add(row(2, 1, phase="collective", name="all_reduce", group="0,1", group_seq=7, peer=None, collectives=3))
    writer.close()
    trace = read_rank(tmp_path, 0)
    assert trace.complete and not trace.torn
    rows = trace.table.to_pylist()
    assert rows[0]["digest"] == 2**64 - 1 and rows[0]["chunks"] == [1, 2**63]
    assert rows[1]["value"] == 0.1 + 0.2  # exact bits survive
    assert rows[1]["digest"] is None
    assert rows[2]["group_seq"] == 7
    assert trace.footer is not None and trace.footer.records == 3 and trace.footer.last_step == 1


def test_closed_rank_file_is_a_standard_arrow_file(tmp_path: Path) -> None:
    write(tmp_path, 0, 10)
    table = feather.read_table(rank_path(tmp_path, 0))  # what pandas.read_feather / Polars read_ipc use
    assert table.num_rows == 10
    assert table.schema.remove_metadata().equals(ARROW_SCHEMA)


def test_unclosed_rank_keeps_every_flushed_batch(tmp_path: Path) -> None:
    writer = write(tmp_path, 0, 10, close=False, batch=4)  # 8 rows flushed in 2 batches, 2 still buffered
    trace = read_rank(tmp_path, 0)
    assert trace.table.num_rows == 8
    assert not trace.complete and trace.footer is None
    assert trace.last_step == 2 and trace.last_complete_step == 1
    writer.close()


def test_torn_tail_is_reported_not_raised(tmp_path: Path) -> None:
    write(tmp_path, 0, 12, close=False, batch=4)
    path = rank_path(tmp_path, 0)
    data = path.read_bytes()
    path.write_bytes(data[:-30])  # cut inside the last batch, as a SIGKILL mid-write would
    trace = read_rank(tmp_path, 0)
    assert trace.torn and "torn tail" in (trace.detail or "")
    assert trace.table.num_rows == 8


def test_existing_trace_is_never_silently_overwritten(tmp_path: Path) -> None:
    write(tmp_path, 0, 3)
    with pytest.raises(TraceError, match="already holds a trace"):
        RankWriter(tmp_path, 0, header={})
    forced = RankWriter(tmp_path, 0, header={}, force=True)
    assert not footer_path(tmp_path, 0).exists()  # the stale footer cannot vouch for the new file
    forced.close()


def test_open_run_reads_headers_and_ranks(tmp_path: Path) -> None:
    write(tmp_path, 0, 3)
    write(tmp_path, 1, 3)
    info = open_run(tmp_path)
    assert info.ranks == (0, 1) and info.world_size == 2 and info.missing_ranks == ()
    assert info.header.rung == "op"


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: None, "does not exist"),
        (lambda p: p.mkdir(), "holds no trace"),
        (lambda p: p.write_text("x"), "is not a directory"),
        (lambda p: (p.mkdir(), rank_path(p, 0).write_bytes(b"garbage")), "not a detrace trace file"),
        (lambda p: (p.mkdir(), rank_path(p, 0).write_bytes(b"ARROW1\x00\x00\x01")), "ends inside its schema"),
    ],
)
def test_bad_run_directories_raise_one_sentence(tmp_path: Path, setup, message: str) -> None:
    target = tmp_path / "run"
    setup(target)
    with pytest.raises(TraceError, match=message):
        open_run(target)


def test_other_schema_version_is_refused(tmp_path: Path) -> None:
    schema = ARROW_SCHEMA.with_metadata({"detrace.schema": "detrace.trace/0"})
    with open(rank_path(tmp_path, 0), "wb") as handle, pa.ipc.new_file(handle, schema):
        pass
    with pytest.raises(TraceError, match=r"detrace\.trace/0"):
        read_rank(tmp_path, 0)


def test_unwritable_directory_is_a_trace_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(TraceError, match="cannot create trace directory"):
        RankWriter(blocker / "run", 0, header={})


DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.float8_e8m0fnu, torch.float4_e2m1fn_x2, torch.int8, torch.int64, torch.uint16, torch.uint64,
          torch.bool, torch.complex64, torch.complex128]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_capture_round_trips_every_dtype_bit_for_bit(tmp_path: Path, dtype: torch.dtype) -> None:
    raw = torch.randint(0, 256, (3, 8 * dtype.itemsize), dtype=torch.uint8)
    tensor = raw.view(dtype)[:, :5]  # non-contiguous
    path = save_capture(tmp_path / "c.safetensors", op="aten.clone.default", args=[tensor],
                        kwargs={"memory_format": torch.contiguous_format}, outputs=[tensor.clone()], meta={"rank": 1})
    capture = load_capture(path)
    (back,) = capture.args
    assert back.dtype == dtype and back.shape == tensor.shape
    assert torch.equal(back.contiguous().view(torch.uint8), tensor.contiguous().view(torch.uint8))
    assert capture.kwargs["memory_format"] is torch.contiguous_format and capture.meta == {"rank": 1}


def test_capture_replays_the_op(tmp_path: Path) -> None:
    target = torch.zeros(4, 2)
    indices = [torch.tensor([0, 1, 1, 3])]
    values = torch.ones(4, 2)
    path = save_capture(tmp_path / "c.safetensors", op="aten.index_put.default", args=[target, indices, values, True],
                        kwargs={}, outputs=[], meta={})
    capture = load_capture(path)
    out = resolve_op(capture.op)(*capture.args, **capture.kwargs)
    assert out[:, 0].tolist() == [1.0, 2.0, 0.0, 1.0]


def test_bad_captures(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="does not exist"):
        load_capture(tmp_path / "none.safetensors")
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 16)
    with pytest.raises(TraceError, match="not a readable detrace capture"):
        load_capture(tmp_path / "bad.safetensors")
    with pytest.raises(TraceError, match="does not exist in this PyTorch build"):
        resolve_op("aten.no_such_op.default")
    with pytest.raises(TraceError, match="cannot capture"):
        save_capture(tmp_path / "x.safetensors", op="aten.add.Tensor", args=[object()], kwargs={}, outputs=[],
                     meta={})


@pytest.mark.parametrize(("which", "content", "words"), [
    ("run.json", [1], "holds a JSON list, not an object"),
    ("run.json", {"world_size": "x"}, "field 'world_size' must be an integer of at least 1, not \"x\""),
    ("run.json", {"windows": {"steps": 3}}, "field 'steps' must be a SPEC or an object of SPECs per rung"),
    ("run.json", {"ranks": "1-"}, "field 'ranks': malformed SPEC"),
    ("footer", [1], "holds a JSON list, not an object"),
    ("footer", {"records": "many"}, "field 'records' must be an integer of at least 0"),
    ("footer", {"groups": "0,1"}, "field 'groups' must be a list of strings"),
])
def test_metadata_of_wrong_types_is_one_sentence_everywhere(tmp_path: Path, which: str, content: object,
                                                            words: str, capsys: pytest.CaptureFixture[str]) -> None:
    """F7: run.json and the footer are validated in one place; diff, certify and report say so in one sentence."""
    from detrace.cli import main

    write(tmp_path / "run", 0, 8)
    write(tmp_path / "run", 1, 8)
    path = tmp_path / "run" / "run.json" if which == "run.json" else footer_path(tmp_path / "run", 1)
    if isinstance(content, dict) and which == "footer":
        content = {**json.loads(path.read_text()), **content}
    path.write_text(json.dumps(content))
    for argv in (["diff", str(tmp_path / "run"), str(tmp_path / "run")], ["certify", str(tmp_path / "run")],
                 ["report", str(tmp_path / "run"), "-o", str(tmp_path / "r.html")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(path) in err and words in err, (argv, err)


def test_footer_round_trips_through_the_writer_as_a_frozen_record(tmp_path: Path) -> None:
    writer = RankWriter(tmp_path, 1, header={"world_size": 2})
    for i in range(5):
        writer.add(row(i, 3 + i // 3))
    # what the tracer's session adds to the writer's own facts (record.session)
    writer.close({"groups": ["0,1"], "step": 4, "pid": 77, "world_size": 2, "collectives": 3,
                  "steps": {"first": 3, "recorded": [3, 4], "source": "env"}, "later_key": {"kept": True}})
    footer = load_footer(footer_path(tmp_path, 1))
    assert footer is not None
    assert (footer.schema, footer.rank, footer.records, footer.batches) == (SCHEMA_VERSION, 1, 5, 1)
    assert footer.last_step == 4
    assert (footer.groups, footer.step, footer.pid, footer.world_size, footer.collectives) == (("0,1",), 4, 77, 2, 3)
    assert footer.steps == StepAccount(first=3, recorded=(3, 4), source="env") and footer.first_step == 3
    assert len(footer.chain) == 16 and footer.arrow_footer is not None and len(footer.arrow_footer) == 16
    with pytest.raises(FrozenInstanceError):
        footer.records = 6  # type: ignore[misc]
    # the rank's trace (whose stream checks the file against the footer's chain) and its opened run carry the same
    # record; a footer the writer wrote alone has no step account
    assert read_rank(tmp_path, 1).footer == footer == open_run(tmp_path).files[1].footer
    write(tmp_path, 0, 3)
    bare = open_run(tmp_path).files[0].footer
    assert bare is not None and bare.steps is None and bare.first_step is None and bare.groups is None


@pytest.mark.parametrize(("change", "words"), [
    ({"steps": {"first": -1}}, "field 'steps' must be an object whose `first` is a non-negative integer"),
    ({"steps": {"first": True}}, "field 'steps' must be an object whose `first` is a non-negative integer"),
    ({"steps": {"recorded": [4, 3]}}, "field 'steps' must be an object whose `recorded` is the first and last step"),
    ({"steps": {"recorded": [1]}}, "field 'steps' must be an object whose `recorded` is the first and last step"),
    ({"steps": {"source": 3}}, "field 'steps' must be an object whose `source` is a string"),
    ({"steps": [0, 1]}, "field 'steps' must be an object"),
    ({"chain": "XYZ"}, "field 'chain' must be 16 hexadecimal digits"),
    ({"last_step": -2}, "field 'last_step' must be an integer of at least -1"),
    ({"records": None}, "field 'records' must be an integer of at least 0"),
    ({"schema": "detrace.trace/0"}, "detrace.trace/0"),
    ({"world_size": 0}, "field 'world_size' must be an integer of at least 1"),
    ({"pid": "x"}, "field 'pid' must be an integer of at least 0"),
])
def test_a_malformed_footer_is_refused_when_the_run_is_opened(tmp_path: Path, change: dict[str, object],
                                                             words: str) -> None:
    write(tmp_path, 0, 3)
    write(tmp_path, 1, 3)
    path = footer_path(tmp_path, 1)
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(TraceError, match=re.escape(words)) as caught:
        open_run(tmp_path)
    assert f"rank footer {path}" in str(caught.value)


def test_a_missing_footer_field_is_named(tmp_path: Path) -> None:
    write(tmp_path, 0, 3)
    path = footer_path(tmp_path, 0)
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "batches"}))
    words = f"rank footer {path} is malformed: field 'batches' is missing"
    with pytest.raises(TraceError, match=re.escape(words)):
        open_run(tmp_path)


def test_run_json_steps_are_typed_and_checked(tmp_path: Path) -> None:
    write(tmp_path, 0, 3)
    (tmp_path / "run.json").write_text(json.dumps({"steps": {"first": 2, "last": 5}}))
    assert open_run(tmp_path).header.steps == (2, 5)
    (tmp_path / "run.json").write_text(json.dumps({"steps": {"first": 2, "last": "5"}}))
    with pytest.raises(TraceError, match="field 'steps' must be an object of the first and last global step run"):
        open_run(tmp_path)


def test_layout_names_rank_files_and_captures(tmp_path: Path) -> None:
    write(tmp_path, 1, 2)
    write(tmp_path, 0, 2)
    (tmp_path / "rank-7.arrow").write_bytes(b"")  # not a rank file of ours: five digits
    assert rank_trace_paths(tmp_path) == {0: rank_path(tmp_path, 0), 1: rank_path(tmp_path, 1)}
    assert rank_trace_paths(tmp_path / "missing") == {}
    for rank, seq in ((1, 3), (0, 12), (0, 4)):
        capture_path(tmp_path, rank, seq).parent.mkdir(exist_ok=True)
        capture_path(tmp_path, rank, seq).write_bytes(b"")
    assert [(r, s) for r, s, _ in capture_paths(tmp_path)] == [(0, 4), (0, 12), (1, 3)]
    assert capture_path(tmp_path, 0, 4).name == "rank-00000-seq00000004.safetensors"


def test_force_replaces_a_detrace_trace_and_nothing_else(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write(run, 0, 2)
    capture_path(run, 0, 4).parent.mkdir()
    capture_path(run, 0, 4).write_bytes(b"ours")
    (run / "capture" / "photo1.jpg").write_bytes(b"theirs")
    prepare_out(run, holds="trace", force=True)  # it deleted capture/ whole before
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == ["capture", "capture/photo1.jpg"]
    (run / "run.json").write_text('{"my": "own run.json"}')
    write(run, 0, 2)
    for force in (False, True):  # it overwrote the user's run.json before
        with pytest.raises(TraceError, match=r"run.json is not a detrace run header.*--force replaces only"):
            prepare_out(run, holds="trace", force=force)
    assert (run / "run.json").read_text() == '{"my": "own run.json"}' and rank_path(run, 0).exists()


def test_one_rule_for_output_directories(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write(run, 0, 2)
    (run / "notes.txt").write_text("mine")
    # one trace: other files never stop a run; a trace does, and --force removes the trace only
    assert prepare_out(tmp_path / "fresh", holds="trace") == tmp_path / "fresh"
    with pytest.raises(TraceError, match="already holds a trace; choose another directory or pass --force"):
        prepare_out(run, holds="trace", force=False)
    assert sorted(p.name for p in trace_files(run)) == ["rank-00000.arrow", "rank-00000.json"]
    prepare_out(run, holds="trace", force=True)
    assert [p.name for p in run.iterdir()] == ["notes.txt"]
    # many runs: a directory that is not empty is refused, unless forced; without --force, none is suggested
    with pytest.raises(UsageError, match=r"^--out .* is not empty; choose another directory or pass --force$"):
        prepare_out(run, holds="runs", force=False, name="--out")
    with pytest.raises(UsageError, match=r"is not empty; choose another directory$"):
        prepare_out(run, holds="runs")
    prepare_out(run, holds="runs", force=True)
    # a file in the way, for either kind
    kinds: tuple[Literal["trace", "runs"], ...] = ("trace", "runs")
    for holds in kinds:
        with pytest.raises(UsageError, match=r"output directory .* exists and is not a directory"):
            prepare_out(run / "notes.txt", holds=holds)
        with pytest.raises(UsageError, match="cannot write to output directory"):
            prepare_out(run / "notes.txt" / "below", holds=holds)
