"""Precision and recall of `detrace audit`'s certain hazards against what `detrace check` observes, on the scripts
of tests/support/audit_cases.py (every op on torch's documented list, seeding and data cases, compiled code, DDP
with and without the recipe, the HF and Lightning integrations), as real processes on this machine.

    python bench/audit_precision.py [--out DIR] [--only PART,PART...]

For each script: `detrace audit --json` once (its verdict: a certain hazard or none; the op hazards it names) and
`detrace check --runs 3` (identical or diverged: a race that strikes in some runs only needs a few). A script is
a true positive when audit names a certain hazard and check sees the runs differ. The CUDA-only ops run last.
Prints one markdown row per script, then precision, recall, and whether every CUDA-only op was named as a
possible hazard. The scripts' `observed` field holds what check saw here: the last
lines say where it no longer does.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))

from audit_cases import CASES, HEAVY, Case

PY = sys.executable


def _run(case: Case, folder: Path) -> dict:
    folder.mkdir(parents=True)
    script = folder / "train.py"
    script.write_text(case.source)
    cmd = [PY, *case.launcher, str(script)]
    began = time.perf_counter()
    audit = subprocess.run([PY, "-m", "detrace", "audit", "--json", "--out", str(folder / "audit"), "--", *cmd],
                           cwd=folder, capture_output=True, text=True, timeout=900)
    audit_seconds = time.perf_counter() - began
    if audit.returncode not in (0, 1):
        return {"error": f"audit exit {audit.returncode}: {audit.stderr.strip()[-300:]}"}
    report = json.loads(audit.stdout)
    check = subprocess.run([PY, "-m", "detrace", "check", "--runs", "3", "--out", str(folder / "check"), "--", *cmd],
                           cwd=folder, capture_output=True, text=True, timeout=900)
    if check.returncode not in (0, 1):
        return {"error": f"check exit {check.returncode}: {check.stderr.strip()[-300:]}"}
    return {"certain": [h["subject"] for h in report["certain"]],
            "possible_ops": [h["subject"] for h in report["possible"] if h["kind"] in ("op", "kernel")],
            "differ": check.returncode == 1, "audit_seconds": audit_seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--only", default="", help="run only the scripts whose name contains one of these "
                        "comma-separated parts")
    args = parser.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="audit-precision-"))
    parts = args.only.split(",")
    cases = sorted((c for c in (*CASES, *HEAVY) if any(part in c.name for part in parts)),
                   key=lambda c: "CUDA only" in c.name)
    tp = fp = fn = tn = 0
    stale, silent = [], []
    print("| script | audit: certain | check: runs differ |\n|---|---|---|", flush=True)
    for i, case in enumerate(cases):
        result = _run(case, out / f"{i:02d}")
        if "error" in result:
            print(f"| {case.name} | error: {result['error']} | |", flush=True)
            continue
        predicted, observed = bool(result["certain"]), result["differ"]
        tp += predicted and observed
        fp += predicted and not observed
        fn += observed and not predicted
        tn += not predicted and not observed
        if observed != case.observed:
            stale.append(case.name)
        if "CUDA only" in case.name and not result["possible_ops"]:
            silent.append(case.name)
        named = ", ".join(result["certain"]) or "none"
        print(f"| {case.name} | {named} | {'yes' if observed else 'no'} |", flush=True)
    precision = tp / (tp + fp) if tp + fp else float("nan")
    recall = tp / (tp + fn) if tp + fn else float("nan")
    print(f"\n{len(cases)} scripts: {tp} true positives, {fp} false positives, {fn} missed, {tn} true negatives")
    print(f"precision {precision:.0%}, recall {recall:.0%}")
    print(f"CUDA-only ops not named as possible: {', '.join(silent) or 'none'}")
    print(f"observed differently than audit_cases.py records: {', '.join(stale) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
