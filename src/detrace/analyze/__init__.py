"""The analysis wing: compare two runs' traces, certify one trace's invariants.

It meets the recording wing (detrace.record) only at the trace format (detrace.tracefile) and never imports it.

- `diff(a, b, *, rank=None)` -> `DiffResult`: the first divergence per rank and across ranks (engine.py, on
  align.py for one rank, classify.py for what "same" means, causality.py across ranks).
- `certify(run, ...)` -> `CertifyResult`: every expected rank and step present, dense seq, no collective
  left incomplete (certify.py).
"""

from detrace.analyze.certify import CertifyResult, certify
from detrace.analyze.diff_result import (
    SCHEMA,
    Compared,
    DiffResult,
    Divergence,
    RankResult,
    first_divergent_step,
    first_origin,
)
from detrace.analyze.engine import diff

__all__ = [
    "SCHEMA",
    "CertifyResult",
    "Compared",
    "DiffResult",
    "Divergence",
    "RankResult",
    "certify",
    "diff",
    "first_divergent_step",
    "first_origin",
]
