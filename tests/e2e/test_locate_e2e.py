"""`detrace locate` end to end on real CPU nondeterminism (no injected fault): one process, a 2-rank torchrun
job where only rank 1 runs the racy op, and the embedded default workload. Each ladder is 7 runs of CMD."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _scenarios import GATHER
from _tools import dump_dom, locate_cli

from detrace.analyze.locate_result import load_ladder
from detrace.cli.locate import render
from detrace.investigate.replay import FIX_DETERMINISTIC
from detrace.report.terminal import make_console

pytestmark = pytest.mark.slow

def _ladder(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode == 1, done.stdout + done.stderr
    payload = json.loads(done.stdout)
    assert list(payload) == ["schema", "verdict", "culprit", "replay", "runs", "report", "cost"]
    assert payload["verdict"] == "nondeterministic"
    return payload


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    folder = tmp_path_factory.mktemp("locate-single")
    out = folder / "out"
    done = locate_cli("--json", "--out", str(out), "--", sys.executable, str(GATHER), "2")
    return _ladder(done), out


def test_single_process_culprit_is_the_racing_index_put(single: tuple[dict[str, Any], Path]) -> None:
    payload, out = single
    assert json.loads((out / "locate.json").read_text()) == payload  # --json prints the file the ladder wrote
    culprit = payload["culprit"]
    assert culprit["name"].startswith("aten.index_put")
    assert culprit["phase"] == "backward" and culprit["rank"] == 0 and culprit["origin"] is True
    assert culprit["module"] == "gather"
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


def test_report_names_the_culprit_in_a_real_browser(single: tuple[dict[str, Any], Path]) -> None:
    payload, _ = single
    page = Path(payload["report"])
    html = page.read_text()
    assert "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "") and "https://" not in html
    dom = dump_dom(page)
    assert payload["culprit"]["name"] in dom
    for section in ("Metric curves", "Where the runs differ, rank by rank", "Narrowing path",
                    "Kernel rung: replay of the culprit", FIX_DETERMINISTIC):
        assert section in dom
    assert dom.count("<svg") >= 3  # metric curves, their differences, the ranks x steps map


# Two ranks on gloo, grads all-reduced by hand. Only rank 1 gathers with repeated indices (its backward is the
# racing index_put); rank 0 repeats rows with a deterministic op. Rank 0 receives the difference through the
# all_reduce: the origin rank is 1.
DIST_SCRIPT = '''
import torch, torch.distributed as dist
from torch import nn
from detrace._exit import leave

torch.set_num_threads(2)
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
ROWS, COPIES = 8192, 131072


class Spread(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("idx", torch.randint(0, ROWS, (COPIES,), generator=torch.Generator().manual_seed(1)))
        self.register_buffer("scale", torch.rand(COPIES, 1, generator=torch.Generator().manual_seed(3)))

    def forward(self, x):
        rows = x[self.idx] if rank == 1 else x.repeat(COPIES // ROWS, 1)
        return rows * self.scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.spread, self.out = nn.Linear(16, 16), Spread(), nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.out(self.spread(self.inp(x))))


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.randn(ROWS, 16, generator=torch.Generator().manual_seed(2 + rank))
for step in range(2):
    model(data).pow(2).mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
dist.barrier()  # the untraced rank is faster: let both finish their last collective before tearing gloo down
dist.destroy_process_group()
leave(0)  # gloo's threads outlive the group: exit handlers (the tracer's last write), then no finalization
'''


def test_torchrun_origin_rank_is_the_rank_that_runs_the_racy_op(tmp_path: Path) -> None:
    script = tmp_path / "dist_train.py"
    script.write_text(DIST_SCRIPT)
    out = tmp_path / "out"
    done = locate_cli("--json", "--out", str(out), "--timeout", "300", "--", sys.executable, "-m",
                      "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script))
    payload = _ladder(done)
    culprit = payload["culprit"]
    assert culprit["rank"] == 1 and culprit["name"].startswith("aten.index_put") and culprit["origin"] is True
    ladder = load_ladder(out)
    assert (ladder.stages[0].diff or {})["origin_ranks"] == [1]
    assert {s.ranks for s in ladder.stages[1:]} == {"1"}  # narrower rungs traced the origin rank only
    assert FIX_DETERMINISTIC in payload["replay"]["fixed_by"]


def test_embedded_default_names_the_moe_dispatch_backward(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = locate_cli("--json", "--out", str(out), timeout=1200)
    payload = _ladder(done)
    culprit = payload["culprit"]
    assert culprit["name"].startswith("aten.index_put") and culprit["phase"] == "backward"
    assert culprit["module"].endswith(".moe") and culprit["origin"] is True
    assert payload["replay"]["nondeterministic"] is True
    assert FIX_DETERMINISTIC in payload["replay"]["fixed_by"]
    assert payload["culprit"]["name"] in dump_dom(Path(payload["report"]))
    # docs/locate.md quotes this run's summary: its culprit and the culprit's records are what it printed
    sink = io.StringIO()
    render(load_ladder(out), make_console(sink))
    doc = (Path(__file__).parents[2] / "docs" / "locate.md").read_text().split("(the embedded default):")[1]
    quoted = doc.split("```")[1].splitlines()
    printed = sink.getvalue().splitlines()
    for prefix in ("  culprit ", "    input[", "    output["):
        assert [line for line in quoted if line.startswith(prefix)] == [
            line.rstrip() for line in printed if line.startswith(prefix)], prefix
