"""The analysis wing: compare two runs' traces, certify one trace's invariants.

It meets the recording wing (detrace.tracing) only at the trace format (detrace.tracefile) and never imports it.

- `diff(a, b, *, rank=None)` -> `DiffResult`: the first divergence per rank and across ranks (engine.py, on
  align.py for one rank, classify.py for what "same" means, causality.py across ranks).
- `certify(run, ...)` -> `CertifyResult`: every expected rank and step present, dense seq, no collective
  left incomplete (certify.py).
"""

from detrace.compare.certify import CertifyResult, certify
from detrace.compare.engine import diff
from detrace.compare.result import (
    SCHEMA,
    Compared,
    DiffResult,
    Divergence,
    RankResult,
    first_divergent_step,
    first_origin,
)

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
