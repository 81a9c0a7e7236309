"""`detrace locate` end to end on real CPU nondeterminism (no injected fault): the embedded default workload (the
README's set-up command, run as written) and the reference workload's planted late race located from checkpoints.
Each ladder is 7-14 runs of CMD; its narrowing (to the origin rank of a multi-rank run among them), retries,
fallbacks and messages are checked in process on synthetic traces (tests/unit/test_locate_logic.py), and the origin
rank of a real 2-rank DDP run by the diff it starts from (tests/e2e/test_diff_real.py)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _tools import dump_dom, locate_cli

from detrace.analyze.locate_result import load_ladder
from detrace.cli.locate import render
from detrace.investigate.audit.report import read_ranks
from detrace.investigate.locate.driver import REFERENCE_RUN
from detrace.investigate.replay import FIX_DETERMINISTIC
from detrace.report.terminal import make_console

pytestmark = [pytest.mark.slow, pytest.mark.race]

ROOT = Path(__file__).parents[2]


def setup_command(readme: str) -> str:
    """The README's set-up block's last command: the one that runs detrace's main job."""
    section = readme.split("\n## Set up", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "the README's set-up section has no ```bash block"
    return block.group(1).strip().splitlines()[-1].strip()


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]:
    """Read-only: the README's set-up command, `detrace locate` with no CMD (the embedded default: the reference
    workload's MoE index dispatch on 2 threads, 8 steps), run as written in an empty directory; what it printed,
    its locate.json and its locate directory."""
    command = setup_command((ROOT / "README.md").read_text())
    assert command == "detrace locate", command
    cwd = tmp_path_factory.mktemp("readme-setup")
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    done = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 1, done.stdout + done.stderr[-3000:]
    out = (cwd / "detrace-runs" / "locate-latest").resolve()
    payload = json.loads((out / "locate.json").read_text())  # the object `--json` prints, keys sorted
    assert sorted(payload) == ["cost", "culprit", "replay", "report", "runs", "schema", "verdict"]
    assert payload["verdict"] == "nondeterministic"
    return done, payload, out


def test_the_readme_setup_command_names_the_moe_dispatch_backward(
        embedded: tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]) -> None:
    done, payload, out = embedded
    # What the README says this command does: the runs part, the ladder names the aten.index_put in the MoE layer's
    # backward (layers.1.moe), replays it alone and names the switch that fixes it.
    printed = " ".join(done.stdout.split())
    assert printed.startswith("nondeterministic: culprit: aten.index_put.default in layers.1.moe, backward of step")
    assert "the op itself is nondeterministic (fixed by torch.use_deterministic_algorithms(True)" in printed
    culprit = payload["culprit"]
    assert culprit["name"].startswith("aten.index_put") and culprit["phase"] == "backward"
    assert culprit["rank"] == 0 and culprit["module"].endswith(".moe") and culprit["origin"] is True
    replay = payload["replay"]
    assert replay["nondeterministic"] is True and replay["differing_elements"] > 0 and replay["max_ulp"] > 0
    assert FIX_DETERMINISTIC in replay["fixed_by"]
    names = [Path(run).name for run in payload["runs"]]
    assert names[:2] == ["1-semantic-a", "1-semantic-b"] and names[-1] == "4-capture" and len(names) <= 12
    assert all(Path(run).is_dir() and Path(run).parent == out for run in payload["runs"])
    # each narrower rung recorded only the divergent step
    ladder = load_ladder(out)
    assert {s.steps for s in ladder.stages[1:]} == {str(culprit["step"])}
    records = {(r.role, r.index): r.equal for r in ladder.culprit_records}
    assert records[("output", 0)] is False and all(eq for (role, _), eq in records.items() if role == "input")
    # docs/locate.md quotes this run's summary: its culprit and the culprit's records are what it printed
    sink = io.StringIO()
    render(ladder, make_console(sink))
    doc = (ROOT / "docs" / "locate.md").read_text().split("(the embedded default):")[1]
    quoted = doc.split("```")[1].splitlines()
    printed = sink.getvalue().splitlines()
    for prefix in ("  culprit ", "    input[", "    output["):
        assert [line for line in quoted if line.startswith(prefix)] == [
            line.rstrip() for line in printed if line.startswith(prefix)], prefix
    # and what it cost (the seconds and the paths vary): in that summary, and in the --json object quoted after it
    for pattern in (r"  runs +\d+ \(of at most \d+\)", r"  cost +\d+ steps executed in \d+ runs"):
        assert re.findall(pattern, "\n".join(quoted)) == re.findall(pattern, sink.getvalue()), pattern
    cost = payload["cost"]
    assert f'"cost": {{"runs": {cost["runs"]}, "steps": {cost["steps"]}, "seconds": ' in doc
    assert any(line.startswith("  note     the audit of the first run predicted it: ") for line in printed)
    assert [line for line in quoted if line.startswith("  note ")] == [], "the audit's note is quoted apart"
    [note] = [line for line in doc.split("```")[3].splitlines() if line.startswith("  note ")]
    assert note in [line.rstrip() for line in printed]


def test_the_free_audit_of_the_first_run_predicted_the_culprit(
        embedded: tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]) -> None:
    # locate arms its first run with `detrace audit`'s probe (DETRACE_AUDIT): on the reference trainer the MoE
    # backward's index_put is a certain hazard, placed where the ladder then finds it.
    _, _, out = embedded
    hazards, ranks, steps = read_ranks(out / REFERENCE_RUN)
    assert ranks == [0] and steps == 2
    [op] = [h for h in hazards if h.kind == "op" and h.certainty == "certain"]
    # run A is traced at the semantic rung, with no module hooks: the hazard's module is placed by the audit's
    # own runs at the module rung (tests/integration/test_audit.py)
    assert op.subject == "aten.index_put.default" and op.phase == "backward" and op.step == 0
    assert "indices repeat an earlier one" in op.what
    notes = load_ladder(out).notes
    assert any(note.startswith("the audit of the first run predicted it: a certain hazard at rank 0, step 0, "
                               "backward") for note in notes), notes


@pytest.mark.browser
def test_report_names_the_culprit_in_a_real_browser(
        embedded: tuple[subprocess.CompletedProcess[str], dict[str, Any], Path]) -> None:
    _, payload, _ = embedded
    page = Path(payload["report"])
    html = page.read_text()
    assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in html
    dom = dump_dom(page)
    assert payload["culprit"]["name"] in dom
    for section in ("Metric curves", "Where the runs differ, rank by rank", "Narrowing path",
                    "Kernel rung: replay of the culprit", FIX_DETERMINISTIC):
        assert section in dom
    assert dom.count("<svg") >= 3  # metric curves, their differences, the ranks x steps map


# The reference workload with a planted late race: deterministic for 4 steps, then the MoE index dispatch's real
# race. It follows the resume contract, so the ladder checkpoints its broad runs and resumes the narrow ones.
PLANTED = [sys.executable, "-m", "detrace.workload.train", "--preset", "tiny", "--batch-size", "32", "--threads", "8",
           "--nondeterministic-from", "4"]


def test_planted_late_race_is_located_from_checkpoints(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # the README's long-runs paragraph quotes this run: same command, 8 steps
    done = locate_cli("--json", "--out", str(out), "--checkpoint-every", "2", "--", *PLANTED, "--steps", "8",
                      timeout=1200)
    assert done.returncode == 1, done.stdout + done.stderr
    payload = json.loads(done.stdout)
    culprit = payload["culprit"]
    assert culprit["name"].startswith("aten.index_put") and culprit["phase"] == "backward"
    assert culprit["module"].endswith(".moe") and culprit["origin"] is True and culprit["step"] >= 4
    cost = payload["cost"]
    assert cost["resume"] == "exact" and cost["checkpoint_every"] == 2 and cost["runs"] == len(payload["runs"])
    runs = {run["run"]: run for run in cost["per_run"]}
    assert runs["1-semantic-a"] == {**runs["1-semantic-a"], "start": 0, "steps": 8}
    proofs = [run for name, run in runs.items() if name.startswith("2-resume-")]
    assert 1 <= len(proofs) <= 2 and all(2 <= run["start"] < 4 and run["steps"] <= 3 for run in proofs)
    narrow = [run for name, run in runs.items() if name[0] not in "12"]
    assert narrow and all(run["rung"] in ("module", "op") for run in narrow)
    for run in narrow:  # from the last checkpoint at or before the divergence, at most window + 1 steps
        assert 4 <= run["start"] <= culprit["step"] and 1 <= run["steps"] <= 3, run
    assert (out / "checkpoints" / "1-semantic-a" / "step-00000004").is_dir()
    readme = " ".join((ROOT / "README.md").read_text().split())
    quoted = re.search(r"culprit `aten.index_put` at step (\d+); `cost`: (\d+) runs, \*\*(\d+) steps\*\*", readme)
    assert quoted is not None and [int(n) for n in quoted.groups()] == [culprit["step"], cost["runs"], cost["steps"]]
