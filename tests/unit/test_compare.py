"""The diff on synthetic traces with known answers: numeric, structural and missing divergences, origin vs
receiver within a rank, and causality across ranks. The traces are written through the real writer."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from _synthetic import Fault, SyntheticRun, rank_table, write_run, write_table
from hypothesis import given, settings
from hypothesis import strategies as st

from detrace.analyze import align, diff, first_divergent_step, first_origin
from detrace.errors import TraceError, UsageError
from detrace.tracefile import ARROW_SCHEMA, footer_path, rank_path

RUN = SyntheticRun(ranks=2, steps=4, ops=8)


def rows_of(run: SyntheticRun, rank: int, fault: Fault | None = None) -> list[dict[str, Any]]:
    return rank_table(run, rank, fault).to_pylist()


def renumber(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Dense seq again after records were inserted or removed (events follow their first record)."""
    moved = {row["seq"]: i for i, row in enumerate(rows)}
    return [{**row, "seq": i, "event": moved.get(row["event"], i)} for i, row in enumerate(rows)]


def write_rows(out: Path, rank: int, rows: list[dict[str, Any]], *, world_size: int = 2, close: bool = True,
               batch_records: int = 4096) -> None:
    write_table(out, rank, pa.Table.from_pylist(rows, schema=ARROW_SCHEMA), world_size=world_size, close=close,
                batch_records=batch_records)


def pair(tmp_path: Path, run: SyntheticRun = RUN, fault: Fault | None = None) -> tuple[Path, Path]:
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(a, run)
    write_run(b, run, fault)
    return a, b


def test_identical_runs(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    result = diff(a, b)
    assert result.verdict == "identical" and result.exit_code == 0
    assert result.first is None and result.origin_ranks == []
    assert result.compared == (2, 2 * RUN.records_per_rank, 0, (0, RUN.steps - 1))
    assert [r.cause for r in result.ranks] == ["identical", "identical"]
    assert first_divergent_step(result) is None


def test_origin_rank_and_receiver_via_the_all_reduce(tmp_path: Path) -> None:
    a, b = pair(tmp_path, fault=Fault(rank=1, step=2, op=3))
    result = diff(a, b)
    assert result.verdict == "diverged" and result.exit_code == 1
    assert result.origin_ranks == [1]
    first = result.first
    assert first is not None
    assert (first.rank, first.step, first.phase, first.module, first.name, first.role, first.occurrence) == (
        1, 2, "backward", "layers.3", "aten.add.Tensor", "output", 0)
    assert first.kind == "numeric" and first.origin
    assert first.detail["inputs"] == ["input float32[64, 64]"] and "digest" in first.detail
    rank0, rank1 = result.ranks
    assert rank0.cause == "receiver" and rank0.via == "all_reduce#2 group 0,1"
    assert rank0.first is not None and rank0.first.name == "all_reduce" and not rank0.first.origin
    assert rank1.cause == "origin" and rank1.via is None
    assert first_divergent_step(result) == 2
    assert first_origin(result) == first


def test_one_origin_among_many_ranks(tmp_path: Path) -> None:
    a, b = pair(tmp_path, SyntheticRun(ranks=5, steps=3, ops=4), Fault(rank=3, step=1, op=0))
    result = diff(a, b)
    assert result.origin_ranks == [3]
    assert [r.cause for r in result.ranks] == ["receiver", "receiver", "receiver", "origin", "receiver"]
    assert {r.via for r in result.ranks if r.cause == "receiver"} == {"all_reduce#1 group 0,1,2,3,4"}


def test_a_diff_reads_each_footer_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run is opened once: its footers are read and validated there, then handed on with the run; no later stage
    (the layout check, the step spans, the alignment, the walk back to the divergent call) reads one again."""
    a, b = pair(tmp_path, fault=Fault(rank=1, step=2, op=3))
    footers = {footer_path(run, rank) for run in (a, b) for rank in range(RUN.ranks)}
    reads: Counter[Path] = Counter()
    read_text = Path.read_text

    def counted(self: Path, *args: Any, **kwargs: Any) -> str:
        reads[self] += self in footers
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counted)
    result = diff(a, b, workers=1)
    assert result.verdict == "diverged" and result.first is not None and result.first.detail["outputs"]
    assert reads == dict.fromkeys(footers, 1)


def test_rank_option_compares_one_rank(tmp_path: Path) -> None:
    a, b = pair(tmp_path, fault=Fault(rank=1, step=2, op=3))
    result = diff(a, b, rank=0)
    assert [r.rank for r in result.ranks] == [0]
    # rank 1 was not compared, so it cannot be ruled out as the sender: rank 0 stays a receiver
    assert result.ranks[0].cause == "receiver" and result.origin_ranks == []
    assert result.first is not None and result.first.rank == 0
    with pytest.raises(UsageError, match="rank 7 has no trace"):
        diff(a, b, rank=7)
    with pytest.raises(UsageError, match="workers"):
        diff(a, b, workers=0)


def test_structural_divergence_resynchronises_and_keeps_comparing(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(a, RUN)
    rows = rows_of(RUN, 0, Fault(rank=0, step=2, op=5))
    # control flow changed in step 1: run B skips one forward call (2 records) and makes an extra one
    step1 = RUN.records_per_step
    extra = {**rows[step1 + 4], "name": "aten.relu.default", "digest": 1}
    rows = renumber(rows[: step1 + 2] + rows[step1 + 4 : step1 + 6] + [extra] + rows[step1 + 6 :])
    write_rows(b, 0, rows)
    write_table(b, 1, rank_table(RUN, 1, Fault(rank=0, step=2, op=5)), world_size=2)
    rank0 = diff(a, b).ranks[0]
    first = rank0.first
    assert first is not None and first.kind == "structural" and first.step == 1
    assert (first.detail["only_in_a"], first.detail["only_in_b"]) == (2, 0)
    assert rank0.structural == 2
    assert rank0.records == RUN.records_per_rank - 2  # every other record was still aligned and compared
    assert rank0.numeric > 0  # the fault of step 2 was seen after resynchronising


def test_resynchronises_at_the_next_step_beyond_the_look_ahead(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(align, "LOOKAHEAD", 4)
    a, b = tmp_path / "a", tmp_path / "b"
    rows = rows_of(RUN, 0)
    write_rows(a, 0, rows, world_size=1)
    step1 = RUN.records_per_step
    inserted = [{**rows[step1], "name": f"aten.extra{i}.default"} for i in range(10)]
    write_rows(b, 0, renumber(rows[: step1 + 1] + inserted + rows[step1 + 1 :]), world_size=1)
    rank0 = diff(a, b).ranks[0]
    assert rank0.first is not None and rank0.first.kind == "structural"
    assert rank0.first.detail["resynchronised_at_step"] == 2
    assert rank0.records == 3 * RUN.records_per_step + 1  # steps 0, 2, 3 and the first record of step 1


def test_rank_that_ended_early_is_missing_with_its_last_common_step(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(a, RUN)
    write_table(b, 0, rank_table(RUN, 0), world_size=2)
    # rank 1 of run B died during step 2: no footer, only what it had flushed
    write_table(b, 1, rank_table(RUN, 1).slice(0, 2 * RUN.records_per_step + 5), world_size=2, close=False,
                batch_records=16)
    result = diff(a, b)
    rank1 = result.ranks[1]
    assert rank1.cause == "missing" and rank1.first is not None and rank1.first.kind == "missing"
    assert rank1.first.detail["last_common_step"] == 1 and rank1.first.detail["ended"] == "b"
    assert not rank1.first.detail["closed"]
    assert result.verdict == "diverged" and result.origin_ranks == []


def test_torn_tail_is_missing_not_an_error(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(a, RUN)
    write_run(b, RUN)
    path = rank_path(b, 0)
    footer_path(b, 0).unlink()  # a killed rank writes no footer (a closed file cut short is corruption)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    rank0 = diff(a, b).ranks[0]
    assert rank0.cause == "missing" and rank0.first is not None
    assert rank0.first.detail["ended"] == "b" and rank0.first.detail["records_left"] > 0


def test_rank_without_a_trace_in_one_run_is_missing(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(a, RUN)
    write_table(b, 0, rank_table(RUN, 0), world_size=2)
    result = diff(a, b)
    assert result.ranks[1].cause == "missing"
    assert result.ranks[1].first is not None and result.ranks[1].first.detail["last_common_step"] == -1


def test_same_records_but_one_rank_never_closed(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_table(a, 0, rank_table(RUN, 0), world_size=1)
    write_table(b, 0, rank_table(RUN, 0), world_size=1, close=False)
    rank0 = diff(a, b).ranks[0]
    assert rank0.cause == "missing" and rank0.first is not None
    assert rank0.first.detail == {"ended": "b", "last_common_step": 3, "records_left": 0, "closed": False}


def _call(seq: int, step: int, module: str, name: str, role: str, digest: int, event: int, **over: Any) -> dict:
    row = dict(seq=seq, step=step, rung="module", phase="forward", module=module, name=name, occurrence=0,
               event=event, role=role, index=0, shape=[8], dtype="float32", numel=8, digest=digest, chunks=None,
               value=None, collectives=0, group=None, group_seq=None, peer=None, extra=None)
    row.update(over)
    return row


def test_walk_back_names_the_enclosing_call_whose_inputs_matched(tmp_path: Path) -> None:
    # block: input -> child a -> (untraced nondeterministic code) -> child b -> output
    def block(changed: bool) -> list[dict]:
        x = 99 if changed else 0
        return [_call(0, 0, "block", "Block", "input", 1, 0),
                _call(1, 0, "block.a", "Linear", "input", 1, 1),
                _call(2, 0, "block.a", "Linear", "output", 2, 1),
                _call(3, 0, "block.b", "Linear", "input", 3 + x, 3),
                _call(4, 0, "block.b", "Linear", "output", 4 + x, 3),
                _call(5, 0, "block", "Block", "output", 5 + x, 0)]

    write_rows(tmp_path / "a", 0, block(False), world_size=1)
    write_rows(tmp_path / "b", 0, block(True), world_size=1)
    first = diff(tmp_path / "a", tmp_path / "b").first
    assert first is not None and first.origin
    assert (first.module, first.role, first.seq) == ("block", "output", 5)
    assert first.detail["receiver"]["label"] == "forward block.b Linear#0 input[0]"
    assert first.detail["inputs"] == ["input float32[8]"]


def test_receiver_without_an_enclosing_origin_is_reported_as_is(tmp_path: Path) -> None:
    rows = [_call(0, 0, "a", "Linear", "input", 1, 0), _call(1, 0, "a", "Linear", "output", 2, 0),
            _call(2, 1, "a", "Linear", "input", 3, 2)]
    write_rows(tmp_path / "a", 0, rows, world_size=1)
    write_rows(tmp_path / "b", 0, [*rows[:2], {**rows[2], "digest": 4}], world_size=1)
    first = diff(tmp_path / "a", tmp_path / "b").first
    assert first is not None and first.role == "input" and not first.origin and "receiver" not in first.detail


def test_chunk_digests_name_the_rows_that_differ(tmp_path: Path) -> None:
    chunks = list(range(100, 116))
    changed = [c + (1 if i in (3, 11) else 0) for i, c in enumerate(chunks)]
    write_rows(tmp_path / "a", 0, [_call(0, 0, "moe", "dispatch", "output", 1, 0, chunks=chunks)], world_size=1)
    write_rows(tmp_path / "b", 0, [_call(0, 0, "moe", "dispatch", "output", 2, 0, chunks=changed)], world_size=1)
    first = diff(tmp_path / "a", tmp_path / "b").first
    assert first is not None and first.detail["chunks"] == [3, 11] and first.detail["chunks_total"] == 16


def test_metric_values_compare_bit_for_bit_and_untaken_digests_do_not(tmp_path: Path) -> None:
    def rows(loss: float, digest: int | None) -> list[dict]:
        return [_call(0, 0, "net", "Net", "output", digest, 0),
                _call(1, 0, None, "loss", "metric", None, 1, rung="metrics", value=loss, shape=[], numel=1)]

    write_rows(tmp_path / "a", 0, rows(0.0, 5), world_size=1)
    write_rows(tmp_path / "b", 0, rows(-0.0, None), world_size=1)  # B took no digest (above --max-numel)
    result = diff(tmp_path / "a", tmp_path / "b")
    first = result.first
    assert first is not None and first.name == "loss" and first.detail["value"] == [0.0, -0.0]
    assert not first.origin  # a metric observes a value; it computes nothing
    assert result.compared == (1, 2, 1, (0, 0))  # the untaken digest is reported as not verified; the metric was
    assert result.ranks[0].unverified == 1


def _collective(seq: int, rank_digest: int, out_digest: int, *, phase: str = "collective",
                name: str = "all_reduce", peer: int | None = None, roles: tuple[str, ...] = ("input", "output"),
                ) -> list[dict]:
    digests = {"input": rank_digest, "output": out_digest}
    return [_call(seq + i, 0, None, name, role, digests[role], seq, rung="semantic", phase=phase, group="0,1",
                  group_seq=0, peer=peer, collectives=i) for i, role in enumerate(roles)]


def test_collective_whose_inputs_matched_everywhere_is_itself_the_origin(tmp_path: Path) -> None:
    for rank in (0, 1):
        write_rows(tmp_path / "a", rank, _collective(0, 10 + rank, 50))
        write_rows(tmp_path / "b", rank, _collective(0, 10 + rank, 51))
    result = diff(tmp_path / "a", tmp_path / "b")
    assert result.origin_ranks == [0, 1]
    assert result.first is not None and result.first.origin and result.first.name == "all_reduce"
    assert result.first.detail["inputs_matched_on_all_ranks"]


def test_recv_receives_from_the_peer_whose_send_differed(tmp_path: Path) -> None:
    send = {"phase": "p2p", "name": "send", "roles": ("input",)}
    recv = {"phase": "p2p", "name": "recv", "roles": ("output",)}
    write_rows(tmp_path / "a", 0, _collective(0, 10, 0, peer=1, **send))
    write_rows(tmp_path / "b", 0, _collective(0, 11, 0, peer=1, **send))
    write_rows(tmp_path / "a", 1, _collective(0, 0, 10, peer=0, **recv))
    write_rows(tmp_path / "b", 1, _collective(0, 0, 11, peer=0, **recv))
    result = diff(tmp_path / "a", tmp_path / "b")
    assert result.origin_ranks == [0]
    assert result.ranks[1].cause == "receiver" and result.ranks[1].via == "recv#0 group 0,1 from rank 0"


def test_runs_of_different_world_sizes_are_incomparable(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    write_table(b, 2, rank_table(RUN, 0), world_size=3)
    (b / "run.json").write_text('{"world_size": 3}')
    result = diff(a, b)
    assert result.verdict == "incomparable" and result.exit_code == 2
    assert result.reason == f"{a} has world size 2 and {b} has world size 3."
    assert result.to_json()["reason"] == result.reason


def test_runs_of_different_rungs_and_layouts_are_incomparable(tmp_path: Path) -> None:
    a, b = pair(tmp_path)
    (a / "run.json").write_text('{"world_size": 2, "rung": "op"}')
    (b / "run.json").write_text('{"world_size": 2, "rung": "semantic"}')
    assert diff(a, b).reason == f"{a} was recorded with rung op and {b} with rung semantic."
    (b / "run.json").write_text('{"world_size": 2, "rung": "op", "fingerprint": "detrace-fp2"}')
    result = diff(a, b)  # A names no scheme: written before fp2 existed, so fp1
    assert result.verdict == "incomparable" and result.exit_code == 2
    assert result.reason == (f"{a} was recorded with fingerprint scheme detrace-fp1 and {b} with fingerprint scheme "
                             "detrace-fp2.")
    (b / "run.json").write_text('{"world_size": 2, "rung": "op", "fingerprint": "detrace-fp1"}')
    assert diff(a, b).verdict == "identical"  # fp1 named and fp1 implied compare as always
    (b / "run.json").unlink()
    footer = json.loads(footer_path(b, 0).read_text())
    footer_path(b, 0).write_text(json.dumps({**footer, "groups": ["0,1", "1"]}))
    footer_path(a, 0).write_text(json.dumps({**footer, "groups": ["0,1"]}))
    assert "different parallel layouts" in (diff(a, b).reason or "")


def test_unreadable_inputs_raise_trace_errors_naming_the_path(tmp_path: Path) -> None:
    a, _ = pair(tmp_path)
    with pytest.raises(TraceError, match="does not exist"):
        diff(a, tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="holds no trace"):
        diff(tmp_path / "empty", a)


def test_json_has_exactly_the_schema_keys(tmp_path: Path) -> None:
    a, b = pair(tmp_path, fault=Fault(rank=0, step=1, op=0))
    payload = diff(a, b).to_json()
    assert set(payload) == {"schema", "verdict", "reason", "first", "origin_ranks", "ranks", "compared", "notes"}
    assert payload["schema"] == "detrace.diff/1"
    assert set(payload["first"]) == {"rank", "step", "seq", "rung", "phase", "kind", "name", "module", "role",
                                     "origin"}
    assert set(payload["ranks"][0]) == {"rank", "first", "cause", "via"}
    assert payload["compared"] == {"ranks": 2, "records": 2 * RUN.records_per_rank, "unverified": 0,
                                   "steps": {"first": 0, "last": RUN.steps - 1}}
    assert payload["notes"] == []


@settings(max_examples=25, deadline=None)
@given(flips=st.sets(st.integers(0, RUN.records_per_rank - 1), max_size=6),
       drops=st.sets(st.integers(0, RUN.records_per_rank - 1), max_size=6),
       batch=st.integers(3, 64))
def test_any_edit_is_found_and_never_crashes(tmp_path_factory: pytest.TempPathFactory, flips: set[int],
                                             drops: set[int], batch: int) -> None:
    base = tmp_path_factory.mktemp("prop")
    rows = rows_of(RUN, 0)
    write_rows(base / "a", 0, rows, world_size=1, batch_records=batch)
    def flip(row: dict[str, Any]) -> dict[str, Any]:
        if row["value"] is not None:
            return {**row, "value": row["value"] + 1.0}
        return {**row, "digest": row["digest"] ^ 1}

    edited = [flip(row) if i in flips else row for i, row in enumerate(rows) if i not in drops]
    write_rows(base / "b", 0, renumber(edited), world_size=1, batch_records=max(1, batch // 2))
    rank0 = diff(base / "a", base / "b").ranks[0]
    assert rank0.records == len(rows) - len(drops)  # identities are unique: every kept record is aligned
    assert rank0.numeric == len(flips - drops)
    if not flips and not drops:
        assert rank0.first is None
    else:
        assert rank0.first is not None
        assert rank0.first.seq == min((flips - drops) | drops)


def test_a_run_that_stops_early_is_not_identical_and_says_where_it_stopped(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(a, RUN)
    for rank in range(RUN.ranks):  # B closed its trace after step 2: it stopped, it did not die
        write_table(b, rank, rank_table(RUN, rank).filter(rank_table(RUN, rank)["step"].to_numpy() <= 2),
                    world_size=2)
    for x, y, ended in ((a, b, "B"), (b, a, "A")):
        result = diff(x, y)
        assert result.verdict == "diverged" and result.exit_code == 1
        first = result.first
        assert first is not None and first.kind == "missing" and first.step == 3
        assert first.detail["ran_on_to"] == 3 and first.detail["ended"] == ended.lower()
        other = "A" if ended == "B" else "B"
        assert first.stop is not None and first.stop.startswith(
            f"{ended} stopped after global step 2 and {other} ran on to step 3")


def test_a_run_that_starts_later_is_compared_from_there(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(a, RUN)
    for rank in range(RUN.ranks):  # B resumed after step 2 and ran to the same last step
        table = rank_table(RUN, rank)
        write_table(b, rank, table.filter(table["step"].to_numpy() >= 2), world_size=2)
    result = diff(a, b)
    assert result.verdict == "identical" and result.first is None


def test_a_resumed_run_that_trained_no_step_is_not_identical(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_table(a, 0, rank_table(RUN, 0), world_size=1)
    # B resumed after step 2 and trained nothing: only its checkpoint load was recorded, at step 2
    load = rank_table(RUN, 0).slice(0, 1).to_pylist()[0]
    load.update(step=2, phase="checkpoint", name="torch.load")
    write_rows(b, 0, [load], world_size=1)
    result = diff(a, b)
    assert result.verdict == "diverged"
    first = result.first
    assert first is not None and first.kind == "missing" and first.detail["ended"] == "b"
    assert first.stop is not None and first.stop.startswith(
        "B trained no step (it began at global step 2 and stopped there) and A ran on to step 3")
