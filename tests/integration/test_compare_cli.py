"""`detrace compare BASE_A BASE_B CANDIDATE`: real or noise, on real deterministic runs (conftest's) and on
synthetic racing baselines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _synthetic import Fault, write_metric_run

from detrace import diff
from detrace.analyze.noise import compare_metric, noise_test
from detrace.cli import main


@pytest.fixture
def steady(steady_runs: dict[str, Path]) -> dict[str, Path]:
    """Deterministic baselines (bit-identical) and a changed learning rate: conftest's."""
    return steady_runs


@pytest.fixture
def racing(tmp_path: Path) -> dict[str, Path]:
    """Synthetic baselines whose loss differs run to run from step 1 on (as a racing op's would: B's trace parts
    from A's at a backward op of step 1, an injected fault named as such), and a candidate whose change moves
    the loss far beyond that spread."""
    race = Fault(rank=0, step=1, op=0)
    losses = {0: 2.0, 1: 1.5, 2: 1.2, 3: 1.0}
    write_metric_run(tmp_path / "a", losses)
    write_metric_run(tmp_path / "b", {0: 2.0, 1: 1.5 + 1e-6, 2: 1.2 - 2e-6, 3: 1.0 + 3e-6}, fault=race)
    write_metric_run(tmp_path / "lr", {0: 2.0, 1: 1.4, 2: 1.05, 3: 0.8}, fault=race)
    runs = {name: tmp_path / name for name in ("a", "b", "lr")}
    assert diff(runs["a"], runs["b"]).verdict == "diverged"
    return runs


def _compare(capsys: pytest.CaptureFixture[str], *runs: Path) -> tuple[int, dict]:
    code = main(["compare", *(str(r) for r in runs), "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_same_program_is_identical(steady: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, payload = _compare(capsys, steady["a"], steady["b"], steady["b"])  # a candidate: the same program
    assert code == 0 and payload["schema"] == "detrace.compare/1" and payload["verdict"] == "identical"
    assert payload["trace"] == {"baselines": None, "candidate": None}


def test_any_change_is_real_against_identical_baselines(steady: dict[str, Path],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    code, payload = _compare(capsys, steady["a"], steady["b"], steady["lr"])
    assert code == 1 and payload["verdict"] == "real"
    loss = next(m for m in payload["metrics"] if m["name"] == "loss")
    assert loss["verdict"] == "real" and loss["first_beyond"] == 1  # the first update changes step 1's loss
    assert all(row["noise"] == 0 for row in loss["steps"])
    first = payload["trace"]["candidate"]
    assert first["step"] == 0 and first["phase"] == "optimizer"  # the change shows first in the updated params
    # the library answer is the same object, typed
    result = noise_test(steady["a"], steady["b"], steady["lr"])
    assert result.verdict == "real" and result.exit_code == 1 and result.baselines is None
    assert result.candidate is not None and result.candidate.phase == "optimizer"
    assert result.to_json() == payload


def test_racing_baselines_measure_the_noise(racing: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, payload = _compare(capsys, racing["a"], racing["b"], racing["lr"])
    assert code == 1 and payload["verdict"] == "real"
    assert payload["trace"]["baselines"] is not None  # the baselines themselves differ
    loss = next(m for m in payload["metrics"] if m["name"] == "loss")
    # the race strikes at random steps: some step of the baselines differs, and its noise is measured
    assert any(row["noise"] > 0 for row in loss["steps"]) and loss["verdict"] == "real"
    # a baseline set against the baselines is, by construction, within their variation
    code, payload = _compare(capsys, racing["a"], racing["b"], racing["b"])
    assert code == 0 and payload["verdict"] == "noise"


def test_human_table(steady: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", str(steady["a"]), str(steady["b"]), str(steady["lr"])]) == 1
    out = capsys.readouterr().out
    assert "real: the change's effect is real" in out and "beyond" in out
    assert "candidate first differs from BASE_A at step 0, rank 0: optimizer" in " ".join(out.split())


def test_rule_majority_of_differing_steps() -> None:
    a = {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0}
    b = {0: 1.0, 1: 2.001, 2: 3.001, 3: 4.001}
    near = {0: 1.0, 1: 2.0005, 2: 3.002, 3: 4.0}
    far = {0: 1.0, 1: 2.5, 2: 3.5, 3: 4.5}
    assert compare_metric("m", a, b, near, 10).verdict == "noise"
    result = compare_metric("m", a, b, far, 10)
    assert result.verdict == "real" and result.first_beyond == 1
    assert compare_metric("m", a, b, dict(a), 10).verdict == "identical"


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--factor", "0"], "--factor must be a positive finite number"),
        (["--rank", "3"], "holds no trace of rank 3"),
    ],
)
def test_bad_input_is_one_sentence(steady: dict[str, Path], extra: list[str], message: str,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", str(steady["a"]), str(steady["b"]), str(steady["lr"]), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("factor", ["inf", "nan", "-1"])
def test_an_infinite_or_nonpositive_factor_is_a_usage_error(tmp_path: Path, factor: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    # inf called every effect noise, even over bit-identical baselines; refused before any run is read.
    assert main(["compare", *(str(tmp_path / n) for n in "abc"), "--factor", factor]) == 2
    err = capsys.readouterr().err
    assert "--factor must be a positive finite number" in err and err.count("\n") == 1


def test_missing_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", str(tmp_path / "x"), str(tmp_path / "y"), str(tmp_path / "z")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_an_incomparable_candidate_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """m3: a 2-rank candidate against 1-rank baselines was called "real" (exit 1) while saying "not comparable"."""
    from _synthetic import SyntheticRun, write_run

    write_run(tmp_path / "a", SyntheticRun(ranks=1, steps=3, ops=2))
    write_run(tmp_path / "b", SyntheticRun(ranks=1, steps=3, ops=2))
    write_run(tmp_path / "c", SyntheticRun(ranks=2, steps=3, ops=2))
    for argv in ([], ["--json"]):
        assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "c"), *argv]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1
        assert f"{tmp_path / 'c'} cannot be compared with {tmp_path / 'a'}" in captured.err
        assert "world size 1" in captured.err


def test_a_candidate_that_stops_early_is_refused_not_identical(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    losses = {0: 2.0, 1: 1.5, 2: 1.2, 3: 1.0, 4: 0.9, 5: 0.8}
    write_metric_run(tmp_path / "a", losses)
    write_metric_run(tmp_path / "b", losses)
    write_metric_run(tmp_path / "short", {step: losses[step] for step in range(4)})  # the same bits, 2 steps fewer
    code = main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), str(tmp_path / "short")])
    err = capsys.readouterr().err
    assert code == 2
    assert "do not cover the same steps: B stopped after global step 3 and A ran on to step 5" in err
