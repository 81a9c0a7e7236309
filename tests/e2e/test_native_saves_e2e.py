"""End to end: `detrace check-resume --native` on a loop with dropout whose checkpoint goes the careful way: saved
under a temporary name and renamed into place (`os.replace`), or saved into an `io.BytesIO` whose bytes the script
writes to its file. Both resume exactly, and the skip-rng control finds the RNG state in the file the script loads.
Real processes, one check each; the logic is in tests/integration/test_checkpoint_files.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from detrace.cli import main

pytestmark = pytest.mark.slow

SCRIPT = '''
import io, os, torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
data, target = torch.randn(48, 8), torch.randn(48, 1)
start = 0
if os.path.exists("ckpt/last.pt"):
    with open("ckpt/last.pt", "rb") as stream:
        state = torch.load(io.BytesIO(stream.read()) if HOW == "buffer" else stream)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    start = state["step"]
os.makedirs("ckpt", exist_ok=True)
for step in range(start, 5):
    batch = slice(step * 8, step * 8 + 8)
    loss = torch.nn.functional.mse_loss(model(data[batch]), target[batch])
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": torch.get_rng_state(),
             "step": step + 1}
    if HOW == "rename":
        torch.save(state, "ckpt/last.pt.tmp")
        os.replace("ckpt/last.pt.tmp", "ckpt/last.pt")
    else:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        with open("ckpt/last.pt", "wb") as stream:
            stream.write(buffer.getvalue())
'''


@pytest.mark.parametrize("how", ["rename", "buffer"])
def test_a_checkpoint_saved_the_careful_way_resumes_exactly_and_its_rng_is_left_out(
        how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text(f"HOW = {how!r}\n{SCRIPT}")
    code = main(["check-resume", "--native", "--at", "3", "--every-control", "--out", str(tmp_path / "check"),
                 "--json", "--", sys.executable, "train.py"])
    report = json.loads(capsys.readouterr().out)
    assert (code, report["verdict"]) == (0, "exact"), report
    [point] = report["points"]
    controls = {c["control"]: c["mattered"] for c in point["controls"]}
    assert controls["skip-rng"], point  # the dropout draws from the RNG state the control left out of the file
    assert "holds no RNG states" not in point["depends"]
    assert (tmp_path / "ckpt" / "last.pt").is_file()  # the continuous run's checkpoint is back in place
