"""The analysis on a pool of worker processes (spawned: each starts an interpreter of its own, and is handed each
rank's file and footer as the run was opened) gives the answer it gives in one process: the diff and certify, on
synthetic traces."""

from __future__ import annotations

from pathlib import Path

from _synthetic import Fault, SyntheticRun, write_run

from detrace.analyze import certify, diff


def test_the_diff_on_a_pool_of_workers_gives_the_same_answer(tmp_path: Path) -> None:
    run = SyntheticRun(ranks=4, steps=3, ops=4)
    a, b = tmp_path / "a", tmp_path / "b"
    write_run(a, run)
    write_run(b, run, Fault(rank=2, step=1, op=1))
    assert diff(a, b, workers=2) == diff(a, b, workers=1)


def test_certify_on_a_pool_of_workers_gives_the_same_answer(tmp_path: Path) -> None:
    write_run(tmp_path / "four", SyntheticRun(ranks=4, steps=2, ops=2))
    assert certify(tmp_path / "four", workers=2) == certify(tmp_path / "four", workers=1)
